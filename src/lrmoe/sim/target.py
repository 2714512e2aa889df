"""Steps to the target loss, as ratios to ``static``, from measured runs.

Two sources, both shipped and both replaceable:

- the convergence study (``benchmarks/convergence.py``; default ``convergence_default.json``,
  docs/convergence.md): steps to target of each lrmoe selection at fixed kept ratios
  (quota ``ratio``) and under memory budgets, where the controller's max–min fair quotas trim the
  hot experts first (quota ``budget``: the regime of a memory cap), with each run's mean kept
  ratio;
- a ``lrmoe compare`` run (default ``compare_default.json``): the systems the study does not run
  (``capacity``), and lrmoe variants named ``lrmoe-<selection>@<ratio>`` for selections the study
  lacks.

What carries over to paper scale is the *ratio* to static at the same kept ratio — the absolute
count depends on the model and data. An lrmoe variant at a kept ratio between two measured ones
is interpolated linearly in the kept ratio, with static's steps at 1 (every pair kept is the
exact backward). A bracketing point that never reached the target, or a kept ratio outside the
measured range, gives None: the projection never invents a step count.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from lrmoe.sim.errors import SimError
from lrmoe.systems import REFERENCE_SYSTEM, parse_system_name

DEFAULT_COMPARE = Path(__file__).with_name("compare_default.json")
DEFAULT_CONVERGENCE = Path(__file__).with_name("convergence_default.json")
DEFAULT_SELECTION = "lrm"  # the selection of a compacting system's name without one
QUOTA_KINDS = ("budget", "ratio")


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
class Curve:
    """Steps to target relative to static against the kept ratio, for one selection and one
    kind of quota; (1, 1) is static's own point."""

    points: tuple[tuple[float, float | None], ...]  # (kept ratio, steps ratio or None), sorted
    source: str

    def at(self, kept: float) -> float | None:
        pts = self.points
        for (lo, s_lo), (hi, s_hi) in zip(pts, pts[1:]):
            if lo - 1e-9 <= kept <= hi + 1e-9:
                if abs(kept - hi) < 1e-9 and s_hi is not None:
                    return s_hi
                if abs(kept - lo) < 1e-9 and s_lo is not None:
                    return s_lo
                if s_lo is None or s_hi is None:
                    return None
                w = 0.0 if hi == lo else (kept - lo) / (hi - lo)
                return (1 - w) * s_lo + w * s_hi
        if pts and abs(kept - pts[-1][0]) < 1e-9:
            return pts[-1][1]
        return None

    def describe(self) -> str:
        return ", ".join(f"{k:.3f}:{'not reached' if v is None else f'{v:.3f}'}" for k, v in self.points)


def _curve(points: dict[float, float | None], source: str) -> Curve:
    return Curve(tuple(sorted({1.0: 1.0, **points}.items())), source)


