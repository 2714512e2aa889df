"""What an emulated cluster changes in a run's config before launch: the link in Gbit/s (``paper``
derived from the GEMM rate measured here), the topology, and the budgets that follow the link.

Unless ``[budget]`` sets them (an explicit setting wins; a ``ranks_per_node`` that contradicts
the nodes is refused):

- ``ranks_per_node``: the ranks of an expert-parallel group on one node (the nodes hold
  consecutive ranks, the groups too);
- ``inter_node_gbps``: a rank's share of its node's link, the link cost of every planner that
  plans by the link (``topoep``, the replica searches);
- ``network_fraction``, lrmoe's network budget: what a node's link carries for a rank during the
  backward's expert GEMMs of a balanced rank (``16·D·F`` FLOP a kept pair: backward and gate/up
  recompute, at the measured rate), as a fraction of that rank's keep-nothing backward bytes
  (``3·D·s`` a pair), never below 1: the backward's exchange of a balanced rank is not trimmed
  for the link, a hot rank's is trimmed to what its link moves while a balanced rank computes
  (docs/design.md "The emulated cluster"). Like every network budget it binds only under a memory
  cap.
"""

from __future__ import annotations

import tomllib
from dataclasses import replace
from pathlib import Path

from lrmoe.config import ClusterBudget
from lrmoe.emulation.config import PAPER
from lrmoe.emulation.namespaces import Link, check_emulation
from lrmoe.emulation.paper_link import measure_gemm_gflops, paper_link_gbps
from lrmoe.memory.bytes import ByteModel
from lrmoe.train.config import ConfigError, RunConfig

BACKWARD_FLOP_PER_PAIR = 16  # × D·F: dgrad and wgrad of three matrices, and gate/up recomputed


def resolve_cluster(cfg: RunConfig) -> RunConfig:
    """``cfg`` with its emulated cluster resolved (module docstring); the same config back where
    ``[cluster]`` emulates nothing or is resolved already. Checks that this machine can build the
    nodes (:func:`~lrmoe.emulation.namespaces.check_emulation`, one line)."""
    cluster, train = cfg.cluster, cfg.train
    if not cluster.emulated:
        return cfg
    nodes, nproc, ep = cluster.emulate_nodes, train.nproc, train.ep_size or train.nproc
    if nproc % nodes:
        raise ConfigError(f"--emulate-nodes={nodes} is invalid: it must divide --nproc={nproc} (each emulated node "
                          f"runs nproc / nodes ranks)")
    per_node = nproc // nodes
    if ep % per_node and per_node % ep:
        raise ConfigError(f"--emulate-nodes={nodes} with --ep-size={ep}: nodes of {per_node} ranks split an "
                          f"expert-parallel group unevenly (one must divide the other)")
    ranks_per_node = min(per_node, ep)
    budget = cfg.budget or ClusterBudget()
    if budget.ranks_per_node not in (None, ranks_per_node):
        raise ConfigError(f"budget.ranks_per_node={budget.ranks_per_node} contradicts --emulate-nodes={nodes}: "
                          f"its nodes hold {ranks_per_node} ranks of an expert-parallel group (leave it out)")
    check_emulation(Link(None if cluster.link_gbps is None else 1.0, cluster.link_latency_us))
    moe, gemm, link = cfg.model.moe, cluster.gemm_gflops, cluster.link_gbps
    sets_network = link is not None and budget.network_bytes is None and budget.network_fraction is None
    if gemm is None and (link == PAPER or sets_network):
        pairs = train.batch * cfg.model.seq_len * moe.top_k  # a rank's pairs with a balanced load
        gemm = measure_gemm_gflops(cfg.model.dim, moe.ffn_dim, max(1, moe.num_experts // ep), pairs)
    elem = moe.torch_dtype.itemsize
    if link == PAPER:
        link = float(f"{paper_link_gbps(cfg.model.dim, moe.ffn_dim, elem, gemm, per_node):.2g}")
    updates = {"ranks_per_node": ranks_per_node}
    if link is not None and budget.inter_node_gbps is None:
        updates["inter_node_gbps"] = link / per_node
    if sets_network:
        gemm_s = BACKWARD_FLOP_PER_PAIR * cfg.model.dim * moe.ffn_dim / (gemm * 1e9)
        wire_s = ByteModel.of(moe).bwd_wire * 8 / (link / per_node * 1e9)  # x and dy in, dx out
        updates["network_fraction"] = max(1.0, float(f"{gemm_s / wire_s:.3g}"))
    return replace(cfg, cluster=replace(cluster, link_gbps=link, gemm_gflops=gemm),
                   budget=replace(budget, **updates))


def resolve_for_launcher(cfg: RunConfig, standalone: bool, resumed: Path | None = None) -> RunConfig:
    """The command line's :func:`resolve_cluster`, its result printed in one line: the emulation is
    one machine's (``standalone``: no rendezvous flags), and a run resumed in ``resumed`` keeps the
    GEMM rate its first launch measured (:func:`measured_gemm_gflops`)."""
    if not standalone:
        raise ConfigError("--emulate-nodes and the rendezvous flags exclude each other: an emulated cluster is "
                          "one machine's, its nodes meet at a rendezvous of their own")
    asked = cfg.cluster.link_gbps
    if resumed is not None and cfg.cluster.gemm_gflops is None:
        cfg = replace(cfg, cluster=replace(cfg.cluster, gemm_gflops=measured_gemm_gflops(resumed)))
    cfg = resolve_cluster(cfg)
    print(describe(cfg, asked), flush=True)
    return cfg


def measured_gemm_gflops(out: Path) -> float | None:
    """The GEMM rate an earlier run in ``out`` measured (``cluster.gemm_gflops`` of the first
    ``config.toml`` under it that has one), so that a resumed run derives the same link and
    budgets, and ``compare --resume`` finds its finished runs' configs unchanged."""
    for path in sorted(Path(out).glob("**/config.toml")):
        try:
            gemm = tomllib.loads(path.read_text()).get("cluster", {}).get("gemm_gflops")
        except (OSError, tomllib.TOMLDecodeError):
            continue
        if gemm is not None:
            return gemm
    return None


def describe(cfg: RunConfig, asked: float | str | None) -> str:
    """One line on the resolved cluster, printed before launch."""
    c, per_node = cfg.cluster, cfg.train.nproc // cfg.cluster.emulate_nodes
    link = "unshaped links" if c.link_gbps is None else f"links of {c.link_gbps:g} Gbit/s"
    if asked == PAPER:
        link += f" ('paper': this machine's expert GEMMs at {c.gemm_gflops:g} GFLOP/s, docs/design.md)"
    latency = f", {c.link_latency_us:g} µs between nodes" if c.link_latency_us else ""
    return f"emulated cluster: {c.emulate_nodes} nodes × {per_node} ranks, {link}{latency}"
