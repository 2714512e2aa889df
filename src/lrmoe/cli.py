"""``lrmoe train | compare | simulate``: the command line.

    lrmoe train    (--config FILE | --hf-model DIR) [--system NAME] [--set SECTION.KEY=VALUE ...] [--nproc N]
                   [--ep-size E] [--steps N] [--data PATH] [--memory-per-rank SIZE] [--out DIR]
                   [--resume | --overwrite] [--max-restarts R] [RENDEZVOUS | CLUSTER]
    lrmoe compare  (--config FILE | --hf-model DIR) [--systems a,b,c] [--set SECTION.KEY=VALUE ...] [--nproc N]
                   [--ep-size E] [--steps N] [--data PATH] [--memory-per-rank SIZE | --memory-caps A,B,C]
                   [--out DIR] [--resume | --overwrite] [--seeds S,T,U] [RENDEZVOUS | CLUSTER]
    lrmoe simulate --model NAME --gpus N --gpu-memory SIZE[,SIZE...] --out DIR [options]

    SIZE: 40GiB, 66.8MiB, 70MB, 1_000_000 (bytes); --gpu-memory's bare numbers are GiB (lrmoe.sizes)

    RENDEZVOUS: --nnodes N --node-rank R (--rdzv-endpoint HOST:PORT [--rdzv-id ID] [--rdzv-backend B]
                | --master-addr HOST [--master-port P]); none: one machine (torchrun --standalone)
    CLUSTER:    --emulate-nodes N [--link-gbps G|paper] [--link-latency-us U]: the ranks on N nodes
                emulated on this machine (network namespaces joined by shaped links; root on Linux)

Ranks are launched through ``torch.distributed.run`` (gloo on CPU, NCCL on CUDA), on one machine
or, with the rendezvous options, on several (docs/training.md "Several machines"). A user error
(bad config or flag, missing or too little data, a used --out, a checkpoint that does not fit),
in the launcher or inside a rank, exits with status 2 and one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from lrmoe.emulation.budgets import resolve_for_launcher
from lrmoe.emulation.config import parse_link_gbps
from lrmoe.sim.cli import add_simulate_parser
from lrmoe.sizes import SizeError, parse_bytes
from lrmoe.systems import (
    REFERENCE_SYSTEM,
    REPLICATED_BASELINE,
    TRIMMING_SYSTEM,
    BackwardKind,
    names_where,
    parse_system_name,
)
from lrmoe.train.checkpoint import CheckpointError
from lrmoe.train.config import ConfigError, RunConfig, apply_sets, from_dict, read_config, require_int
from lrmoe.train.data import DEFAULT_CORPUS, DataError, read_corpus
from lrmoe.train.hf_defaults import describe_choices, fill_hf_defaults
from lrmoe.train.launch import RankError, check_out, launch, preflight
from lrmoe.train.rendezvous import Rendezvous, current_rendezvous, use_rendezvous

# System names in the help come from systems.py (each example parses: system[-selection][@ratio])
OURS, BASE = TRIMMING_SYSTEM, REPLICATED_BASELINE
MASKED = names_where(backward=BackwardKind.MASKED)[0]  # the selective kept set on full-size tensors
SYSTEM_EXAMPLES = f"{OURS}-random@0.5 or {MASKED}@0.25"  # --system
SYSTEMS_EXAMPLE = f"{REFERENCE_SYSTEM},{BASE},{OURS}@0.5"  # --systems


def _common(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--config", help="TOML file (see configs/); optional with --hf-model (lrmoe's defaults for a "
                                     "checkpoint, printed before launch)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override one config value, parsed as TOML (repeatable), e.g. --set train.lr=1e-3 "
                         "--set model.moe.top_k=4 --set backward.selection=random")
    ap.add_argument("--nproc", type=int, help="ranks to launch (overrides train.nproc)")
    ap.add_argument("--ep-size", type=int, help="ranks per expert-parallel group (default: all)")
    ap.add_argument("--steps", type=int, help="optimizer steps (overrides train.steps)")
    ap.add_argument("--data", help="a text file or a folder of text files (default: the built-in corpus)")
    ap.add_argument("--hf-model", metavar="DIR",
                    help="train a local transformers checkpoint folder (config, weights, tokenizer) instead of "
                         "[model]: its MoE blocks become the system's layers; its tokenizer reads --data; "
                         "save_pretrained output goes to out/hf and each checkpoint (overrides train.hf_model)")
    ap.add_argument("--memory-per-rank", metavar="SIZE",
                    help="the whole rank's memory (model, gradients, optimizer state, activations, MoE layers), "
                         "e.g. 40GiB or 32MiB; each MoE layer's expert-side budget (budget.memory_bytes) is derived "
                         "from it and the split printed before launch (overrides budget.memory_per_rank)")
    ap.add_argument("--overwrite", action="store_true", help="replace the earlier outputs in a used --out")
    em = ap.add_argument_group("emulated cluster (docs/training.md \"An emulated cluster\"; root on Linux)")
    em.add_argument("--emulate-nodes", type=int, metavar="N",
                    help="run the ranks on N emulated nodes of this machine, nproc / N each: network namespaces "
                         "joined by shaped links (overrides cluster.emulate_nodes)")
    em.add_argument("--link-gbps", metavar="G", help="each node's link in Gbit/s each way, or 'paper': the link at "
                                                     "which the dispatch takes the paper's 2.6x the forward expert "
                                                     "GEMMs (overrides cluster.link_gbps; none: unshaped)")
    em.add_argument("--link-latency-us", type=float, metavar="U",
                    help="added one-way latency between nodes, µs (overrides cluster.link_latency_us)")
    rz = ap.add_argument_group("rendezvous (torchrun's; none of them: one machine, torchrun --standalone)")
    rz.add_argument("--nnodes", type=int, default=1,
                    help="machines the run spans; each starts nproc / nnodes ranks (--nproc counts the whole run)")
    rz.add_argument("--node-rank", type=int, help="this machine's index 0..nnodes-1 (required with --nnodes > 1; "
                                                  "node 0 checks and prepares --out, a folder all machines share)")
    rz.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="c10d rendezvous endpoint (one of the machines)")
    rz.add_argument("--rdzv-backend", help="c10d (default with --rdzv-endpoint) or static (default with "
                                           "--master-addr)")
    rz.add_argument("--rdzv-id", help="the job's id at the rendezvous (default lrmoe)")
    rz.add_argument("--master-addr", metavar="HOST", help="static rendezvous: node 0's address")
    rz.add_argument("--master-port", type=int, help="static rendezvous: node 0's port (torchrun's default 29500)")


def _rendezvous(args: argparse.Namespace) -> Rendezvous:
    """The rendezvous flags of ``train`` and ``compare`` (validated: a ConfigError)."""
    return Rendezvous(nnodes=args.nnodes, node_rank=args.node_rank, rdzv_backend=args.rdzv_backend,
                      rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id, master_addr=args.master_addr,
                      master_port=args.master_port)


def _load(args: argparse.Namespace) -> tuple[RunConfig, dict[str, object]]:
    """The config file (none: lrmoe's defaults, with ``--hf-model`` only) with ``--set``,
    ``--hf-model`` and ``--memory-per-rank`` applied (the flag replaces the file's
    ``budget.memory_bytes`` or ``memory_per_rank``, not a ``--set`` of either), and the
    checkpoint defaults filled in (:mod:`lrmoe.train.hf_defaults`)."""
    hf_model, per_rank = getattr(args, "hf_model", None), getattr(args, "memory_per_rank", None)
    if not args.config and not hf_model:
        raise ConfigError("--config FILE is required (or --hf-model DIR: a transformers checkpoint trains with "
                          "lrmoe's defaults)")
    sets = list(args.set)
    # --hf-model is train.hf_model (absolute: the ranks may start elsewhere), so a [model] the
    # checkpoint fixes is refused as in a config file
    if hf_model:
        sets.append(f"train.hf_model={json.dumps(str(Path(hf_model).resolve()))}")
    raw = read_config(args.config) if args.config else {}
    if per_rank is not None:
        if any(item.partition("=")[0].strip() == "budget.memory_bytes" for item in args.set):
            raise ConfigError("--memory-per-rank and budget.memory_bytes exclude each other: --memory-per-rank is "
                              "the whole rank's memory, from which lrmoe derives memory_bytes")
        budget = raw.setdefault("budget", {})
        budget.pop("memory_bytes", None)
        budget["memory_per_rank"] = parse_bytes(per_rank, "--memory-per-rank")
    raw = apply_sets(raw, sets)
    link = getattr(args, "link_gbps", None)
    for key, value in (("emulate_nodes", getattr(args, "emulate_nodes", None)),
                       ("link_latency_us", getattr(args, "link_latency_us", None)),
                       ("link_gbps", None if link is None else parse_link_gbps(link))):
        if value is not None:
            raw.setdefault("cluster", {})[key] = value
    filled = fill_hf_defaults(raw)
    return from_dict(raw), filled


def _resolve(args: argparse.Namespace) -> RunConfig:
    """The config (:func:`_load`) with ``--system`` and the flags applied, checked before any
    rank starts (config, data, routing trace, the corpus's size against one global batch), its
    ``memory_per_rank`` turned into each MoE layer's budget (the split printed)."""
    from lrmoe.train.memory_split import with_memory_per_rank

    cfg, filled = _load(args)
    if getattr(args, "system", None):
        from lrmoe.train.compare import system_config

        try:
            parse_system_name(args.system)
        except ValueError as e:
            raise ConfigError(f"--{e}") from None
        try:
            cfg = system_config(cfg, args.system)  # compare's names: system[-selection][@ratio]
        except ConfigError as e:  # a selection or ratio [backward] rejects
            detail = str(e).removeprefix(f"compare system {args.system!r}: ")
            raise ConfigError(f"--system {args.system!r}: {detail}") from None
    overrides = {k: v for k, v in (("nproc", args.nproc), ("ep_size", args.ep_size), ("steps", args.steps),
                                   ("data", args.data)) if v is not None}
    try:
        cfg = cfg.with_train(**overrides)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.train.data != DEFAULT_CORPUS:
        read_corpus(cfg.train.data)  # a missing path or empty text fails here, before any rank starts
    if cfg.train.routing_trace:
        from lrmoe.train.build import read_routing_trace

        read_routing_trace(cfg.train.routing_trace, cfg.model)  # likewise an unreadable or mismatched trace
    current_rendezvous().torchrun_args(cfg.train.nproc)  # --nnodes must divide the run's ranks
    if cfg.cluster.emulated:  # (before the layers are checked: the nodes give the topology)
        resumed = _out(args, cfg) if getattr(args, "resume", False) else None
        cfg = resolve_for_launcher(cfg, current_rendezvous().standalone, resumed)
    preflight(cfg)  # and a corpus too small for one global batch
    if getattr(args, "memory_caps", None) is not None and cfg.memory_per_rank is not None:
        raise ConfigError("--memory-caps and --memory-per-rank (budget.memory_per_rank) exclude each other: one "
                          "sweeps each MoE layer's expert-side cap, the other derives it from the rank's memory")
    if cfg.train.hf_model and (filled or not args.config):  # what the user did not choose, once
        print(describe_choices(cfg.train.hf_model, filled, vars(cfg.train), cfg.model.seq_len, bool(args.config)),
              flush=True)
    where = "--memory-per-rank" if getattr(args, "memory_per_rank", None) is not None else "budget.memory_per_rank"
    return with_memory_per_rank(cfg, where)  # a cap too small for the smallest plan stops here


def _out(args: argparse.Namespace, cfg: RunConfig) -> Path:
    """``--out``, or the command's default folder (``train``'s named after the system)."""
    if args.out:
        return Path(args.out)
    return Path("runs/compare") if args.command == "compare" else Path(f"runs/{args.system or cfg.train.system}")


def cmd_train(args: argparse.Namespace) -> None:
    """``lrmoe train``: one system's run, summarised in one line."""
    cfg = _resolve(args)
    name = args.system or cfg.train.system
    out = _out(args, cfg)
    check_out(out, args.resume, args.overwrite)
    summary = launch(cfg, out, resume=args.resume, max_restarts=args.max_restarts)
    val = summary["val"][-1]["loss"] if summary["val"] else float("nan")
    print(f"trained {summary['steps']} steps of {name}: validation loss {val:.4f} "
          f"(unigram {summary['unigram_loss']:.4f}), MoE time {summary['moe_time_s']:.2f} s; results in {out}/")


def cmd_compare(args: argparse.Namespace) -> None:
    """``lrmoe compare``: the systems of the flag or the config, run by :func:`run_compare`, or
    with ``--memory-caps`` at each cap by :func:`run_sweep`, with ``--seeds`` once per seed
    (:func:`run_seeds`; both: :func:`run_seed_sweeps`)."""
    from lrmoe.train.build import check_layers
    from lrmoe.train.compare import run_compare, system_config, target_steps
    from lrmoe.train.sweep import parse_caps, parse_seeds, run_seeds, run_sweep
    from lrmoe.train.sweep_seeds import run_seed_sweeps

    caps = parse_caps(args.memory_caps) if args.memory_caps is not None else None
    cfg = _resolve(args)
    seeds = parse_seeds(args.seeds) if args.seeds is not None else cfg.compare.seeds
    systems = tuple(s.strip() for s in args.systems.split(",")) if args.systems else cfg.compare.systems
    replace(cfg.compare, systems=systems)  # --systems checked as compare.systems is (each name, none twice)
    for name in systems:  # what each system's layers would refuse, before any run starts
        check_layers(system_config(cfg, name))
    standard, *strict = target_steps(cfg)
    if strict and strict[0] <= standard:
        raise ConfigError(f"compare.strict_fraction={cfg.compare.strict_fraction} gives the reference's step "
                          f"{strict[0]} of train.steps={cfg.train.steps}, not after the standard target's "
                          f"({standard}): more steps or a later fraction")
    out = _out(args, cfg)
    check_out(out, args.resume, args.overwrite)
    if seeds and caps is not None:
        run_seed_sweeps(cfg, systems, caps, seeds, out, resume=args.resume)
    elif seeds:
        run_seeds(cfg, systems, seeds, out, resume=args.resume)
    elif caps is None:
        run_compare(cfg, systems, out, resume=args.resume)
    else:
        run_sweep(cfg, systems, caps, out, resume=args.resume)


def _train_parser(sub) -> None:
    """``lrmoe train``'s flags."""
    tr = sub.add_parser("train", help="train one system")
    _common(tr)
    tr.add_argument("--system", help=f"overrides train.system; compare's names too, e.g. {SYSTEM_EXAMPLES} "
                                     "(selection and ratio go to [backward])")
    tr.add_argument("--out", help="output folder (default runs/SYSTEM); a used one needs --resume or --overwrite")
    tr.add_argument("--resume", action="store_true", help="continue from the last good checkpoint in --out, "
                                                             "also at another --nproc or --ep-size")
    tr.add_argument("--max-restarts", type=int, default=0,
                    help="restart failed ranks this many times; restarted ranks resume from the last checkpoint "
                         "(with train.checkpoint_every = 0, checkpoints then come every train.eval_every steps)")
    tr.set_defaults(fn=cmd_train)


def _compare_parser(sub) -> None:
    """``lrmoe compare``'s flags."""
    cp = sub.add_parser("compare", help="time to a target loss, system by system")
    _common(cp)
    cp.add_argument("--systems", help=f"comma-separated, e.g. {SYSTEMS_EXAMPLE} (overrides compare.systems)")
    cp.add_argument("--out", help="output folder (default runs/compare); a used one needs --resume or --overwrite")
    cp.add_argument("--resume", action="store_true",
                    help="keep the systems whose runs in --out finished with the same config; run the rest")
    cp.add_argument("--memory-caps", metavar="A,B,C",
                    help="run the comparison at each per-rank memory cap (bytes such as 70MB or 66.8MiB, or a "
                         "fraction of the uncapped reference's peak such as 0.8x) and plot MoE time to target "
                         "against the cap (sweep.json, sweep.png)")
    cp.add_argument("--seeds", metavar="S,T,U",
                    help="run the whole comparison (with --memory-caps: the whole sweep) once per seed (train.seed "
                         "and backward.seed; out/seed-S/ ...) and report mean, min-max and std of steps and MoE time "
                         "to target (overrides compare.seeds)")
    cp.set_defaults(fn=cmd_compare)


def main(argv: list[str] | None = None) -> None:
    """Parse, dispatch; a user error exits 2 with one line on stderr."""
    ap = argparse.ArgumentParser(prog="lrmoe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    _compare_parser(sub)
    add_simulate_parser(sub)
    args = ap.parse_args(argv)
    try:
        for name, least in (("nproc", 1), ("ep_size", 0), ("steps", 1), ("max_restarts", 0), ("emulate_nodes", 1)):
            if getattr(args, name, None) is not None:
                require_int(f"--{name.replace('_', '-')}", getattr(args, name), least)
        if args.command in ("train", "compare"):
            use_rendezvous(_rendezvous(args))  # every launch of the command meets there
        args.fn(args)
    except RankError as e:  # reported by a rank
        print(f"lrmoe: {e}", file=sys.stderr)
        raise SystemExit(e.exit_code) from None
    except (ConfigError, DataError, CheckpointError, SizeError) as e:
        print(f"lrmoe: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