@dataclass(frozen=True)
class StepsToTarget:
    """Measured steps to target per compared system (None: not reached), and lrmoe's curves."""

    systems: dict[str, int | None]
    source: str
    curves: dict[tuple[str, str], Curve] = field(default_factory=dict)  # (selection, quota kind)

    @staticmethod
    def load(path: str | Path | None = None, convergence: str | Path | None = None,
             use_convergence: bool = False) -> StepsToTarget:
        """A compare run's ``results.json`` (``path``; default the shipped one) and, when
        ``convergence`` is given or ``use_convergence`` is set, a convergence study's JSON
        (default the shipped one): its curves take precedence over the compare run's."""
        p = Path(path) if path is not None else DEFAULT_COMPARE
        doc = _read(p, "compare results", "{'systems': {name: {'steps_to_target': ...}}}")
        try:
            systems = {name: r["steps_to_target"] for name, r in doc["systems"].items()}
        except (KeyError, TypeError, AttributeError) as e:
            raise SimError(f"compare results {str(p)!r}: expected {{'systems': {{name: "
                           f"{{'steps_to_target': ...}}}}}} ({type(e).__name__}: {e})") from None
        static = systems.get(REFERENCE_SYSTEM)
        if not static:
            raise SimError(f"compare results {str(p)!r} need a {REFERENCE_SYSTEM!r} system that reached "
                           f"the target")
        by_selection: dict[str, dict[float, float | None]] = {}
        for name, steps in systems.items():
            parsed = _parse(name)
            if parsed is not None:
                by_selection.setdefault(parsed[0], {})[parsed[1]] = None if steps is None else steps / static
        curves = {(sel, "ratio"): _curve(pts, f"compare run {p}") for sel, pts in by_selection.items()}
        if convergence is not None or use_convergence:
            curves.update(_convergence_curves(Path(convergence) if convergence is not None else DEFAULT_CONVERGENCE))
        return StepsToTarget(systems, str(p), curves)

    def ratio(self, name: str) -> float | None:
        """Steps to target of a measured system relative to static."""
        steps = self.systems.get(name)
        return None if steps is None else steps / self.systems[REFERENCE_SYSTEM]

    def points(self, selection: str) -> list[tuple[float, float | None]]:
        """The compare run's (kept ratio, steps ratio or None) of one selection, static at 1."""
        curve = self.curves.get((selection, "ratio"))
        return list(curve.points) if curve is not None else [(1.0, 1.0)]

    def lrmoe_ratio(self, selection: str, kept: float, kind: str = "ratio") -> float | None:
        """Steps ratio to static of ``selection`` at kept ratio ``kept`` (see :meth:`lrmoe_steps`)."""
        return self.lrmoe_steps(selection, kept, kind)[0]

    def lrmoe_steps(self, selection: str, kept: float, kind: str) -> tuple[float | None, str]:
        """Steps ratio to static of ``selection`` at kept ratio ``kept`` under quotas of
        ``kind`` ("budget": a controller at a memory cap; "ratio": a fixed ratio), from that
        kind's curve, else the other kind's; and how it was found."""
        for k in (kind, *(q for q in QUOTA_KINDS if q != kind)):
            curve = self.curves.get((selection, k))
            if curve is not None:
                r = curve.at(kept)
                how = (f"interpolated at kept ratio {kept:.3f} on {selection}'s {k} runs "
                       f"{{{curve.describe()}}} ({curve.source})")
                return r, how if r is not None else "not reached / not measured at this kept ratio: " + how
        return None, f"no measured runs of selection {selection!r}"


def _read(p: Path, what: str, form: str) -> dict:
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        raise SimError(f"{what} {str(p)!r} not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SimError(f"{what} {str(p)!r}: expected {form} ({type(e).__name__}: {e})") from None


def _convergence_curves(p: Path) -> dict[tuple[str, str], Curve]:
    """Curves of a ``benchmarks/convergence.py`` JSON: per (selection, quota kind), each run's
    mean kept ratio and steps to target relative to the study's static run."""
    form = "{'runs': {name: {'selection', 'quota', 'mean_kept_ratio', 'steps_to_target'}}}"
    doc = _read(p, "convergence study", form)
    try:
        runs = doc["runs"]
        static = next(r["steps_to_target"] for r in runs.values() if r["selection"] is None)
        pts: dict[tuple[str, str], dict[float, float | None]] = {}
        for r in runs.values():
            if r["selection"] is None or r["quota"] not in QUOTA_KINDS:
                continue
            steps = r["steps_to_target"]
            pts.setdefault((r["selection"], r["quota"]), {})[float(r["mean_kept_ratio"])] = \
                None if steps is None else steps / static
    except (KeyError, TypeError, AttributeError, StopIteration) as e:
        raise SimError(f"convergence study {str(p)!r}: expected {form} and a {REFERENCE_SYSTEM} run "
                       f"({type(e).__name__}: {e})") from None
    if not static:
        raise SimError(f"convergence study {str(p)!r}: its {REFERENCE_SYSTEM} run never reached the target")
    return {key: _curve(v, f"convergence study {p}") for key, v in pts.items()}
