"""Shared timing and reporting for the benchmark scripts.

Timings on shared machines drift: rows run interleaved (one iteration of each per round, after
a warm-up round) and report medians, so a slow phase hits every row alike. Use ratios between
rows of one run, never absolute numbers across runs. Processes on the host keep freed memory
for reuse (:func:`lrmoe.train.host_memory.keep_freed_memory`), as ``lrmoe train`` does, so the
absolute times are those of training's setting, without a page fault per fresh tensor.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable

import torch

from lrmoe.train.host_memory import keep_freed_memory


def time_rows(
    modules: dict[str, torch.nn.Module],
    x: torch.Tensor,
    g: torch.Tensor,
    repeats: int,
    after_backward: Callable[[str, torch.nn.Module], dict] | None = None,
) -> dict[str, dict[str, float]]:
    """Median forward, backward and forward+backward (ms) per module, interleaved rounds.

    ``after_backward(name, module)`` may return extra per-iteration figures (medians too).
    """
    if x.device.type == "cpu":  # freed blocks reused, as in training (lrmoe.train.host_memory)
        keep_freed_memory()
    samples: dict[str, dict[str, list[float]]] = {name: {} for name in modules}
    for i in range(repeats + 1):  # round 0 warms up
        for name, module in modules.items():
            module.zero_grad(set_to_none=True)
            xi = x.detach().requires_grad_(True)
            t0 = time.perf_counter()
            y = module(xi)
            t1 = time.perf_counter()
            y.backward(g)
            t2 = time.perf_counter()
            if not i:
                continue
            figures = {"fwd_ms": (t1 - t0) * 1e3, "bwd_ms": (t2 - t1) * 1e3, "fwd_bwd_ms": (t2 - t0) * 1e3}
            if after_backward is not None:
                figures.update(after_backward(name, module))
            for key, value in figures.items():
                samples[name].setdefault(key, []).append(float(value))
    return {name: {k: statistics.median(v) for k, v in figs.items()} for name, figs in samples.items()}


def _cell(v: object) -> str:
    if v is None:
        return f"{'-':>16}"
    if isinstance(v, float):
        return f"{v:>16.3f}" if abs(v) < 10 else f"{v:>16.1f}"
    return f"{v!s:>16}"


def print_table(title: str, rows: dict[str, dict], columns: list[str]) -> None:
    print(title)
    width = max(len(name) for name in rows) + 2
    print(f"{'row':<{width}}" + "".join(f"{c:>16}" for c in columns))
    for name, r in rows.items():
        cells = []
        for c in columns:
            v = r.get(c)
            cells.append(_cell(v))
        print(f"{name:<{width}}" + "".join(cells))


def write_json(path: str | None, rows: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=2)
        print(f"wrote {path}")


def _rank_worker(rank: int, world: int, port: int, fn, args, queue) -> None:
    import sys
    import traceback

    import torch.distributed as dist

    keep_freed_memory()  # the ranks run on the host: freed blocks reused, as in training
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    code = 0
    try:
        queue.put((rank, fn(dist.group.WORLD, args)))
        dist.barrier()  # every rank done with its collectives before any tears the group down
    except BaseException:  # noqa: BLE001 - printed here; the parent sees the exit code
        traceback.print_exc()
        queue.put((rank, None))  # so the parent does not wait for this rank's result
        code = 1
    finally:
        dist.destroy_process_group()
    # Leave without the interpreter's teardown, as the test pool's ranks do: gloo's threads can
    # abort it ("terminate called without an active exception", exit -6) after the result is
    # in; what this rank still had to say is flushed first.
    queue.close()
    queue.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_ranks(fn: Callable, world: int, args) -> list:
    """Run ``fn(group, args)`` on ``world`` gloo ranks spawned on localhost; results by rank.
    ``fn`` must be a module-level function (it is pickled into the spawned processes)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_worker, args=(r, world, port, fn, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=3600) for _ in procs)
    for p in procs:
        p.join()
        if p.exitcode:
            raise SystemExit(f"a rank exited with code {p.exitcode}")
    return [results[r] for r in range(world)]


def selection_variant(label: str) -> dict:
    """``sampled^1`` → {"selection": "sampled", "score_power": 1.0}; ``lrm`` → {"selection": "lrm"};
    ``local-sampled^0.5/0.1`` → also {"p_min": 0.1}; a ``+cv`` suffix → also {"control_variate":
    True}: the BackwardConfig fields a study label stands for."""
    label, cv, _ = label.partition("+cv")
    name, _, tail = label.partition("^")
    power, _, floor = tail.partition("/")
    return {"selection": name, **({"score_power": float(power)} if power else {}),
            **({"p_min": float(floor)} if floor else {}), **({"control_variate": True} if cv else {})}
