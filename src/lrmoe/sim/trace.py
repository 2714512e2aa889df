"""Routing counts for the simulator: a trace recorded by ``lrmoe train``, or a skew model.

A trace is ``routing.npz`` from a train run's out dir: ``counts``, float32 (steps, moe_layers,
experts), the global pairs routed to each expert in each step. A small model's trace has few
experts (16 in configs/compare.toml) and few tokens; :func:`rescale_counts` maps each step's
load *shares* onto the target model's experts and token count:

- expert axis: trace expert i covers the interval [i/E_t, (i+1)/E_t) of a continuous expert
  axis and its share is spread evenly over it; target expert j takes the share of its own
  interval [j/E, (j+1)/E). For E a multiple of E_t each trace expert becomes E/E_t equally
  loaded experts. This keeps the imbalance (max/mean load), its drift from step to step and its
  layer-to-layer differences; it invents no finer skew than the trace has.
- token axis: counts = shares × tokens × top_k, rounded by largest remainder so the total is
  exactly tokens × top_k, with no expert above ``tokens`` (a token picks an expert at most once;
  excess is handed to the others in proportion to their shares).

Without a trace, :func:`zipf_counts` draws the documented skew model: shares ∝ 1/rank^s
(Zipf) over a per-layer random order of experts, drifting over steps by ``drift`` random
adjacent swaps of that order per step.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lrmoe.sim.errors import SimError


def load_trace(path: str | Path) -> np.ndarray:
    """``counts`` (steps, layers, experts) float64 from a ``routing.npz``; clear errors otherwise."""
    p = Path(path)
    if not p.is_file():
        raise SimError(f"trace {str(p)!r} not found (expected routing.npz from an `lrmoe train` run)")
    try:
        with np.load(p) as z:
            counts = np.asarray(z["counts"], dtype=np.float64)
    except KeyError:
        raise SimError(f"trace {str(p)!r} has no 'counts' array") from None
    except (OSError, ValueError) as e:
        raise SimError(f"trace {str(p)!r} is not a readable .npz file: {e}") from None
    if counts.ndim != 3 or 0 in counts.shape:
        raise SimError(f"trace {str(p)!r}: counts has shape {counts.shape}, expected (steps, layers, experts)")
    if not np.isfinite(counts).all() or (counts < 0).any() or (counts.sum(-1) <= 0).any():
        raise SimError(f"trace {str(p)!r}: counts must be finite, non-negative, with pairs in every step and layer")
    return counts


def _spread(shares_Et: np.ndarray, num_experts: int) -> np.ndarray:
    """Shares of E_t trace experts → shares of ``num_experts`` by interval overlap."""
    Et = shares_Et.size
    edges_t = np.linspace(0.0, 1.0, Et + 1)
    edges = np.linspace(0.0, 1.0, num_experts + 1)
    cum_t = np.concatenate([[0.0], np.cumsum(shares_Et)])
    cum = np.interp(edges, edges_t, cum_t)  # the share curve is piecewise linear in the axis
    return np.diff(cum)


def _integerise(shares_E: np.ndarray, total: int, cap: int) -> np.ndarray:
    """Non-negative ints summing to ``total``, each ≤ ``cap``, close to shares × total."""
    E = shares_E.size
    if total > cap * E:
        raise SimError(f"{total} pairs cannot fit {E} experts with at most {cap} each")
    target = shares_E / shares_E.sum() * total
    for _ in range(E):  # water-fill: clip at cap, hand excess to the unclipped in proportion
        over = target > cap
        if not over.any():
            break
        excess = (target[over] - cap).sum()
        target[over] = cap
        free = ~over & (target < cap)
        target[free] += excess * target[free] / target[free].sum() if target[free].sum() > 0 else excess / free.sum()
    counts = np.floor(target).astype(np.int64)
    counts = np.minimum(counts, cap)
    short = total - int(counts.sum())
    if short:
        rem = np.where(counts < cap, target - counts, -1.0)
        order = np.lexsort((np.arange(E), -rem))  # largest remainder first, lower id on ties
        counts[order[:short]] += 1
    return counts


def rescale_counts(counts_Et: np.ndarray, num_experts: int, tokens: int, top_k: int) -> np.ndarray:
    """One step-layer of trace counts → int64 counts for ``num_experts`` experts that sum to
    exactly ``tokens · top_k``, none above ``tokens``."""
    shares = np.asarray(counts_Et, dtype=np.float64)
    shares = shares / shares.sum()
    return _integerise(_spread(shares, num_experts), tokens * top_k, tokens)


def zipf_counts(steps: int, layers: int, num_experts: int, tokens: int, top_k: int, exponent: float = 1.0,
                drift: int = 4, seed: int = 0) -> np.ndarray:
    """Skew model: (steps, layers, E) int64 counts, Zipf(exponent) shares over a per-layer
    random expert order that drifts by ``drift`` adjacent swaps per step (seeded)."""
    rng = np.random.default_rng(seed)
    zipf = 1.0 / np.arange(1, num_experts + 1) ** exponent
    out = np.zeros((steps, layers, num_experts), np.int64)
    for layer in range(layers):
        order = rng.permutation(num_experts)  # order[i]: expert with popularity rank i
        for step in range(steps):
            for _ in range(drift):
                i = int(rng.integers(num_experts - 1))
                order[i], order[i + 1] = order[i + 1], order[i]
            shares = np.empty(num_experts)
            shares[order] = zipf
            out[step, layer] = _integerise(shares, tokens * top_k, tokens)
    return out


def split_sources(counts_E: np.ndarray, world: int) -> np.ndarray:
    """(world, E) int64: each expert's pairs split evenly over the source ranks (every rank's
    tokens follow the same routing distribution), remainders to the lowest ranks."""
    base, extra = np.divmod(np.asarray(counts_E, dtype=np.int64), world)
    return base[None, :] + (np.arange(world)[:, None] < extra[None, :]).astype(np.int64)


def pick_layers(available: int, wanted: int) -> list[int]:
    """``wanted`` representative layer indices spread evenly over ``available``."""
    wanted = max(1, min(wanted, available))
    return sorted({int(round(i)) for i in np.linspace(0, available - 1, wanted)})
