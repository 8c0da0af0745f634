"""Random DeepSeek-V4 attention problems shared by the CPU (interpreter) and GPU tests: a ragged batch
of requests, each with a state slot (a sliding-window ring, partially filled or wrapped), a block
table over paged compressed entries and indexer keys, and indexer selections with −1 padding."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.interfaces import ForwardContext


@dataclass
class V4Problem:
    """One step's inputs; ``ctx.backends`` is empty (the tests call the backends directly)."""

    q: torch.Tensor  # [T, H, D]
    kv: torch.Tensor  # [T, D]
    ring: torch.Tensor  # [slots, size, D]
    sinks: torch.Tensor  # [H]
    compressed: torch.Tensor  # [num_blocks, block_size / ratio, D]
    selected: torch.Tensor  # [T, topk], −1 padded
    index_q: torch.Tensor  # [T, index_heads, index_dim]
    index_w: torch.Tensor  # [T, index_heads] float32
    index_keys: torch.Tensor  # [num_blocks, block_size / ratio, index_dim]
    ctx: ForwardContext

    def to(self, device: str) -> V4Problem:
        """The problem with every tensor on ``device``."""
        ctx = self.ctx
        moved = {f: getattr(ctx, f).to(device) for f in ("positions", "slot_mapping", "query_start_loc",
                                                          "seq_lens", "block_tables", "state_slots")}
        if ctx.visibility_floor is not None:
            moved["visibility_floor"] = ctx.visibility_floor.to(device)
        fields = {k: v.to(device) for k, v in vars(self).items() if isinstance(v, torch.Tensor)}
        return V4Problem(**fields, ctx=ForwardContext(**{**vars(ctx), **moved}))


def make_problem(seq_lens: list[int], query_lens: list[int], *, heads: int, dim: int, window: int,
                 backtrack: int, ratio: int, topk: int, block_size: int, index_heads: int, index_dim: int,
                 seed: int, dtype: torch.dtype = torch.float32, device: str = "cpu",
                 floors: list[int] | None = None) -> V4Problem:
    """Request i has ``seq_lens[i]`` tokens after this step, the last ``query_lens[i]`` of them computed
    now (decode rows first: ``query_lens`` of 1 lead). Blocks are handed out shuffled, so block tables
    are not the identity; slots start at 1 (slot 0 is reserved) in a shuffled order. ``floors``: the
    requests' visibility floors (bounded replay), or None."""
    gen = torch.Generator().manual_seed(seed)
    n_req = len(seq_lens)
    per_block = block_size // ratio
    blocks = [-(-n // block_size) for n in seq_lens]
    width = max(blocks)
    order = torch.randperm(sum(blocks), generator=gen) + 1  # block 0 stays unused, as in the engine
    tables = torch.zeros(n_req, width, dtype=torch.int64)
    used = 0
    for i, b in enumerate(blocks):
        tables[i, :b] = order[used:used + b]
        used += b
    slots = (torch.randperm(n_req, generator=gen) + 1).tolist()
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    positions = torch.cat([torch.arange(e - n, e) for e, n in zip(seq_lens, query_lens, strict=True)])
    tokens = starts[-1]

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    selected = torch.full((tokens, topk), -1, dtype=torch.int64)
    for t, p in enumerate(positions.tolist()):
        complete = (p + 1) // ratio
        picks = torch.randperm(complete, generator=gen)[:topk]
        cols = torch.randperm(topk, generator=gen)[: picks.numel()]  # −1 holes anywhere
        selected[t, cols] = picks
    num_blocks = sum(blocks) + 1
    ctx = ForwardContext(
        positions=positions, slot_mapping=torch.zeros(tokens, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32), seq_lens=torch.tensor(seq_lens),
        block_tables=tables, num_decodes=sum(1 for n in query_lens if n == 1), query_start_loc_host=starts,
        seq_lens_host=list(seq_lens), block_size=block_size, backends={},
        state_slots=torch.tensor(slots), state_slots_host=slots, write_floor_host=[0] * n_req,
        visibility_floor=None if floors is None else torch.tensor(floors), visibility_floor_host=floors)
    problem = V4Problem(
        q=rand(tokens, heads, dim), kv=rand(tokens, dim), ring=rand(n_req + 2, window + backtrack, dim),
        sinks=torch.randn(heads, generator=gen), compressed=rand(num_blocks, per_block, dim),
        selected=selected, index_q=rand(tokens, index_heads, index_dim),
        index_w=torch.randn(tokens, index_heads, generator=gen), index_keys=rand(num_blocks, per_block, index_dim),
        ctx=ctx)
    return problem.to(device) if device != "cpu" else problem


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out − ref| / max |ref|, in float32."""
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-12)).item()
