"""A rank's training state in a form that does not depend on the world size, for the
``torch.distributed.checkpoint`` (DCP) checkpoints of :mod:`lrmoe.train.checkpoint`.

Every value is a tensor under a flat key:

- ``model/NAME``: a parameter or buffer every rank holds alike (embeddings, attention, norms,
  routers, shared experts);
- ``model/NAME/E``: routed expert ``E`` of an MoE layer's ``experts.gate_up_proj`` ((2F, D)) or
  ``experts.down_proj`` ((D, F)), whole;
- ``optim/NAME/KEY`` and ``optim/NAME/KEY/E``: that parameter's optimizer state (AdamW:
  ``step``, ``exp_avg``, ``exp_avg_sq``), experts split the same way;
- ``moe/L/dpK/...``: MoE layer L's train state in data-parallel replica K (``load_E``, the
  ``counters`` [planner steps, backward calls, lrmoe's searched replica count or -1], the replica
  placement as a (ranks, experts) ``slots`` mask, smartmoe's ``trace``, the noise objective's
  ``noise`` state, and ``kept_activations``: whether the last backward kept them, which the next
  call's row order follows);
- ``rng/R``: rank R's torch RNG state.

A rank contributes the experts it owns under the static placement of its expert-parallel
group, so it writes and reads 1/ep_size of every expert tensor whatever the layout; ``laer``'s
slices of every expert are first exchanged into whole owned experts (one all-to-all, the same
bytes as the slices) and back after a load. Replicated keys are written once (DCP keeps one
writer per key). A checkpoint therefore loads at any ``--nproc`` and ``--ep-size``: each rank
asks for the experts it owns there, with their Adam moments.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.checkpoint.metadata import Metadata

from lrmoe.layer import EXPERT_TENSORS, MoELayer, moe_layers
from lrmoe.parallel import sharding
from lrmoe.parallel.comm import WireCounter
from lrmoe.systems import PlacementKind
from lrmoe.train.groups import Groups

GATE_UP, DOWN = EXPERT_TENSORS
# MoELayer.train_state()'s keys
LAYER_STATE_KEYS = {"load_E", "steps", "slots", "trace", "replica_k", "backward_calls", "noise",
                    "kept_activations"}


def _host(t: torch.Tensor) -> torch.Tensor:
    """The tensor on the host (no copy when it is there already): DCP writes host tensors only."""
    return t.detach().cpu()


def readable(key: str) -> str:
    """``model/layers.0.mlp.experts.down_proj/3`` → ``layers.0.mlp.experts.down_proj of expert 3``."""
    parts = key.split("/")
    return parts[1] + (f" of expert {parts[2]}" if len(parts) == 3 else "")


def expert_of(key: str) -> int | None:
    """The expert a ``model/NAME/E`` or ``optim/NAME/KEY/E`` key holds; None for other keys."""
    parts = key.split("/")
    whole = {"model": 3, "optim": 4}.get(parts[0])
    return int(parts[-1]) if len(parts) == whole else None


class TrainState:
    """The checkpointed state of one rank: ``model``'s parameters and buffers, ``opt``'s state,
    each MoE layer's train state and the RNG, under the keys of the module docstring."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer, groups: Groups) -> None:
        self.model, self.opt, self.groups = model, opt, groups
        self.layers: list[tuple[str, MoELayer]] = moe_layers(model)
        self.experts = {f"{prefix}.{t}": layer for prefix, layer in self.layers for t in EXPERT_TENSORS}
        self.names = {id(p): n for n, p in model.named_parameters()}
        self._picked: dict[str, str] = {}  # what targets() chose: layer state replica, RNG key
        self._expert_optim: dict[str, list[str]] = {}  # per MoE layer: the experts' optimizer state keys

    # ---------------------------------------------------------------- expert layouts
    @staticmethod
    def _owned(layer: MoELayer) -> tuple[int, ...]:
        return layer.base_placement.owned(layer.rank)

    @staticmethod
    def _whole(layer: MoELayer, gate_up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's owned experts, whole, from its local expert tensors (collective for laer)."""
        if layer.spec.placement is PlacementKind.SHARDED:
            return sharding.assemble(gate_up, down, layer.base_placement, layer.rank, layer.group, WireCounter())
        return gate_up, down

    @staticmethod
    def _local(layer: MoELayer, gate_up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inverse of :meth:`_whole`: every owner's whole experts back to this rank's slices
        (with one holder per expert, the sum laer's gradient reduction takes is that holder's)."""
        if layer.spec.placement is PlacementKind.SHARDED:
            return sharding.reduce_grads(gate_up, down, layer.base_placement, layer.rank, layer.group, WireCounter(),
                                         layer.config.num_experts)
        return gate_up, down

    def _expert_pairs(self, layer: MoELayer) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """(gate_up, down) of the layer's weights (``""``) and of every optimizer state shaped like them."""
        gu, dn = layer.experts.gate_up_proj, layer.experts.down_proj
        pairs = {"": (gu.detach(), dn.detach())}
        s_gu, s_dn = self.opt.state.get(gu, {}), self.opt.state.get(dn, {})
        for k in sorted(s_gu):  # one order on every rank: laer's exchanges are collectives
            if torch.is_tensor(s_gu[k]) and s_gu[k].shape == gu.shape:
                pairs[k] = (s_gu[k], s_dn[k])
        return pairs

    # ---------------------------------------------------------------- save
    @torch.no_grad()
    def capture(self) -> dict[str, torch.Tensor]:
        """This rank's share of the checkpoint (collective when a layer is ``laer``)."""
        out: dict[str, torch.Tensor] = {}
        for name, v in self.model.state_dict().items():
            if name not in self.experts:
                out[f"model/{name}"] = _host(v)
        for name, p in self.model.named_parameters():
            for k, v in self.opt.state.get(p, {}).items():
                if not torch.is_tensor(v):
                    raise TypeError(f"optimizer state {name}/{k} is a {type(v).__name__}; checkpoints hold tensors")
                if name not in self.experts or v.shape != p.shape:
                    out[f"optim/{name}/{k}"] = _host(v)
        for i, (prefix, layer) in enumerate(self.layers):
            owned = self._owned(layer)
            for k, pair in self._expert_pairs(layer).items():
                for t, whole in zip(EXPERT_TENSORS, self._whole(layer, *pair)):
                    where = f"model/{prefix}.{t}" if not k else f"optim/{prefix}.{t}/{k}"
                    for row, e in enumerate(owned):
                        out[f"{where}/{e}"] = _host(whole[row]).clone()  # its own storage, not the stack's
            out.update(self._layer_state(i, layer))
        out[f"rng/{self.groups.rank}"] = torch.get_rng_state()
        return out

    def _layer_state(self, i: int, layer: MoELayer) -> dict[str, torch.Tensor]:
        s = layer.train_state()
        if set(s) != LAYER_STATE_KEYS:  # a new field must be given a key here, not dropped
            raise KeyError(f"MoELayer.train_state() has keys {sorted(s)}, checkpoints know {sorted(LAYER_STATE_KEYS)}")
        where = f"moe/{i}/dp{self.groups.dp_rank}"
        slots = torch.zeros(len(s["slots"]), layer.config.num_experts, dtype=torch.int8)
        for r, experts in enumerate(s["slots"]):
            slots[r, list(experts)] = 1
        out = {f"{where}/load_E": s["load_E"].detach().clone(), f"{where}/slots": slots,
               f"{where}/counters": torch.tensor([s["steps"], s["backward_calls"],
                                                  -1 if s["replica_k"] is None else s["replica_k"]], dtype=torch.int64)}
        if s["trace"]:
            out[f"{where}/trace"] = torch.stack(list(s["trace"]))
        out[f"{where}/kept_activations"] = torch.tensor([int(s["kept_activations"])], dtype=torch.int8)
        if s["noise"] is not None:  # the noise objective's ratio and last measurements (nan: none yet)
            noise = [math.nan if v is None else v for v in s["noise"]]
            out[f"{where}/noise"] = torch.tensor(noise, dtype=torch.float64)
        return out

    # ---------------------------------------------------------------- load
    def misfit(self, md: Metadata) -> str | None:
        """Why a checkpoint's model does not fit this one (the first difference), or None. Every
        rank checks every key, so all ranks come to the same answer without a collective."""
        expected = {f"model/{n}": list(v.shape) for n, v in self.model.state_dict().items() if n not in self.experts}
        for prefix, layer in self.layers:
            c = layer.config
            for e in range(c.num_experts):
                expected[f"model/{prefix}.{GATE_UP}/{e}"] = [2 * c.ffn_dim, c.dim]
                expected[f"model/{prefix}.{DOWN}/{e}"] = [c.dim, c.ffn_dim]
        saved = {k: list(m.size) for k, m in md.state_dict_metadata.items() if k.startswith("model/")}
        for key, shape in expected.items():
            if key not in saved:
                return f"it lacks {readable(key)}"
            if saved[key] != shape:
                return f"{readable(key)} is {saved[key]} there, {shape} here"
        extra = sorted(set(saved) - set(expected))
        return f"it holds {readable(extra[0])}, which this model lacks" if extra else None

    def targets(self, md: Metadata) -> dict[str, torch.Tensor]:
        """Empty tensors for exactly the keys this rank reads from a checkpoint that fits
        (:meth:`misfit`): the replicated ones, its own experts and their optimizer state, its
        replica's layer state (the first replica's when the checkpoint had fewer), its RNG."""
        saved = md.state_dict_metadata

        def empty(key: str) -> torch.Tensor:
            m = saved[key]
            return torch.empty(m.size, dtype=m.properties.dtype)

        owned = {name: self._owned(layer) for name, layer in self.experts.items()}
        want = {}
        for key in saved:
            kind, name, *_ = key.split("/")
            expert = expert_of(key)
            if kind in ("model", "optim") and (expert is None or expert in owned.get(name, ())):
                want[key] = empty(key)
        for i in range(len(self.layers)):
            mine = f"moe/{i}/dp{self.groups.dp_rank}"
            where = mine if f"{mine}/load_E" in saved else f"moe/{i}/dp0"
            self._picked[f"moe/{i}"] = where
            want.update({k: empty(k) for k in saved if k.startswith(where + "/")})
        for prefix, _ in self.layers:  # from the checkpoint's keys: a rank may own no expert
            self._expert_optim[prefix] = sorted({k.split("/")[2] for k in saved if expert_of(k) is not None
                                                 and k.startswith(f"optim/{prefix}.{GATE_UP}/")})
        rng = f"rng/{self.groups.rank}"
        self._picked["rng"] = rng if rng in saved else "rng/0"
        want[self._picked["rng"]] = empty(self._picked["rng"])
        return want

    @torch.no_grad()
    def restore(self, flat: dict[str, torch.Tensor]) -> None:
        """Put what :meth:`targets` loaded back into the model, optimizer, layers and RNG
        (collective when a layer is ``laer``)."""
        sd = {n: flat[f"model/{n}"] for n in self.model.state_dict() if n not in self.experts}
        optim: dict[str, dict[str, torch.Tensor]] = {n: {} for n in self.names.values()}
        for key, v in flat.items():
            kind, name, *rest = key.split("/")
            if kind == "optim" and expert_of(key) is None:
                optim[name][rest[0]] = v
        for prefix, layer in self.layers:
            owned = self._owned(layer)
            for k in ["", *self._expert_optim[prefix]]:
                whole = []
                for t in EXPERT_TENSORS:
                    where = f"model/{prefix}.{t}" if not k else f"optim/{prefix}.{t}/{k}"
                    dtype = layer.get_parameter(t).dtype  # every rank alike, also one that owns no expert
                    rows = [flat[f"{where}/{e}"].to(dtype) for e in owned]
                    whole.append(torch.stack(rows) if rows else torch.empty(0, *expert_shape(layer, t), dtype=dtype))
                local = self._local(layer, *whole)
                for t, v in zip(EXPERT_TENSORS, local):
                    if not k:
                        sd[f"{prefix}.{t}"] = v
                    else:
                        optim[f"{prefix}.{t}"][k] = v
        self.model.load_state_dict(sd)
        self._restore_optimizer(optim)
        for i, (_, layer) in enumerate(self.layers):
            layer.load_train_state(self._layer_train_state(flat, self._picked[f"moe/{i}"], layer))
        torch.set_rng_state(flat[self._picked["rng"]])

    def _restore_optimizer(self, optim: dict[str, dict[str, torch.Tensor]]) -> None:
        params = [p for g in self.opt.param_groups for p in g["params"]]
        state = {i: optim[self.names[id(p)]] for i, p in enumerate(params) if optim[self.names[id(p)]]}
        # load_state_dict moves each moment to its parameter's device and dtype
        self.opt.load_state_dict({"state": state, "param_groups": self.opt.state_dict()["param_groups"]})

    @staticmethod
    def _layer_train_state(flat: dict[str, torch.Tensor], where: str, layer: MoELayer) -> dict:
        slots_WE = flat[f"{where}/slots"]
        steps, backward_calls, replica_k = flat[f"{where}/counters"].tolist()
        same_ep = slots_WE.shape[0] == layer.world
        if same_ep:
            slots = [torch.nonzero(row).flatten().tolist() for row in slots_WE]
        else:  # another expert-parallel size: no replicas, and a fresh search, until the next re-plan
            slots = [list(layer.base_placement.owned(r)) for r in range(layer.world)]
        trace, noise = flat.get(f"{where}/trace"), flat.get(f"{where}/noise")
        if noise is not None:
            noise = tuple(None if math.isnan(v) else v for v in noise.tolist())
        kept_activations = flat.get(f"{where}/kept_activations")  # (older checkpoints lack it)
        return {"noise": noise, "load_E": flat[f"{where}/load_E"].to(torch.float64), "steps": steps, "slots": slots,
                "trace": [] if trace is None else list(trace.to(torch.float64).unbind(0)),
                "replica_k": replica_k if same_ep and replica_k >= 0 else None, "backward_calls": backward_calls,
                "kept_activations": True if kept_activations is None else bool(kept_activations.item())}


def expert_shape(layer: MoELayer, tensor: str) -> tuple[int, int]:
    """One whole expert's shape of ``experts.gate_up_proj`` or ``experts.down_proj``."""
    c = layer.config
    return (2 * c.ffn_dim, c.dim) if tensor == GATE_UP else (c.dim, c.ffn_dim)
