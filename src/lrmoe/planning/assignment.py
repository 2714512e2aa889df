"""Where each token–expert pair is computed: pairs of expert e from source rank s computed at
rank r, stored per (expert, holder) entry.

The dense form ``assign_ESR`` (E, S, R) is mostly zeros: only an expert's holders compute its
pairs. At 128 experts × 64 ranks it is 4 MiB of int64 a layer call, at 256 × 256 128 MiB, and
allocating, zeroing and summing it cost more than planning the assignment itself. Here each
(expert, holder) entry h carries its row of sources ``rows_HS[h]`` (the H dimension: entries of
an assignment): with a few holders an expert, a few·E·S numbers instead of E·S·R. Every rank
builds the same one after the count exchange; the row plans read their own rank's slices of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch


@dataclass(frozen=True, eq=False)
class PairAssignment:
    """``rows_HS[h, s]``: pairs of expert ``expert_H[h]`` from source rank s computed at rank
    ``rank_H[h]``. Entries are distinct (expert, rank), ordered by expert then rank; an entry may
    carry no rows (a holder that computes none of the call's pairs)."""

    expert_H: np.ndarray  # int64 (H,)
    rank_H: np.ndarray  # int64 (H,)
    rows_HS: np.ndarray  # int64 (H, S)
    num_experts: int

    @property
    def world(self) -> int:
        return self.rows_HS.shape[1]

    @staticmethod
    def from_dense(assign_ESR: torch.Tensor) -> PairAssignment:
        """The entries of a dense (E, S, R) assignment that carry rows."""
        A = np.asarray(assign_ESR, dtype=np.int64)
        expert_H, rank_H = np.nonzero(A.sum(1))
        return PairAssignment(expert_H, rank_H, np.ascontiguousarray(A[expert_H, :, rank_H]), A.shape[0])

    def dense(self) -> torch.Tensor:
        """int64 ``assign_ESR`` (E, S, R)."""
        out = np.zeros((self.num_experts, self.world, self.world), np.int64)
        out[self.expert_H, :, self.rank_H] = self.rows_HS
        return torch.from_numpy(out)

    @cached_property
    def _sizes_E(self) -> np.ndarray:
        """Entries of each expert."""
        return np.bincount(self.expert_H, minlength=self.num_experts)

    @cached_property
    def _first_E(self) -> np.ndarray:
        """Index of each expert's first entry."""
        return np.cumsum(self._sizes_E) - self._sizes_E

    @cached_property
    def rows_H(self) -> np.ndarray:
        """Pairs each entry computes, over every source."""
        return self.rows_HS.sum(1)

    def rows_ER(self) -> torch.Tensor:
        """int64 (E, R): pairs of expert e computed at rank r."""
        out = np.zeros((self.num_experts, self.world), np.int64)
        out[self.expert_H, self.rank_H] = self.rows_H
        return torch.from_numpy(out)

    def rows_R(self) -> list[int]:
        """Pairs each rank computes."""
        return np.bincount(self.rank_H, self.rows_H, self.world).astype(np.int64).tolist()

    def rows_SR(self) -> torch.Tensor:
        """int64 (S, R): pairs source s sends to rank r, over every expert."""
        out = np.zeros((self.world, self.world), np.int64)
        np.add.at(out.T, self.rank_H, self.rows_HS)
        return torch.from_numpy(out)

    def sent_ER(self, source: int) -> torch.Tensor:
        """int64 (E, R): pairs of expert e from ``source`` computed at rank r."""
        out = np.zeros((self.num_experts, self.world), np.int64)
        out[self.expert_H, self.rank_H] = self.rows_HS[:, source]
        return torch.from_numpy(out)

    def received_SL(self, rank: int, experts: list[int] | tuple[int, ...]) -> torch.Tensor:
        """int64 (S, len(experts)): pairs of each of ``experts`` from source s computed at
        ``rank`` (zero for an expert the rank computes none of)."""
        out = np.zeros((len(experts), self.world), np.int64)
        at = np.flatnonzero(self.rank_H == rank)
        slot = {e: i for i, e in enumerate(experts)}
        for h, e in zip(at.tolist(), self.expert_H[at].tolist()):
            if e in slot:
                out[slot[e]] = self.rows_HS[h]
        return torch.from_numpy(out.T.copy())

    def restricted(self, kept_SE: torch.Tensor | np.ndarray) -> PairAssignment:
        """The kept pairs computed where this assignment computed them: each (source s,
        expert e)'s ``kept_SE[s, e]`` pairs split over e's entries in proportion to the rows
        each computed from s — floors, then one more for the largest remainders (ties: the
        earlier entry, i.e. the lower rank). Integer arithmetic, so every rank derives the
        same split from the plan alone. ``kept_SE`` may not exceed the assigned pairs."""
        return PairAssignment(self.expert_H, self.rank_H, self.kept_rows(kept_SE)[1], self.num_experts)

    def kept_rows(self, kept_SE: torch.Tensor | np.ndarray, experts: np.ndarray | None = None,
                  sources: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`restricted` for the entries of ``experts`` (distinct; default all) from ``sources``
        (default all): (those entries' indices, their kept rows (entries, sources)). A rank needs
        only its own source's column and its own experts' entries: O(H + its entries · S)."""
        sizes_E = self._sizes_E
        chosen = np.flatnonzero(sizes_E) if experts is None else np.sort(np.asarray(experts, dtype=np.int64))
        chosen = chosen[sizes_E[chosen] > 0]
        sizes = sizes_E[chosen]  # entries of each chosen expert (contiguous: entries are ordered by expert)
        starts = np.cumsum(sizes) - sizes
        entries = np.arange(int(sizes.sum())) + np.repeat(self._first_E[chosen] - starts, sizes)
        kept = np.asarray(kept_SE, dtype=np.int64)
        if sources is None:
            rows_NS, kept_NS = self.rows_HS[entries], kept[:, chosen].T
        else:
            rows_NS, kept_NS = self.rows_HS[:, sources][entries], kept[sources][:, chosen].T
        kept_NS = np.repeat(kept_NS, sizes, axis=0)  # the entry's expert's total
        single = np.repeat(sizes == 1, sizes)
        share_NS = kept_NS.copy()  # an expert computed by one entry keeps all there
        bad = (share_NS > rows_NS)[single].any()
        if experts is None:  # kept pairs of an expert nobody computes
            bad = bad or kept[:, sizes_E == 0].any()
        multi = np.flatnonzero(sizes > 1)
        if len(multi):  # each such expert's entries laid out as (entry, expert, source)
            first, M = starts[multi], int(sizes[multi].max())
            valid_MX = np.arange(M)[:, None] < sizes[multi]
            n_MX = np.where(valid_MX, first + np.arange(M)[:, None], 0)
            rows_MXS = rows_NS[n_MX] * valid_MX[:, :, None]
            kept_XS = kept_NS[first]
            total_XS = rows_MXS.sum(0)
            bad = bad or (kept_XS > total_XS).any()
            floor_MXS, rem_MXS = np.divmod(kept_XS * rows_MXS, np.maximum(total_XS, 1))
            rem_MXS[~valid_MX] = -1  # remainders share a denominator within (expert, source): compared exactly
            missing_XS = kept_XS - floor_MXS.sum(0)
            for j in range(M):  # entry j's place among its expert's by remainder (ties: the earlier entry)
                ahead = sum((rem_MXS[k] >= rem_MXS[j]) if k < j else (rem_MXS[k] > rem_MXS[j])
                            for k in range(M) if k != j)
                floor_MXS[j] += ahead < missing_XS
            share_NS[n_MX[valid_MX]] = floor_MXS[valid_MX]
        if bad:
            raise ValueError("restricted: more pairs kept than the assignment computes")
        return entries, share_NS
