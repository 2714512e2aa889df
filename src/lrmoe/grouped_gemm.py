"""The one grouped-GEMM seam every expert product goes through (:mod:`lrmoe.experts` uses it;
tests intercept its two public names to count the rows each call processed).

Two products cover every expert GEMM:

    grouped_mm(a_RK, b_LKN, counts_L)       rows of group l times b[l]        -> (R, N)
    grouped_mm_wgrad(a_RM, b_RN, counts_L)  a_lᵀ · b_l, reduction over rows   -> (L, M, N)

Group l's rows are consecutive, the groups one after another, unless an operand's rows start
elsewhere (``*_starts_L``: the first row of each group in that operand): a backward that
compacted its saved rows in place leaves a gap after each group (:mod:`lrmoe.passes.compaction`).
The rows a call processes are Σ counts_L.
"""

from __future__ import annotations

import torch

from lrmoe.parallel.comm import to_device

_GROUPED_MM = getattr(torch, "_grouped_mm", None)


def _aligned(t: torch.Tensor) -> bool:
    """``_grouped_mm`` needs every non-unit stride 16-byte aligned (leading dims, batch stride)."""
    step = 16 // t.element_size()
    return all(s == 1 or s % step == 0 for s in t.stride())


def _use_grouped_mm(a: torch.Tensor, b: torch.Tensor, wgrad: bool, into: bool) -> bool:
    """Pick the kernel per call: fused grouped GEMM where it is supported and at least as fast.

    On CUDA the fused kernel avoids one launch per expert and any host read of the counts. On
    CPU it is a loop of GEMMs inside ATen: measured equal to our loop for row-grouped products
    and ~15% slower for the weight gradient (bench_layer shape, one thread), and it cannot
    write into a given buffer (``into``), which on CPU costs a fresh, page-faulting
    allocation plus a copy. So the CPU takes the loop for weight gradients and for products
    written into existing buffers.
    """
    if _GROUPED_MM is None or a.dtype != b.dtype or not (_aligned(a) and _aligned(b)):
        return False
    if a.device.type == "cuda":
        return a.dtype == torch.bfloat16 and torch.cuda.get_device_capability(a.device) >= (9, 0)
    return not (wgrad or into)


def _offsets(counts_L: torch.Tensor, device: torch.device) -> torch.Tensor:
    return to_device(counts_L.cumsum(0).to(torch.int32), device)


Slots = torch.Tensor | tuple[torch.Tensor, ...]  # (L, ·, ·) slot weights, or several sets one after another


def _starts(counts_L: torch.Tensor, starts_L: torch.Tensor | None) -> list[int]:
    """First row of each group: as given, or the groups back to back."""
    if starts_L is not None:
        return starts_L.tolist()
    return (counts_L.cumsum(0) - counts_L).tolist()


def _first(w: Slots) -> torch.Tensor:
    return w if isinstance(w, torch.Tensor) else w[0]


def _segments(counts_L: torch.Tensor, sets: tuple[torch.Tensor, ...]) -> list[tuple[int, int, torch.Tensor]]:
    """(first row, end row, counts of its slots) of each weight set's rows, back to back."""
    out, r0 = [], 0
    for l0, l1 in _sets(sets):
        c = counts_L[l0:l1]
        n = int(c.sum())
        out.append((r0, r0 + n, c))
        r0 += n
    return out


def _sets(sets: tuple[torch.Tensor, ...]) -> list[tuple[int, int]]:
    """(first slot, end slot) of each weight set: their slots follow one another."""
    ends = torch.tensor([w.shape[0] for w in sets]).cumsum(0).tolist()
    return list(zip([0] + ends[:-1], ends))


