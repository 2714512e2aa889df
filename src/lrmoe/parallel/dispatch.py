"""The exchanges that move rows by a :class:`~lrmoe.parallel.rows.RowLayout`: home rows to the
experts (regrouped slot-major), expert rows back home, and the variants that carry a per-row
value as extra columns of the same message. Every exchange goes through the pass's
:class:`~lrmoe.parallel.comm.Channel`, which counts its bytes and tells the meter of the row
buffers it delivers and frees.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lrmoe.memory.bytes import position_bytes
from lrmoe.parallel import comm
from lrmoe.parallel.comm import Channel
from lrmoe.parallel.rows import RowLayout


def to_experts(send_ND: torch.Tensor, layout: RowLayout, channel: Channel, regroup: bool = True) -> torch.Tensor:
    """Send home rows (in ``layout.pair_idx`` order) to the experts; returns them received and
    regrouped slot-major (``regroup`` False: in received order, source by source, for a
    consumer that reads them through ``layout.regroup_idx`` itself, with no second buffer)."""
    recv_RD = channel.all_to_all(send_ND, layout.send_splits, layout.recv_splits)
    channel.delivered(recv_RD)
    if layout.regroup_idx is None or not regroup:
        return recv_RD
    rows_RD = recv_RD[comm.to_device(layout.regroup_idx, recv_RD.device)]
    channel.delivered(rows_RD)
    channel.freed(recv_RD)
    return rows_RD


def to_home(rows_RX: torch.Tensor, layout: RowLayout, channel: Channel, slot_major: bool = True,
            order_R: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of :func:`to_experts`: slot-major expert rows (``slot_major`` False: rows in
    received order; ``order_R``: row i is slot-major row ``order_R[i]``) back to their home ranks."""
    if slot_major and (layout.regroup_idx is not None or order_R is not None):
        place_R = order_R if layout.regroup_idx is None else comm.to_device(layout.regroup_idx, rows_RX.device)
        if order_R is not None and layout.regroup_idx is not None:
            place_R = place_R[order_R.to(place_R.device)]
        back = torch.empty_like(rows_RX)
        back[place_R.to(rows_RX.device)] = rows_RX
        rows_RX = back
    return channel.all_to_all(rows_RX, layout.recv_splits, layout.send_splits)


