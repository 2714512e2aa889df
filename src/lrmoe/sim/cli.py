"""``lrmoe simulate``: the projection's command line (its flags and their parsing; the heavy
modules load only when it runs)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lrmoe.config import BackwardConfig
from lrmoe.sim.errors import SimError
from lrmoe.sizes import UNITS, SizeError, parse_bytes
from lrmoe.systems import REPLICATED_BASELINE as BASE
from lrmoe.systems import TRIMMING_SYSTEM as OURS


def _floats(flag: str, text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise SimError(f"--{flag}={text!r} is invalid: expected comma-separated numbers") from None


def _gib(flag: str, text: str) -> tuple[float, ...]:
    """A comma list of sizes (:mod:`lrmoe.sizes`: ``40GiB``, ``80GB``) in GiB; a bare number is GiB,
    as this flag has always read it."""
    gib = UNITS["gib"]
    try:
        return tuple(parse_bytes(v, f"--{flag}", bare_unit=gib) / gib for v in text.split(",") if v.strip())
    except SizeError as e:
        raise SimError(str(e)) from None


def _share_floors(text: str) -> tuple[tuple[float, float], ...]:
    """``--late-floor``'s SHARE:FLOOR pairs (SimConfig checks their values)."""
    try:  # a non-number, or a pair without its two halves
        return tuple((float(a), float(b)) for a, b in (v.split(":") for v in text.split(",") if v.strip()))
    except ValueError:
        raise SimError(f"--late-floor={text!r} is invalid: expected SHARE:FLOOR pairs, comma-separated, "
                       f"e.g. 0.6:0.3") from None