def grouped_mm(
    a_RK: torch.Tensor,
    b_LKN: Slots,
    counts_L: torch.Tensor,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    a_starts_L: torch.Tensor | None = None,
    out_starts_L: torch.Tensor | None = None,
) -> torch.Tensor:
    """Row-grouped product: rows of group l (``counts_L[l]`` rows) times ``b_LKN[l]``.

    ``b_LKN`` may be several weight sets (the owned experts' parameters, then the replicas'
    buffers): their slots follow one another, each set's rows are multiplied by it, and the
    sets are never concatenated (no second copy of the owned weights). ``out`` receives the
    result (``accumulate``: added to what it holds). ``a_starts_L`` / ``out_starts_L``: where
    each group's rows start in ``a`` / ``out`` (None: back to back)."""
    gapped = a_starts_L is not None or out_starts_L is not None
    if not gapped and isinstance(b_LKN, torch.Tensor) and a_RK.shape[0] \
            and _use_grouped_mm(a_RK, b_LKN, wgrad=False, into=out is not None):
        res = _GROUPED_MM(a_RK, b_LKN, offs=_offsets(counts_L, a_RK.device))
        if out is None:
            return res
        return out.add_(res) if accumulate else out.copy_(res)
    if out is None:
        out = a_RK.new_empty(int(counts_L.sum()), _first(b_LKN).shape[-1])
    if not gapped and isinstance(b_LKN, tuple):  # each set over its own rows, fused where it may be
        for (r0, r1, c), b in zip(_segments(counts_L, b_LKN), b_LKN):
            grouped_mm(a_RK[r0:r1], b, c, out[r0:r1], accumulate)
        return out
    sets = (b_LKN,) if isinstance(b_LKN, torch.Tensor) else b_LKN
    a0, o0, n_L = _starts(counts_L, a_starts_L), _starts(counts_L, out_starts_L), counts_L.tolist()
    for (l0, l1), b in zip(_sets(sets), sets):
        for l in range(l0, l1):
            n = n_L[l]
            if not n:
                continue
            rows, a_l = out[o0[l] : o0[l] + n], a_RK[a0[l] : a0[l] + n]
            if accumulate:
                rows.addmm_(a_l, b[l - l0])
            else:
                torch.mm(a_l, b[l - l0], out=rows)
    return out


def grouped_mm_wgrad(
    a_RM: torch.Tensor, b_RN: torch.Tensor, counts_L: torch.Tensor, out: Slots | None = None,
    accumulate: bool = False, a_starts_L: torch.Tensor | None = None, b_starts_L: torch.Tensor | None = None,
) -> Slots:
    """Per-group reduction over rows: out[l] = a_lᵀ · b_l (a weight gradient), zeros if empty.

    ``out`` several sets (:func:`grouped_mm`'s): each set's gradients from its rows.
    ``accumulate``: added to what ``out`` holds (a chunked backward's partial sums), group by
    group with no full-size temporary, so groups without rows keep their value.
    ``a_starts_L`` / ``b_starts_L``: where each group's rows start (None: back to back)."""
    gapped = a_starts_L is not None or b_starts_L is not None
    if not gapped and isinstance(out, tuple):  # each set's gradients from its own rows
        for (r0, r1, c), o in zip(_segments(counts_L, out), out):
            grouped_mm_wgrad(a_RM[r0:r1], b_RN[r0:r1], c, o, accumulate)
        return out
    if (not gapped and a_RM.shape[0] and not accumulate
            and _use_grouped_mm(a_RM.t(), b_RN, wgrad=True, into=out is not None)):
        res = _GROUPED_MM(a_RM.t(), b_RN, offs=_offsets(counts_L, a_RM.device))
        return res if out is None else out.copy_(res)
    if out is None:
        out = a_RM.new_empty(counts_L.numel(), a_RM.shape[1], b_RN.shape[1])
    sets = (out,) if isinstance(out, torch.Tensor) else out
    a0, b0, n_L = _starts(counts_L, a_starts_L), _starts(counts_L, b_starts_L), counts_L.tolist()
    for (l0, l1), o in zip(_sets(sets), sets):
        for l in range(l0, l1):
            n, o_l = n_L[l], o[l - l0]
            if n and accumulate:
                o_l.addmm_(a_RM[a0[l] : a0[l] + n].t(), b_RN[b0[l] : b0[l] + n])
            elif n:
                torch.mm(a_RM[a0[l] : a0[l] + n].t(), b_RN[b0[l] : b0[l] + n], out=o_l)
            elif not accumulate:
                o_l.zero_()
    return out
