"""Starting the ranks of one run: ``torch.distributed.run`` over :mod:`lrmoe.train.worker`.

Before any rank starts, :func:`preflight` checks what can be checked in the launcher (the corpus
holds one global batch). The resolved config travels to the ranks through a temporary file;
rank 0 writes it to ``out/config.toml`` only once the run has started (a resume that fails
changes nothing in ``out``). A rank that meets a user error (config, data, checkpoint) writes
its one-line message to an error file and exits with :data:`USER_ERROR_EXIT`; the launcher then
stops the other ranks, swallows torchrun's report and raises :class:`RankError` with that line.
Where the ranks meet (one machine, or several: :mod:`lrmoe.train.rendezvous`) is torchrun's
business, except on an emulated cluster, whose nodes (one torchrun each) this module starts
inside their namespaces (:mod:`lrmoe.emulation`); a run that torchrun may restart checkpoints
every ``train.eval_every`` steps unless ``train.checkpoint_every`` says otherwise
(:func:`~lrmoe.train.config.with_restart_checkpoints`).
"""

from __future__ import annotations

import codecs
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from lrmoe.emulation.budgets import resolve_cluster
from lrmoe.emulation.namespaces import EmulatedCluster, emulated_cluster
from lrmoe.train.config import ConfigError, RunConfig, with_restart_checkpoints
from lrmoe.train.data import TokenData, check_fits
from lrmoe.train.rendezvous import Rendezvous, current_rendezvous
from lrmoe.train.toml_dump import dump_toml

USER_ERROR_EXIT = 3  # a rank's exit status after it wrote a user error to the error file
RUN_FILES = ("config.toml", "metrics.jsonl", "routing.npz", "summary.json", "results.json", "report.md", "sweep.json")


class RankError(ValueError):
    """A user error a rank reported (bad data, an unreadable or unfitting checkpoint, ...);
    ``exit_code`` is 2 for user errors, 1 for a run stopped on purpose (``on_nonfinite=stop``)."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def write_error(path: Path, message: str, exit_code: int = 2) -> None:
    """A rank's report of a user error, read back by :func:`launch`."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"message": message, "exit": exit_code}))
    os.replace(tmp, path)


def preflight(cfg: RunConfig) -> None:
    """What the launcher can check before any rank starts: the ``train.hf_model`` checkpoint
    (:func:`~lrmoe.train.hf_model.inspect_checkpoint`), the corpus (tokenized once here and
    cached for the ranks) holds one global batch in its training and validation splits, and the
    TensorBoard writer a run asks for is installed, a CUDA device where ``train.device`` asks for
    one, and what the ranks' MoE layers would refuse (:func:`~lrmoe.train.build.check_layers`)."""
    from lrmoe.train.build import check_layers  # (the model's modules: here, not at the CLI's start)

    t = cfg.train
    if t.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device='cuda' is invalid here: this machine's torch sees no CUDA device "
                          "(train.device='auto' takes one where there is one)")
    check_layers(cfg)
    if t.tensorboard:
        import importlib.util

        from lrmoe.train.metrics import TENSORBOARD_MISSING

        if importlib.util.find_spec("tensorboard") is None:
            raise ConfigError(TENSORBOARD_MISSING)
    if t.hf_model:
        from lrmoe.train.hf_model import inspect_checkpoint

        inspect_checkpoint(t.hf_model, cfg.model.seq_len)
    data = TokenData.load(t.data, t.vocab_size, t.val_fraction, t.hf_model)
    check_fits(data, cfg.model.seq_len, t.batch, t.nproc // (t.ep_size or t.nproc))


def is_run_folder(folder: Path) -> bool:
    """``folder`` holds the outputs of an ``lrmoe train`` run (or a compare's system run)."""
    return any((folder / name).exists() for name in ("config.toml", "metrics.jsonl", "ckpt"))


def clear_outputs(out: Path) -> None:
    """Remove what earlier runs wrote in ``out``: run files, checkpoints, a comparison's
    per-system run folders, results, report and plots. Anything else stays."""
    if not out.is_dir():
        return
    compare_folder = (out / "results.json").exists() or any(p.is_dir() and is_run_folder(p) for p in out.iterdir())
    for p in out.iterdir():
        if p.is_symlink() and is_run_folder(p):  # a cap sweep's link to its shared reference run
            p.unlink()
        elif p.is_dir() and p.name in ("ckpt", "tensorboard"):
            shutil.rmtree(p)
        elif p.is_dir() and is_run_folder(p):
            clear_outputs(p)
            if not any(p.iterdir()):
                p.rmdir()
        elif p.is_file() and (p.name in RUN_FILES or (compare_folder and p.suffix == ".png")):
            p.unlink()


def check_out(out: Path, resume: bool, overwrite: bool) -> None:
    """Refuse (ConfigError) an ``--out`` that holds something, unless the run resumes there or
    replaces it; with ``overwrite``, earlier outputs are removed (:func:`clear_outputs`). On a
    machine other than node 0 of a multi-machine run, ``--out`` is node 0's to prepare."""
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite exclude each other: continue the run in --out or replace it")
    if not current_rendezvous().prepares_out:
        return
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder")
    if out.is_dir() and any(out.iterdir()) and not (resume or overwrite):
        raise ConfigError(f"--out {out} is not empty: pass --resume to continue its run or --overwrite to "
                          f"replace it")
    if overwrite:
        clear_outputs(out)


def _run_ranks(commands: list[list[str]], env: dict, error_path: Path, cluster: EmulatedCluster | None = None) -> int:
    """Run torchrun (one command, or one per emulated node of ``cluster``), passing its stderr
    through as it comes; once a rank has reported a user error, stop the run and swallow the
    rest (torchrun's report of the failed ranks). Returns the first failing exit status, or 0."""
    if cluster is not None:
        procs = cluster.start(commands, env, stderr=subprocess.PIPE)
    else:
        procs = [subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE) for cmd in commands]
    swallow = threading.Event()

    def forward(proc: subprocess.Popen) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        while chunk := os.read(proc.stderr.fileno(), 65536):
            if not swallow.is_set():
                sys.stderr.write(decoder.decode(chunk))
                sys.stderr.flush()

    threads = [threading.Thread(target=forward, args=(p,), daemon=True) for p in procs]
    for t in threads:
        t.start()
    try:
        while any(p.poll() is None for p in procs):
            if error_path.exists():
                swallow.set()
                _stop(procs, grace=10)  # torchrun stops the other ranks itself once one has exited with an error
                break
            if any(p.returncode for p in procs):  # a node whose ranks failed: the others wait in vain
                _stop(procs, grace=30)
                break
            time.sleep(0.1)
        for p in procs:
            p.wait()
    except BaseException:
        _stop(procs, grace=0)
        raise
    finally:
        for t in threads:
            t.join(timeout=5)
    return next((p.returncode for p in procs if p.returncode), 0)


