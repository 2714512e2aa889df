"""The training loop of one rank: expert parallelism inside data parallelism.

Ranks form expert-parallel (EP) groups of ``ep_size`` consecutive ranks; the EP groups are the
data-parallel (DP) replicas of each other. Gradient reduction, for the global mean loss
(1/W) Σ_r loss_r: replicated parameters (embeddings, attention, norms, routers, shared
experts) are summed over all W ranks; an expert's gradient at its owner already sums its EP
group's tokens (and its replicas' gradients), so it is summed over the DP group of owners;
both are divided by W. AdamW keeps expert optimizer state at owners only.

``metrics.jsonl`` — one JSON object per optimizer step, written by rank 0:

| key | meaning |
|---|---|
| ``step`` | optimizer steps done (1-based) |
| ``loss`` | training cross entropy, mean over all ranks' tokens |
| ``val_loss`` | validation cross entropy (only on evaluation steps) |
| ``moe_fwd_ms``, ``moe_bwd_ms`` | routed forward / backward time this step, sum over layers, max over ranks |
| ``moe_placement_ms`` | ``step_end`` time this step (replica re-planning and refresh), max over ranks |
| ``moe_time_s`` | cumulative moe_fwd_ms + moe_bwd_ms + moe_placement_ms (seconds) since step 1 |
| ``a2a_bytes`` | all-to-all bytes sent this step, forward + backward, all layers, all ranks |
| ``bwd_a2a_bytes`` | the backward's share of them |
| ``kept_ratio`` | backward pairs kept / routed, all layers |
| ``load_min``, ``load_max``, ``load_cv`` | per MoE layer: expert load min, max, coefficient of variation |
| ``peak_expert_side_bytes`` | max over layers and ranks |
| ``placement_bytes`` | expert parameter bytes moved this step (replicas, shadows, assembled slices), all ranks |
| ``a2a_inter_bytes`` | the part of ``a2a_bytes`` that crossed nodes (only with ``[budget] ranks_per_node``) |
| ``tokens_per_s`` | training tokens per second, all ranks |
| ``skipped`` | the step was skipped for a non-finite loss or gradient |

``routing.npz`` holds ``counts`` (steps × MoE layers × experts), the global routing counts
of every step, as traces for the simulator.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from lrmoe import comm
from lrmoe.layer import TAKES_BUDGET, MoELayer
from lrmoe.models import MoETransformer
from lrmoe.train import checkpoint
from lrmoe.train.config import ConfigError, RunConfig
from lrmoe.train.data import Batches, TokenData


class Groups:
    """World, expert-parallel and data-parallel groups of this rank (None at world size 1)."""

    def __init__(self, world_group, ep_size: int) -> None:
        self.world = comm.world_size(world_group)
        self.rank = comm.rank_of(world_group)
        self.ep_size = ep_size or self.world
        self.dp_size = self.world // self.ep_size
        self.world_group = world_group
        self.ep_group = self.dp_group = None
        if self.world > 1:
            ranks = dist.get_process_group_ranks(world_group)
            for k in range(self.dp_size):  # every rank creates every group, in one order
                g = dist.new_group([ranks[k * self.ep_size + i] for i in range(self.ep_size)])
                if k == self.rank // self.ep_size:
                    self.ep_group = g if self.ep_size > 1 else None
            for i in range(self.ep_size):
                g = dist.new_group([ranks[k * self.ep_size + i] for k in range(self.dp_size)])
                if i == self.rank % self.ep_size:
                    self.dp_group = g if self.dp_size > 1 else None
        self.dp_rank = self.rank // self.ep_size


def _all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In place; host tensors go through the accelerator when the group is NCCL."""
    if group is None:
        return t
    device = comm.comm_device(group)
    if device is None or t.device == device:
        dist.all_reduce(t, op=op, group=group)
    else:
        moved = t.to(device)
        dist.all_reduce(moved, op=op, group=group)
        t.copy_(moved)
    return t


