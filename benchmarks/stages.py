"""Where each system's MoE time goes, stage by stage, from runs' ``metrics.jsonl``
(``moe_stage_ms``, :mod:`lrmoe.passes.stages`).

    python benchmarks/stages.py runs/roomy/seed-0 runs/roomy/seed-1 [--steps 51-160] [--out FILE]

Each folder is a run (it holds ``metrics.jsonl``) or holds runs (a ``lrmoe compare`` seed folder:
one run per system, named after it); a system's runs in several folders are pooled. Per system,
the median over its steps in ``--steps`` of each stage's ms (sum over layers, mean over ranks),
of ``moe_placement_ms`` and of the step's MoE time (``moe_fwd_ms + moe_bwd_ms +
moe_placement_ms``, max over ranks: the stages of the slowest rank add up to more than their
mean). Prints stages as rows and systems as columns; JSON ``{system: {row: ms}}`` with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from common import print_table, write_json

from lrmoe.passes.stages import STAGES


def runs_in(folder: Path) -> list[Path]:
    """``folder`` itself where it is a run, else the runs directly inside it."""
    if (folder / "metrics.jsonl").exists():
        return [folder]
    return sorted(p for p in folder.iterdir() if (p / "metrics.jsonl").exists())


def step_records(run: Path, first: int, last: int) -> list[dict]:
    """The run's step records in [first, last] that carry stage times."""
    out = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line) if line.strip() else {}
        if "moe_stage_ms" in r and first <= r["step"] <= last:
            out.append(r)
    return out


def stage_table(folders: list[Path], first: int, last: int) -> dict[str, dict[str, float]]:
    """{system: {stage…, "placement", "step": median ms}} over the runs in ``folders``."""
    pooled: dict[str, list[dict]] = {}
    for folder in folders:
        for run in runs_in(folder):
            pooled.setdefault(run.name, []).extend(step_records(run, first, last))
    table = {}
    for system, recs in pooled.items():
        if not recs:
            continue
        row = {k: statistics.median(r["moe_stage_ms"].get(k, 0.0) for r in recs) for k in STAGES}
        row["placement"] = statistics.median(r["moe_placement_ms"] for r in recs)
        row["step"] = statistics.median(r["moe_fwd_ms"] + r["moe_bwd_ms"] + r["moe_placement_ms"] for r in recs)
        row["steps"] = len(recs)
        table[system] = row
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--steps", default="1-1000000", help="FIRST-LAST: the steps read (default: all)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    first, last = (int(v) for v in args.steps.split("-"))
    table = stage_table(args.folders, first, last)
    if not table:
        raise SystemExit(f"no step with stage times in {', '.join(map(str, args.folders))} (steps {args.steps})")
    rows = {name: {system: table[system][name] for system in table} for name in (*STAGES, "placement", "step")}
    counts = ", ".join(f"{system}: {row['steps']}" for system, row in table.items())
    print_table(f"median ms a step, steps {args.steps} (steps read: {counts})", rows, list(table))
    write_json(args.out, table)


if __name__ == "__main__":
    main()
