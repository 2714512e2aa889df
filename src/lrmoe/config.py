"""Typed configuration for an MoE layer and its backward (the cluster's budgets:
:mod:`lrmoe.cluster_budget`, re-exported here).

Every field is validated at construction; an invalid value raises a ``ValueError`` that names
the field, the value given and what is allowed, so a bad config fails where it is written and
not deep inside a collective.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from lrmoe.cluster_budget import ClusterBudget as ClusterBudget  # re-exported: configs are imported from here
from lrmoe.validation import Floor, bad, fraction, is_int_at_least, is_number, positive_int, step_ratios

ROUTERS = ("softmax", "sigmoid")
SELECTIONS = ("lrm", "random", "local", "sampled", "local-sampled")
# Selections with no exchange: every rank's share of q_e, and where each kept pair is computed,
# follow from the counts alone (lrmoe.selection.strata)
LOCAL_SELECTIONS = ("local", "local-sampled")
# What a compacting backward's expert side keeps from forward to backward (docs/design.md "Recompute")
KEEP_X_ACTS, KEEP_X_GATE_UP, KEEP_X, KEEP_NOTHING = "x+acts", "x+gate_up", "x", "nothing"
KEEP_MODES = (KEEP_X_ACTS, KEEP_X_GATE_UP, KEEP_X, KEEP_NOTHING)  # richest first
OBJECTIVES = ("memory", "time", "noise")  # what the controller's quotas minimise beyond fitting (BackwardConfig)
VARIATE_SCORES = ("residuals", "contributions")  # what a control variate's draw is proportional to (BackwardConfig)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map a config dtype (a name such as ``"bfloat16"`` or a ``torch.dtype``) to a ``torch.dtype``."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise bad("dtype", dtype, f"expected one of {sorted(_DTYPES)}")
        return dtype
    if dtype not in _DTYPES:
        raise bad("dtype", dtype, f"expected one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


@dataclass(frozen=True)
class MoEConfig:
    """Shape and routing semantics of one MoE layer.

    ``router="softmax"`` is Qwen3-MoE: softmax over all experts, top-k, optional renormalisation.
    ``router="sigmoid"`` is GLM-4.5 / DeepSeek-V3: sigmoid scores plus a per-expert correction
    bias used only for choosing, optional group-limited choice (``n_group`` groups, the best
    ``topk_group`` of them by the sum of their top-2 scores), weights = unbiased sigmoid scores of
    the chosen, renormalised if ``norm_topk_prob``, times ``routed_scaling_factor``.

    ``num_shared_experts`` > 0 adds a dense SwiGLU shared expert (``shared_ffn_dim`` wide per
    shared expert, all fused into one) to every token's output, as GLM-4.5 and DeepSeek-V3 do;
    ``shared_expert_gate`` scales it by ``sigmoid(x · w)`` with a learned (D,) gate, as Qwen2-MoE
    and Qwen3-Next do.
    """

    dim: int
    ffn_dim: int
    num_experts: int
    top_k: int
    router: str = "softmax"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    num_shared_experts: int = 0
    shared_ffn_dim: int | None = None
    shared_expert_gate: bool = False
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    dtype: str | torch.dtype = "float32"

    def __post_init__(self) -> None:
        for name in ("dim", "ffn_dim", "num_experts", "top_k", "n_group", "topk_group"):
            positive_int(name, getattr(self, name))
        if self.top_k > self.num_experts:
            raise bad("top_k", self.top_k, f"expected 1 <= top_k <= num_experts={self.num_experts}")
        if self.router not in ROUTERS:
            raise bad("router", self.router, f"expected one of {ROUTERS}")
        if not isinstance(self.norm_topk_prob, bool):
            raise bad("norm_topk_prob", self.norm_topk_prob, "expected a bool")
        if not (self.routed_scaling_factor > 0):
            raise bad("routed_scaling_factor", self.routed_scaling_factor, "expected a number > 0")
        if self.num_experts % self.n_group:
            raise bad("n_group", self.n_group, f"expected a divisor of num_experts={self.num_experts}")
        if self.topk_group > self.n_group:
            raise bad("topk_group", self.topk_group, f"expected <= n_group={self.n_group}")
        if self.n_group > 1:
            if self.router != "sigmoid":
                raise bad("n_group", self.n_group, "group-limited choice needs router='sigmoid'")
            per_group = self.num_experts // self.n_group
            if per_group < 2:
                raise bad("n_group", self.n_group, "each group needs >= 2 experts (top-2 group score)")
            if self.top_k > self.topk_group * per_group:
                raise bad(
                    "top_k", self.top_k, f"expected <= topk_group * experts per group = "
                    f"{self.topk_group * per_group}"
                )
        if not is_int_at_least(self.num_shared_experts, 0):
            raise bad("num_shared_experts", self.num_shared_experts, "expected an integer >= 0")
        if self.shared_ffn_dim is not None:
            positive_int("shared_ffn_dim", self.shared_ffn_dim)
        if not isinstance(self.shared_expert_gate, bool):
            raise bad("shared_expert_gate", self.shared_expert_gate, "expected a bool")
        if self.shared_expert_gate and not self.num_shared_experts:
            raise bad("shared_expert_gate", self.shared_expert_gate, "a gate needs num_shared_experts >= 1")
        for name in ("aux_loss_coef", "z_loss_coef"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value >= 0):
                raise bad(name, value, "expected a number >= 0")
        resolve_dtype(self.dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype)

    @property
    def shared_hidden(self) -> int:
        """Hidden size of the shared expert MLP (all shared experts fused into one, as in HF)."""
        return (self.shared_ffn_dim or self.ffn_dim) * self.num_shared_experts


@dataclass(frozen=True)
class BackwardConfig:
    """How the LRMoE backward picks the token–expert pairs it keeps (docs/design.md "Selections").

    ``selection``: ``"lrm"`` exact global top-q_e by LRM score (the paper's); ``"random"``
    uniform within the quota (seeded); ``"local"`` each rank keeps its largest-remainder share of
    q_e by its own scores, no score exchange; ``"sampled"`` exactly q_e kept, each pair with
    probability π ∝ score (capped at 1, mixed with uniform so that π ≥ min(``p_min``, q_e/c_e)),
    kept contributions weighted by 1/π — unbiased, all scores exchanged; ``"local-sampled"`` the
    same drawn by each source rank from its largest-remainder share of q_e — unbiased, exactly
    q_e, no score exchange. ``score_power``: the samplers' π ∝ score^score_power. The LRM score
    is a *squared* norm, so 0.5 (π ∝ the norm of the pair's weight-gradient contribution) is
    the choice that minimises the variance of the weighted estimate; 1 follows the score itself
    (heavier weights on rare pairs); 0 samples uniformly (weighted by c_e/q_e).
    ``ratio``: the fixed-ratio quota q_e = min(c_e, max(1, ceil(ratio·c_e − 1e-6))); 1 keeps
    every pair (an exact backward). With a :class:`ClusterBudget` the controller's quotas apply,
    capped by the ratio's. ``keep``: what a compacting backward's expert side keeps from the
    forward (``"x+acts"``, ``"x"``, ``"nothing"``), fixed instead of chosen per call by the
    controller (None), for ablations and benchmarks; not with a memory cap, which chooses it.
    ``balance``: demand-side balance (docs/design.md "Controller"): each rank's backward keeps
    at most (1 + balance) × the call's balanced mean of pairs a rank, the overload of hot
    experts trimmed max–min fair, never below ``min_ratio`` of an expert's pairs; None (the
    default) trims for memory (and the ratio) alone. ``objective``: ``"memory"`` (the default)
    keeps every pair memory, the network and the ratio allow; ``"time"`` also trims where the
    predicted time to target falls (:mod:`lrmoe.planning.time_objective`): steps grow as
    1 + ``drop_cost`` · (share of pairs dropped) down to ``min_ratio`` (the convergence study's
    fit, docs/convergence.md), while each call's GEMM work shrinks with its kept rows. It
    applies to the compacting systems, whose GEMMs shrink. ``trim_after``: the first
    ``trim_after`` optimizer steps keep every pair the memory, the network and ``warm_ratio``
    allow (not ``ratio``, no balance, no time objective): trimming while the router and the
    experts take shape costs steps that the same trimming later does not (docs/convergence.md
    "When to trim"). ``warm_ratio``: the fixed-ratio quota of those first steps (1, the
    default, keeps every pair); a ratio the study found free in steps trims them too.
    ``warm_balance``: the demand-side balance of those first steps (None, the default: none) —
    only the overload of the hottest experts trimmed, as a memory cap trims them there.
    ``min_ratio_after``: ((step, ratio), ...) in increasing steps: from that optimizer step on,
    ``min_ratio`` is that ratio — the estimator's noise at a fixed ratio falls as training goes
    on (docs/convergence.md "Noise by training step"), so a later floor may be lower. A ratio
    may be a list, one per MoE layer in model order: the layers' noise at a ratio differs
    several-fold (the same table), and :meth:`for_layer` gives each layer its own.
    ``objective="noise"``: each step keeps, per layer, the fewest pairs whose sampling variance in
    the down projection's gradient stays within ``noise_threshold`` × the minibatch gradient's
    squared norm (the share of extra steps it predicts), measured on the step before
    (:mod:`lrmoe.planning.noise_control`);
    ``ratio``, memory and the network still cap it; ``min_ratio`` and ``drop_cost`` are not read,
    ``trim_after`` and ``min_ratio_after`` are refused with it. The noise priced is a local-sampled
    draw's, whatever the selection: an ablation's selection keeps the same quotas.
    ``control_variate``: the dropped pairs' share of the expert weight gradients estimated by a
    control variate (:mod:`lrmoe.passes.control`): each expert side's mean x, h and SwiGLU
    derivatives over its forward rows stand in for every pair, the kept pairs' 1/π-weighted
    residuals correct them, unbiased; the scores (and the noise objective's pricing) are then
    the residuals'. One row of D a (source, slot) goes on the wire. ``variate_scores``:
    "residuals" (the default) as said; "contributions" draws and prices by the pairs' own
    contributions, as without the variate (the same π, so dx, which the variate does not
    correct, is no noisier), and the variate only corrects the weight gradients.
    ``recompute_chunk``: rows a compacting backward that recomputes its kept rows' activations
    (keeping x, or nothing) recomputes at once, the weight gradients summed over chunks; 0 (the
    default) recomputes every kept row at once. Under a memory cap the kept capacity then counts
    a kept row's dy and x and one chunk's activations instead of every kept row's, so the cap
    trims fewer pairs, and each rank's chunk grows to the largest that fits (docs/design.md
    "Recompute").
    """

    selection: str = "local-sampled"
    ratio: float = 1.0
    seed: int = 0
    p_min: float = 0.01
    score_power: float = 0.5
    keep: str | None = None
    balance: float | None = None
    min_ratio: float = 0.5
    objective: str = "memory"
    drop_cost: float = 0.13  # docs/convergence.md: configs/paper.toml's model, 3 seeds, fit over ρ in [0.5, 1]
    trim_after: int = 0
    warm_ratio: float = 1.0
    warm_balance: float | None = None
    min_ratio_after: tuple[tuple[int, Floor], ...] = ()
    noise_threshold: float = 0.1  # docs/convergence.md "The noise objective": chosen on seeds 0-2
    control_variate: bool = False
    variate_scores: str = "residuals"
    recompute_chunk: int = 0

    def __post_init__(self) -> None:
        if self.selection not in SELECTIONS:
            raise bad("selection", self.selection, f"expected one of {SELECTIONS}")
        fraction("ratio", self.ratio)
        fraction("p_min", self.p_min)
        if isinstance(self.score_power, bool) or not isinstance(self.score_power, (int, float)) \
                or not 0 <= self.score_power <= 2:
            raise bad("score_power", self.score_power, "expected a number in [0, 2]")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise bad("seed", self.seed, "expected an integer")
        if self.keep is not None and self.keep not in KEEP_MODES:
            raise bad("keep", self.keep, f"expected None or one of {KEEP_MODES}")
        for name in ("balance", "warm_balance"):
            value = getattr(self, name)
            if value is not None and not (is_number(value) and value >= 0):
                raise bad(name, value, "expected None or a number >= 0 (the overload over the mean allowed)")
        fraction("min_ratio", self.min_ratio)
        if self.objective not in OBJECTIVES:
            raise bad("objective", self.objective, f"expected one of {OBJECTIVES}")
        if self.objective == "noise" and (self.trim_after or self.min_ratio_after):
            raise bad("objective", self.objective, "the noise objective sets when and how far to trim: "
                      "trim_after=0, min_ratio_after=()")
        if not (is_number(self.noise_threshold) and self.noise_threshold > 0):
            raise bad("noise_threshold", self.noise_threshold, "expected a number > 0 (the share of extra steps "
                      "the sampling noise may cost)")
        if not (is_number(self.drop_cost) and self.drop_cost >= 0):
            raise bad("drop_cost", self.drop_cost, "expected a number >= 0 (extra steps per unit of pairs dropped)")
        if isinstance(self.trim_after, bool) or not isinstance(self.trim_after, int) or self.trim_after < 0:
            raise bad("trim_after", self.trim_after, "expected an integer >= 0 (optimizer steps before trimming)")
        fraction("warm_ratio", self.warm_ratio)
        if not isinstance(self.control_variate, bool):
            raise bad("control_variate", self.control_variate, "expected true or false")
        if self.variate_scores not in VARIATE_SCORES:
            raise bad("variate_scores", self.variate_scores, f"expected one of {VARIATE_SCORES}")
        if isinstance(self.recompute_chunk, bool) or not isinstance(self.recompute_chunk, int) \
                or self.recompute_chunk < 0:
            raise bad("recompute_chunk", self.recompute_chunk, "expected an integer >= 0 (rows recomputed at once; "
                      "0: every kept row at once)")
        object.__setattr__(self, "min_ratio_after", step_ratios("min_ratio_after", self.min_ratio_after))

    def at_step(self, steps: int) -> BackwardConfig:
        """The config a layer's backward follows after ``steps`` optimizer steps: within the first
        ``trim_after`` its :meth:`warm_phase`, after them this one with the floor
        ``min_ratio_after`` sets by then."""
        if steps < self.trim_after:
            return self.warm_phase()
        if self.layer_floors:
            raise ValueError(f"min_ratio_after={self.min_ratio_after!r} has per-layer floors: "
                             "take each layer's config with for_layer first")
        floors = [ratio for step, ratio in self.min_ratio_after if steps >= step]
        return replace(self, min_ratio=floors[-1], min_ratio_after=()) if floors else self

    @property
    def layer_floors(self) -> int:
        """How many MoE layers ``min_ratio_after``'s per-layer floors are for (0: none are)."""
        return max((len(r) for _, r in self.min_ratio_after if isinstance(r, tuple)), default=0)

    def for_layer(self, index: int, layers: int) -> BackwardConfig:
        """MoE layer ``index``'s (of ``layers``, in model order) config: its own entry of each
        per-layer floor in ``min_ratio_after``; a ValueError when a list is not ``layers`` long."""
        if any(isinstance(r, tuple) and len(r) != layers for _, r in self.min_ratio_after):
            raise ValueError(f"min_ratio_after={self.min_ratio_after!r}: a per-layer floor needs one ratio per "
                             f"MoE layer ({layers})")
        own = tuple((step, r[index] if isinstance(r, tuple) else r) for step, r in self.min_ratio_after)
        return replace(self, min_ratio_after=own)

    def warm_phase(self) -> BackwardConfig:
        """The warm steps' config: ``warm_ratio`` as the ratio, ``warm_balance`` as the balance, the
        memory objective."""
        return replace(self, ratio=self.warm_ratio, balance=self.warm_balance, objective="memory", trim_after=0)

    @property
    def local(self) -> bool:
        """Each rank keeps a share of q_e fixed by the counts: no exchange before the rows."""
        return self.selection in LOCAL_SELECTIONS
