"""The simulator's one error type: bad input that the command line reports in one line."""


class SimError(ValueError):
    """Invalid simulator input (unknown model, impossible cluster, unreadable trace, ...)."""
