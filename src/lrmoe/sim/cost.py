"""Time of one layer call from what it does (a :class:`LayerCall`) and the hardware.

Per rank, every term is a count times a rate, so the same code serves the GPU projection and
the CPU calibration (where the rates are fitted by least squares):

- grouped GEMMs: a roofline, ``max(FLOPs / (peak·gemm_eff), operand bytes / (bw·mem_eff))``;
  forward ``6·R·D·F`` FLOPs for R rows (gate, up, down), backward ``12·R·D·F`` (dh, dW_down,
  dW_gate, dW_up, dx) plus ``4·R·D·F`` where gate/up are recomputed (``call.recomputes``:
  static-recompute, masked, and lrmoe unless its call kept x and the activations or gate/up,
  which recomputes silu and h; a call kept by the row, ``call.split_R``: its x-only rows, its
  gate/up rows recomputing silu and h);
  operand bytes are the weights (once per local copy, GEMM and chunk) plus the rows in and out;
- elementwise and copy kernels: bytes / (bw·mem_eff) — SwiGLU and its backward, ‖h‖² (the
  selective systems, ``spec.selective``), the home-side gather of rows into send order and the
  weighted combine / scatter-add, the selection's sort passes (``spec.selects``), and a keep-x
  backward's gather of its kept rows out of the saved ones;
- kernel launches × ``launch_s`` (forward and backward chunks multiply them; on CPU a grouped GEMM is a loop
  of one GEMM per local expert, so each expert costs a launch);
- router and shared expert GEMMs (same for every system, kept so that reductions are relative
  to the whole MoE-layer time);
- all-to-all (α–β): a rank's time is ``α_intra·(g−1) + α_inter·(W−g)`` for its messages plus
  the larger of its intra-node bytes / ``intra_bw`` and its inter-node bytes / ``inter_bw``
  (links in parallel), sent or received, whichever is more; the collective takes its slowest
  rank. Exchanges: forward rows out and back (+ ‖h‖² for the selective systems), backward dy
  and dx (+ x where a compacting backward kept nothing, ``call.resends_x``; where it kept x, a
  local selection's dy rows carry their 4-byte positions, ``call.positions``, and a global
  selection first sends one byte per forward row saying which rows are kept), the selection's
  exchange (``local`` and ``local-sampled`` none at all, lrmoe.selection.strata; the global selections
  all-gather their non-finite counts, E int64 per rank, then ``lrm`` and ``random`` their
  candidates' keys, ``sampled`` every score: :data:`lrmoe.sim.layer_calls.SCORE_EXCHANGE`; capacity's
  score exchange in the forward), replica refresh (owner → holder, every step) and
  replica-gradient reduction (holder → owner); an exchange in rounds (an exact call keeping
  nothing under a cap, ``call.rounds``) pays the messages of its row exchanges once per round;
- selection: scored pairs × ``select_pair_s`` (0 on GPU, where the sort passes above stand for
  it; fitted on CPU, where scoring and exact top-q run as many small ops);
- host time: the library's planner calls in this call times their recorded benchmark cost
  (:mod:`lrmoe.sim.host`), the same on every machine. What the forward waits for (and the
  step's re-plan, and a backward's own) is on the critical path; the backward's plan, which the
  layer computes once the forward's rows and expert work are issued, only where it outlasts
  that device work (:func:`host_on_path`);
- CPU only: ranks beyond ``cores`` share them, so compute and memory terms scale by W/cores.

The layer call's time is the sum over phases of the slowest rank per phase (collectives
synchronise the ranks).
"""

from __future__ import annotations

import numpy as np

from lrmoe.memory.bytes import H_SQ_BYTES, KEEP_X_GATE_UP, expert_param_bytes, position_bytes
from lrmoe.sim.hardware import Hardware
from lrmoe.sim.layer_calls import LayerCall
from lrmoe.sim.models import ModelSpec
from lrmoe.systems import spec_of

SCORE_BYTES = 8  # float64 LRM scores / routing probabilities exchanged for a global selection
SORT_PASSES = 16  # selection sorts the pairs' 8-byte keys: counted as this many passes over them
# Kernel launches per call: forward (gate, up, silu·mul, down, ‖h‖²), backward (recompute 3,
# dW_down, dh, 2 elementwise, dW_gate, dW_up, dx 2).
FWD_GEMMS, BWD_GEMMS, RECOMPUTE_GEMMS = 3, 6, 2
FWD_KERNELS, BWD_KERNELS = 6, 12

PHASES = ("fwd_compute", "fwd_a2a", "bwd_compute", "bwd_a2a", "select", "replicas", "dense", "host")