def train_device(cfg: RunConfig) -> torch.device:
    """``train.device``: ``auto`` takes this rank's CUDA device when there is one."""
    if cfg.train.device == "cpu" or (cfg.train.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("train.device='cuda' but this machine's torch sees no CUDA device")
    return torch.device("cuda", torch.cuda.current_device())


def build_model(cfg: RunConfig, vocab_size: int, groups: Groups) -> MoETransformer:
    """The model with EP layers, initialised from the world-size-1 model of the same seed, so
    every system, world size and EP layout starts from identical weights."""
    model_cfg = replace(cfg.model, vocab_size=vocab_size)
    torch.manual_seed(cfg.train.seed)
    full = MoETransformer(model_cfg).state_dict()
    t = cfg.train
    budget = cfg.budget if t.system in TAKES_BUDGET else None
    trace_SLE = read_routing_trace(t.routing_trace, model_cfg) if t.routing_trace else None

    def make_moe(i: int) -> MoELayer:
        return MoELayer(model_cfg.moe, system=t.system, group=groups.ep_group, backward=cfg.backward,
                        budget=budget, capacity_factor=t.capacity_factor, replan_interval=t.replan_interval,
                        routing_trace=None if trace_SLE is None else trace_SLE[:, i - model_cfg.first_dense_layers])

    model = MoETransformer(model_cfg, make_moe)
    moe_prefixes = {name for name, m in model.named_modules() if isinstance(m, MoELayer)}
    plain = {k: v for k, v in full.items() if not any(k.startswith(p + ".") for p in moe_prefixes)}
    missing = model.load_state_dict(plain, strict=False).missing_keys
    for prefix in moe_prefixes:
        layer = model.get_submodule(prefix)
        layer.load_full_state_dict({k[len(prefix) + 1 :]: v for k, v in full.items() if k.startswith(prefix + ".")})
    assert all(any(k.startswith(p + ".") for p in moe_prefixes) for k in missing), missing
    return model


def read_routing_trace(path: str, model_cfg) -> torch.Tensor:
    """(steps, MoE layers, experts) counts of an earlier run's routing.npz, checked against the model."""
    try:
        counts = np.load(path)["counts"]
    except (OSError, KeyError, ValueError) as e:
        raise ConfigError(f"train.routing_trace={path!r} cannot be read as a routing.npz with 'counts': {e}") from None
    want = (model_cfg.n_layers - model_cfg.first_dense_layers, model_cfg.moe.num_experts)
    if counts.ndim != 3 or counts.shape[1:] != want or not len(counts):
        raise ConfigError(f"train.routing_trace={path!r} holds counts of shape {counts.shape}, expected "
                         f"(steps, {want[0]}, {want[1]}) for this model")
    return torch.from_numpy(counts.astype(np.float64))


def reduce_gradients(model: torch.nn.Module, groups: Groups) -> None:
    """Gradients of the global mean loss: replicated parameters summed over all ranks, routed
    experts over the data-parallel group of owners, both divided by the world size."""
    W = groups.world
    for name, p in model.named_parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        expert = ".mlp.experts." in name  # routed experts; shared experts are replicated
        _all_reduce(p.grad, groups.dp_group if expert else groups.world_group)
        p.grad.div_(W)


def _lr(step: int, cfg) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(cfg.steps - cfg.warmup, 1)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


@torch.no_grad()
def evaluate(model: MoETransformer, batches: Batches, n: int, groups: Groups) -> float:
    total = torch.zeros(2, dtype=torch.float64)
    device = next(model.parameters()).device
    for ids, tgt in batches.val_batches(n):
        _, ce = model.loss(ids.to(device), tgt.to(device))
        total += torch.tensor([ce.item() * tgt.numel(), tgt.numel()], dtype=torch.float64)
    _all_reduce(total, groups.world_group)
    return float(total[0] / total[1])


class Progress:
    """Progress on rank 0: loss, tokens/s, ETA — one rewritten line on a terminal, a line every
    tenth of the run otherwise (logs stay readable)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled, self.t0 = total, enabled, time.time()
        self.tty = sys.stderr.isatty()

    def update(self, step: int, loss: float, tok_s: float, start: int) -> None:
        if not self.enabled or not (self.tty or step == self.total or step % max(self.total // 10, 1) == 0):
            return
        eta = (time.time() - self.t0) / max(step - start, 1) * (self.total - step)
        bar = "#" * int(24 * step / self.total)
        line = f"[{bar:<24}] {step}/{self.total} loss {loss:.3f} {tok_s:,.0f} tok/s ETA {eta:4.0f}s"
        if self.tty:
            print("\r" + line, end="\n" if step == self.total else "", file=sys.stderr, flush=True)
        else:
            print(line, file=sys.stderr, flush=True)


def _step_metrics(model: MoETransformer, groups: Groups) -> dict:
    layers = model.moe_layers
    stats = [layer.last_stats for layer in layers]
    mx = torch.tensor([sum(s.get("fwd_ms", 0.0) for s in stats), sum(s.get("bwd_ms", 0.0) for s in stats),
                       max((s.get("peak_expert_side_bytes", 0) for s in stats), default=0)], dtype=torch.float64)
    sm = torch.tensor([sum(s.get("fwd_a2a_bytes", 0) + s.get("bwd_a2a_bytes", 0) for s in stats),
                       sum(s.get("placement_bytes", 0) for s in stats),
                       sum(s.get("bwd_a2a_bytes", 0) for s in stats),
                       sum(s.get("fwd_a2a_inter_bytes", 0) + s.get("bwd_a2a_inter_bytes", 0) for s in stats)],
                      dtype=torch.float64)
    _all_reduce(mx, groups.world_group, dist.ReduceOp.MAX)
    _all_reduce(sm, groups.world_group)
    counts = torch.stack([s["counts_E"].to(torch.float64) for s in stats]) if stats else torch.zeros(0, 1)
    kept = torch.stack([s["kept_E"].to(torch.float64) for s in stats]) if stats else torch.zeros(0, 1)
    both = torch.stack([counts, kept]) if stats else torch.zeros(2, 0, 1)
    _all_reduce(both, groups.dp_group)  # EP-group counts summed over the data-parallel replicas
    counts, kept = both[0], both[1]
    mean = counts.mean(1).clamp(min=1e-9)
    return {
        "moe_fwd_ms": float(mx[0]), "moe_bwd_ms": float(mx[1]), "peak_expert_side_bytes": int(mx[2]),
        "a2a_bytes": int(sm[0]), "bwd_a2a_bytes": int(sm[2]), "placement_bytes": int(sm[1]),
        **({"a2a_inter_bytes": int(sm[3])} if any("fwd_a2a_inter_bytes" in s for s in stats) else {}),
        "kept_ratio": float(kept.sum() / counts.sum().clamp(min=1)),
        "load_min": counts.min(1).values.tolist(), "load_max": counts.max(1).values.tolist(),
        "load_cv": (counts.std(1, unbiased=False) / mean).tolist(),
        "_counts": counts,
    }


def train(cfg: RunConfig, out: Path, world_group=None, resume: bool = False,
          max_steps: int | None = None, stop_at: float | None = None, eval_at: tuple[int, ...] = ()) -> dict:
    """Run (or resume) training on this rank. ``max_steps`` overrides ``train.steps`` as the
    step budget; with ``stop_at`` the run ends at the first evaluation whose validation loss
    is at or below it. Evaluations run every ``eval_every`` steps, at every step of
    ``eval_at`` and at the end. Returns rank 0's summary."""
    t = cfg.train
    out = Path(out)
    groups = Groups(world_group, t.ep_size)
    torch.set_num_threads(1)
    data = TokenData.load(t.data, t.vocab_size, t.val_fraction)
    batches = Batches(data, cfg.model.seq_len, t.batch, groups.dp_rank, groups.dp_size, t.seed)
    device = train_device(cfg)
    model = build_model(cfg, data.vocab_size, groups).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay, betas=(0.9, 0.95))
    total_steps = max_steps or t.steps
    lead = groups.rank == 0
    out.mkdir(parents=True, exist_ok=True)

    start, history = 0, {"moe_time_s": 0.0, "val": [], "routing": []}
    if resume:
        state = checkpoint.load_latest(out, groups.rank)
        if state is not None:
            start = checkpoint.restore(state, model, opt)
            history = state["history"]
    metrics_path = out / "metrics.jsonl"
    if lead:
        checkpoint.truncate_metrics(metrics_path, start)
    progress = Progress(total_steps, lead)
    eval_steps = set(eval_at)
    summary = {"stopped_at_target": False}
    for step in range(start, total_steps):
        for g in opt.param_groups:
            g["lr"] = _lr(step, t)
        t0 = time.time()
        ids, tgt = (b.to(device) for b in batches.train_batch(step))
        loss, ce = model.loss(ids, tgt)
        loss.backward()
        reduce_gradients(model, groups)
        finite = torch.tensor([float(torch.isfinite(loss).item()
                                     and all(torch.isfinite(p.grad).all() for p in model.parameters()))])
        _all_reduce(finite, groups.world_group, dist.ReduceOp.MIN)
        skipped = not bool(finite.item())
        if skipped and t.on_nonfinite == "stop":
            raise FloatingPointError(f"non-finite loss or gradient at step {step + 1}; stopping (on_nonfinite=stop)")
        if skipped and lead:
            print(f"\nstep {step + 1}: non-finite loss or gradient, step skipped (on_nonfinite=skip)",
                  file=sys.stderr, flush=True)
        if not skipped:
            opt.step()
        opt.zero_grad(set_to_none=True)
        m = _step_metrics(model, groups)
        placement_s = 0.0
        for layer in model.moe_layers:
            t_place = time.perf_counter()
            layer.step_end()  # re-planning and replica refresh: MoE time too
            placement_s += time.perf_counter() - t_place
            if layer.router.e_score_correction_bias is not None and t.bias_update_rate > 0:
                counts = _all_reduce(layer.last_stats["counts_E"].to(torch.float64), groups.dp_group)
                layer.update_router_bias(counts, t.bias_update_rate)
        ce_mean = _all_reduce(ce.detach().to(torch.float64).reshape(1), groups.world_group) / groups.world
        m["moe_placement_ms"] = float(_all_reduce(torch.tensor([placement_s * 1e3], dtype=torch.float64),
                                                  groups.world_group, dist.ReduceOp.MAX))
        history["moe_time_s"] += (m["moe_fwd_ms"] + m["moe_bwd_ms"] + m["moe_placement_ms"]) / 1e3
        history["routing"].append(m.pop("_counts").numpy().tolist())
        record = {"step": step + 1, "loss": float(ce_mean), **m, "moe_time_s": history["moe_time_s"],
                  "tokens_per_s": groups.world * ids.numel() / max(time.time() - t0, 1e-9), "skipped": skipped}
        done = step + 1
        if done % t.eval_every == 0 or done in eval_steps or done == total_steps:
            model.eval()
            record["val_loss"] = evaluate(model, batches, t.eval_batches, groups)
            model.train()
            history["val"].append((done, record["val_loss"], history["moe_time_s"]))
        if lead:
            checkpoint.append_jsonl(metrics_path, record)
            progress.update(done, record["loss"], record["tokens_per_s"], start)
        reached = stop_at is not None and record.get("val_loss", math.inf) <= stop_at
        if (t.checkpoint_every and done % t.checkpoint_every == 0) or done == total_steps or reached:
            checkpoint.save(out, groups.rank, done, model, opt, history, world_group)
        if reached:
            summary["stopped_at_target"] = True
            break
        _maybe_inject_fault(done, groups.rank)
    if lead:
        np.savez_compressed(out / "routing.npz", counts=np.asarray(history["routing"], dtype=np.float32))
    summary.update(steps=len(history["routing"]), val=history["val"], moe_time_s=history["moe_time_s"],
                   unigram_loss=data.unigram_loss())
    if lead:
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _maybe_inject_fault(step: int, rank: int) -> None:
    """Testing hook for rank-failure recovery: ``LRMOE_FAULT_AT=STEP:RANK`` kills that rank with
    SIGKILL after that step, on the first attempt only (torchrun's restart count is 0)."""
    spec = os.environ.get("LRMOE_FAULT_AT")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    fault_step, fault_rank = (int(v) for v in spec.split(":"))
    if (step, rank) == (fault_step, fault_rank):
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def main_worker(config_path: str, out: str, resume: bool, max_steps: int | None, stop_at: float | None,
                eval_at: tuple[int, ...]) -> None:
    """Entry of a rank launched by torch.distributed.run."""
    from lrmoe.train.config import load

    cfg = load(config_path)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    group = None
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if world > 1:
        # A fresh key prefix per restart attempt: otherwise gloo may read the addresses of the
        # previous attempt's (dead) ranks from the shared store and fail to connect.
        rank = int(os.environ["RANK"])
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "False") == "True"
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                              is_master=not agent_store and rank == 0)
        cuda = train_device(cfg).type == "cuda"
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo",
                                store=dist.PrefixStore(f"lrmoe/attempt_{restart}", store), rank=rank, world_size=world)
        group = dist.group.WORLD
    # a rank restarted by torchrun (--max-restarts) resumes from the last good checkpoint
    resume = resume or restart > 0
    try:
        train(cfg, Path(out), group, resume=resume, max_steps=max_steps, stop_at=stop_at, eval_at=eval_at)
    finally:
        if world > 1:
            dist.destroy_process_group()
