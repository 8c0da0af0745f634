"""The shape, layer schedule and rope facts of a DeepSeek-V4 ``config.json`` (``V4Dims``) and the
layer kinds: sliding-window (``SLIDING``), compressed sparse (``CSA``) and heavily compressed (``HCA``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from deepinfer.errors import ConfigError
from deepinfer.model.base import config_value
from deepinfer.model.deepseek_v3 import FORCE_BALANCED_ROUTING_KEY, expert_rows

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
_SCORE_FNS = {
    "sqrtsoftplus": lambda x: F.softplus(x).sqrt(),
    "sigmoid": torch.sigmoid,
    "softmax": lambda x: x.softmax(dim=-1),
}


class V4Dims:
    """The shape, layer schedule and rope facts of a DeepSeek-V4 ``config.json`` (transformers' nested
    form or the upstream flat one: ``compress_ratios``, ``num_hash_layers``, ``rope_scaling``,
    ``qk_rope_head_dim``)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.hidden = cfg["hidden_size"]
        self.heads = cfg["num_attention_heads"]
        self.layers = cfg["num_hidden_layers"]
        self.vocab = cfg["vocab_size"]
        self.head_dim = cfg.get("head_dim") or 512
        self.eps = config_value(cfg, "rms_norm_eps", default=1e-6)
        self.tied = bool(cfg.get("tie_word_embeddings", False))
        self.q_lora = cfg.get("q_lora_rank") or 1024
        partial = cfg.get("partial_rotary_factor")
        rope_dim = cfg.get("qk_rope_head_dim")
        self.rope_dim = int(rope_dim if rope_dim else self.head_dim * (partial if partial else 64 / 512))
        self.window = config_value(cfg, "sliding_window", default=128)
        self.o_groups = config_value(cfg, "o_groups", default=8)
        self.o_lora = config_value(cfg, "o_lora_rank", default=1024)
        self.index_heads = config_value(cfg, "index_n_heads", default=64)
        self.index_dim = config_value(cfg, "index_head_dim", default=128)
        self.index_topk = config_value(cfg, "index_topk", default=512)
        self.hc_mult = config_value(cfg, "hc_mult", default=4)
        self.hc_iters = config_value(cfg, "hc_sinkhorn_iters", default=20)
        self.hc_eps = config_value(cfg, "hc_eps", default=1e-6)
        self.n_routed = config_value(cfg, "n_routed_experts", "num_local_experts", default=256)
        self.n_shared = config_value(cfg, "n_shared_experts", default=1)
        self.top_k = config_value(cfg, "num_experts_per_tok", default=6)
        self.moe_inter = config_value(cfg, "moe_intermediate_size", "intermediate_size", default=2048)
        self.scaling = float(config_value(cfg, "routed_scaling_factor", default=1.5))
        self.swiglu_limit = cfg.get("swiglu_limit", 10.0)
        self.scoring = config_value(cfg, "scoring_func", default="sqrtsoftplus")
        self.num_mtp = config_value(cfg, "num_nextn_predict_layers", default=0)
        self.balanced = bool(cfg.get(FORCE_BALANCED_ROUTING_KEY, False))
        self.sharded, self.expert_ids = expert_rows(cfg, self.n_routed)
        rates = dict(cfg.get("compress_rates") or {CSA: 4, HCA: 128})
        if cfg.get("compress_rate_csa"):
            rates[CSA] = cfg["compress_rate_csa"]
        if cfg.get("compress_rate_hca"):
            rates[HCA] = cfg["compress_rate_hca"]
        self.rates = {SLIDING: 0, **rates}
        self.layer_types = self._layer_types(cfg)
        mlp = cfg.get("mlp_layer_types")
        if mlp is None:
            n_hash = config_value(cfg, "num_hash_layers", default=3)
            mlp = ["hash_moe"] * min(self.layers, n_hash) + ["moe"] * max(0, self.layers - n_hash)
        self.mlp_types = list(mlp)[: self.layers]
        self.rope_main, self.rope_compress = self._rope_sets(cfg)
        self.yoco = int(cfg.get("yoco_num_producer_layers") or 0)
        self._check(cfg)

    def _layer_types(self, cfg: dict[str, Any]) -> list[str]:
        if cfg.get("layer_types") is not None:
            return list(cfg["layer_types"])[: self.layers]
        if cfg.get("compress_ratios") is not None:
            # Upstream form: the ratio of each layer. 0 is sliding-only and the CSA rate is CSA; any
            # other ratio is HCA (transformers maps exactly 0/4/128; this also reads other HCA rates).
            types = []
            for r in list(cfg["compress_ratios"])[: self.layers]:
                if r and r != self.rates[CSA]:
                    self.rates[HCA] = r
                types.append(SLIDING if not r else CSA if r == self.rates[CSA] else HCA)
            if len({r for r in cfg["compress_ratios"][: self.layers] if r and r != self.rates[CSA]}) > 1:
                raise ConfigError("config.json compress_ratios: at most one heavily compressed ratio is supported")
            return types
        # transformers' default: two HCA layers, then CSA and HCA alternating.
        return [HCA] * min(self.layers, 2) + [CSA if i % 2 else HCA for i in range(max(self.layers - 2, 0))]

    def _rope_sets(self, cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        rp = dict(cfg.get("rope_parameters") or {})
        if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
            return dict(rp["main"]), dict(rp["compress"])
        flat = {k: v for k, v in rp.items() if k not in ("main", "compress")}
        for key, value in (cfg.get("rope_scaling") or {}).items():
            flat.setdefault("rope_type" if key == "type" else key, value)
        main = {"rope_type": "default", "rope_theta": config_value(cfg, "rope_theta", default=10000.0)}
        compress = {**flat, "rope_theta": config_value(cfg, "compress_rope_theta", default=160000.0)}
        compress.setdefault("rope_type", "default")
        if compress["rope_type"] == "yarn":
            # The V4 reference does not scale cos/sin by YaRN's mscale (transformers forces 1.0 too).
            compress.setdefault("attention_factor", 1.0)
        return main, compress

    def _check(self, cfg: dict[str, Any]) -> None:
        arch = "DeepseekV4ForCausalLM"
        if config_value(cfg, "hidden_act", default="silu") != "silu":
            raise ConfigError(f"config.json hidden_act must be 'silu' for {arch}")
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            raise ConfigError(f"config.json attention_bias/mlp_bias=true is not supported for {arch}")
        if cfg.get("num_key_value_heads", 1) != 1:
            raise ConfigError(f"config.json num_key_value_heads must be 1 for {arch} (one shared key=value head)")
        if len(self.layer_types) != self.layers or len(self.mlp_types) != self.layers:
            raise ConfigError(f"config.json layer_types and mlp_layer_types need num_hidden_layers={self.layers} "
                              "entries")
        unknown = sorted({t for t in self.layer_types if t not in (SLIDING, CSA, HCA)}
                         | {t for t in self.mlp_types if t not in ("moe", "hash_moe")})
        if unknown:
            raise ConfigError(f"config.json layer_types/mlp_layer_types: unknown entry {unknown[0]!r}")
        if self.scoring not in _SCORE_FNS:
            raise ConfigError(f"config.json scoring_func {self.scoring!r} is not supported for {arch} "
                              f"(supported: {', '.join(sorted(_SCORE_FNS))})")
        if (self.heads * self.head_dim) % self.o_groups:
            raise ConfigError(f"config.json o_groups={self.o_groups} must divide num_attention_heads × head_dim")
        if not 0 < self.top_k <= self.n_routed:
            raise ConfigError(f"config.json num_experts_per_tok={self.top_k} must be in [1, n_routed_experts]")
        if self.yoco:
            consumers = self.layer_types[self.yoco:]
            if not 0 < self.yoco < self.layers or all(t == SLIDING for t in consumers):
                raise ConfigError(
                    f"config.json yoco_num_producer_layers={self.yoco} must be in (0, num_hidden_layers="
                    f"{self.layers}) with at least one compressed layer among the consumers (API.md §7)")

    def role(self, layer: int) -> str:
        if not self.yoco:
            return "plain"
        return "producer" if layer < self.yoco else "consumer"
