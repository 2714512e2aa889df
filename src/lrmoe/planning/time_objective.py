"""The controller's time objective: trim a call's backward where that shortens the time to target.

Memory and the network decide what a backward *can* keep; this decides what it *should* keep
(``BackwardConfig(objective="time")``, docs/design.md "Controller"). Two measured effects pull
against each other:

- **Steps.** Dropping pairs adds variance to the expert-weight gradients, so the model needs
  more steps to the target. The convergence study (docs/convergence.md) fits it as
  ``steps(ρ) ≈ 1 + drop_cost · (1 − ρ)`` for the pairs kept, ρ, down to ``min_ratio``, below
  which it was not measured to hold (the guard).
- **Time per step.** A call's MoE time is its slowest rank's expert GEMM work, in passes over a
  row: three forward passes (gate, up, down) per forward row; a backward pass per kept row of
  each of its GEMMs — six with x and the activations kept, eight where gate and up are
  recomputed (x kept), nine where x travels to the expert side again (nothing kept); and
  ``FIXED_PASSES`` per forward row for what no kept ratio shrinks (the router's gradient, dy's
  packing, dx's scatter, the gradient buffers: about 8 % of static's backward in
  ``benchmarks/bench_backward.py``). Trimming can also let a capped rank keep x and the
  activations where an exact backward must recompute them, which is where it pays most.

The objective picks, among the ratios 1, 1 − ``RATIO_STEP``, … down to ``min_ratio``, the quotas
(each the memory controller's, capped at that ratio) with the least ``steps × work``. Within one
keep mode both factors are linear in ρ, so their product is concave and its least value sits
at an end of a keep mode's interval; the grid finds those ends to within a step. Ties keep more.
Everything is read from the call's forward plan, so every rank picks the same quotas.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lrmoe.config import KEEP_NOTHING, KEEP_X, KEEP_X_ACTS, KEEP_X_GATE_UP, BackwardConfig
from lrmoe.planning.quota_ratio import fixed_ratio_quota

FORWARD_PASSES = 3.0
BACKWARD_PASSES = {KEEP_X_ACTS: 6.0, KEEP_X_GATE_UP: 6.0, KEEP_X: 8.0, KEEP_NOTHING: 9.0}
FIXED_PASSES = 0.5  # per forward row: the backward's work no kept ratio shrinks (~8 % of static's 6 passes)
RATIO_STEP = 0.05


def call_work(rows_ER: torch.Tensor, quota_E: torch.Tensor, keep: str) -> float:
    """The slowest rank's expert work in row passes when each expert keeps ``quota_E`` pairs,
    spread over its holders in proportion to their forward rows (``rows_ER``: the forward's rows
    of expert e on rank r), as a local selection's strata split them."""
    return float(calls_work(rows_ER, quota_E.view(1, -1), [keep])[0])


def calls_work(rows_ER: torch.Tensor, quota_CE: torch.Tensor, keeps: list[str]) -> torch.Tensor:
    """:func:`call_work` of C candidates at once: their quotas (C, E) and keep modes; (C,) float64."""
    rows_ER = rows_ER.to(torch.float64)
    fwd_R = rows_ER.sum(0)
    share_CE = quota_CE.to(torch.float64) / rows_ER.sum(1).clamp(min=1.0)
    bwd_CR = (rows_ER.unsqueeze(0) * share_CE.unsqueeze(2)).sum(1)
    passes_C = torch.tensor([BACKWARD_PASSES[k] for k in keeps], dtype=torch.float64, device=rows_ER.device)
    return ((FORWARD_PASSES + FIXED_PASSES) * fwd_R + passes_C.view(-1, 1) * bwd_CR).amax(1)


def candidate_ratios(min_ratio: float) -> list[float]:
    """1, 1 − RATIO_STEP, … and ``min_ratio`` itself, never below it."""
    n = int((1.0 - min_ratio) / RATIO_STEP + 1e-9)
    return sorted({*(round(1.0 - i * RATIO_STEP, 10) for i in range(n + 1)), min_ratio}, reverse=True)


def fastest_quotas(counts_E: torch.Tensor, rows_ER: torch.Tensor, quota_E: torch.Tensor,
                   keep_of: Callable[[torch.Tensor], str], cfg: BackwardConfig) -> tuple[torch.Tensor, str]:
    """(quotas, keep mode) with the least predicted time to target, each candidate ``quota_E``
    (what memory, the network and the ratio allow) capped at a ratio of ``counts_E``;
    ``keep_of``: the keep mode a candidate's quotas leave room for. Every candidate is priced in
    one pass (a few tensor operations a call, not a dozen)."""
    q_CE = torch.minimum(quota_E, fixed_ratio_quota(counts_E, candidate_ratios(cfg.min_ratio)))
    fresh_C = torch.ones(len(q_CE), dtype=torch.bool, device=q_CE.device)
    fresh_C[1:] = (q_CE[1:] != q_CE[:-1]).any(1)  # a ratio whose quotas equal the one before adds nothing
    q_CE = q_CE[fresh_C]
    keeps = keep_modes(list(q_CE), keep_of)
    total = float(counts_E.sum())
    kept_C = q_CE.sum(1).to(torch.float64)
    dropped_C = 1.0 - kept_C / total if total else torch.zeros_like(kept_C)  # no pairs: none dropped
    predicted = ((1.0 + cfg.drop_cost * dropped_C) * calls_work(rows_ER, q_CE, keeps)).tolist()
    best = 0
    for c in range(1, len(predicted)):  # ties keep more: a later candidate must be faster by more than rounding
        if predicted[c] < predicted[best] * (1 - 1e-9):
            best = c
    return q_CE[best], keeps[best]


def keep_modes(candidates: list[torch.Tensor], keep_of: Callable[[torch.Tensor], str]) -> list[str]:
    """``keep_of`` of every candidate, asked only at the ends of each run of equal modes (found by
    bisection): each candidate keeps at most the pairs of the one before it, expert by expert,
    so it never leaves less room for what the expert side keeps — the mode can only get richer
    along the list. A call whose candidates all allow one mode asks twice, not once per ratio."""
    modes: list[str | None] = [None] * len(candidates)

    def fill(lo: int, hi: int) -> None:  # modes[lo] and modes[hi] known
        if modes[lo] == modes[hi]:
            modes[lo + 1 : hi] = [modes[lo]] * (hi - lo - 1)
        elif hi - lo > 1:
            mid = (lo + hi) // 2
            modes[mid] = keep_of(candidates[mid])
            fill(lo, mid)
            fill(mid, hi)

    modes[0] = keep_of(candidates[0])
    modes[-1] = keep_of(candidates[-1]) if len(candidates) > 1 else modes[0]
    fill(0, len(candidates) - 1)
    return modes  # type: ignore[return-value]


__all__ = ["BACKWARD_PASSES", "FIXED_PASSES", "FORWARD_PASSES", "RATIO_STEP", "call_work", "calls_work",
           "candidate_ratios", "fastest_quotas", "keep_modes"]
