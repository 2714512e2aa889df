"""A GPU's memory cap → each system's whole-step memory, and lrmoe's per-layer budget.

A training step holds, per GPU and for every MoE layer at once: the layer's expert copies
(parameters + gradient buffers, :meth:`lrmoe.memory.bytes.ByteModel.slots_held`), the owned experts'
optimizer state, the home-side tensors (:func:`home_bytes`), the router's and shared expert's
state and activations; and, when the backward begins, what each layer's expert side kept from
its forward (:func:`kept_between_passes`: rows and activations for static-like systems; for lrmoe
what its call's keep mode says). On top comes the transient peak of the one layer being computed (its
``peak_expert_side_bytes`` less its slots, already counted). The representative layers stand
for all: kept bytes are their mean times the other layers, the transient their maximum.

lrmoe's :class:`ClusterBudget` is a per-layer budget M; :func:`lrmoe_budget` gives the largest
M whose step fits with every other layer at the controller's most slots (its replica search's
ceiling, ``Controller.slots``) and nothing kept between the passes — a conservative start; the
simulator then searches M on the simulated step itself (:mod:`lrmoe.sim.run`), since the
controller's cost search usually takes far fewer replicas than its ceiling and a call that
keeps x (and activations) holds them across the other layers' calls.
"""

from __future__ import annotations

import numpy as np

from lrmoe.config import ClusterBudget
from lrmoe.memory.bytes import GIB, ByteModel, expert_param_bytes
from lrmoe.planning.controller import Controller
from lrmoe.planning.placement import Placement
from lrmoe.sim.errors import SimError
from lrmoe.sim.layer_calls import LayerCall
from lrmoe.sim.memory import home_bytes
from lrmoe.sim.models import ModelSpec
from lrmoe.systems import TRIMMING_SYSTEM, spec_of

__all__ = ["GIB", "dense_bytes", "lrmoe_budget", "moe_step_bytes", "param_state_bytes", "per_layer_state",
           "step_peak_bytes"]
_DTYPE_OF_BYTES = {2: "bfloat16", 4: "float32", 8: "float64"}


def param_state_bytes(params: int, s: int, optimizer_bytes_per_param: float) -> int:
    """Parameters held with their gradients (``s`` bytes each) and optimizer state."""
    return int(params * (2 * s + optimizer_bytes_per_param))


def dense_bytes(spec: ModelSpec, tokens: int, s: int, optimizer_bytes_per_param: float) -> int:
    """Router and shared expert of one layer: parameters, gradients, optimizer state and the
    activations autograd keeps (x's gate, up, h of the shared expert, router logits)."""
    params = spec.num_experts * spec.dim + 3 * spec.dim * spec.shared_ffn_dim
    acts = tokens * (3 * spec.shared_ffn_dim * s + spec.num_experts * 4)
    return param_state_bytes(params, s, optimizer_bytes_per_param) + int(acts)


def per_layer_state(spec: ModelSpec, tokens: int, s: int, opt: float, selective: bool, owned: int) -> int:
    """Bytes of one layer that do not depend on placement: optimizer, home side, dense part."""
    params = expert_param_bytes(spec.dim, spec.ffn_dim, 1)  # parameters of one expert
    return int(owned * params * opt
               + home_bytes(tokens, spec.dim, spec.top_k, s, selective)
               + dense_bytes(spec, tokens, s, opt))


def step_peak_bytes(spec: ModelSpec, calls: list[list[LayerCall]], s: int, opt: float) -> int:
    """Peak bytes per GPU of a whole training step (max over ranks and simulated steps);
    ``calls[step][layer]`` are the representative layers' calls. Each representative layer
    stands for ``L / layers`` of the model's L layers: its copies (which differ by layer where
    replicas follow each layer's load) and what it kept to the backward enter as the mean over
    the representative layers; the transient on top is the largest of one layer call."""
    L = spec.moe_layers
    bytes_ = ByteModel(spec.dim, spec.ffn_dim, s)
    worst = 0
    for layer_calls in calls:
        c0 = layer_calls[0]
        selective = spec_of(c0.system).selective  # the home side keeps ‖h‖² to the backward
        slots_LR = np.array([[bytes_.slots_held(int(k), int(o)) for k, o in zip(c.copies_R, c.owned_R)]
                             for c in layer_calls])
        state_R = np.array([per_layer_state(spec, c0.tokens_per_rank, s, opt, selective, int(o))
                            for o in c0.owned_R])
        kept_R = np.mean([c.kept_bytes_R for c in layer_calls], axis=0)
        transient_R = (np.array([c.peak_R for c in layer_calls]) - slots_LR).max(0)
        total_R = L * (slots_LR.mean(0) + state_R) + (L - 1) * kept_R + transient_R
        worst = max(worst, int(total_R.max()))
    return worst


def moe_step_bytes(spec: ModelSpec, world: int, M: int, tokens: int, s: int, opt: float,
                   slots: int | None = None) -> int | None:
    """Bytes per rank of the MoE layers' step under a per-layer expert-side budget ``M``: every
    layer's placement-free state (:func:`per_layer_state`), every other layer holding the
    controller's most slots at ``M`` (``slots``: that many a rank), this layer ``M``; None where
    ``M`` cannot hold a rank's owned experts (the controller refuses it). The layer's dtype is the
    one of ``s`` bytes (bf16 at paper scale, fp32 for ``lrmoe train --memory-per-rank``), so the
    controller's slots and the byte model here count the same bytes."""
    base = Placement.static(spec.num_experts, world)
    owned = max(len(base.owned(r)) for r in range(world))
    try:
        slots_R = Controller(spec.moe_config(_DTYPE_OF_BYTES[s]), ClusterBudget(memory_bytes=M, slots=slots),
                             world).slots(base)
    except ValueError:
        return None
    held = ByteModel(spec.dim, spec.ffn_dim, s).slots_held(max(slots_R), owned)
    return (spec.moe_layers - 1) * held + spec.moe_layers * per_layer_state(spec, tokens, s, opt, True, owned) + M


def lrmoe_budget(spec: ModelSpec, world: int, cap_bytes: int, tokens: int, s: int, opt: float,
                 slots: int | None = None, system: str = TRIMMING_SYSTEM) -> int:
    """Largest per-layer expert-side budget M (bytes per rank) whose whole step fits the cap
    (:func:`moe_step_bytes`, every other layer holding the controller's most slots); the start
    of ``system``'s budget search."""
    lo, hi = 1, cap_bytes
    best = None
    for _ in range(60):
        if lo > hi:
            break
        mid = (lo + hi) // 2
        need = moe_step_bytes(spec, world, mid, tokens, s, opt, slots)
        if need is not None and need <= cap_bytes:
            best, lo = mid, mid + 1
        elif need is None:
            lo = mid + 1  # below the owned experts' slots: a larger M may fit
        else:
            hi = mid - 1
    if best is None:
        owned = max(len(Placement.static(spec.num_experts, world).owned(r)) for r in range(world))
        state = per_layer_state(spec, tokens, s, opt, True, owned)
        least = owned * ByteModel(spec.dim, spec.ffn_dim, s).slot
        raise SimError(f"{system}: a {cap_bytes / GIB:.1f} GiB GPU cannot hold {spec.moe_layers} layers' "
                       f"owned experts and states ({(spec.moe_layers * (least + state)) / GIB:.1f} GiB needed)")
    return best