def cmd_simulate(args: argparse.Namespace) -> None:
    """Paper-scale projection (docs/simulation.md); bad input exits 2 with one line."""
    from lrmoe.sim.config import SimConfig
    from lrmoe.sim.models import MODELS
    from lrmoe.sim.run import project

    models = sorted(MODELS) if args.model == "all" else [args.model]
    try:
        cfgs = [SimConfig(model=m, gpus=args.gpus, memory_caps_gib=_gib("gpu-memory", args.gpu_memory),
                          link_gbps=args.link_gbps, trace=args.trace, compare=args.compare, steps=args.steps,
                          layers=args.layers, tokens_per_gpu=args.tokens_per_gpu,
                          ratios=_floats("ratios", args.ratios), selection=args.selection,
                          lrmoe_slots=args.lrmoe_slots, zipf=args.zipf, seed=args.seed,
                          network_budget=args.network_budget or None, convergence=args.convergence,
                          backward=BackwardConfig(objective=args.objective, drop_cost=args.drop_cost,
                                                  min_ratio=args.min_ratio, warm_ratio=args.warm_ratio,
                                                  warm_balance=args.warm_balance),
                          warm_share=args.warm_share, late_floors=_share_floors(args.late_floor),
                          planning=args.planning) for m in models]
        out = Path(args.out)
        if out.exists() and not out.is_dir():  # (before the simulation, not after it)
            raise SimError(f"--out {out} is a file, not a folder")
        project(cfgs, out, progress=not args.quiet)
    except (SimError, ValueError) as e:
        print(f"lrmoe: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print((out / "table.md").read_text())
    print(f"wrote {out}/table.md, results.json, memory_sensitivity.png, bandwidth_sensitivity.png")



def add_simulate_parser(sub) -> None:
    """``lrmoe simulate``'s flags."""
    # the flag's values belong to the simulator's config (light; the rest loads in cmd_simulate)
    from lrmoe.sim.config import LRMOE_SLOTS_FIXED, LRMOE_SLOTS_SEARCH

    sm = sub.add_parser("simulate", help="paper-scale projection of time to target and memory (docs/simulation.md)")
    sm.add_argument("--model", required=True, help="qwen3-30b-a3b, glm45-air or all")
    sm.add_argument("--gpus", type=int, required=True, help="GPUs in the expert-parallel group (8 per node)")
    sm.add_argument("--gpu-memory", required=True, help="memory cap per GPU: a size such as 80GiB or 141GB, a bare "
                    "number in GiB; a comma list for several")
    sm.add_argument("--link-gbps", type=float, default=400.0, help="inter-node Gbit/s per GPU (default 400)")
    sm.add_argument("--trace", help="routing.npz of an `lrmoe train` run (default: Zipf skew model)")
    sm.add_argument("--compare", help="results.json of an `lrmoe compare` run (default: the shipped one)")
    sm.add_argument("--convergence", help=f"a benchmarks/convergence.py JSON: {OURS}'s steps to target "
                    "(default: the shipped study)")
    sm.add_argument("--planning", help="a benchmarks/bench_planning.py JSON: host planning cost per planner "
                    "call (default: the recorded figures)")
    sm.add_argument("--steps", type=int, default=20, help="simulated steps (default 20)")
    sm.add_argument("--layers", type=int, default=4, help="representative MoE layers (default 4)")
    sm.add_argument("--tokens-per-gpu", type=int, default=4096, help="tokens per GPU per step (default 4096)")
    sm.add_argument("--ratios", default="1", help=f"upper caps on {OURS}'s kept ratio, comma list (default 1: "
                    "the controller's quotas at the cap alone)")
    sm.add_argument("--selection", default="local-sampled", help=f"{OURS}'s selection: its exchange and its "
                    "steps to target (lrm, random, local, sampled, local-sampled; default local-sampled)")
    sm.add_argument("--lrmoe-slots", default=LRMOE_SLOTS_SEARCH, help=f"{OURS} replica slots: {LRMOE_SLOTS_SEARCH} "
                    f"(the controller's cost search, default) or {LRMOE_SLOTS_FIXED} ({BASE}'s default count, fixed)")
    sm.add_argument("--network-budget", type=float, default=1.0, help=f"{OURS}'s network budget per backward, "
                    "x a balanced rank's dy, x and dx of every pair (default 1; 0: none)")
    sm.add_argument("--objective", default="memory", choices=("memory", "time"), help=f"{OURS}'s controller: memory "
                    "(trim what the budgets force, default) or time (also trim where steps x work falls)")
    sm.add_argument("--drop-cost", type=float, default=BackwardConfig.drop_cost,
                    help="the time objective's extra steps per unit of pairs dropped (docs/convergence.md)")
    sm.add_argument("--min-ratio", type=float, default=BackwardConfig.min_ratio,
                    help="the time objective's floor on each expert's kept ratio")
    sm.add_argument("--warm-share", type=float, default=0.0,
                    help=f"share of {OURS}'s steps to target in its warm phase (trim_after over its steps; "
                         "configs/paper.toml: 40 of ~166, 0.24): they run at --warm-ratio with no time objective "
                         "(default 0: none)")
    sm.add_argument("--warm-ratio", type=float, default=BackwardConfig.warm_ratio,
                    help="the warm phase's kept ratio (default 1: every pair memory and the network allow)")
    sm.add_argument("--warm-balance", type=float, default=None,
                    help="the warm phase's demand-side balance: no rank keeps more than (1 + this) x the "
                         "balanced mean (default: none)")
    sm.add_argument("--late-floor", default="", metavar="SHARE:FLOOR[,SHARE:FLOOR]",
                    help="the time objective's later floors (min_ratio_after): from SHARE of "
                         f"{OURS}'s steps to target on, the floor is FLOOR (default: none, as in configs/paper.toml)")
    sm.add_argument("--zipf", type=float, default=0.3, help="Zipf exponent of the skew model (default 0.3)")
    sm.add_argument("--seed", type=int, default=0)
    sm.add_argument("--quiet", action="store_true", help="no progress bar")
    sm.add_argument("--out", required=True, help="output folder")
    sm.set_defaults(fn=cmd_simulate)
