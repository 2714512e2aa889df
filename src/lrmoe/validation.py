"""Checks of single config values: each raises a ``ValueError`` naming the field, the value given
and what is allowed (:mod:`lrmoe.config`, :mod:`lrmoe.train.config`)."""

from __future__ import annotations


def bad(field: str, value: object, allowed: str) -> ValueError:
    return ValueError(f"{field}={value!r} is invalid: {allowed}")


def is_int_at_least(value: object, minimum: int) -> bool:
    """``value`` is an int (not a bool) >= ``minimum``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def positive_int(field: str, value: object) -> None:
    """Raise a ValueError naming ``field`` unless ``value`` is an int >= 1 (bools are not)."""
    if not is_int_at_least(value, 1):
        raise bad(field, value, "expected an integer >= 1")


def is_number(value: object) -> bool:
    """An int or a float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def fraction(field: str, value: object) -> None:
    if not (is_number(value) and 0 < value <= 1):
        raise bad(field, value, "expected a number in (0, 1]")


def ints_per_rank(field: str, value: object, world: int, minimum: int) -> list[int] | None:
    """One int >= ``minimum`` for every rank, or a list of ``world`` of them, as a list (None: None)."""
    if value is None:
        return None
    values = [value] * world if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(values, (list, tuple)) or len(values) != world:
        raise bad(field, value, f"expected one int for all ranks or a list of {world} (one per rank)")
    for v in values:
        if not is_int_at_least(v, minimum):
            raise bad(field, value, f"expected integers >= {minimum}")
    return list(values)


Floor = float | tuple[float, ...]  # one ratio for every layer, or one per MoE layer


def step_ratios(field: str, value: object) -> tuple[tuple[int, Floor], ...]:
    """[[step, ratio], ...] (lists or tuples) with steps >= 0 increasing and ratios in (0, 1], as
    tuples; a ratio may be a non-empty list of them, one per MoE layer."""

    def one(r: object) -> bool:
        return is_number(r) and 0 < r <= 1

    def ratio_ok(r: object) -> bool:
        return one(r) or (isinstance(r, (list, tuple)) and bool(r) and all(one(x) for x in r))

    pairs_ok = isinstance(value, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in value)
    if not pairs_ok or not all(is_int_at_least(s, 0) and ratio_ok(r) for s, r in value) \
            or any(a[0] >= b[0] for a, b in zip(value, value[1:])):
        raise bad(field, value, "expected [[step, ratio], ...]: steps >= 0 increasing, each ratio in (0, 1] "
                                "or a list of them, one per MoE layer")
    return tuple((s, tuple(map(float, r)) if isinstance(r, (list, tuple)) else float(r)) for s, r in value)
