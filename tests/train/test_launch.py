"""torchrun's rendezvous options, passed through by the launcher: the command for a standalone,
c10d or static rendezvous, the options' errors (in the launcher and through the command line as
one line), and what launch() hands the ranks (checkpoints every eval_every steps for a run that
may restart; on node 1 of two, ``--out`` left to node 0)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.train import config_file, one_line_error, run_main, tiny


@pytest.fixture
def rendezvous_reset():
    from lrmoe.train.rendezvous import Rendezvous, use_rendezvous

    yield
    use_rendezvous(Rendezvous())


def test_torchrun_command_rendezvous(rendezvous_reset):
    from lrmoe.train.config import ConfigError
    from lrmoe.train.launch import torchrun_command
    from lrmoe.train.rendezvous import Rendezvous, use_rendezvous

    cfg = tiny(nproc=4)
    worker = ["--config", "c.toml"]

    def args(rdzv=None):
        cmd = torchrun_command(cfg, worker, 2, rdzv)
        assert cmd[1:3] == ["-m", "torch.distributed.run"] and cmd[-4:] == ["-m", "lrmoe.train.worker", *worker]
        return cmd[3:-4]

    assert args() == ["--standalone", "--nproc-per-node=4", "--max-restarts=2"]
    c10d = Rendezvous(nnodes=2, node_rank=1, rdzv_endpoint="node0:29400", rdzv_id="job7")
    assert args(c10d) == ["--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d", "--rdzv-id=job7",
                          "--rdzv-endpoint=node0:29400", "--max-restarts=2"]
    static = Rendezvous(nnodes=4, node_rank=3, master_addr="10.0.0.1", master_port=29501)
    assert args(static) == ["--nnodes=4", "--nproc-per-node=1", "--rdzv-backend=static", "--rdzv-id=lrmoe",
                            "--master-addr=10.0.0.1", "--master-port=29501", "--node-rank=3", "--max-restarts=2"]
    use_rendezvous(c10d)
    assert args() == args(c10d), "the launches of a command meet where the command line said"
    for kwargs, needle in [
        (dict(nnodes=2, node_rank=0), "--nnodes=2 needs a meeting point"),
        (dict(nnodes=2, rdzv_endpoint="h:1"), "needs --node-rank"),
        (dict(nnodes=2, node_rank=2, rdzv_endpoint="h:1"), "--node-rank=2 is invalid"),
        (dict(rdzv_endpoint="h:1", master_addr="h"), "exclude each other"),
        (dict(rdzv_backend="c10d", master_addr="h"), "c10d needs --rdzv-endpoint"),
        (dict(rdzv_backend="mpi", rdzv_endpoint="h:1"), "--rdzv-backend='mpi'"),
        (dict(master_port=70000, master_addr="h"), "--master-port=70000"),
        (dict(master_port=29500), "with --master-addr"),
        (dict(rdzv_id="x"), "--rdzv-id need"),
        (dict(nnodes=0), "--nnodes=0"),
    ]:
        with pytest.raises(ConfigError, match=needle):
            Rendezvous(**kwargs)
    with pytest.raises(ConfigError, match="--nnodes=3 is invalid: it must divide --nproc=4"):
        args(Rendezvous(nnodes=3, node_rank=0, rdzv_endpoint="h:1"))


def test_launch_passes_rendezvous_and_restart_checkpoints(tmp_path, monkeypatch, rendezvous_reset):
    """launch() without ranks: torchrun's command and the config handed to the ranks."""
    from lrmoe.train import launch as launch_mod
    from lrmoe.train.config import load
    from lrmoe.train.rendezvous import Rendezvous, use_rendezvous

    seen = {}

    def fake_run(commands, env, error_path, cluster=None):
        (cmd,) = commands
        seen["cmd"] = cmd
        seen["cfg"] = load(cmd[cmd.index("--config") + 1])
        (Path(cmd[cmd.index("--out") + 1]) / "summary.json").write_text("{}")
        return 0

    monkeypatch.setattr(launch_mod, "_run_ranks", fake_run)
    cfg = tiny(nproc=2, eval_every=5)
    launch_mod.launch(cfg, tmp_path / "a", max_restarts=1)
    assert "--standalone" in seen["cmd"] and seen["cfg"].train.checkpoint_every == 5, \
        "a run that may restart checkpoints every eval_every steps"
    launch_mod.launch(cfg.with_train(checkpoint_every=3), tmp_path / "b", max_restarts=1)
    assert seen["cfg"].train.checkpoint_every == 3, "a value the user set stays"
    launch_mod.launch(cfg, tmp_path / "c")
    assert seen["cfg"].train.checkpoint_every == 0
    # on node 1 of two, --out is node 0's to prepare: nothing of it is refused or removed
    used = tmp_path / "used"
    used.mkdir()
    (used / "metrics.jsonl").write_text("{}\n")
    use_rendezvous(Rendezvous(nnodes=2, node_rank=1, master_addr="10.0.0.1"))  # as the command line sets it
    launch_mod.check_out(used, resume=False, overwrite=True)
    launch_mod.launch(cfg, used)
    assert (used / "metrics.jsonl").exists()
    assert "--node-rank=1" in seen["cmd"] and "--nproc-per-node=1" in seen["cmd"]


def test_cli_rendezvous_errors_are_one_line(tmp_path):
    cfg = str(config_file(tmp_path))
    assert "needs --node-rank" in one_line_error(run_main("train", "--config", cfg, "--nnodes", "2",
                                                       "--rdzv-endpoint", "h:29400"))
    assert "must divide --nproc=2" in one_line_error(run_main("compare", "--config", cfg, "--nnodes", "4",
                                                           "--node-rank", "0", "--master-addr", "h"))
