"""The few array operations where NumPy and torch differ, so that each selection is written once
and runs on either.

A selection is a few dozen small vector operations over a rank's pairs. On the CPU, torch
spends ~10 µs of dispatch on each (a default backward dispatched ~275 selection ops, more than
the GEMM rows it saved at small shapes); NumPy spends about a tenth of that on the same
arithmetic. So a CPU tensor is viewed as a NumPy array (no copy) for the selection and the
result viewed back as a tensor, while a device tensor stays a tensor and never leaves the
device (docs/performance.md "Host reads"). Operators, indexing, ``where``, ``minimum``,
``maximum``, ``ceil``, ``cumsum(0)`` and ``clip`` are spelt alike in both libraries; what is
not is here.
"""

from __future__ import annotations

import numpy as np
import torch

Array = np.ndarray | torch.Tensor


def on_host(t: torch.Tensor) -> Array:
    """A CPU tensor as a NumPy view (shared memory; bfloat16, which NumPy lacks, as a float32
    copy); a device tensor as it is."""
    if t.device.type != "cpu":
        return t
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


def as_tensor(a: Array) -> torch.Tensor:
    """Inverse of :func:`on_host`: a NumPy array as a tensor view."""
    return torch.from_numpy(np.ascontiguousarray(a)) if isinstance(a, np.ndarray) else a


def xp(a: Array):
    """The library ``a`` belongs to (``numpy`` or ``torch``), for the functions spelt alike."""
    return np if isinstance(a, np.ndarray) else torch


def float64(a: Array) -> Array:
    return a.astype(np.float64, copy=False) if isinstance(a, np.ndarray) else a.to(torch.float64)


def int64(a: Array) -> Array:
    return a.astype(np.int64, copy=False) if isinstance(a, np.ndarray) else a.long()


def arange(n: int, like: Array) -> Array:
    return np.arange(n) if isinstance(like, np.ndarray) else torch.arange(n, device=like.device)


def zeros(n: int, like: Array, dtype: str | np.dtype | torch.dtype = "float64") -> Array:
    """``n`` zeros of ``dtype`` (a name such as ``"bool"``, or either library's dtype of ``like``)
    beside ``like``."""
    if isinstance(like, np.ndarray):
        return np.zeros(n, dtype=dtype)
    return torch.zeros(n, dtype=getattr(torch, dtype) if isinstance(dtype, str) else dtype, device=like.device)


def segment_sum(values: Array, groups: Array, G: int) -> Array:
    """Per-group sums of ``values`` (float64 or int64, kept) over ``G`` groups (no device→host
    read: torch's ``bincount`` would read the largest group)."""
    if isinstance(values, np.ndarray):
        out = np.bincount(groups, weights=values, minlength=G)
        return out if values.dtype == np.float64 else out.astype(values.dtype)
    return torch.zeros(G, dtype=values.dtype, device=values.device).index_add_(0, groups, values)


def block_sum(values: Array, sizes_G: Array) -> Array:
    """:func:`segment_sum` of a block-sorted vector (blocks of ``sizes_G`` elements, end to end).
    On the host one ``add.reduceat`` over the blocks' starts, about a fifth of ``bincount``'s
    time (which reads a group id and scatters per element); its order of summation differs,
    so a sum may differ in its last bit."""
    if not isinstance(values, np.ndarray):
        return segment_sum(values, expand(arange(len(sizes_G), values), sizes_G, len(values)), len(sizes_G))
    out = np.zeros(len(sizes_G), dtype=values.dtype)
    filled = sizes_G > 0
    if filled.any():  # (reduceat reads one element at each start: the empty blocks' would be the next's)
        out[filled] = np.add.reduceat(values, (sizes_G.cumsum() - sizes_G)[filled])
    return out


def expand(values_G: Array, sizes_G: Array, n: int) -> Array:
    """Each block's value repeated over its ``sizes_G`` elements (``values_G[g]`` for the
    block-sorted ids g, ``n`` = Σ sizes_G): on the host ``repeat``, about half the gather's time;
    on a device ``repeat_interleave`` with its output size given, so nothing is read back."""
    if isinstance(values_G, np.ndarray):
        return np.repeat(values_G, sizes_G)
    return torch.repeat_interleave(values_G, sizes_G, output_size=n)


def count_at_most(sorted_keys: Array, queries: Array) -> Array:
    """Per query, how many of the ascending ``sorted_keys`` are ≤ it (``searchsorted``, right side)."""
    if isinstance(sorted_keys, np.ndarray):
        return np.searchsorted(sorted_keys, queries, side="right")
    return torch.searchsorted(sorted_keys, queries.contiguous(), right=True)


def order_by_group_then_key(groups: Array, key: Array) -> Array:
    """Indices sorted by (group asc, key desc, index asc): by key, then a stable sort by group
    (on the host a radix sort of small integers, nearly free). On the host the sort by key is
    NumPy's vectorised quicksort, about six times its stable sort; it is redone stably only when
    the key has ties, whose order the quicksort leaves open."""
    if isinstance(key, np.ndarray):
        by_key = np.argsort(-key)
        ranked = key[by_key]
        if len(ranked) > 1 and bool((ranked[1:] == ranked[:-1]).any()):
            by_key = np.argsort(-key, kind="stable")
        g = groups[by_key]
        narrow = g.astype(np.int16) if len(g) and int(g.max()) < 2**15 else g
        return by_key[np.argsort(narrow, kind="stable")]
    by_key = torch.argsort(key, descending=True, stable=True)
    return by_key[torch.argsort(groups[by_key], stable=True)]


def position_in_block(sorted_groups: Array, sizes_G: Array) -> Array:
    """For ids sorted into consecutive blocks, each element's position inside its block."""
    starts = sizes_G.cumsum(0) - sizes_G
    return arange(len(sorted_groups), sorted_groups) - expand(starts, sizes_G, len(sorted_groups))


def group_sizes(groups_P: Array, G: int) -> Array:
    """Members of each of G groups (``bincount`` without its device→host read of the maximum)."""
    if isinstance(groups_P, np.ndarray):
        return np.bincount(groups_P, minlength=G)
    return segment_sum(torch.ones_like(groups_P), groups_P, G)


def segment_cumsum(x: Array, sizes_G: Array) -> tuple[Array, Array]:
    """Inclusive and exclusive cumulative sums inside each block of a block-sorted vector
    (blocks of ``sizes_G`` elements, end to end)."""
    total = x.cumsum(0)
    before = xp(x).concatenate([zeros(1, total, total.dtype), total])  # before[i]: Σ x[:i]
    incl = total - expand(before[sizes_G.cumsum(0) - sizes_G], sizes_G, len(x))
    return incl, incl - x


def scatter_pairs(values_N: torch.Tensor, pairs_N: torch.Tensor, P: int) -> torch.Tensor:
    """A tensor over all ``P`` pairs holding ``values_N`` at ``pairs_N``, zero (False) elsewhere."""
    v, pairs = on_host(values_N), on_host(pairs_N)
    out = zeros(P, v, v.dtype)
    out[pairs] = v
    return as_tensor(out)
