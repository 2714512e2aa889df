"""``--memory-per-rank`` (``[budget] memory_per_rank``): a whole rank's memory, split by the
simulator's byte model into what the rest of the model takes and each MoE layer's expert-side
budget, ``budget.memory_bytes`` (docs/training.md "A memory cap per rank").

A training rank holds, per step:

- outside the MoE layers (attention, embeddings, norms, dense FFN layers, the head): parameters,
  gradients and AdamW's two moments, :func:`lrmoe.sim.budget.param_state_bytes`;
- the activations those parts keep for the backward, :func:`outside_activation_bytes`;
- per MoE layer, what does not depend on the placement, :func:`lrmoe.sim.budget.per_layer_state`
  (the owned experts' AdamW moments, the home side's rows, router and shared expert);
- the expert sides: one layer at its peak within M, every other layer holding the controller's
  most expert slots at M (:func:`lrmoe.sim.budget.moe_step_bytes`).

M is the largest budget whose total fits, found as the simulator finds its start
(:func:`lrmoe.sim.budget.lrmoe_budget`). The smallest plan a layer can run (its owned experts,
the x and y rows of a balanced forward, one row computed at a time) must fit, or the run stops
before any rank starts. The description the simulator's functions take (a
:class:`~lrmoe.sim.models.ModelSpec`) is built from the run's model (:mod:`lrmoe.train.model_shape`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lrmoe.config import ClusterBudget
from lrmoe.memory.bytes import ByteModel
from lrmoe.planning.cost import ADAM_STATES
from lrmoe.planning.placement import Placement
from lrmoe.sim.budget import lrmoe_budget, moe_step_bytes, param_state_bytes, per_layer_state
from lrmoe.sizes import format_size
from lrmoe.train.config import ConfigError, RunConfig
from lrmoe.train.model_shape import DENSE_DTYPE_BYTES, RankShape, shape_of

# D-wide values autograd keeps per token in one transformer layer outside its MLP: the two
# RMSNorms' inputs and outputs, q, k, v, the rotated q and k, the attention output, the output
# projection's input, rounded up (measured with saved-tensor hooks on the built-in transformer:
# 11-12.6 D a layer at D = 64-128; fused attention keeps no probabilities, only their logsumexp)
ATTENTION_ROWS = 13
# per token at the top: the final norm's and the head's inputs (D-wide, 4 measured), the
# log-softmax the loss keeps and the logits' gradient when the backward starts (V-wide)
HEAD_ROWS, LOGIT_ROWS = 4, 2
DENSE_FFN_ROWS = 5  # a dense FFN layer's D-wide values (its norm, input, output) beside its four activations


def outside_activation_bytes(shape: RankShape, batch: int, seq_len: int) -> int:
    """Activations kept for the backward outside the MoE layers, for ``batch`` sequences of
    ``seq_len`` tokens: per token every layer's attention (:data:`ATTENTION_ROWS` D-wide values),
    every dense FFN layer's :data:`DENSE_FFN_ROWS` and its four activations (the byte model's
    ``fwd_compute``, as an expert's), the head's :data:`HEAD_ROWS` and :data:`LOGIT_ROWS`. Within
    about 10 % of what the built-in transformer keeps (tests/train/test_memory_per_rank.py)."""
    s, D = DENSE_DTYPE_BYTES, shape.spec.dim
    dense_ffn = ByteModel(D, shape.dense_ffn_dim, s).fwd_compute if shape.dense_layers else 0
    per_token = (shape.layers * ATTENTION_ROWS * D + HEAD_ROWS * D + LOGIT_ROWS * shape.vocab) * s \
        + shape.dense_layers * (DENSE_FFN_ROWS * D * s + dense_ffn)
    return batch * seq_len * per_token


def _owned(shape: RankShape, world: int) -> int:
    """The most experts a rank owns in the static placement (the one the budget functions use)."""
    base = Placement.static(shape.spec.num_experts, world)
    return max(len(base.owned(r)) for r in range(world))


def smallest_layer_budget(shape: RankShape, world: int, tokens: int) -> int:
    """The least expert-side budget a layer can run with: a rank's owned experts (parameters and
    gradients), the x and y of the rows a balanced forward brings it (``tokens`` × top-k) and
    one row computed at a time (the controller's forward chunking at its smallest)."""
    spec = shape.spec
    bm = ByteModel(spec.dim, spec.ffn_dim, shape.expert_bytes)
    return _owned(shape, world) * bm.slot + tokens * spec.top_k * bm.fwd_io + bm.fwd_compute


@dataclass(frozen=True)
class MemorySplit:
    """A rank's memory cap and where it goes, in bytes."""

    total: int
    outside_params: int
    dense_state: int  # parameters outside the MoE layers, their gradients and AdamW moments
    outside_acts: int  # activations outside the MoE layers
    moe_state: int  # every MoE layer's placement-free state (per_layer_state)
    expert_side: int  # the expert sides: one layer at M, the others at their slots
    layer_budget: int  # M: budget.memory_bytes
    moe_layers: int
    tokens: int  # a rank's tokens a step

    def describe(self, where: str) -> str:
        """The block printed before launch."""
        rows = [
            ("dense params+grads+optimizer", self.dense_state,
             f"{self.outside_params:,} parameters outside the MoE layers, fp32, AdamW"),
            ("activations outside MoE", self.outside_acts, f"{self.tokens:,} tokens a rank a step"),
            ("MoE layers' own state", self.moe_state,
             f"{self.moe_layers} layers: owned experts' AdamW moments, home-side rows, router"),
            ("expert side", self.expert_side, "one MoE layer at its peak, the others holding their expert slots"),
            ("  per MoE layer", self.layer_budget,
             f"x {self.moe_layers} layers: budget.memory_bytes = {self.layer_budget:,}"),
        ]
        lines = [f"{where} {format_size(self.total)} ({self.total:,} bytes), split by lrmoe's byte model:"]
        lines += [f"  {name:<30}{format_size(n):>10}  ({note})" for name, n, note in rows]
        return "\n".join(lines)


def _fixed_slots(cfg: RunConfig) -> int | None:
    slots = cfg.budget.slots if cfg.budget is not None else None
    return max(slots) if isinstance(slots, (list, tuple)) else slots


def split_memory(cfg: RunConfig, cap: int, where: str = "memory_per_rank", shape: RankShape | None = None
                 ) -> MemorySplit:
    """``cap`` bytes a rank for ``cfg``'s run, split (module docstring); a one-line ConfigError
    naming ``where`` when even the smallest plan does not fit."""
    shape = shape or shape_of(cfg)
    t, spec, s = cfg.train, shape.spec, shape.expert_bytes
    world, tokens, opt = t.ep_size or t.nproc, t.batch * cfg.model.seq_len, ADAM_STATES * s
    dense = param_state_bytes(shape.outside_params, DENSE_DTYPE_BYTES, ADAM_STATES * DENSE_DTYPE_BYTES)
    acts = outside_activation_bytes(shape, t.batch, cfg.model.seq_len)
    slots = _fixed_slots(cfg)
    least = moe_step_bytes(spec, world, smallest_layer_budget(shape, world, tokens), tokens, s, opt, slots)
    if least is None or dense + acts + least > cap:
        need = dense + acts + (least or 0)
        raise ConfigError(f"{where}={format_size(cap)} is too small: the smallest plan needs {format_size(need)} "
                          f"a rank ({format_size(dense)} dense params+grads+optimizer, {format_size(acts)} "
                          f"activations outside MoE, {format_size(least or 0)} for {spec.moe_layers} MoE layers "
                          f"holding only their own experts)")
    M = lrmoe_budget(spec, world, cap - dense - acts, tokens, s, opt, slots)
    state = spec.moe_layers * per_layer_state(spec, tokens, s, opt, True, _owned(shape, world))
    step = moe_step_bytes(spec, world, M, tokens, s, opt, slots)
    return MemorySplit(total=cap, outside_params=shape.outside_params, dense_state=dense, outside_acts=acts,
                       moe_state=state, expert_side=step - state, layer_budget=M, moe_layers=spec.moe_layers,
                       tokens=tokens)


def with_memory_per_rank(cfg: RunConfig, where: str = "memory_per_rank") -> RunConfig:
    """``cfg`` with ``memory_per_rank`` resolved into ``budget.memory_bytes`` (the config the ranks
    run and ``config.toml`` records), the split printed; ``cfg`` itself without one."""
    if cfg.memory_per_rank is None:
        return cfg
    split = split_memory(cfg, cfg.memory_per_rank, where)
    print(split.describe(where), flush=True)
    budget = cfg.budget if cfg.budget is not None else ClusterBudget()
    return replace(cfg, memory_per_rank=None, budget=replace(budget, memory_bytes=split.layer_budget))