def a2a_seconds(bytes_SR: np.ndarray, hw: Hardware, messages: bool = True) -> float:
    """α–β time of an all-to-all carrying ``bytes_SR[s, r]`` from rank s to rank r."""
    W = bytes_SR.shape[0]
    if W == 1:
        return 0.0
    g = max(1, min(hw.devices_per_node, W))
    node = np.arange(W) // g
    same = node[:, None] == node[None, :]
    off = ~np.eye(W, dtype=bool)
    b = np.where(off, bytes_SR, 0).astype(np.float64)
    intra = np.maximum((b * same).sum(1), (b * same).sum(0))
    inter = np.maximum((b * ~same).sum(1), (b * ~same).sum(0))
    t = np.maximum(intra / hw.intra_bw, inter / hw.inter_bw)
    if messages:
        t = t + hw.alpha_intra * (g - 1) + hw.alpha_inter * (W - g)
    return float(t.max())


def _compute_scale(hw: Hardware, world: int) -> float:
    return max(1.0, world / hw.cores) if hw.cores else 1.0


def _gemm_seconds(flops: np.ndarray, bytes_: np.ndarray, hw: Hardware) -> np.ndarray:
    return np.maximum(flops / (hw.peak_flops * hw.gemm_eff), bytes_ / (hw.mem_bw * hw.mem_eff))


def features(call: LayerCall, spec: ModelSpec, s: int, per_expert_gemm: bool = False) -> dict[str, np.ndarray]:
    """Per-rank counts behind every term: FLOPs, bytes, launches (arrays over ranks)."""
    D, F, E, K = spec.dim, spec.ffn_dim, spec.num_experts, spec.top_k
    Rf = call.fwd_SR.sum(0).astype(np.float64)
    Rb = call.bwd_SR.sum(0).astype(np.float64)
    L = call.copies_R.astype(np.float64)
    T = float(call.tokens_per_rank)
    system = spec_of(call.system)
    # share of each rank's backward rows whose gate/up/h are recomputed (by the row: its x-only
    # part; its gate/up part recomputes silu and h, two elementwise ops)
    recompute, gate_up_rows = np.full_like(Rb, 1.0 if call.recomputes else 0.0), np.zeros_like(Rb)
    if call.split_R is not None:
        kept = np.array([[s.acts, s.gate_up] for s in call.split_R], np.float64).reshape(-1, 2)
        gate_up_rows = np.minimum(kept[:, 1], Rb)
        recompute = np.clip(Rb - kept.sum(1), 0, None) / np.maximum(Rb, 1)
    if call.keep == KEEP_X_GATE_UP:  # a compacting call keeping gate/up: silu and h of every kept row
        gate_up_rows = Rb
    recomputes = recompute > 0
    w_bytes = expert_param_bytes(D, F, s) * L  # one read of every local copy's weights
    groups = L if per_expert_gemm else np.ones_like(L)
    fwd_flops = 6 * Rf * D * F
    bwd_flops = 12 * Rb * D * F + 4 * Rb * D * F * recompute
    bwd_chunks = np.ones_like(L) if call.bwd_chunks_R is None else call.bwd_chunks_R.astype(np.float64)
    # every chunk (or round) reads its copies' weights again
    fwd_gemm_bytes = w_bytes * call.chunks_R + Rf * (3 * D + 3 * F) * s
    bwd_gemm_bytes = (3 * w_bytes + w_bytes * 2 / 3 * recomputes) * bwd_chunks \
        + Rb * (6 * D + 8 * F) * s + Rb * (2 * D + 2 * F) * s * recompute
    h_sq = system.selective  # the forward also reduces h to ‖h‖² per row
    fwd_elem = Rf * 4 * F * s + (Rf * F * s if h_sq else 0) + call.home_pairs_R * 3 * D * s
    bwd_elem = Rb * 8 * F * s + (Rb * recompute + gate_up_rows) * 4 * F * s + call.home_bwd_pairs_R * 3 * D * s
    if call.keep is not None and not call.resends_x:  # kept rows gathered out of the saved x (and activations)
        saved_F = np.where(recomputes, 0, 2 * F if call.keep == KEEP_X_GATE_UP else 4 * F)
        bwd_elem = bwd_elem + np.where(Rb < Rf, 2 * Rb * (D + saved_F) * s, 0)
    if system.selects:
        sort = SORT_PASSES * SCORE_BYTES * T * K
        if call.score_in_forward:
            fwd_elem = fwd_elem + sort
        else:
            bwd_elem = bwd_elem + sort
    fwd_launch = (FWD_GEMMS * groups + (FWD_KERNELS - FWD_GEMMS)) * call.chunks_R
    bwd_launch = ((BWD_GEMMS + RECOMPUTE_GEMMS * recomputes) * groups + (BWD_KERNELS - BWD_GEMMS)) * bwd_chunks
    return {
        "fwd_flops": fwd_flops, "bwd_flops": bwd_flops, "fwd_gemm_bytes": fwd_gemm_bytes,
        "bwd_gemm_bytes": bwd_gemm_bytes, "fwd_elem_bytes": fwd_elem, "bwd_elem_bytes": bwd_elem,
        "fwd_launches": fwd_launch, "bwd_launches": bwd_launch,
        "dense_flops": np.full_like(Rf, 3 * 2 * T * D * E + 3 * 6 * T * D * spec.shared_ffn_dim),
        "select_pairs": np.full_like(Rf, T * K if system.selects else 0.0),
    }


