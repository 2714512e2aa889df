"""The emulated cluster end to end: nodes meet over their links, a shaped link changes time only,
nothing outlives a run however it ends, and a machine that cannot build the nodes says so."""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import subprocess
import sys
import time

import pytest

from lrmoe.emulation.namespaces import Link, node_address
from lrmoe.emulation.probe import run_probe
from tests.helpers.train import config_file, one_line_error, records, run_main

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")


def net_namespaces() -> set[str]:
    """The network namespaces that some process of this machine is in."""
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):  # gone meanwhile
            found.add(os.readlink(f"/proc/{pid}/ns/net"))
    return found


def await_namespaces(expected: set[str], timeout: float = 20.0) -> set[str]:
    deadline = time.monotonic() + timeout
    while (now := net_namespaces()) != expected and time.monotonic() < deadline:
        time.sleep(0.2)
    return now


def test_ranks_meet_at_the_rendezvous_over_the_emulated_network(tmp_path):
    """Two nodes of two ranks: c10d at node 0's address orders the nodes, so global ranks 0-1 run
    on node 0 and 2-3 on node 1, each bound to its node's link; all_to_all delivers (the probe
    checks every element)."""
    ranks = run_probe(tmp_path, nproc=4, nodes=2, link=Link(1.0), sizes=(4096,), repeats=1)
    assert [r["host"] for r in ranks] == ["node0", "node0", "node1", "node1"]
    assert [r["address"] for r in ranks] == [node_address(0)] * 2 + [node_address(1)] * 2
    assert {r["ifname"] for r in ranks} == {"eth0"}


def test_a_shaped_link_changes_time_only(tmp_path):
    """static (its plan reads no link) on 2 nodes × 1 rank behind a 0.2 Gbit/s link trains 4 steps
    loss for loss and byte for byte as on the unshaped loopback with the same topology."""
    cfg = config_file(tmp_path, steps=4)
    emu = run_main("train", "--config", cfg, "--system", "static", "--emulate-nodes", "2", "--link-gbps", "0.2",
                   "--out", tmp_path / "emu")
    assert emu.returncode == 0, emu.stderr[-3000:]
    assert "emulated cluster: 2 nodes × 1 ranks, links of 0.2 Gbit/s" in emu.stdout
    loop = run_main("train", "--config", cfg, "--system", "static", "--set", "budget.ranks_per_node=1",
                    "--out", tmp_path / "loop")
    assert loop.returncode == 0, loop.stderr[-3000:]
    a, b = records(tmp_path / "emu"), records(tmp_path / "loop")
    assert len(a) == len(b) == 4
    keys = ["loss", "grad_norm", *sorted(k for k in a[0] if k.endswith("_bytes"))]
    assert "a2a_inter_bytes" in keys and all(a[0][k] for k in ("a2a_bytes", "a2a_inter_bytes"))
    assert [[r[k] for k in keys] for r in a] == [[r[k] for k in keys] for r in b]
    resolved = (tmp_path / "emu" / "config.toml").read_text()
    assert "emulate_nodes = 2" in resolved and "inter_node_gbps = 0.2" in resolved


def test_a_killed_rank_leaves_no_namespace_or_link(tmp_path):
    """A rank SIGKILLed after step 2: the run fails, and every namespace (and so every veth link
    and the bridge) is gone when the command returns."""
    before = net_namespaces()
    cfg = config_file(tmp_path, steps=6)
    env = {**os.environ, "LRMOE_FAULT_AT": "2:1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "lrmoe.cli", "train", "--config", str(cfg), "--system", "static",
                           "--emulate-nodes", "2", "--link-gbps", "1", "--out", str(tmp_path / "out")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert net_namespaces() == before


@pytest.mark.parametrize("how", ["kill", "ctrl-c"])
def test_a_killed_launcher_leaves_no_namespace_or_link(tmp_path, how):
    """The launcher SIGKILLed mid-run (its children die with it: the kernel's parent-death
    signal, then each node's process namespace), or Ctrl-C to the terminal's process group."""
    before = net_namespaces()
    cfg = config_file(tmp_path, steps=2000, eval_every=1000)
    proc = subprocess.Popen([sys.executable, "-m", "lrmoe.cli", "train", "--config", str(cfg), "--system", "static",
                             "--emulate-nodes", "2", "--link-gbps", "1", "--out", str(tmp_path / "out")],
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        metrics = tmp_path / "out" / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2) and time.monotonic() < deadline:
            assert proc.poll() is None, "the run ended before it was stopped"
            time.sleep(0.2)
        assert len(net_namespaces() - before) == 3, "two nodes and the switch while it trains"
        if how == "kill":
            proc.kill()
        else:
            os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert await_namespaces(before) == before


def test_one_line_where_namespaces_cannot_be_made(tmp_path, monkeypatch):
    """As a user without the right to create namespaces (unshare run as nobody): one line, exit 2,
    before any rank starts."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "unshare").write_text("#!/bin/sh\nexec setpriv --reuid=65534 --regid=65534 --clear-groups "
                                  "/usr/bin/unshare \"$@\"\n")
    (fake / "unshare").chmod(stat.S_IRWXU)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    r = run_main("train", "--config", config_file(tmp_path), "--emulate-nodes", "2", "--out", tmp_path / "out")
    assert "--emulate-nodes cannot build its nodes here" in one_line_error(r)
    assert "Operation not permitted" in r.stderr
    assert not (tmp_path / "out").exists()

