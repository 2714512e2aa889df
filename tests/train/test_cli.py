"""The command line as a user meets it: ``--set`` overrides, compare's system names in
``train``, a used ``--out`` refused, a failed resume that changes nothing, a resume at another
``--nproc``, user errors in the launcher and inside ranks as one line with exit 2, flags
validated, help that matches the commands.

Most commands run through ``lrmoe.cli.main`` in the test process (``run_main``: no start-up of a
Python with torch, seconds each); the first run of the resume test, the first user error of
test_cli_user_errors_are_one_line and compare's unknown system run through a process of their
own (``run_cli``), as a user types them."""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from lrmoe.train.config import ConfigError, apply_sets, from_dict, load
from tests.helpers.train import (
    TINY,
    config_file,
    losses,
    one_line_error,
    records,
    run_cli,
    run_main,
    tiny,
    write_text_folder,
)


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` with the hash of its bytes."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------- --set


def test_set_overrides_parse_as_toml_and_validate():
    raw = apply_sets(json.loads(json.dumps(TINY)), [
        "train.steps=3", "train.lr=1e-3", "model.moe.top_k=1", "backward.selection=random",
        'train.device="cpu"', "budget.ranks_per_node=1", 'compare.systems=["static", "lrmoe@0.5"]',
        "model.preset=glm45-tiny"])
    cfg = from_dict(raw)
    assert (cfg.train.steps, cfg.train.lr, cfg.model.moe.top_k, cfg.backward.selection, cfg.train.device) == \
        (3, 1e-3, 1, "random", "cpu")
    assert cfg.budget.ranks_per_node == 1 and cfg.compare.systems == ("static", "lrmoe@0.5")
    assert cfg.model.moe.router == "sigmoid"
    for item, needle in [("train.stepz=3", "unknown key 'stepz' in [train]"), ("trian.steps=3", "no table [trian]"),
                         ("train=3", "expected section.key=value"), ("train.steps", "expected section.key=value"),
                         ("model.moe=3", "unknown key 'moe'"), ("model.moe.experts=3", "unknown key 'experts'"),
                         ("train.steps={a=1}", "not a table")]:
        with pytest.raises(ConfigError, match=needle.replace("[", r"\[").replace("]", r"\]")):
            apply_sets({}, [item])
    with pytest.raises(ConfigError, match="train.steps=0"):  # the values go through the config's validation
        from_dict(apply_sets({}, ["train.steps=0"]))
    with pytest.raises(ConfigError, match="train.steps='3x'"):
        from_dict(apply_sets({}, ["train.steps=3x"]))


def test_set_applies_to_the_file(tmp_path):
    cfg = load(config_file(tmp_path), ["train.steps=3", "train.steps=4"])  # the last one wins
    assert cfg.train.steps == 4


def test_cli_set_and_system_errors_are_one_line(tmp_path):
    cfg = str(config_file(tmp_path))
    assert "unknown key 'stepz' in [train]" in one_line_error(run_main("train", "--config", cfg, "--set",
                                                                       "train.stepz=3"))
    assert "train.batch=0" in one_line_error(run_main("compare", "--config", cfg, "--set", "train.batch=0"))
    assert "--system 'lrmoe-best@0.5'" in one_line_error(run_main("train", "--config", cfg, "--system",
                                                                  "lrmoe-best@0.5"))
    assert "ratio" in one_line_error(run_main("train", "--config", cfg, "--system", "lrmoe@1.5"))


# ------------------------------------------------------------------- --system takes compare's names


def _resolve(tmp_path: Path, **flags):
    from lrmoe.cli import _resolve

    args = dict(config=str(config_file(tmp_path)), set=[], nproc=None, ep_size=None, steps=None, data=None,
                system=None)
    return _resolve(argparse.Namespace(**{**args, **flags}))


@pytest.mark.parametrize("name,want", [
    ("lrmoe-random@0.5", ("lrmoe", "random", 0.5)), ("masked@0.25", ("masked", "local-sampled", 0.25)),
    ("lrmoe-sampled", ("lrmoe", "sampled", 1.0)), ("symi", ("symi", "local-sampled", 1.0)),
])
def test_train_system_takes_compare_names(tmp_path, name, want):
    cfg = _resolve(tmp_path, system=name, set=["train.steps=3"])
    assert (cfg.train.system, cfg.backward.selection, cfg.backward.ratio) == want and cfg.train.steps == 3


# ------------------------------------------------------------------- --out, resume, user errors in ranks


def test_check_out_and_clear_outputs(tmp_path):
    from lrmoe.train.launch import check_out, clear_outputs

    out = tmp_path / "cmp"
    check_out(out, resume=False, overwrite=False)  # a new folder
    for name in ("static", "lrmoe@0.5"):
        (out / name / "ckpt" / "step_0000002").mkdir(parents=True)
        (out / name / "metrics.jsonl").write_text("{}\n")
        (out / name / "config.toml").write_text("")
    for name in ("results.json", "report.md", "config.toml", "kept_ratio.png", "notes.txt"):
        (out / name).write_text("x")
    with pytest.raises(ConfigError, match="is not empty: pass --resume .* or --overwrite"):
        check_out(out, resume=False, overwrite=False)
    with pytest.raises(ConfigError, match="exclude each other"):
        check_out(out, resume=True, overwrite=True)
    check_out(out, resume=True, overwrite=False)  # compare --resume keeps the finished systems
    assert (out / "static" / "metrics.jsonl").exists()
    check_out(out, resume=False, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"], "only what lrmoe wrote is removed"
    (out / "file").write_text("")
    with pytest.raises(ConfigError, match="is a file"):
        check_out(out / "file", resume=False, overwrite=False)
    clear_outputs(tmp_path / "missing")


def test_too_small_corpus_is_one_line_before_launch_and_inside_ranks(tmp_path, monkeypatch):
    from lrmoe.train.launch import RankError, launch

    monkeypatch.setenv("LRMOE_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "texts"
    write_text_folder(data)
    cfg = config_file(tmp_path, data=str(data), vocab_size=300, batch=100_000)
    out = tmp_path / "run"
    line = one_line_error(run_main("train", "--config", str(cfg), "--out", str(out)))
    assert "the corpus is too small" in line and "train.batch=100000" in line
    assert not out.exists(), "refused before anything was written"
    # the same error raised inside the ranks (a launch without the launcher's checks)
    with pytest.raises(RankError, match="the corpus is too small") as e:
        launch(tiny(data=str(data), vocab_size=300, batch=100_000), out)
    assert e.value.exit_code == 2
    assert not (out / "config.toml").exists(), "no rank started the run"


def test_used_out_failed_resume_resume_and_overwrite(tmp_path):
    """One run through its steps: trained at --nproc 2 (through a process of its own, as a user
    runs it), a used --out refused, resumes that fail (another model; a checkpoint of an earlier
    lrmoe) changing nothing, a resume at --nproc 1 that continues the step count, --overwrite."""
    cfg = str(config_file(tmp_path, checkpoint_every=1, eval_every=2))
    out = tmp_path / "run"
    # checkpoint_every=0 in this first run: the checkpoint at the end is the one a resume reads
    r = run_cli("train", "--config", cfg, "--system", "lrmoe-random@0.5", "--set", "train.steps=3",
             "--set", "train.checkpoint_every=0", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "trained 3 steps of lrmoe-random@0.5" in r.stdout
    written = load(out / "config.toml")
    assert (written.train.system, written.backward.selection, written.backward.ratio, written.train.steps) == \
        ("lrmoe", "random", 0.5, 3)
    assert written.train.nproc == 2
    summary = json.loads((out / "summary.json").read_text())
    assert [v["step"] for v in summary["val"]] == [2, 3]
    assert len(losses(out)) == 3 and (out / "routing.npz").exists()
    assert (out / "ckpt" / "latest").read_text() == "3"
    before = snapshot(out)

    # a used --out without --resume: refused, nothing touched
    line = one_line_error(run_main("train", "--config", cfg, "--out", str(out)))
    assert "is not empty" in line and "--overwrite" in line
    # a resume that cannot work (another model): one line from inside both ranks, nothing touched
    line = one_line_error(run_main("train", "--config", cfg, "--system", "lrmoe-random@0.5",
                                "--set", "model.moe.ffn_dim=48", "--out", str(out), "--resume"))
    assert "does not fit this run" in line
    assert snapshot(out) == before, "a failed resume changes nothing on disk"

    # a good resume, at another --nproc, continues the step count
    r = run_main("train", "--config", cfg, "--system", "lrmoe-random@0.5", "--nproc", "1", "--steps", "5",
              "--out", str(out), "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "trained 5 steps of lrmoe-random@0.5" in r.stdout
    rows = records(out)
    assert [x["step"] for x in rows] == [1, 2, 3, 4, 5]
    assert all(np.isfinite(losses(out)))
    assert rows[3]["wall_s"] > rows[2]["wall_s"], "wall time continues across the resume"
    written = load(out / "config.toml")
    assert (written.train.steps, written.train.nproc) == (5, 1)

    # a checkpoint of an earlier lrmoe (one pickled file a rank): one line with exit 2, nothing touched
    shutil.rmtree(out / "ckpt")
    (out / "ckpt" / "step_0000005").mkdir(parents=True)
    (out / "ckpt" / "step_0000005" / "rank_0.pt").write_bytes(b"old")
    (out / "ckpt" / "latest").write_text("5")
    before = snapshot(out)
    assert "earlier lrmoe" in one_line_error(run_main("train", "--config", cfg, "--nproc", "1", "--steps", "6",
                                                   "--out", str(out), "--resume"))
    assert snapshot(out) == before

    # --overwrite replaces the run: no old metrics lines or checkpoints beside the new ones
    r = run_main("train", "--config", cfg, "--system", "static", "--steps", "2", "--out", str(out), "--overwrite")
    assert r.returncode == 0, r.stderr[-3000:]
    assert [x["step"] for x in records(out)] == [1, 2]
    assert sorted(p.name for p in (out / "ckpt").glob("step_*")) == ["step_0000001", "step_0000002"]


def test_compare_refuses_a_used_out(tmp_path):
    out = tmp_path / "cmp"
    (out / "static").mkdir(parents=True)
    (out / "static" / "metrics.jsonl").write_text("")
    line = one_line_error(run_main("compare", "--config", str(config_file(tmp_path)), "--out", str(out)))
    assert "is not empty" in line


# ------------------------------------------------------------------- help


def test_help_matches_the_commands():
    for argv, needles in [([], ["simulate", "compare", "--resume | --overwrite", "--set SECTION.KEY=VALUE"]),
                          (["compare"], ["--resume", "--overwrite", "--set", "--systems", "--seeds"]),
                          (["train"], ["--system", "lrmoe-random@0.5", "--set", "--overwrite", "--max-restarts"])]:
        r = run_main(*argv, "--help")
        assert r.returncode == 0
        for needle in needles:
            assert needle in r.stdout, (argv, needle)


# ------------------------------------------------------------------- user errors and flags


def test_cli_user_errors_are_one_line(tmp_path):
    cfg = config_file(tmp_path)
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nsteps = -3\n")
    sub = tmp_path / "sub"
    sub.mkdir()
    for args, needle in [
        (["train", "--config", str(cfg), "--data", str(tmp_path / "missing")], "no such file or folder"),
        (["train", "--config", str(cfg), "--data", str(empty)], "empty"),
        (["train", "--config", str(tmp_path / "nope.toml")], "no such file"),
        (["train", "--config", str(bad)], "train.steps=-3"),
        (["train", "--config", str(cfg), "--system", "fast"], "--system 'fast' is invalid"),
        (["train", "--config", str(config_file(sub, system="smartmoe", routing_trace=str(empty)))], "routing_trace"),
    ]:
        # the first through a process of its own (the entry point a user meets), the rest in this one
        r = run_cli(*args) if args[-1].endswith("missing") else run_main(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert needle in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_what_the_ranks_layers_would_refuse_is_one_line_before_launch(tmp_path):
    """Budget lists, topology, replica and assembly slots, a sharded hidden size, the device:
    checked on the launcher for an expert-parallel group of the run's size (the ranks raised
    these with a traceback when they built their layers)."""
    cfg = str(config_file(tmp_path))  # 4 experts, ffn_dim 32, 2 ranks
    for args, needle in [
        (["--system", "laer", "--nproc", "3"], "ffn_dim=32 must be a multiple of the world size 3"),
        (["--system", "symi", "--set", "budget.slots=1"], "rank 0 has 1 expert slots but owns 2 experts"),
        (["--system", "flexmoe", "--set", "budget.slots=1"], "rank 0 has 1 expert slots but owns 2 experts"),
        (["--system", "ultraep", "--set", "budget.slots=1"], "rank 0 has 1 expert slots but owns 2 experts"),
        (["--system", "laer", "--set", "budget.slots=1"], "assemble at most 2 experts at once"),
        (["--nproc", "4", "--ep-size", "2", "--set", "budget.memory_bytes=[4000000, 4000000, 4000000, 4000000]"],
         "expert-parallel group of 2 ranks: memory_bytes=[4000000, 4000000, 4000000, 4000000] is invalid"),
        (["--system", "topoep", "--set", "budget.ranks_per_node=3"], "ranks_per_node=3 is invalid"),
    ]:
        assert needle in one_line_error(run_main("train", "--config", cfg, *args)), args
    assert "listed twice" in one_line_error(run_main("compare", "--config", cfg, "--systems", "static,lrmoe,lrmoe"))
    assert "not after the standard target's" in one_line_error(run_main(
        "compare", "--config", cfg, "--steps", "2", "--set", "compare.strict_fraction=0.9"))
    assert "train.system='symi'" in one_line_error(run_main("compare", "--config", cfg, "--systems", "static,symi",
                                                            "--set", "budget.slots=1"))
    small = run_main("train", "--config", cfg, "--set", "budget.memory_bytes=1000", "--out", str(tmp_path / "oom"))
    assert small.returncode == 0 and "out of the memory cap" in small.stdout + small.stderr, \
        "a cap the layers cannot live in stays the run's out-of-memory record, not a config error"
    if not torch.cuda.is_available():
        assert "train.device='cuda' is invalid here" in one_line_error(
            run_main("train", "--config", cfg, "--set", 'train.device="cuda"'))


@pytest.mark.parametrize("flag,value", [("--nproc", "0"), ("--steps", "-1"), ("--ep-size", "-2"),
                                        ("--max-restarts", "-1")])
def test_cli_flags_validated(tmp_path, flag, value):
    r = run_main("train", "--config", str(config_file(tmp_path)), flag, value)
    assert r.returncode == 2 and flag in r.stderr and value in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_cli_compare_seeds_errors_are_one_line(tmp_path):
    cfg = str(config_file(tmp_path))
    assert "--seeds='0,x' is invalid" in one_line_error(run_main("compare", "--config", cfg, "--seeds", "0,x"))
    assert "compare.seeds=[1, 1]" in one_line_error(run_main("compare", "--config", cfg, "--set",
                                                            "compare.seeds=[1, 1]"))


def test_cli_compare_rejects_unknown_system(tmp_path):
    # through a process of its own, as a user runs it (most commands here run in-process)
    r = run_cli("compare", "--config", str(config_file(tmp_path)), "--systems", "static,warp")
    assert r.returncode == 2 and "warp" in r.stderr and len(r.stderr.strip().splitlines()) == 1
