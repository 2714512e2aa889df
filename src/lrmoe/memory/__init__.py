"""The expert side's byte model, the meter that follows a call's tensors, and its replay on numbers."""
