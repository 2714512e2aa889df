"""What a run records each step (``metrics.jsonl``), its progress line, and reading it back.

``metrics.jsonl`` — one JSON object per optimizer step, written by rank 0:

| key | meaning |
|---|---|
| ``step`` | optimizer steps done (1-based) |
| ``loss`` | training cross entropy, mean over all ranks' tokens |
| ``val_loss`` | validation cross entropy (only on evaluation steps) |
| ``moe_fwd_ms``, ``moe_bwd_ms`` | routed forward / backward time this step, sum over layers, max over ranks |
| ``moe_placement_ms`` | ``step_end`` time this step (replica re-planning and refresh), max over ranks |
| ``moe_stage_ms`` | {stage: ms} of the routed passes (:mod:`lrmoe.passes.stages`), sum over layers, mean over ranks |
| ``moe_time_s`` | cumulative moe_fwd_ms + moe_bwd_ms + moe_placement_ms (seconds) since step 1 |
| ``a2a_bytes`` | all-to-all bytes sent this step, forward + backward, all layers, all ranks |
| ``bwd_a2a_bytes`` | the backward's share of them |
| ``kept_ratio`` | backward pairs kept / routed, all layers |
| ``compacted_rows`` | saved rows the backward's compaction moved or gathered, all layers and ranks (where any) |
| ``load_min``, ``load_max``, ``load_cv`` | per MoE layer: expert load min, max, coefficient of variation |
| ``peak_expert_side_bytes`` | max over layers and ranks |
| ``placement_bytes`` | expert parameter bytes moved this step (replicas, shadows, assembled slices), all ranks |
| ``a2a_inter_bytes`` | the part of ``a2a_bytes`` that crossed nodes (only with ``[budget] ranks_per_node``) |
| ``tokens_per_s`` | training tokens per second, all ranks (this step) |
| ``lr`` | learning rate of this step (warmup, then cosine decay) |
| ``grad_norm`` | L2 norm of the whole model's reduced gradient before the optimizer step (every expert once) |
| ``wall_s`` | wall-clock seconds of training since step 1, across resumes (model building excluded) |
| ``step_ms`` | the training step's wall time at rank 0 (batch to ``step_end``; no evaluation, no checkpoint) |
| ``train_wall_s`` | cumulative ``step_ms`` in seconds since step 1, across resumes (compare's wall time) |
| ``skipped`` | the step was skipped for a non-finite loss or gradient |
| ``replica_slots`` | expert copies held per rank, mean over layers and ranks |
| ``keep_modes`` | per MoE layer: what its expert side kept to the backward (a ``KEEP_MODES`` name) |
| ``fwd_chunk_rows``, ``bwd_chunk_rows`` | under a cap: fewest rows computed at once, min over layers and ranks |
| ``kept_parts`` | kept by the row: shares of received rows keeping activations, gate/up, x alone |
| ``trim_ratio`` | per MoE layer, the noise objective: the ratio of its pairs its quotas took this step |
| ``variance_ratio`` | ... sampling noise over the minibatch gradient's squared norm, the step before (None at step 1) |
| ``minibatch_ratio`` | ... sampling noise over the minibatch's own noise (VCAS's ratio), the step before |
| ``memory_trimmed`` | ... memory or the network kept fewer pairs than ``trim_ratio`` |

``summary.json`` (rank 0, at the end): ``steps`` run, ``val`` (one ``{"step", "loss",
"moe_time_s"}`` per evaluation), ``moe_time_s``, ``wall_s``, ``train_wall_s``, ``unigram_loss`` (the corpus's
context-free loss), ``stopped_at_target``, ``status`` (``done``: ran its steps, ``reached``: stopped
at the target, ``oom``: a layer call did not fit the memory cap — then ``oom_step``, the
message ``oom`` and ``oom_during``, the phase: ``setup``, ``training step``, ``evaluation`` or
``checkpoint``; the metrics' last line is ``{"step", "oom", "during"}``, after the step's own
record where its evaluation did not fit: :mod:`lrmoe.train.oom`).
"""

from __future__ import annotations

import io
import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from lrmoe.models import MoETransformer
from lrmoe.passes.stages import STAGES
from lrmoe.train.groups import Groups, all_reduce


