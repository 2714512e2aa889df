"""Training: data, the loop, checkpoints, metrics, and the comparison of systems."""