def _stop(procs: list[subprocess.Popen], grace: float) -> None:
    """Give ``procs`` ``grace`` seconds to end, then terminate them, then kill them."""
    deadline = time.monotonic() + grace
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def torchrun_command(cfg: RunConfig, worker_args: list[str], max_restarts: int = 0,
                     rendezvous: Rendezvous | None = None, rendezvous_args: list[str] | None = None) -> list[str]:
    """The torchrun command line of one run: the rendezvous (:mod:`lrmoe.train.rendezvous`;
    ``--standalone`` by default; or ``rendezvous_args`` as they are: an emulated node's),
    ``cfg.train.nproc`` ranks in all, then the worker's arguments."""
    if rendezvous_args is None:
        rendezvous_args = (rendezvous or current_rendezvous()).torchrun_args(cfg.train.nproc)
    return [sys.executable, "-m", "torch.distributed.run", *rendezvous_args, f"--max-restarts={max_restarts}",
            "-m", "lrmoe.train.worker", *worker_args]


def launch(cfg: RunConfig, out: Path, resume: bool = False, max_steps: int | None = None,
           stop_at: float | None = None, eval_at: tuple[int, ...] = (), max_restarts: int = 0,
           rendezvous: Rendezvous | None = None) -> dict:
    """Run the ranks of ``cfg`` into ``out``; returns the summary. A fresh run (no ``resume``)
    first removes earlier outputs in ``out`` (:func:`clear_outputs`; the command line refuses a
    used ``--out`` unless ``--overwrite``), on node 0 only when the run spans machines. With
    ``max_restarts`` > 0 and ``train.checkpoint_every`` = 0, checkpoints come every
    ``train.eval_every`` steps. A user error in a rank raises :class:`RankError`."""
    out = Path(out)
    rendezvous = rendezvous or current_rendezvous()
    cfg = resolve_cluster(with_restart_checkpoints(cfg, max_restarts))  # (the command line's resolved already)
    rendezvous.torchrun_args(cfg.train.nproc)  # a bad --nnodes fails before anything is touched
    if not resume and rendezvous.prepares_out:
        clear_outputs(out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="lrmoe-launch-") as tmp:
        config_path, error_path = Path(tmp) / "config.toml", Path(tmp) / "error.json"
        config_path.write_text(dump_toml(cfg.to_dict()))
        worker = ["--config", str(config_path), "--out", str(out), "--error-file", str(error_path)]
        if resume:
            worker.append("--resume")
        if max_steps:
            worker += ["--max-steps", str(max_steps)]
        if stop_at is not None:
            worker += ["--stop-at", repr(stop_at)]
        if eval_at:
            worker += ["--eval-at", *map(str, eval_at)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        with emulated_cluster(cfg.cluster) as cluster:
            commands = [torchrun_command(cfg, worker, max_restarts, rendezvous)] if cluster is None else [
                torchrun_command(cfg, worker, max_restarts, rendezvous_args=cluster.torchrun_args(i, cfg.train.nproc))
                for i in range(cluster.nodes)]
            code = _run_ranks(commands, env, error_path, cluster)
        if error_path.exists():
            report = json.loads(error_path.read_text())
            raise RankError(report["message"], report.get("exit", 2))
    if code:
        raise SystemExit(f"lrmoe: training ranks failed (exit {code}); see the log above")
    return json.loads((out / "summary.json").read_text())
