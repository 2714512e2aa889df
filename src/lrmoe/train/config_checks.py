"""The config's error and its value checks (a leaf module: :mod:`lrmoe.train.config` and the
modules it builds on share them; ``lrmoe.train.config`` re-exports both names)."""

from __future__ import annotations

from lrmoe.validation import is_int_at_least


class ConfigError(ValueError):
    """A user-facing configuration problem: field, value, what is allowed."""


def require_int(where: str, v: object, least: int) -> int:
    """``v`` itself when it is an integer >= ``least`` (a bool is not); else a ConfigError that
    names ``where`` (a field or a flag), the value and the bound."""
    if not is_int_at_least(v, least):
        raise ConfigError(f"{where}={v!r} is invalid: expected an integer >= {least}")
    return v


def require_number(where: str, v: object, least: float, strict: bool) -> None:
    """A ConfigError unless ``v`` is a number (not a bool) > ``least`` (``strict``) or >= it."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v > least if strict else v >= least):
        raise ConfigError(f"{where}={v!r} is invalid: expected a number {'>' if strict else '>='} {least}")
