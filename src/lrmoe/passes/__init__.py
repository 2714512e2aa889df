"""The routed experts' forward and backward passes: the autograd function, its stages, its call record."""
