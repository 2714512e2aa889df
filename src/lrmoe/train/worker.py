"""One rank of ``lrmoe train``, started by torch.distributed.run (see :mod:`lrmoe.train.launch`):
process-group setup, freed host memory kept for reuse on the CPU, resume after a restart, user
errors reported to the launcher, and the fault-injection testing hook."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from lrmoe.train.checkpoint import CheckpointError
from lrmoe.train.config import ConfigError, load
from lrmoe.train.data import DataError
from lrmoe.train.groups import train_device
from lrmoe.train.host_memory import keep_freed_memory
from lrmoe.train.launch import USER_ERROR_EXIT, write_error
from lrmoe.train.loop import PeerRankError, train

# what a rank reports as one line (exit status for the launcher): user errors, and a run stopped
# on purpose (train.on_nonfinite = "stop")
REPORTED = ((ConfigError, 2), (DataError, 2), (CheckpointError, 2), (FloatingPointError, 1))


def maybe_inject_fault(step: int, rank: int) -> None:
    """Testing hook for rank-failure recovery: ``LRMOE_FAULT_AT=STEP:RANK`` kills that rank with
    SIGKILL after that step, on the first attempt only (torchrun's restart count is 0)."""
    spec = os.environ.get("LRMOE_FAULT_AT")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    fault_step, fault_rank = (int(v) for v in spec.split(":"))
    if (step, rank) == (fault_step, fault_rank):
        os.kill(os.getpid(), signal.SIGKILL)


def main_worker(config_path: str, out: str, resume: bool, max_steps: int | None, stop_at: float | None,
                eval_at: tuple[int, ...], error_file: str | None = None) -> None:
    """Entry of a rank launched by torch.distributed.run: joins the world, trains, leaves. A
    user error goes to ``error_file`` as one line (the launcher prints it) and ends the rank
    with :data:`USER_ERROR_EXIT`; a rank that stops because another failed exits the same way."""
    try:
        _join_and_train(config_path, out, resume, max_steps, stop_at, eval_at)
    except PeerRankError:  # the failing rank reports; give it the time to write before torchrun stops it
        time.sleep(2)
        sys.exit(USER_ERROR_EXIT)
    except tuple(cls for cls, _ in REPORTED) as e:
        if error_file is None:
            raise
        code = next(code for cls, code in REPORTED if isinstance(e, cls))
        write_error(Path(error_file), " ".join(str(e).split()), code)
        sys.exit(USER_ERROR_EXIT)


def _join_and_train(config_path: str, out: str, resume: bool, max_steps: int | None, stop_at: float | None,
                    eval_at: tuple[int, ...]) -> None:
    cfg = load(config_path)
    if train_device(cfg).type == "cpu":  # every system alike: a step's tensors reuse freed pages
        keep_freed_memory()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    group = None
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if world > 1:
        # A fresh key prefix per restart attempt: otherwise gloo may read the addresses of the
        # previous attempt's (dead) ranks from the shared store and fail to connect.
        rank = int(os.environ["RANK"])
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "False") == "True"
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                              is_master=not agent_store and rank == 0)
        cuda = train_device(cfg).type == "cuda"
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo",
                                store=dist.PrefixStore(f"lrmoe/attempt_{restart}", store), rank=rank, world_size=world)
        group = dist.group.WORLD
    # a rank restarted by torchrun (--max-restarts) resumes from the last good checkpoint
    resume = resume or restart > 0
    try:
        train(cfg, Path(out), group, resume=resume, max_steps=max_steps, stop_at=stop_at, eval_at=eval_at,
              after_step=maybe_inject_fault)
    finally:
        if world > 1:
            dist.destroy_process_group()


def main() -> None:
    """The worker's command line, as :func:`lrmoe.train.launch.launch` passes it."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--max-steps", type=int)
    ap.add_argument("--stop-at", type=float)
    ap.add_argument("--eval-at", type=int, nargs="*", default=[])
    ap.add_argument("--error-file")
    a = ap.parse_args()
    main_worker(a.config, a.out, a.resume, a.max_steps, a.stop_at, tuple(a.eval_at), a.error_file)
    # Everything is written and the process group destroyed: leave without the interpreter's
    # teardown, in which gloo's threads can abort a finished rank ("terminate called without an
    # active exception", exit -6) and torchrun would report the run as failed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
