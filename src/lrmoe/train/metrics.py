"""What a run records each step (``metrics.jsonl``), its progress line, and reading it back.

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
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from lrmoe.models import MoETransformer
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
                       sum(s.get("fwd_a2a_inter_bytes", 0) + s.get("bwd_a2a_inter_bytes", 0) for s in stats)],
                      dtype=torch.float64)
    all_reduce(mx, groups.world_group, dist.ReduceOp.MAX)
    all_reduce(sm, groups.world_group)
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
        "_counts": counts,
    }


def read_metrics(folder: Path) -> list[dict]:
    """The records of ``folder/metrics.jsonl`` (none when the run wrote none)."""
    path = folder / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


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
