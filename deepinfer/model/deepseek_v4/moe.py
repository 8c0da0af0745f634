"""DeepSeek-V4 MoE.

Every layer: routed experts through the backend op ``experts`` with ``swiglu_limit`` (gate
clamped above, up on both sides) plus the shared experts (same clamp; one MLP of width
``moe_intermediate_size × n_shared_experts``, the reference's concatenation — transformers ignores
``n_shared_experts``, which is 1 in every published V4 config). Scores are
``scoring_func(x·Wᵀ)`` in float32 (``sqrtsoftplus`` = sqrt(softplus), ``sigmoid`` or ``softmax``);
``moe`` layers take top-k of ``score + e_score_correction_bias``, ``hash_moe`` layers the frozen
table ``tid2eid[token]``; weights are the chosen scores over their sum (+1e-20) times
``routed_scaling_factor``. ``kernels.force_balanced_routing`` replaces the learned top-k (not the
hash tables) with a uniform draw, as for V3. ``router_stats``/``take_router_stats``, expert parallelism
(``expert_parallel``, with the ``swiglu_limit``) and expert shards (``deepinfer_expert_shard``) as in V3.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.interfaces import ForwardContext
from deepinfer.model.deepseek_v3 import count_routed_tokens
from deepinfer.model.deepseek_v4.config import _SCORE_FNS, V4Dims
from deepinfer.model.layers.routing import balanced_draws


class V4MoE(nn.Module):
    def __init__(self, d: V4Dims, layer: int, mlp_type: str, dtype: torch.dtype,
                 device: torch.device | None = None) -> None:
        super().__init__()
        self.d, self.layer = d, layer
        self.is_hash = mlp_type == "hash_moe"
        f32 = {"dtype": torch.float32, "device": device}
        kw = {"dtype": dtype, "device": device}
        e, inter = d.n_routed, d.moe_inter
        self.gate_weight = nn.Parameter(torch.empty(e, d.hidden, **f32))
        if self.is_hash:
            # Valid expert ids until the checkpoint's table is loaded (dummy weights keep them).
            tokens = torch.arange(d.vocab, device=device).unsqueeze(1) * 7919
            table = (tokens + torch.arange(d.top_k, device=device)) % e
            self.register_buffer("tid2eid", table, persistent=False)
        else:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(e, **f32), requires_grad=False)
        # Expert-parallel capable (``parallel/moe.py``), as V3's ``DeepseekMoE``: ``num_experts`` logical
        # experts, ``expert_ids`` the logical expert of each row of ``w13``/``w2``, and ``expert_parallel``
        # (set on a rank) replacing the ``experts`` op.
        self.num_experts = e
        self.expert_ids = d.expert_ids if layer < d.layers else list(range(e))
        self._init_experts(kw)
        self.expert_parallel: Any = None
        shared = inter * d.n_shared
        self.shared_gate_up = nn.Parameter(torch.empty(2 * shared, d.hidden, **kw)) if shared else None
        self.shared_down = nn.Parameter(torch.empty(d.hidden, shared, **kw)) if shared else None
        self.stats: torch.Tensor | None = None

    def _init_experts(self, kw: dict[str, Any]) -> None:
        """The routed experts' parameters: ``w13 [E, 2I, H]`` (gate rows then up rows), ``w2 [E, H, I]``
        (``fp4_moe.V4Fp4MoE`` stores them packed instead)."""
        e, inter, hidden = len(self.expert_ids), self.d.moe_inter, self.d.hidden
        self.w13 = nn.Parameter(torch.empty(e, 2 * inter, hidden, **kw))
        self.w2 = nn.Parameter(torch.empty(e, hidden, inter, **kw))

    def routed(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, ctx: ForwardContext,
               limit: float | None) -> torch.Tensor:
        """``Σ_j weights[t, j] · expert_{ids[t, j]}(x[t])`` through the backend op ``experts``."""
        return ctx.backends["experts"].experts(x, ids, weights, (self.w13, self.w2), swiglu_limit=limit)

    def route(self, x: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids [T, k] int64, weights [T, k] float32)``."""
        d = self.d
        scores = _SCORE_FNS[d.scoring](F.linear(x.float(), self.gate_weight))
        if self.is_hash:
            ids = self.tid2eid[input_ids]
        elif d.balanced:
            ids = self._balanced_ids(positions)
        else:
            ids = (scores + self.e_score_correction_bias).topk(d.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * d.scaling

    def _balanced_ids(self, positions: torch.Tensor) -> torch.Tensor:
        """k distinct experts per token, uniformly at random from a hash of (position, layer, expert)."""
        return balanced_draws(positions, self.layer, self.d.n_routed).topk(self.d.top_k, dim=-1).indices

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        ids, weights = self.route(x, input_ids, positions)
        if self.stats is not None:
            count_routed_tokens(self.stats, ids, ctx)
        limit = self.d.swiglu_limit
        if self.expert_parallel is not None:
            out = self.expert_parallel(x, ids, weights, ctx, swiglu_limit=limit)
        else:
            out = self.routed(x, ids, weights, ctx, limit)
        if self.shared_gate_up is not None:
            gemm = ctx.backends["linear"]
            gate, up = gemm.linear(x, self.shared_gate_up).chunk(2, dim=-1)
            if limit is not None:
                gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
            out = out + gemm.linear(F.silu(gate) * up, self.shared_down)
        return out
