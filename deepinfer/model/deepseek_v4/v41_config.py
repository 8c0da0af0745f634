"""The facts of a DeepSeek-V4.1-Flash ``config.json`` (``V41Dims``), read under the reference's keys.

The reference (DeepInfer 0.1.0, ``hugging_face/config.py``; reference/deepinfer.md §11) reads
``model_type: deepseek_v41`` with the text model under ``text_config``; this also reads the same keys
flat at the top level. What differs from V4 (``config.py``):

- ``compress_ratios`` (``num_hidden_layers + num_nextn_predict_layers`` entries) are 0 (sliding window
  only), 1 or 2 (C1/C2: compressed entries without overlap or position bias, a projected indexer on
  every compressed layer); the trailing ``num_nextn_predict_layers`` entries describe the DSpark layers.
- YoCo: the first layer of ratio 1 is the first consumer (``yoco`` = its index; it must be > 0 here).
- ``hc_shifted`` (default true): each sub-layer reads the streams through the pre-mix the previous
  sub-layer computed; the model ends with the last one instead of an ``hc_head``.
- Cross-layer sharing: ``kv_source_layer_ids``, ``index_k_source_layer_ids`` (default: the KV sources)
  and ``index_source_layer_ids`` name the source layers; every layer reads from the nearest source at or
  before it (``kv_source``, ``index_k_source``, ``index_source``: one entry per layer). An index-K source
  projects keys of its KV source's entries with its own ``wk``/``k_norm``.
- ``candidate_source_layer_id``, ``candidate_topk_blocks``, ``candidate_block_size``: from that layer on,
  the later index sources score only entries inside the candidate blocks the source layer picked.

A key this class does not know is an error naming it (no silent fallback); so is a known feature this
implementation does not run yet (``quantization_config`` other than ``expert_dtype: fp4``, the routed
experts' FP4 storage of ``fp4_moe.py``, and ``quant_method: fp8``, dense weights dequantized at load).
Engram: ``engram.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deepinfer.errors import ConfigError
from deepinfer.model.deepseek_v4.config import CSA, HCA, SLIDING, V4Dims

ARCH = "DeepseekV41ForCausalLM"
MODEL_FOLDER_KEY = "deepinfer_model_folder"  # set by ``model/loader.read_hf_config`` for V4.1 folders

# text_config keys the reference reads (reference/deepinfer.md §11), plus the generic ones transformers writes.
_TEXT_KEYS = frozenset({
    "num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size", "max_position_embeddings", "hidden_act",
    "attention_dropout", "attention_bias", "num_key_value_heads", "rms_norm_eps", "swiglu_limit",
    "tie_word_embeddings", "sliding_window", "rope_theta", "compress_rope_theta", "rope_scaling", "q_lora_rank",
    "head_dim", "qk_rope_head_dim", "o_lora_rank", "o_groups", "hc_mult", "hc_shifted", "hc_eps",
    "hc_sinkhorn_iters", "compress_ratios", "num_nextn_predict_layers", "use_fp4_sparse_kv", "index_topk",
    "index_n_heads", "index_head_dim", "index_source_layer_ids", "kv_source_layer_ids", "index_k_source_layer_ids",
    "candidate_source_layer_id", "candidate_topk_blocks", "candidate_block_size", "moe_intermediate_size",
    "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "routed_scaling_factor", "scoring_func",
    "norm_topk_prob", "topk_method", "dspark_block_size", "dspark_target_layer_ids", "dspark_target_attn_input",
    "dspark_markov_rank", "dspark_noise_token_id", "dspark_n_routed_experts", "dspark_num_experts_per_tok",
    "engram_layer_ids", "engram_max_ngram_size", "engram_vocab_size", "engram_n_heads", "engram_head_dim",
    "engram_compressed_vocab_size", "engram_pad_token_id",
    # written by transformers / the reference's top level
    "model_type", "architectures", "dtype", "torch_dtype", "transformers_version", "pad_token_id", "bos_token_id",
    "eos_token_id", "text_config", "vision_config", "quantization_config",
})


EXPERT_DTYPES = ("bf16", "fp4")
# quantization_config values this engine loads (the reference's, reference/deepinfer.md §8).
_QUANT_VALUES: dict[str, tuple[Any, ...]] = {"quant_method": ("fp8",), "expert_dtype": EXPERT_DTYPES,
                                             "scale_fmt": ("ue8m0",), "weight_block_size": ([32, 32],),
                                             "activation_scheme": ("dynamic",)}


def _quantization(quant: dict[str, Any] | None) -> tuple[str, str | None]:
    """``(expert_dtype, quant_method)`` from ``quantization_config`` (``("bf16", None)`` without one):
    ``expert_dtype: fp4`` is e2m1 experts with ue8m0 scales per 32 (``fp4_moe.py``); ``quant_method: fp8``
    is dense e4m3 weights with ue8m0 scales per 32×32 block, dequantized at load (``v41_weights.py``). Any
    other key or value is a ``ConfigError`` naming it."""
    if not quant:
        return "bf16", None
    for key, value in quant.items():
        allowed = _QUANT_VALUES.get(key)
        if allowed is None:
            raise ConfigError(f"config.json quantization_config.{key}: not a key {ARCH} knows "
                              f"(known: {sorted(_QUANT_VALUES)})")
        if value not in allowed:
            raise ConfigError(f"config.json quantization_config.{key} = {value!r}: {ARCH} supports "
                              f"{' or '.join(map(repr, allowed))}")
    return str(quant.get("expert_dtype", "bf16")), quant.get("quant_method")


@dataclass(frozen=True)
class CandidateLimit:
    """The candidate-block limit: layer ``source`` picks ``topk_blocks`` blocks of ``block_size`` of its
    compressed entries per query (``block_size × ratio`` tokens); the index sources after it score only
    entries inside those blocks."""

    source: int
    topk_blocks: int
    block_size: int
    block_tokens: int


@dataclass(frozen=True)
class EngramSpec:
    """Engram's config (``engram.py``): its layers, n-gram size, heads of ``head_dim`` per order, table
    vocabulary, compressed vocabulary size (None: no tokenizer compression), raw pad id, model folder."""

    layer_ids: list[int]
    max_ngram: int
    heads: int
    head_dim: int
    vocab: int
    compressed_vocab: int | None
    pad_token: int
    folder: str | None


def _nearest_sources(ids: list[int], layers: int, key: str) -> list[int]:
    """Each layer's nearest source at or before it (reference ``_source_map``); layers before the first
    source are their own."""
    if any(not isinstance(i, int) or not 0 <= i < layers for i in ids):
        raise ConfigError(f"config.json {key}: layer ids must be in [0, num_hidden_layers={layers})")
    ordered = sorted(set(ids))
    return [max((s for s in ordered if s <= layer), default=layer) for layer in range(layers)]


class V41Dims(V4Dims):
    """``V4Dims`` of a DeepSeek-V4.1 config plus its own facts (see the module docstring)."""

    def __init__(self, hf_config: dict[str, Any]) -> None:
        text = dict(hf_config.get("text_config") or hf_config)
        extras = {k: v for k, v in hf_config.items() if k.startswith("deepinfer_")}
        unknown = sorted(k for k in [*text, *hf_config] if k not in _TEXT_KEYS and not k.startswith("deepinfer_"))
        if unknown:
            raise ConfigError(f"config.json key {unknown[0]!r} is not a {ARCH} key this engine knows "
                              f"(reference/deepinfer.md §11)")
        self.expert_dtype, self.quant_method = _quantization(hf_config.get("quantization_config")
                                                             or text.get("quantization_config"))
        layers = int(text["num_hidden_layers"])
        nextn = int(text.get("num_nextn_predict_layers") or 0)
        ratios = list(text["compress_ratios"])
        if len(ratios) != layers + nextn:
            raise ConfigError(f"config.json compress_ratios has {len(ratios)} entries; {ARCH} needs num_hidden_layers"
                              f" + num_nextn_predict_layers = {layers + nextn}")
        if any(r not in (0, 1, 2) for r in ratios):
            raise ConfigError(f"config.json compress_ratios: {ARCH} layers have ratio 0, 1 or 2, got {ratios}")
        if text.get("norm_topk_prob", True) is not True or text.get("topk_method", "noaux_tc") != "noaux_tc":
            raise ConfigError(f"config.json norm_topk_prob/topk_method: {ARCH} runs normalized noaux_tc routing only")
        self.ratios = [int(r) for r in ratios[:layers]]
        first_c1 = next((i for i, r in enumerate(self.ratios) if r == 1), None)
        if first_c1 is None or first_c1 == 0:
            raise ConfigError(f"config.json compress_ratios: {ARCH} needs a layer of ratio 1 after layer 0 (the first "
                              f"YoCo consumer, reference/deepinfer.md §6), got {self.ratios}")
        flat = {
            **{k: v for k, v in text.items() if k in _TEXT_KEYS and k not in (
                "compress_ratios", "text_config", "vision_config", "quantization_config")},
            **extras,
            # Compressed layers are built by V41Attention from ``ratios``; HCA only picks the compress rope.
            "layer_types": [SLIDING if r == 0 else HCA for r in self.ratios],
            "compress_rates": {CSA: 4, HCA: 2},
            "mlp_layer_types": ["moe"] * layers,
            "yoco_num_producer_layers": first_c1,
            "num_nextn_predict_layers": 0,  # DSpark layers: not loaded yet (docs/status.md)
        }
        super().__init__(flat)
        self.hc_shifted = bool(text.get("hc_shifted", True))
        self.nextn = nextn
        self.kv_source = _nearest_sources(list(text.get("kv_source_layer_ids", range(layers))), layers,
                                          "kv_source_layer_ids")
        index_k = text.get("index_k_source_layer_ids")
        self.index_k_source = (self.kv_source if index_k is None
                               else _nearest_sources(list(index_k), layers, "index_k_source_layer_ids"))
        self.index_source = _nearest_sources(list(text.get("index_source_layer_ids", range(layers))), layers,
                                             "index_source_layer_ids")
        self.candidate = self._candidate(text)
        self._check_sharing()
        self.engram = self._engram(text, hf_config)

    def _engram(self, text: dict[str, Any], hf_config: dict[str, Any]) -> EngramSpec | None:
        layer_ids = list(text.get("engram_layer_ids") or [])
        if not layer_ids:
            return None
        if any(not 0 <= i < self.yoco for i in layer_ids):
            raise ConfigError(f"config.json engram_layer_ids={layer_ids}: Engram layers must be YoCo producers "
                              f"(layers before {self.yoco}, reference/deepinfer.md §6)")
        max_ngram = int(text["engram_max_ngram_size"])
        if max_ngram < 2:
            raise ConfigError("config.json engram_max_ngram_size must be at least 2")
        compressed = text.get("engram_compressed_vocab_size")
        folder = hf_config.get(MODEL_FOLDER_KEY)
        if compressed and folder is None:
            raise ConfigError("config.json engram_compressed_vocab_size: tokenizer compression needs the model folder "
                              "(its tokenizer.json)")
        return EngramSpec(layer_ids, max_ngram, int(text["engram_n_heads"]), int(text["engram_head_dim"]),
                          int(text["engram_vocab_size"]), int(compressed) if compressed else None,
                          int(text["engram_pad_token_id"]), None if folder is None else str(folder))

    def _candidate(self, text: dict[str, Any]) -> CandidateLimit | None:
        source = text.get("candidate_source_layer_id")
        if source is None:
            return None
        if not 0 <= source < self.layers or self.ratios[source] == 0 or self.index_source[source] != source:
            raise ConfigError(f"config.json candidate_source_layer_id={source} must be a compressed layer that is its "
                              "own index source (index_source_layer_ids)")
        blocks, size = int(text["candidate_topk_blocks"]), int(text["candidate_block_size"])
        if blocks <= 0 or size <= 0:
            raise ConfigError("config.json candidate_topk_blocks and candidate_block_size must be positive")
        tokens = size * self.ratios[source]
        for layer in range(source + 1, self.layers):
            if self.ratios[layer] and tokens % self.ratios[layer]:
                raise ConfigError(f"config.json candidate_block_size={size}: a block of {tokens} tokens does not hold "
                                  f"whole entries of layer {layer} (ratio {self.ratios[layer]})")
        return CandidateLimit(source, blocks, size, tokens)

    def _check_sharing(self) -> None:
        """The reference's topology checks (``cross_layer.py``): sharing stays within compressed layers of
        one ratio; top-k segments lie inside index-K segments, which lie inside KV segments (a finer
        segment's source reads the coarser segment's source); no KV segment crosses the YoCo boundary."""
        maps = (("kv_source_layer_ids", self.kv_source), ("index_k_source_layer_ids", self.index_k_source),
                ("index_source_layer_ids", self.index_source))
        for name, sources in maps:
            for layer, src in enumerate(sources):
                if src != layer and (self.ratios[layer] == 0 or self.ratios[src] != self.ratios[layer]):
                    raise ConfigError(f"config.json {name}: layer {layer} reads layer {src}, but sharing needs "
                                      "compressed layers of the same ratio")
        for (fine_name, fine), (coarse_name, coarse) in ((maps[1], maps[0]), (maps[2], maps[1])):
            for layer, src in enumerate(fine):
                if src != layer and coarse[layer] != coarse[src]:
                    raise ConfigError(f"config.json {fine_name}: layer {layer} reads layer {src} across a segment of "
                                      f"{coarse_name}")
        if any(sources[self.yoco] != self.yoco for _, sources in maps):
            raise ConfigError(f"config.json kv_source_layer_ids/index_k_source_layer_ids/index_source_layer_ids: layer "
                              f"{self.yoco} (the first YoCo consumer) must be its own source")

    def owns_kv(self, layer: int) -> bool:
        """Whether ``layer`` computes (and caches) its compressed entries."""
        return bool(self.ratios[layer]) and self.kv_source[layer] == layer

    def owns_index_k(self, layer: int) -> bool:
        """Whether ``layer`` projects (and caches) indexer keys of its KV source's entries."""
        return bool(self.ratios[layer]) and self.index_k_source[layer] == layer

    def owns_topk(self, layer: int) -> bool:
        """Whether ``layer`` scores its own top-k (else it reads its index source's)."""
        return bool(self.ratios[layer]) and self.index_source[layer] == layer

    def limited(self, layer: int) -> bool:
        """Whether ``layer``'s top-k is restricted to the candidate blocks."""
        return self.candidate is not None and layer > self.candidate.source and self.owns_topk(layer)
