"""Memory sizes as a user types them, one grammar for ``train``, ``compare`` and ``simulate``.

A size is a number with an optional unit: ``70MB`` (decimal, 10**6), ``66.8MiB`` (binary,
2**20), ``40GiB``, ``3MiB``, ``1_000_000`` (underscores between digits, as in TOML and
Python), ``1e9``; units are B, KB, MB, GB, KiB, MiB, GiB, in any case. A bare number
counts ``bare_unit`` bytes each (1, bytes, except ``simulate --gpu-memory``, whose bare numbers
have always been GiB). Where a cap may be relative (``compare --memory-caps``), ``0.65x`` is a
fraction of a reference the caller knows. A size must be > 0; a bad one is one line that names
the flag or key, the text and the grammar.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
# digits with single underscores between them, an optional fraction and exponent, then a unit
_SIZE = re.compile(r"^([0-9](?:_?[0-9])*(?:\.[0-9](?:_?[0-9])*)?|\.[0-9]+)(e[+-]?[0-9]+)?\s*([a-z]*)$",
                   re.IGNORECASE)
EXAMPLES = "40GiB, 66.8MiB, 70MB or 1_000_000 (bytes)"


class SizeError(ValueError):
    """A size the grammar refuses: one line for the user (the CLI exits 2 with it)."""


@dataclass(frozen=True)
class Relative:
    """A cap relative to a reference the caller knows (``0.65x``)."""

    factor: float

    def of(self, reference: int) -> int:
        return int(self.factor * reference)


def parse_size(text: str | int | float, where: str, *, relative: bool = False,
               bare_unit: int = 1) -> int | Relative:
    """``text`` as whole bytes (> 0), or with ``relative`` a ``Relative`` for ``0.65x``; a
    :class:`SizeError` naming ``where`` (a flag or a config key) otherwise. An int or float (a
    TOML number) is a bare number."""
    if isinstance(text, bool):
        raise SizeError(f"{where}={text!r} is invalid: expected a size such as {EXAMPLES}")
    raw = repr(text) if isinstance(text, (int, float)) else str(text).strip()
    if raw.startswith("-"):
        raise SizeError(f"{where}={text!r} is invalid: a size must be > 0")
    m = _SIZE.match(raw)
    unit = m.group(3).lower() if m else ""
    if not m or not (unit in UNITS or (relative and unit == "x")):
        also = ", or a fraction such as 0.65x" if relative else ""
        raise SizeError(f"{where}={text!r} is invalid: expected a size such as {EXAMPLES}{also}")
    value = float(m.group(1) + (m.group(2) or ""))
    if not math.isfinite(value):
        raise SizeError(f"{where}={text!r} is invalid: a size must be a finite number")
    if unit == "x":
        if not value > 0:
            raise SizeError(f"{where}={text!r} is invalid: a fraction must be > 0")
        return Relative(value)
    n = int(value * (UNITS[unit] if unit else bare_unit))
    if n < 1:
        raise SizeError(f"{where}={text!r} is invalid: a size must be > 0 (at least 1 byte)")
    return n


def parse_bytes(text: str | int | float, where: str, bare_unit: int = 1) -> int:
    """:func:`parse_size` where only an absolute size makes sense."""
    n = parse_size(text, where, bare_unit=bare_unit)
    assert isinstance(n, int)
    return n


def format_size(n: int) -> str:
    """``n`` bytes the way the printed memory split shows them (binary units, 3 significant digits)."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"
