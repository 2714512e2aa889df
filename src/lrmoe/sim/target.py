"""Steps to the target loss, from a ``lrmoe compare`` run, as ratios to ``static``.

A compare run's ``results.json`` gives each system's ``steps_to_target`` (None: never reached
within the run's step budget). What carries over to paper scale is the *ratio* to static at
the same kept ratio — the absolute count depends on the model and data. Full-backward systems
(``symi``) should match static; ``capacity`` drops pairs in both passes; an lrmoe variant at a
kept ratio ρ between two measured ratios is interpolated linearly in ρ, with static's steps at
ρ = 1 (every pair kept is the exact backward). A bracketing point that never reached the target,
or a ρ outside the measured range, gives None: the projection never invents a step count.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from lrmoe.sim.errors import SimError
from lrmoe.systems import REFERENCE_SYSTEM, parse_system_name

DEFAULT_COMPARE = Path(__file__).with_name("compare_default.json")
DEFAULT_SELECTION = "lrm"  # the selection of a compacting system's name without one


def _parse(name: str) -> tuple[str, float] | None:
    """``lrmoe@0.5`` → ("lrm", 0.5); ``lrmoe-sampled@0.25`` → ("sampled", 0.25); else None
    (names of systems whose backward does not compact, names without a ratio, bad names)."""
    try:
        parsed = parse_system_name(name)
    except ValueError:
        return None
    if not parsed.spec.compacts or parsed.ratio is None:
        return None
    return parsed.selection or DEFAULT_SELECTION, parsed.ratio


@dataclass(frozen=True)
class StepsToTarget:
    """Measured steps to target per compared system (None: not reached)."""

    systems: dict[str, int | None]
    source: str

    @staticmethod
    def load(path: str | Path | None = None) -> StepsToTarget:
        p = Path(path) if path is not None else DEFAULT_COMPARE
        try:
            doc = json.loads(p.read_text())
            systems = {name: r["steps_to_target"] for name, r in doc["systems"].items()}
        except FileNotFoundError:
            raise SimError(f"compare results {str(p)!r} not found") from None
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise SimError(f"compare results {str(p)!r}: expected {{'systems': {{name: "
                           f"{{'steps_to_target': ...}}}}}} ({type(e).__name__}: {e})") from None
        if not systems.get(REFERENCE_SYSTEM):
            raise SimError(f"compare results {str(p)!r} need a {REFERENCE_SYSTEM!r} system that reached "
                           f"the target")
        return StepsToTarget(systems, str(p))

    def ratio(self, name: str) -> float | None:
        """Steps to target of a measured system relative to static."""
        steps = self.systems.get(name)
        return None if steps is None else steps / self.systems[REFERENCE_SYSTEM]

    def points(self, selection: str) -> list[tuple[float, int | None]]:
        """Measured (kept ratio, steps or None) of one lrmoe selection, plus static at ρ = 1."""
        pts = {1.0: self.systems[REFERENCE_SYSTEM]}
        for name, steps in self.systems.items():
            parsed = _parse(name)
            if parsed is not None and parsed[0] == selection:
                pts[parsed[1]] = steps
        return sorted(pts.items())

    def lrmoe_ratio(self, selection: str, kept: float) -> float | None:
        """Steps ratio to static of ``selection`` at kept ratio ``kept`` (linear in ρ between
        measured points; None if a bracketing point never reached the target or ρ is outside)."""
        pts = self.points(selection)
        for (lo, s_lo), (hi, s_hi) in zip(pts, pts[1:]):
            if lo - 1e-9 <= kept <= hi + 1e-9:
                if s_lo is None or s_hi is None:
                    if abs(kept - hi) < 1e-9 and s_hi is not None:
                        return s_hi / self.systems[REFERENCE_SYSTEM]
                    return None
                w = 0.0 if hi == lo else (kept - lo) / (hi - lo)
                return ((1 - w) * s_lo + w * s_hi) / self.systems[REFERENCE_SYSTEM]
        if pts and abs(kept - pts[-1][0]) < 1e-9:
            return 1.0
        return None