@dataclass(frozen=True)
class Message:
    """Rows and one extra value per row side by side in one buffer — the value's bytes as extra
    columns of the rows' dtype, nothing rounded — so that one exchange carries both. Written in
    place (:meth:`empty`, then fill :attr:`rows` and :attr:`extra`), nothing is copied to send it."""

    buffer_NX: torch.Tensor
    width: int  # the rows' columns
    extra_dtype: torch.dtype

    @staticmethod
    def empty(n: int, width: int, like: torch.Tensor, extra_dtype: torch.dtype) -> Message | None:
        """An unfilled message of ``n`` rows; None where a row's bytes would misalign the value."""
        size, extra = like.element_size(), extra_dtype.itemsize
        if (width * size) % extra:
            return None
        return Message(like.new_empty(n, width + extra // size), width, extra_dtype)

    @staticmethod
    def of(rows_NX: torch.Tensor, extra_N: torch.Tensor) -> Message:
        """A message holding copies of ``rows_NX`` and ``extra_N``."""
        cols = extra_N.element_size() // rows_NX.element_size()
        buffer = torch.cat([rows_NX, extra_N.to(rows_NX.device).view(rows_NX.dtype).view(-1, cols)], 1)
        return Message(buffer, rows_NX.shape[1], extra_N.dtype)

    @property
    def rows(self) -> torch.Tensor:
        return self.buffer_NX[:, : self.width]

    @property
    def extra(self) -> torch.Tensor:
        """The values (a strided view: write into it; read it through :meth:`split`)."""
        return self.buffer_NX[:, self.width :].view(self.extra_dtype).view(-1)

    @staticmethod
    def split(buffer_NX: torch.Tensor, width: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """A received message's (rows, values): the rows a view, the values contiguous."""
        return buffer_NX[:, :width], buffer_NX[:, width:].contiguous().view(dtype).view(-1)


def to_home_with_norms(message: Message, layout: RowLayout, channel: Channel) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`to_home` of expert outputs together with each row's float64 ‖h‖² (the LRM score's
    expert-side factor) in one :class:`Message`: a selective forward makes one return exchange,
    not two. Returns (y rows, ‖h‖² per row) in home order."""
    back_NX = to_home(message.buffer_NX, layout, channel)
    return Message.split(back_NX, message.width, message.extra_dtype)


def position_dtype(rows: torch.Tensor) -> torch.dtype:
    """Dtype of a row's position riding in its message (:func:`lrmoe.memory.bytes.position_bytes`)."""
    return torch.int64 if position_bytes(rows.element_size()) == 8 else torch.int32


@dataclass(frozen=True)
class Delivered:
    """Rows an exchange delivered to the expert side, in received order (source by source),
    before they are put slot-major."""

    rows_RD: torch.Tensor  # received rows (possibly a view of a wider message)
    regroup_R: torch.Tensor | None  # received order → slot-major order (None: already slot-major)

    def slot_major(self, channel: Channel, order_R: torch.Tensor | None = None) -> torch.Tensor:
        """The rows slot-major, contiguous — or, with ``order_R``, row i being slot-major row
        ``order_R[i]`` — in one gather."""
        index = self.regroup_R
        if order_R is not None:
            index = order_R if index is None else index[order_R]
        if index is None:
            return self.rows_RD.contiguous()
        rows_RD = torch.index_select(self.rows_RD, 0, index)
        channel.delivered(rows_RD)  # a second buffer, as :func:`to_experts`' regroup
        channel.freed(self.rows_RD)
        return rows_RD


def to_kept_experts(sent: Message, layout: RowLayout, fwd: RowLayout, channel: Channel
                    ) -> tuple[Delivered, torch.Tensor | None]:
    """:func:`to_experts` of the kept rows' dy under a :func:`~lrmoe.parallel.rows.kept_layout`,
    each row's stratum position riding as extra columns of the message (:func:`position_dtype`).
    Returns dy as delivered and each kept row's slot-major index among the forward's received
    rows, slot-major (None: every row kept)."""
    recv_RX = channel.all_to_all(sent.buffer_NX, layout.send_splits, layout.recv_splits)
    recv_RD, pos_R = Message.split(recv_RX, sent.width, sent.extra_dtype)
    channel.delivered(recv_RD)
    regroup = None if layout.regroup_idx is None else comm.to_device(layout.regroup_idx, recv_RD.device)
    return Delivered(recv_RD, regroup), kept_forward_rows(pos_R, layout, fwd, regroup)


def kept_forward_rows(pos_R: torch.Tensor, layout: RowLayout, fwd: RowLayout, regroup_R: torch.Tensor | None = None
                      ) -> torch.Tensor | None:
    """Each kept row's slot-major index among the forward's received rows, from its position in
    its (source, slot) block (``pos_R`` in received order; ``regroup_R``: received → slot-major,
    None where they agree). None where every forward row is kept."""
    if layout.recv_rows == fwd.recv_rows:  # (kept ≤ forward rows in every block)
        return None
    # forward rows are slot-major: block (slot l, source s) starts at the rows of earlier blocks
    S, L = fwd.counts_SL.shape
    flat_LS = fwd.counts_SL.t().reshape(-1)
    start_SL = (flat_LS.cumsum(0) - flat_LS).view(L, S).t().reshape(-1)
    device = pos_R.device
    fwd_row_R = torch.repeat_interleave(comm.to_device(start_SL, device),
                                        comm.to_device(layout.counts_SL.reshape(-1), device),
                                        output_size=len(pos_R)) + pos_R.long()
    return fwd_row_R if regroup_R is None else fwd_row_R[regroup_R]
