"""``LLMEngine``: builds everything from the config and runs the step loop.

Start-up order: config (with plugin env aliases) → plugin host → model skeleton → ``EngineInfo`` and
plugin checks → weights → KV cache → scheduler, runner, executor.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from deepinfer.config import EngineConfig, build_config
from deepinfer.engine.core import EngineCore
from deepinfer.engine.outputs import RequestOutput
from deepinfer.engine.request import Request
from deepinfer.engine.scheduler import Scheduler
from deepinfer.engine.stats import EngineStats
from deepinfer.errors import ConfigError
from deepinfer.interfaces import CacheLayout, EngineInfo, RunRequirements, StepStats
from deepinfer.kv.blocks import KVCacheManager
from deepinfer.kv.pools import RESERVED_BLOCKS, KVPool, bytes_per_block, num_blocks_for
from deepinfer.model.assets import resolve_model_path
from deepinfer.model.loader import init_dummy, load_checkpoint, read_hf_config
from deepinfer.model.registry import resolve_architecture
from deepinfer.model.runner import ModelRunner
from deepinfer.plugins import PluginHost, config_aliases, discover_plugins
from deepinfer.sampling.params import SamplingParams
from deepinfer.sampling.rng import derive_seed
from deepinfer.tokenizer import Tokenizer, eos_token_ids

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_DEFAULT_KV_BYTES = 2 << 30


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("model.device: 'cuda' was asked for but torch sees no CUDA device")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return _DTYPES[name]


class LLMEngine:
    """One model on one device, with its scheduler, cache and executor."""

    def __init__(self, model: str | None = None, *, config: Any = None,
                 overrides: Mapping[str, Any] | None = None, extra_plugins: tuple = ()) -> None:
        installed = discover_plugins()
        tree = dict(overrides or {})
        if model is not None:
            tree.setdefault("model", {})["path"] = model
        resolved = build_config(config=config, overrides=tree, aliases=config_aliases(installed))
        self.config: EngineConfig = resolved.config
        self.config_sources = resolved.sources
        cfg = self.config
        self.host = PluginHost(cfg.plugins, installed, extra_plugins)

        self.model_path = resolve_model_path(cfg.model.path)
        self.hf_config = read_hf_config(self.model_path)
        self.device = resolve_device(cfg.model.device)
        self.dtype = resolve_dtype(cfg.model.dtype, self.device)
        self.tokenizer = self._load_tokenizer()
        self.eos_token_ids = eos_token_ids(self.model_path, self.hf_config)
        self.max_model_len = cfg.model.max_model_len or int(self.hf_config.get("max_position_embeddings", 8192))

        offers = self.host.named_offers("deepinfer_model_architectures")
        architectures = {name: offer.value for name, offer in offers.items()}
        model_cls = resolve_architecture(self.hf_config, architectures, str(self.model_path))
        # Engine switches a model may honour travel as documented hf_config keys (the model protocol
        # takes only hf_config): kernels.force_balanced_routing → "deepinfer_force_balanced_routing".
        model_config = dict(self.hf_config, deepinfer_force_balanced_routing=cfg.kernels.force_balanced_routing)
        with torch.device(self.device):
            self.model = model_cls(model_config, dtype=self.dtype, device=self.device,
                                   max_positions=self.max_model_len)
        self.model.eval()
        specs = self.model.cache_specs()
        max_backtrack = 1 if cfg.cache.max_backtrack == "auto" else int(cfg.cache.max_backtrack)
        self.info = EngineInfo(
            architecture=self.hf_config["architectures"][0],
            num_layers=len(specs),
            vocab_size=self.model.vocab_size,
            max_model_len=self.max_model_len,
            layout=CacheLayout(tuple(s.info() for s in specs), cfg.cache.block_size, max_backtrack),
            has_mtp=False,
            max_draft=0,
            device=self.device.type,
            dtype=str(self.dtype).removeprefix("torch."),
            world_size=1,
        )
        self.host.notify("deepinfer_validate_config", config=cfg, info=self.info)
        if self.device.type == "cuda" and cfg.kernels.cuda_graphs:
            logger.warning("kernels.cuda_graphs: CUDA graph capture is not implemented yet; running eagerly")
        backends = self._select_backends()

        if cfg.model.load_format == "dummy":
            init_dummy(self.model, cfg.sampling.seed)
        else:
            load_checkpoint(self.model, self.model_path, self.dtype)
        gemm = backends["linear"]
        with torch.no_grad():
            for weight in self.model.gemm_weights():
                weight.data = gemm.prepare_weight(weight.data)

        num_blocks = self._num_kv_blocks(specs)
        self.pool = KVPool(specs, num_blocks, cfg.cache.block_size, self.dtype, self.device)
        self.model.bind_cache(self.pool.layers)
        self.kv = KVCacheManager(num_blocks, cfg.cache.block_size, cfg.cache.prefix_caching)
        needed = self.kv.blocks_needed(self.max_model_len)
        if needed > num_blocks - RESERVED_BLOCKS:
            raise ConfigError(
                f"the KV cache holds {(num_blocks - RESERVED_BLOCKS) * cfg.cache.block_size} tokens but "
                f"model.max_model_len is {self.max_model_len}; raise cache.kv_cache_bytes "
                "(or cache.gpu_memory_utilization) or lower model.max_model_len"
            )
        policy = self.host.select("deepinfer_schedule_policies", cfg.scheduler.policy, "scheduler.policy")
        self.scheduler = Scheduler(self.kv, policy, max_num_seqs=cfg.scheduler.max_num_seqs,
                                   max_num_batched_tokens=cfg.scheduler.max_num_batched_tokens,
                                   chunked_prefill=cfg.scheduler.chunked_prefill)
        if not cfg.scheduler.chunked_prefill and cfg.scheduler.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"scheduler.max_num_batched_tokens ({cfg.scheduler.max_num_batched_tokens}) must be >= "
                f"model.max_model_len ({self.max_model_len}) when scheduler.chunked_prefill is false"
            )
        self.runner = ModelRunner(self.model, backends, cfg.cache.block_size, self.device)
        self.stats = EngineStats()
        self.core = EngineCore(
            self.scheduler, self.runner, self.tokenizer, self.stats,
            on_step_end=self._on_step_end if self.host.has_observers("deepinfer_step_end") else None,
            on_request_end=self._on_request_end if self.host.has_observers("deepinfer_request_end") else None,
        )
        # Strategies used by later stages (sliding-window restore, data parallelism) are resolved now so
        # a misspelt name fails at start-up rather than when it is first needed.
        self.host.select("deepinfer_replay_planners", cfg.cache.replay, "cache.replay")
        self.host.select("deepinfer_request_routers", cfg.parallel.router, "parallel.router")
        factory = self.host.select("deepinfer_step_executors", cfg.scheduler.executor, "scheduler.executor")
        self.executor = factory(self.core)
        self._counter = 0
        self.host.notify("deepinfer_engine_started", info=self.info)

    # ------------------------------------------------------------------------------------------ setup

    def _load_tokenizer(self) -> Tokenizer | None:
        name = self.config.model.tokenizer
        folder = Path(name) if name else self.model_path
        if name and not Tokenizer.exists(folder):
            raise ConfigError(f"model.tokenizer: {name!r} is not a folder with a tokenizer.json")
        return Tokenizer(folder) if Tokenizer.exists(folder) else None

    def _select_backends(self) -> dict[str, Any]:
        k = self.config.kernels
        req = RunRequirements(
            device=self.device.type,
            dtype=self.dtype,
            kv_dtype=self.config.cache.kv_dtype,
            graph_safe=False,
            batch_invariant=k.batch_invariant,
        )
        backends: dict[str, Any] = {}
        for hook, chosen, path in (("deepinfer_attention_backends", k.attention, "kernels.attention"),
                                   ("deepinfer_moe_backends", k.moe, "kernels.moe"),
                                   ("deepinfer_gemm_backends", k.gemm, "kernels.gemm")):
            backends.update(self.host.select_backends(hook, chosen, path, req))
        return backends

    def _num_kv_blocks(self, specs: list) -> int:
        cache = self.config.cache
        if cache.kv_cache_bytes is not None:
            budget = cache.kv_cache_bytes
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            reserve = self.config.scheduler.max_num_batched_tokens * self.model.vocab_size * 4
            budget = int(total * cache.gpu_memory_utilization) - used - reserve
        else:
            budget = CPU_DEFAULT_KV_BYTES
        blocks = num_blocks_for(budget, specs, cache.block_size, self.dtype)
        logger.info("KV cache: %d blocks of %d tokens (%d bytes each)", blocks, cache.block_size,
                    bytes_per_block(specs, cache.block_size, self.dtype))
        return blocks

    # ---------------------------------------------------------------------------------------- requests

    def make_request(self, prompt: str | list[int], params: SamplingParams) -> Request:
        """Validate one prompt and its params against the model; raises ``ValueError`` naming the
        problem. Nothing is queued."""
        text: str | None = None
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"prompt is a string but the model folder {str(self.model_path)!r} has no tokenizer "
                    "(tokenizer.json); pass token ids or set model.tokenizer")
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        if not ids:
            raise ValueError("prompt is empty: at least one token is needed")
        vocab = self.model.vocab_size
        for i, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"prompt token {i} is {t!r}, outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens; it must be shorter than max_model_len={self.max_model_len}")
        for t in params.stop_token_ids:
            if t >= vocab:
                raise ValueError(f"SamplingParams.stop_token_ids has {t}, outside the vocabulary [0, {vocab})")
        seed = params.seed if params.seed is not None else derive_seed(self.config.sampling.seed, self._counter)
        request_id = str(self._counter)
        self._counter += 1
        return Request(request_id, text, ids, params, seed, self.eos_token_ids,
                       max_total_tokens=min(len(ids) + params.max_tokens, self.max_model_len))

    def add(self, request: Request) -> None:
        self.stats.prompt_tokens += request.num_prompt_tokens
        self.scheduler.add(request)

    def abort(self, request_id: str) -> bool:
        return self.core.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.core.has_work()

    def step(self) -> list[RequestOutput]:
        return self.executor.step()

    # ------------------------------------------------------------------------------------------ stats

    def get_stats(self) -> dict[str, Any]:
        kv = self.kv
        stats: dict[str, Any] = {
            "steps": self.stats.steps,
            "prompt_tokens": self.stats.prompt_tokens,
            "generated_tokens": self.stats.generated_tokens,
            "prefix_cache_hit_rate": kv.hit_tokens / kv.lookup_tokens if kv.lookup_tokens else 0.0,
            "preemptions": self.scheduler.num_preemptions,
            "kv_blocks_total": kv.pool.num_usable,
            "kv_blocks_free": kv.num_free_blocks,
            "step_time_split": dict(self.stats.phase_seconds),
        }
        stats.update(self.host.plugin_stats())
        return stats

    def _on_step_end(self, stats: StepStats) -> None:
        self.host.notify("deepinfer_step_end", stats=stats)

    def _on_request_end(self, output: RequestOutput) -> None:
        self.host.notify("deepinfer_request_end", output=output)

    def shutdown(self) -> None:
        self.host.notify("deepinfer_engine_stopping")

