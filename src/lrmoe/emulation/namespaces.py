"""Building the emulated nodes and their links, and removing them whatever happens.

Nothing is added to the machine's own network namespace, and nothing outlives the run: every
namespace belongs to a process the launcher started, with no name or bind mount to keep it. The
switch is a namespace held by one ``sleep``; a node is ``unshare --net --pid --mount --uts
--fork --kill-child`` around its ``torch.distributed.run``, which is process 1 of the node's
process namespace. Each of these dies with the launcher (the kernel's parent-death signal), and
the node's processes die with its process 1 (the kernel's rule for a process namespace); a
namespace with no process left is freed by the kernel, and a veth pair with it. So a crash, a
killed rank, a killed launcher or Ctrl-C leave nothing behind.

Addresses come from 198.18.0.0/15, the range set aside for network benchmarks: node i is
198.18.0.(100 + i), so that torchrun's c10d rendezvous, which orders the nodes by their address
as text, gives node i the global ranks ``[i·k, (i+1)·k)``.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from lrmoe.emulation.config import ClusterConfig
from lrmoe.parallel.comm import A2A_ENV, RECEIVES_FIRST
from lrmoe.train.config_checks import ConfigError
from lrmoe.train.rendezvous import Rendezvous

SUBNET, FIRST_HOST = "198.18.0", 100
RDZV_PORT = 29400
NODE_LINK = "eth0"  # a node's end of its link, where gloo binds (GLOO_SOCKET_IFNAME)
TOOLS = ("unshare", "nsenter", "ip", "tc", "sleep")
NODE_NAMESPACES = ("--net", "--pid", "--mount", "--uts", "--fork", "--kill-child")


@dataclass(frozen=True)
class Link:
    """One node's link: ``gbps`` in each direction (None: unshaped), ``latency_us`` one way between
    two nodes (half at each end: a packet crosses its sender's port and its receiver's)."""

    gbps: float | None = None
    latency_us: float = 0.0

    def qdisc_commands(self, dev: str) -> list[list[str]]:
        """tc commands shaping ``dev``'s egress: a token bucket for the rate (a burst of 1 ms at
        the rate, at least 64 KiB so that the kernel's segmentation offload passes), under netem
        for the latency."""
        if self.gbps is None and not self.latency_us:
            return []
        commands, parent = [], ["root"]
        if self.latency_us:
            commands.append(["tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay",
                             f"{self.latency_us / 2:.3f}us", "limit", "100000"])
            parent = ["parent", "1:1", "handle", "10:"]
        if self.gbps is not None:
            rate_Bps = self.gbps * 1e9 / 8
            burst = max(64 * 1024, int(rate_Bps * 1e-3))
            commands.append(["tc", "qdisc", "add", "dev", dev, *parent, "tbf", "rate", f"{self.gbps * 1e9:.0f}bit",
                             "burst", str(burst), "latency", "2ms"])
        return commands


def node_address(node: int) -> str:
    return f"{SUBNET}.{FIRST_HOST + node}"


def check_emulation(link: Link) -> None:
    """One line (ConfigError) where this machine cannot build the emulation: the tools, the right
    to create namespaces (root on Linux), veth pairs, a bridge and the link's queueing
    disciplines, tried in a throwaway namespace (tens of milliseconds)."""
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        raise ConfigError(f"--emulate-nodes needs {', '.join(missing)} (util-linux, iproute2) on this machine")
    script = " && ".join([
        "ip link add lrmoe-a type veth peer name lrmoe-b", "ip link add lrmoe-s type bridge",
        *(" ".join(c) for c in Link(1.0, link.latency_us).qdisc_commands("lrmoe-a"))])
    done = subprocess.run(["unshare", *NODE_NAMESPACES, "sh", "-c", script], capture_output=True, text=True)
    if done.returncode:
        why = (done.stderr.strip().splitlines() or ["unknown error"])[-1]
        if "netem" in script and "qdisc kind is unknown" in why:
            why = "this kernel has no netem queueing discipline for --link-latency-us (0 adds no latency)"
        raise ConfigError(f"--emulate-nodes cannot build its nodes here (network namespaces, veth links, a bridge "
                          f"and tc need root on Linux): {why}")


def _die_with_parent() -> None:
    """In a launched child: the kernel kills it when the launcher dies (PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


class EmulatedCluster:
    """``nodes`` emulated nodes joined by links like ``link``, for one launch (a context manager;
    :meth:`start` starts one command per node, :meth:`close` removes everything)."""

    def __init__(self, nodes: int, link: Link) -> None:
        self.nodes, self.link = nodes, link
        self.switch: subprocess.Popen | None = None
        self.procs: list[subprocess.Popen] = []

    @property
    def endpoint(self) -> str:
        return f"{node_address(0)}:{RDZV_PORT}"

    def torchrun_args(self, node: int, nproc: int) -> list[str]:
        """torchrun's rendezvous options for ``node`` of a run of ``nproc`` ranks in all: c10d at
        node 0's address, node 0 hosting the store, each node's agent at its own address."""
        rendezvous = Rendezvous(nnodes=self.nodes, node_rank=node, rdzv_endpoint=self.endpoint)
        return [*rendezvous.torchrun_args(nproc), f"--local-addr={node_address(node)}",
                f"--rdzv-conf=is_host={int(node == 0)}"]

    def start(self, commands: list[list[str]], env: dict[str, str], **popen_kw) -> list[subprocess.Popen]:
        """Start ``commands[i]`` on node i once every link is up; returns the node processes."""
        assert len(commands) == self.nodes
        self.switch = subprocess.Popen(["unshare", "--net", "sleep", "infinity"], preexec_fn=_die_with_parent)
        node_env = {**env, "GLOO_SOCKET_IFNAME": NODE_LINK, A2A_ENV: RECEIVES_FIRST}  # (a link slower than gloo)
        for cmd in commands:  # each waits for the line that says its link is up
            self.procs.append(subprocess.Popen(["unshare", *NODE_NAMESPACES, "sh", "-c", 'read -r _ && exec "$@"',
                                                "sh", *cmd], stdin=subprocess.PIPE, env=node_env,
                                               preexec_fn=_die_with_parent, **popen_kw))
        with tempfile.TemporaryDirectory(prefix="lrmoe-cluster-") as tmp:
            hosts = Path(tmp) / "hosts"
            # names for the nodes' addresses, also as the store's IPv6 socket sees them (else c10d
            # warns that it cannot name a client)
            hosts.write_text("127.0.0.1 localhost\n::1 localhost\n" + "".join(
                f"{node_address(i)} node{i}\n::ffff:{node_address(i)} node{i}\n" for i in range(self.nodes)))
            for pid in (self.switch.pid, *(p.pid for p in self.procs)):
                _await_namespace(pid)
            self._wire(str(hosts))
        for p in self.procs:
            p.stdin.write(b"up\n")
            p.stdin.close()
        return self.procs

    def _wire(self, hosts: str) -> None:
        """The switch's bridge; per node its veth pair, address, host name and the shaping of
        both ends."""
        switch = ["nsenter", "-t", str(self.switch.pid), "-n"]
        _run([*switch, "ip", "link", "add", "br0", "type", "bridge"], [*switch, "ip", "link", "set", "br0", "up"])
        for i, p in enumerate(self.procs):
            node = ["nsenter", "-t", str(p.pid), "-n", "-m", "-u"]
            port = f"n{i}"
            _run([*switch, "ip", "link", "add", port, "type", "veth", "peer", "name", NODE_LINK, "netns", str(p.pid)],
                 [*switch, "ip", "link", "set", port, "master", "br0", "up"],
                 *([*switch, *c] for c in self.link.qdisc_commands(port)),
                 [*node, "ip", "link", "set", "lo", "up"],
                 [*node, "ip", "addr", "add", f"{node_address(i)}/24", "dev", NODE_LINK],
                 [*node, "ip", "link", "set", NODE_LINK, "up"],
                 *([*node, *c] for c in self.link.qdisc_commands(NODE_LINK)),
                 [*node, "hostname", f"node{i}"],
                 [*node, "mount", "--make-rprivate", "/"],  # (unshare does too, maybe not yet)
                 [*node, "mount", "--bind", hosts, "/etc/hosts"])

    def close(self) -> None:
        """Stop what still runs (a node: its process 1 and so the whole node) and wait for it."""
        for p in [*self.procs, self.switch]:
            if p is not None and p.poll() is None:
                p.kill()  # unshare's --kill-child then kills the node's process 1
        for p in [*self.procs, self.switch]:
            if p is not None:
                p.wait()

    def __enter__(self) -> EmulatedCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextmanager
def emulated_cluster(cluster: ClusterConfig) -> Iterator[EmulatedCluster | None]:
    """The emulated cluster of one launch (None where ``cluster`` emulates nothing), removed on
    leaving. ``cluster.link_gbps`` is a number here (:func:`lrmoe.emulation.budgets.resolve_cluster`)."""
    if not cluster.emulated:
        yield None
        return
    with EmulatedCluster(cluster.emulate_nodes, Link(cluster.link_gbps, cluster.link_latency_us)) as c:
        yield c


def _await_namespace(pid: int, timeout: float = 10.0) -> None:
    """Wait until ``pid`` (a starting ``unshare``) is in a network namespace of its own."""
    own = os.readlink("/proc/self/ns/net")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if os.readlink(f"/proc/{pid}/ns/net") != own:
                return
        except FileNotFoundError:
            break
        time.sleep(0.005)
    raise RuntimeError(f"an emulated node (pid {pid}) did not get its namespace")


def _run(*commands: list[str]) -> None:
    for cmd in commands:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"emulated cluster: {' '.join(cmd)}: {done.stderr.strip()}")
