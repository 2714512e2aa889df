"""One rank of a network probe, started by ``torch.distributed.run`` (on an emulated cluster or
not): where the rank runs, and an all-to-all per message size, both the library's
(:func:`lrmoe.parallel.comm.all_to_all`: on gloo, receives posted first) and gloo's own
``all_to_all_single``.

    python -m torch.distributed.run ... -m lrmoe.emulation.probe OUT [--sizes B,B,...] [--repeats N]

Each rank sends ``B`` bytes in all, ``B / W`` to every rank (its own chunk stays home), checks
what it received, and writes ``OUT/rank-R.json``: its global rank, host name, the address gloo
bound to, per exchange and size the median seconds (after a barrier) and the machine's CPU
seconds (all cores, from /proc/stat) spent per exchange: what the links, their shaping and the
transport cost the machine (benchmarks/link.py).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from lrmoe.emulation.namespaces import EmulatedCluster, Link
from lrmoe.parallel import comm


def machine_cpu_s() -> float:
    """Busy CPU seconds of the whole machine so far (every core; /proc/stat is not per namespace)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


EXCHANGES = {  # the library's exchange on an emulated node (receives first), and gloo's own
    "lrmoe": lambda send, splits: comm.all_to_all(send, splits, splits, dist.group.WORLD),
    "gloo": lambda send, splits: _gloo_all_to_all(send),
}


def _gloo_all_to_all(send: torch.Tensor) -> torch.Tensor:
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    return recv


def exchange(how: str, total_bytes: int, repeats: int, rank: int, world: int) -> dict[str, float]:
    """One all-to-all (``how``: a key of :data:`EXCHANGES`) of ``total_bytes`` a rank: median
    seconds, the machine's CPU seconds per exchange, and the bytes a rank sent to others."""
    n = max(world, total_bytes // 4 // world * world)
    send, splits = torch.full((n,), float(rank)), [n // world] * world
    run = EXCHANGES[how]
    recv = run(send, splits)  # warm-up: connections made, buffers touched
    if not torch.equal(recv, torch.arange(world, dtype=torch.float32).repeat_interleave(n // world)):
        raise RuntimeError(f"the {how} all-to-all delivered other data than sent")
    times = []
    cpu0 = machine_cpu_s()
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        run(send, splits)
        times.append(time.perf_counter() - t0)
    dist.barrier()
    return {"seconds": statistics.median(times), "machine_cpu_s": (machine_cpu_s() - cpu0) / repeats,
            "wire_bytes": n // world * (world - 1) * 4}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--sizes", default="4096", help="bytes a rank sends in one exchange, comma-separated")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    iface = os.environ.get("GLOO_SOCKET_IFNAME")
    record = {"rank": rank, "world": world, "host": socket.gethostname(), "ifname": iface,
              "address": socket.gethostbyname(socket.gethostname()) if iface else None}
    for how in EXCHANGES:
        record[how] = {str(size): exchange(how, size, a.repeats, rank, world) for size in map(int, a.sizes.split(","))}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / f"rank-{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


def run_probe(out: Path, nproc: int, nodes: int = 0, link: Link | None = None, sizes: tuple[int, ...] = (4096,),
              repeats: int = 5) -> list[dict]:
    """Run the probe on ``nproc`` ranks, on ``nodes`` emulated nodes joined by ``link`` (0: this
    machine's loopback, ``torchrun --standalone``); the ranks' records in rank order."""
    probe = ["-m", "lrmoe.emulation.probe", str(out), "--sizes", ",".join(map(str, sizes)), "--repeats",
             str(repeats)]
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if nodes:
        with EmulatedCluster(nodes, link or Link()) as cluster:
            procs = cluster.start([[*torchrun, *cluster.torchrun_args(i, nproc), *probe] for i in range(nodes)],
                                  env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            failed = [p.communicate()[1] for p in procs if p.wait()]
    else:
        done = subprocess.run([*torchrun, "--standalone", f"--nproc-per-node={nproc}", *probe], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        failed = [done.stderr] if done.returncode else []
    if failed:
        raise RuntimeError(f"the probe failed: {failed[0].decode(errors='replace')[-2000:]}")
    return [json.loads((Path(out) / f"rank-{r}.json").read_text()) for r in range(nproc)]


if __name__ == "__main__":
    main()
