"""A pool of gloo ranks on localhost that runs test cases, shared by one test module.

Starting ranks costs seconds, so a module starts one pool of 4 processes (one thread each)
and runs every case on it; world sizes 2 and 3 run on subgroups of the same pool. A case is a
module-level function ``fn(group, *args)`` (``group`` is ``None`` at world size 1), sent to the
ranks by pickling, so importable by its module path (``tests.layer.test_counters``, ...) in a
fresh process; ranks outside the case's group skip it. Results come back as a list indexed by
rank in the group.
"""

from __future__ import annotations

import os
import socket
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, tasks, results) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=60),
    )
    groups = {w: dist.new_group(list(range(w))) for w in range(2, world)}
    groups[world] = dist.group.WORLD
    while True:
        item = tasks.get()
        if item is None:
            break
        fn, size, args = item
        if os.environ.get("LRMOE_TEST_DEBUG"):
            import faulthandler
            import sys

            faulthandler.dump_traceback_later(15, exit=False, file=sys.stderr)
        if rank >= size:
            results.put((rank, "skip", None))
            continue
        try:
            out = fn(groups[size] if size > 1 else None, *args)
            results.put((rank, "ok", out))
        except BaseException:  # noqa: BLE001 - the traceback goes back to the test
            results.put((rank, "error", traceback.format_exc()))
    dist.destroy_process_group()
    # Leave without the interpreter's teardown (seconds with torch loaded, four processes on
    # two cores); what this rank still had to say is flushed first.
    results.close()
    results.join_thread()
    os._exit(0)


class RankPool:
    def __init__(self, world: int = 4) -> None:
        ctx = mp.get_context("spawn")
        self.world = world
        self.broken = False
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        port = _free_port()
        self.procs = [
            ctx.Process(target=_worker, args=(r, world, port, self.tasks[r], self.results), daemon=True)
            for r in range(world)
        ]
        for p in self.procs:
            p.start()

    def run(self, size: int, fn, *args, timeout: float = 90.0) -> list:
        """Run ``fn(group, *args)`` on ranks 0..size-1; returns their results in rank order."""
        if self.broken:
            raise RuntimeError("an earlier case failed on this pool; its ranks are out of step")
        if size == 1:  # world size 1: same code, no process group, in the test process
            return [fn(None, *args)]
        for q in self.tasks:
            q.put((fn, size, args))
        out = [None] * size
        for _ in range(self.world):
            rank, status, value = self.results.get(timeout=timeout)
            if status == "ok":
                out[rank] = value
            elif status == "error":
                # Fail at once: peers may be blocked in a collective the failed rank never joined
                # (gloo's timeout frees them); the pool is unusable after that, so it is retired.
                self.broken = True
                raise AssertionError(f"rank {rank}:\n{value}")
        return out

    def close(self) -> None:
        if self.broken:  # its ranks may wait in a collective that never completes
            for p in self.procs:
                p.kill()
        for q in self.tasks:
            q.put(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


class SharedPool:
    """One :class:`RankPool` for every module that asks for it (starting ranks costs seconds); a
    pool an earlier case broke is replaced before the next case, so one failure stays one."""

    def __init__(self, world: int) -> None:
        self.world = world
        self._pool: RankPool | None = None

    def run(self, size: int, fn, *args, timeout: float = 90.0) -> list:
        if size == 1:
            return [fn(None, *args)]
        if self._pool is not None and self._pool.broken:
            self._pool.close()
            self._pool = None
        if self._pool is None:
            self._pool = RankPool(self.world)
        return self._pool.run(size, fn, *args, timeout=timeout)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