def step_metrics(model: MoETransformer, groups: Groups) -> dict:
    """This step's MoE record, reduced over ranks (times and memory: max; bytes: sum; loads over
    the data-parallel replicas); ``_counts`` carries the global routing counts for routing.npz."""
    stats = [layer.last_stats for layer in model.moe_layers]
    mx = torch.tensor([sum(s.get("fwd_ms", 0.0) for s in stats), sum(s.get("bwd_ms", 0.0) for s in stats),
                       max((s.get("peak_expert_side_bytes", 0) for s in stats), default=0)], dtype=torch.float64)
    sm = torch.tensor([sum(s.get("fwd_a2a_bytes", 0) + s.get("bwd_a2a_bytes", 0) for s in stats),
                       sum(s.get("placement_bytes", 0) for s in stats),
                       sum(s.get("bwd_a2a_bytes", 0) for s in stats),
                       sum(s.get("fwd_a2a_inter_bytes", 0) + s.get("bwd_a2a_inter_bytes", 0) for s in stats),
                       sum(s.get("replica_slots", 0) for s in stats) / max(len(stats), 1),
                       *_split_rows(stats),
                       *(sum(s.get("stage_ms", {}).get(k, 0.0) for s in stats) for k in STAGES),
                       sum(s.get("compacted_rows", 0) for s in stats)],
                      dtype=torch.float64)
    all_reduce(mx, groups.world_group, dist.ReduceOp.MAX)
    all_reduce(sm, groups.world_group)
    chunks = {**_fewest_rows_at_once(stats, groups), **_kept_parts(*sm[5:8].tolist())}
    counts = torch.stack([s["counts_E"].to(torch.float64) for s in stats]) if stats else torch.zeros(0, 1)
    kept = torch.stack([s["kept_E"].to(torch.float64) for s in stats]) if stats else torch.zeros(0, 1)
    both = torch.stack([counts, kept]) if stats else torch.zeros(2, 0, 1)
    all_reduce(both, groups.dp_group)  # EP-group counts summed over the data-parallel replicas
    counts, kept = both[0], both[1]
    mean = counts.mean(1).clamp(min=1e-9)
    return {
        "moe_fwd_ms": float(mx[0]), "moe_bwd_ms": float(mx[1]), "peak_expert_side_bytes": int(mx[2]),
        "a2a_bytes": int(sm[0]), "bwd_a2a_bytes": int(sm[2]), "placement_bytes": int(sm[1]),
        **({"a2a_inter_bytes": int(sm[3])} if any("fwd_a2a_inter_bytes" in s for s in stats) else {}),
        "kept_ratio": float(kept.sum() / counts.sum().clamp(min=1)),
        "load_min": counts.min(1).values.tolist(), "load_max": counts.max(1).values.tolist(),
        "load_cv": (counts.std(1, unbiased=False) / mean).tolist(),
        "replica_slots": float(sm[4]) / groups.world,  # mean over layers, then over ranks
        "moe_stage_ms": {k: round(float(v) / groups.world, 3) for k, v in zip(STAGES, sm[8:])},
        **({"compacted_rows": int(sm[-1])} if sm[-1] > 0 else {}),
        **({"keep_modes": [s["keep_mode"] for s in stats]} if all("keep_mode" in s for s in stats) and stats else {}),
        **chunks,
        **_noise(stats),
        "_counts": counts,
    }


def _noise(stats: list[dict]) -> dict:
    """The noise objective's figures per MoE layer (identical on every rank of a layer's group:
    every rank sums the same exchanged sums before the ratio is set)."""
    if not stats or not all("trim_ratio" in s for s in stats):
        return {}
    keys = ("trim_ratio", "variance_ratio", "minibatch_ratio", "memory_trimmed")
    return {k: [s.get(k) for s in stats] for k in keys}


def _fewest_rows_at_once(stats: list[dict], groups: Groups) -> dict:
    """``fwd_chunk_rows`` / ``bwd_chunk_rows``: the fewest rows any layer call computed at once,
    min over layers and ranks (collective where a capped call reported them: the same on every rank)."""
    keys = [k for k in ("fwd_chunk_rows", "bwd_chunk_rows") if any(k in s for s in stats)]
    if not keys:
        return {}
    none = float(2**62)
    fewest = torch.tensor([min((s[k] for s in stats if k in s), default=none) for k in keys], dtype=torch.float64)
    all_reduce(fewest, groups.world_group, dist.ReduceOp.MIN)
    return {k: int(v) for k, v in zip(keys, fewest.tolist())}


def _split_rows(stats: list[dict]) -> list[float]:
    """(rows keeping activations, rows keeping gate/up, all rows) of this rank's calls that kept by
    the row: summed into the step's one collective, whatever kept by the row where (a
    data-parallel replica's calls may split where another's fit whole)."""
    split = [s for s in stats if s.get("kept_acts_rows") is not None]
    return [float(sum(s[k] for s in split)) for k in ("kept_acts_rows", "kept_gate_up_rows", "recv_rows")]


def _kept_parts(acts: float, gate_up: float, total: float) -> dict:
    """``kept_parts``: of the rows received by calls that kept by the row (all layers and ranks),
    the shares that kept x and the activations, x and gate/up, x alone; none where no call did."""
    if total <= 0:
        return {}
    return {"kept_parts": [acts / total, gate_up / total, (total - acts - gate_up) / total]}


