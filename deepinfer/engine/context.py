"""The one builder of ``ForwardContext``: eager steps, graph captures, drafter rows and idle ranks.

Every forward describes its batch the same way: spans ``(block table, first position, count)``, each
a request computing positions ``[first, first + count)`` on its blocks, with KV length
``first + count`` after the step. ``SpanLayout`` turns spans into the host lists a context holds
(positions, cache slots, query starts, sequence lengths, padded block tables); ``forward_context``
copies them to the device (``model/transfer.py``: never waits for the device) and fills the context.
The runner's steps, its placeholder steps and drafter spans, the CUDA graphs' static contexts (the
capture's batch, re-pointed at the graph's buffers) and an idle rank's empty forward
(``parallel/worker.py``) all come through here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from deepinfer.interfaces import ForwardContext
from deepinfer.model.transfer import to_device_many

Span = tuple[Sequence[int], int, int]
"""``(block table, first position, count)`` of one request in a forward."""


@dataclass(frozen=True)
class SpanLayout:
    """The host lists of a batch of spans (``ForwardContext``'s ``*_host`` fields and what its tensors
    hold): ``positions`` and cache ``slots`` per token, ``starts`` (query start of each span, then the
    total), ``seq_lens`` per span, ``tables`` (each span's block table, zero-padded to ``width``).
    ``num_decodes`` counts the leading one-token spans (the context's decode rows; spans of one
    position must come first); ``max_query_len`` the longest span (0 for none)."""

    positions: list[int]
    slots: list[int]
    starts: list[int]
    seq_lens: list[int]
    tables: list[list[int]]
    width: int
    num_decodes: int
    max_query_len: int

    @classmethod
    def of(cls, spans: Sequence[Span], block_size: int) -> SpanLayout:
        """The layout of ``spans`` on blocks of ``block_size`` positions."""
        bs = block_size
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        for table, first, count in spans:
            positions.extend(range(first, first + count))
            slots.extend(table[p // bs] * bs + p % bs for p in range(first, first + count))
            starts.append(starts[-1] + count)
        width = max((len(table) for table, _, _ in spans), default=1)
        num_decodes = 0
        while num_decodes < len(spans) and spans[num_decodes][2] == 1:
            num_decodes += 1
        return cls(positions, slots, starts, [first + count for _, first, count in spans],
                   [[*table] + [0] * (width - len(table)) for table, _, _ in spans], width, num_decodes,
                   max((count for _, _, count in spans), default=0))


def forward_context(layout: SpanLayout, *, block_size: int, backends: Mapping[str, object],
                    device: torch.device, state_slots: Sequence[int] | None = None,
                    write_floors: Sequence[int] | None = None) -> ForwardContext:
    """The ``ForwardContext`` of ``layout`` on ``device``. ``state_slots`` (per span) and
    ``write_floors`` (per span, the shared-prefix positions exact replay must not rewrite) are for
    models with per-request state (``kv/state.py``); None leaves those fields unset."""
    i64 = torch.int64
    fields = [(layout.positions, i64), (layout.slots, i64), (layout.starts, torch.int32), (layout.seq_lens, i64),
              (layout.tables, i64)]
    if state_slots is not None:
        fields.append((list(state_slots), i64))
    # One copy per dtype (``to_device_many``): the fields are views of it.
    positions, slots, starts, seq_lens, tables, *slots_of_state = to_device_many(fields, device)
    ctx = ForwardContext(
        positions=positions,
        slot_mapping=slots,
        query_start_loc=starts,
        seq_lens=seq_lens,
        block_tables=tables.reshape(len(layout.seq_lens), layout.width),
        num_decodes=layout.num_decodes,
        query_start_loc_host=layout.starts,
        seq_lens_host=layout.seq_lens,
        block_size=block_size,
        backends=backends,
        max_query_len=layout.max_query_len,
    )
    if state_slots is not None:
        ctx.state_slots_host = list(state_slots)
        ctx.state_slots = slots_of_state[0]
    if write_floors is not None:
        ctx.write_floor_host = list(write_floors)
    return ctx
