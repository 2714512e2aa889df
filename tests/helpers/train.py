"""What the training tests share: the tiny config, a run's metrics, the training case the rank
pools run, a made-up corpus, and the command line run as a user meets it (a process of its own,
or ``lrmoe.cli.main`` in this process)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np

from lrmoe.train.config import from_dict
from lrmoe.train.loop import train

TINY = {
    "model": {"preset": "qwen3-moe-tiny", "dim": 32, "n_layers": 2, "n_heads": 2, "seq_len": 32,
              "moe": {"ffn_dim": 32, "num_experts": 4, "top_k": 2}},
    "train": {"steps": 8, "batch": 4, "lr": 1e-2, "warmup": 2, "eval_every": 4, "eval_batches": 1,
              "nproc": 2},
}


def tiny(**train_overrides):
    raw = json.loads(json.dumps(TINY))
    raw["model"]["moe"].update(train_overrides.pop("moe", {}))
    raw["train"].update({k: v for k, v in train_overrides.items() if k not in ("budget", "backward")})
    if "budget" in train_overrides:
        raw["budget"] = train_overrides["budget"]
    if "backward" in train_overrides:
        raw["backward"] = train_overrides["backward"]
    return from_dict(raw)


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def train_case(group, cfg_kwargs: dict, out: str, resume=False, max_steps=None):
    cfg = tiny(**cfg_kwargs)
    return train(cfg, Path(out), group, resume=resume, max_steps=max_steps)


def write_text_folder(folder: Path) -> None:
    """A made-up corpus (generated here, nothing third-party)."""
    rng = np.random.default_rng(0)
    nouns = ["expert", "router", "token", "gradient", "budget", "replica", "rank", "layer", "quota", "batch"]
    verbs = ["routes", "keeps", "drops", "scores", "sends", "reduces", "plans", "computes"]
    folder.mkdir()
    for i in range(3):
        lines = [f"The {rng.choice(nouns)} {rng.choice(verbs)} the {rng.choice(nouns)} of every "
                 f"{rng.choice(nouns)}." for _ in range(800)]
        (folder / f"part{i}.txt").write_text("\n".join(lines))


def run_cli(*args, cwd=None):
    """``lrmoe ARGS`` in a process of its own, as a user runs it (seconds of imports each)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "lrmoe.cli", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=300)


def run_main(*args) -> subprocess.CompletedProcess:
    """``lrmoe ARGS`` through ``lrmoe.cli.main`` in this process, with what :func:`run_cli` returns:
    the exit status, stdout and stderr (ranks still start through torchrun, their stderr passed
    through the launcher's). Without the start-up of a Python process with torch (seconds), for
    the many checks of what the launcher says; ``run_cli`` keeps the real entry point covered.
    Warnings a process would print (Python's default filters) count as stderr lines."""
    from lrmoe.cli import main
    from lrmoe.train.rendezvous import current_rendezvous, use_rendezvous

    out, err, before = io.StringIO(), io.StringIO(), current_rendezvous()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.simplefilter("ignore", category)
        try:
            main([str(a) for a in args])
        except SystemExit as e:  # as the interpreter turns it into an exit status
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
                code = 1
            else:
                code = e.code or 0
        finally:
            use_rendezvous(before)  # main() sets the command's rendezvous for the process
    stderr = err.getvalue() + "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line)
                                      for w in caught)
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), stderr)


def config_file(tmp_path: Path, **train_overrides) -> Path:
    from lrmoe.train.toml_dump import dump_toml

    path = tmp_path / "cfg.toml"
    path.write_text(dump_toml(tiny(**train_overrides).to_dict()))
    return path


def one_line_error(r, code: int = 2) -> str:
    assert r.returncode == code, (r.returncode, r.stderr[-3000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lrmoe: ") and "Traceback" not in r.stderr, r.stderr[-3000:]
    return lines[0]
