"""Which ranks hold which experts, in the forms the planners walk (per expert, per rank, and as
(expert, holder) entries end to end), and the one move every planner's flow starts with: rows
of an expert onto its holders' free room, lowest rank first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import chain

import numpy as np


def experts_of_ranks(holders: list[list[int]], ranks: int) -> list[list[int]]:
    """The inverse of ``holders`` (expert → ranks holding it): rank → experts it holds, ascending."""
    out: list[list[int]] = [[] for _ in range(ranks)]
    for e, hs in enumerate(holders):
        for r in hs:
            out[r].append(e)
    return out


def holder_lists_of(holders: Sequence[Sequence[int]]) -> list[list[int]]:
    """Each expert's holders as a sorted list of distinct ints: the given lists themselves when
    they already are (as :attr:`Placement.holder_lists` are; callers must not modify them)."""
    for hs in holders:
        if type(hs) is not list:
            break
        prev = -1 << 62
        for r in hs:
            if type(r) is not int or r <= prev:
                break
            prev = r
        else:
            continue
        break
    else:
        return holders if type(holders) is list else list(holders)
    return [sorted({int(r) for r in hs}) for hs in holders]


@dataclass(frozen=True, eq=False)
class HolderIndex:
    """Each expert's holders in the forms the planners walk: per expert and per rank as lists,
    and as (expert, holder) entries end to end (experts ascending, then ranks). A
    :class:`~lrmoe.planning.placement.Placement` builds its own once (``placement.holder_index``), so a
    layer call that plans several times over one placement indexes it once."""

    lists: list[list[int]]  # expert → its holders, ascending
    of_rank: list[list[int]]  # rank → experts it holds, ascending
    expert_H: np.ndarray  # int64 (H,): the expert of entry h
    rank_H: np.ndarray  # int64 (H,): the holder of entry h
    world: int

    @staticmethod
    def build(holders: Sequence[Sequence[int]], world: int) -> HolderIndex:
        lists = holder_lists_of(holders)
        sizes = [len(hs) for hs in lists]
        rank_H = np.fromiter(chain.from_iterable(lists), np.int64, sum(sizes))
        expert_H = np.repeat(np.arange(len(sizes)), sizes)
        in_range = not len(rank_H) or (rank_H.min() >= 0 and rank_H.max() < world)
        of_rank = experts_of_ranks(lists, world) if in_range else []  # out of range: the planner says so
        return HolderIndex(lists, of_rank, expert_H, rank_H, world)

    @cached_property
    def sizes_E(self) -> np.ndarray:
        return np.bincount(self.expert_H, minlength=len(self.lists))

    @cached_property
    def starts_E(self) -> np.ndarray:
        """Each expert's first entry (of its holders end to end)."""
        return np.cumsum(self.sizes_E) - self.sizes_E


def holder_index(holders: Sequence[Sequence[int]] | HolderIndex, world: int) -> HolderIndex:
    """``holders`` indexed for ``world`` ranks (itself when it already is)."""
    if isinstance(holders, HolderIndex) and holders.world == world:
        return holders
    return HolderIndex.build(holders.lists if isinstance(holders, HolderIndex) else holders, world)


def fill_holders(flow_e: list[int], rows: int, holders_e: list[int], slack: list[int]) -> int:
    """Put up to ``rows`` rows of one expert on its holders in rank order, each taking what its
    ``slack`` allows (``flow_e[r]``: the expert's rows on rank r); returns the rows left over."""
    for r in holders_e:
        k = slack[r]
        if k > 0:
            d = rows if rows < k else k
            flow_e[r] += d
            slack[r] = k - d
            rows -= d
            if not rows:
                break
    return rows