def read_metrics(folder: Path) -> list[dict]:
    """The records of ``folder/metrics.jsonl`` (none when the run wrote none)."""
    path = folder / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def grad_norm(model: MoETransformer, groups: Groups) -> float:
    """L2 norm of the reduced gradient of the whole model: replicated parameters once, and every
    expert once (its owner's or its shards' gradients summed over the expert-parallel group;
    the data-parallel replicas hold the same)."""
    experts = {id(p) for layer in model.moe_layers for p in layer.experts.parameters()}
    squares: dict[bool, list[torch.Tensor]] = {True: [], False: []}
    for p in model.parameters():
        if p.grad is not None:
            squares[id(p) in experts].append(p.grad.detach().float().square().sum())

    def total(xs: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(xs).sum().double().cpu().reshape(1) if xs else torch.zeros(1, dtype=torch.float64)

    expert_sq = all_reduce(total(squares[True]), groups.ep_group)
    return math.sqrt(float(total(squares[False])) + float(expert_sq))


def nonfinite(loss: torch.Tensor, norm: float, model: MoETransformer) -> bool:
    """Whether this rank's loss or gradient is not finite. A non-finite gradient makes the norm
    (:func:`grad_norm`) non-finite, so a finite norm settles it without a pass over every
    gradient (that pass cost 8 % of a step's wall time on the 2-core VM); a norm that overflowed
    from finite gradients is told apart by the pass itself."""
    if not torch.isfinite(loss).item():
        return True
    return not (math.isfinite(norm) or all(torch.isfinite(p.grad).all() for p in model.parameters()
                                           if p.grad is not None))


def val_entry(v) -> dict:
    """One evaluation of ``summary.json["val"]``; checkpoints of earlier versions hold
    (step, loss, moe_time_s) triples."""
    return v if isinstance(v, dict) else {"step": v[0], "loss": v[1], "moe_time_s": v[2]}


TENSORBOARD_MISSING = ("train.tensorboard = true needs the tensorboard package: "
                       "pip install 'lrmoe[tensorboard]' (or set train.tensorboard = false)")


def scalars(record: dict) -> dict[str, float]:
    """A metrics.jsonl record as TensorBoard scalars: numbers as they are, per-layer lists as
    ``name/layer{i}``; the step, flags and text left out."""
    out = {}
    for key, value in record.items():
        if key == "step" or isinstance(value, (bool, str)):
            continue
        if isinstance(value, (int, float)):
            out[key] = float(value)
        elif isinstance(value, list):
            out.update({f"{key}/layer{i}": float(v) for i, v in enumerate(value)})
    return out


class TensorBoardLog:
    """Every metrics.jsonl record also as TensorBoard scalars in ``out/tensorboard`` (rank 0,
    ``train.tensorboard = true``); a resumed run appends to the same folder."""

    def __init__(self, out: Path, writer=None) -> None:
        if writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise RuntimeError(TENSORBOARD_MISSING) from None
            writer = SummaryWriter(log_dir=str(out / "tensorboard"))
        self.writer = writer

    def log(self, record: dict) -> None:
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, record["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class Progress:
    """Progress on rank 0 through ``tqdm``: steps, smoothed step rate and ETA, loss, the last
    validation loss, learning rate and smoothed tokens/s. On a terminal one bar rewritten in
    place; otherwise (a log file) the bar's text as a line every tenth of the run."""

    def __init__(self, total: int, start: int, enabled: bool) -> None:
        self.total, self.enabled = total, enabled
        self.tty = sys.stderr.isatty()
        self.tok_s: float | None = None
        self.val: float | None = None
        self.bar = tqdm(total=total, initial=start, unit="step", smoothing=0.1, dynamic_ncols=True,
                        file=sys.stderr if self.tty else io.StringIO(), disable=not enabled, leave=True)

    def update(self, step: int, loss: float, tok_s: float, lr: float, val_loss: float | None = None) -> None:
        if not self.enabled:
            return
        self.tok_s = tok_s if self.tok_s is None else 0.9 * self.tok_s + 0.1 * tok_s
        if val_loss is not None:
            self.val = val_loss
        post = {"loss": f"{loss:.3f}", **({"val": f"{self.val:.3f}"} if self.val is not None else {}),
                "lr": f"{lr:.2e}", "tok/s": f"{self.tok_s:,.0f}"}
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(step - self.bar.n)
        if not self.tty and (step == self.total or step % max(self.total // 10, 1) == 0):
            print(str(self.bar), file=sys.stderr, flush=True)

    def write(self, message: str) -> None:
        """A message that does not break the bar."""
        if self.tty and self.enabled:
            self.bar.write(message, file=sys.stderr)
        else:
            print(message, file=sys.stderr, flush=True)

    def close(self) -> None:
        self.bar.close()