def exchanges(call: LayerCall, spec: ModelSpec, s: int) -> list[tuple[str, np.ndarray]]:
    """Every exchange of one layer call as (phase, (W, W) bytes from rank s to rank r). A
    return trip (y, dx, replica gradients) is the transpose of its outbound matrix."""
    D, F = spec.dim, spec.ffn_dim
    W = call.fwd_SR.shape[0]
    row = D * s
    system = spec_of(call.system)
    out = [("fwd_a2a", np.full((W, W), spec.num_experts * 8)),  # per-expert count all-gather
           ("fwd_a2a", call.fwd_SR * row),
           ("fwd_a2a", call.fwd_SR.T * (row + (H_SQ_BYTES if system.selective else 0))),  # y (+ ‖h‖²)
           ("bwd_a2a", call.bwd_SR * (row + (position_bytes(s) if call.positions else 0))),  # dy (+ kept positions)
           ("bwd_a2a", call.bwd_SR.T * row)]
    if call.resends_x:
        out.append(("bwd_a2a", call.bwd_SR * row))  # x of the kept pairs, re-sent
    elif call.keep is not None and not call.positions:
        out.append(("bwd_a2a", call.fwd_SR))  # one byte per forward row: which rows are kept
    if call.count_gather:
        out.append(("select", np.full((W, W), spec.num_experts * 8)))  # non-finite counts, all-gathered
    if call.score_pairs_R.any():
        out.append(("select", np.repeat(call.score_pairs_R[:, None] * SCORE_BYTES, W, axis=1)))
    if call.refresh_SR.any():
        params = expert_param_bytes(D, F, s)
        out += [("replicas", call.refresh_SR * params), ("replicas", call.refresh_SR.T * params)]
    return out


def layer_seconds(call: LayerCall, spec: ModelSpec, hw: Hardware, s: int = 2) -> dict[str, float]:
    """Seconds of one layer call by phase (slowest rank per phase) and their ``total``."""
    f = features(call, spec, s, hw.per_expert_gemm)
    W = call.fwd_SR.shape[0]
    scale = _compute_scale(hw, W)
    mem = hw.mem_bw * hw.mem_eff
    fwd = (_gemm_seconds(f["fwd_flops"], f["fwd_gemm_bytes"], hw) + f["fwd_elem_bytes"] / mem) * scale \
        + f["fwd_launches"] * hw.launch_s
    bwd = (_gemm_seconds(f["bwd_flops"], f["bwd_gemm_bytes"], hw) + f["bwd_elem_bytes"] / mem) * scale \
        + f["bwd_launches"] * hw.launch_s
    out = dict.fromkeys(PHASES, 0.0)
    out["fwd_compute"], out["bwd_compute"] = float(fwd.max()), float(bwd.max())
    moves = exchanges(call, spec, s)
    for phase, bytes_SR in moves:
        out[phase] += a2a_seconds(bytes_SR, hw)
    if call.rounds > 1:  # the row exchanges (x and y out and back; x, dy and dx) pay their messages per round
        messages = a2a_seconds(np.zeros_like(call.fwd_SR), hw)
        out["fwd_a2a"] += 2 * (call.rounds - 1) * messages
        out["bwd_a2a"] += 2 * (call.rounds - 1) * messages
    out["dense"] = float((f["dense_flops"] / (hw.peak_flops * hw.gemm_eff)).max()) * scale + hw.call_s
    out["select"] += float(f["select_pairs"].max()) * hw.select_pair_s * scale
    # the forward's device work after its plan: every forward exchange but the count all-gather
    # the plan waits for (the first), and its expert compute
    window = out["fwd_compute"] + out["fwd_a2a"] - a2a_seconds(moves[0][1], hw)
    out["host"] = host_on_path(call, window, hw)
    out["host_total"] = call.host_s + call.deferred_host_s  # every planner call, hidden or not (diagnostic)
    out["total"] = sum(out[p] for p in PHASES)
    return out


def host_on_path(call: LayerCall, window_s: float, hw: Hardware) -> float:
    """Host planning on a layer call's critical path: ``host_s`` (what the forward waits for,
    the step's re-plan, a global selection's kept assignment in the backward) in full, plus
    ``max(0, deferred_host_s − window_s)``: the backward's plan runs on the host once the layer
    has issued the forward's exchanges and expert compute (``window_s`` seconds of device work,
    the count all-gather excluded: the plan waits for it) and delays the device only by what it
    outlasts them. A CPU (``hw.host_overlaps`` False) computes both on the same cores: all of it."""
    if not hw.host_overlaps:
        return call.host_s + call.deferred_host_s
    return call.host_s + max(0.0, call.deferred_host_s - max(window_s, 0.0))
