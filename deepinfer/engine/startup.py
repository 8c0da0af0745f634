"""Engine start-up: everything ``LLMEngine`` runs on, built in order from a validated config.

``StartUp(config, host)`` resolves the device and dtype, builds the model skeleton, resolves the
speculative settings and ``EngineInfo`` (plugins check the config against it), selects the backends,
loads the weights, sizes and allocates the KV cache, captures the CUDA graphs, builds the drafter,
the runner, the step-cost curve, the speculator and the scheduler — each part given what it needs when
it is constructed — and the ``RequestIntake``. ``LLMEngine`` then adds the step loop's core and
executor. ``resolve_config`` is the config set-up that every engine (single, parallel, torchrun) runs.
"""

from __future__ import annotations

import dataclasses
import logging
import platform
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer.config import EngineConfig, ResolvedConfig, build_config
from deepinfer.engine.compiled import check_compile_support, compile_layers
from deepinfer.engine.cost import CurveCache, StepCost, profile_sizes, time_call
from deepinfer.engine.drafting import TokenCache
from deepinfer.engine.graphs import DecodeGraphs
from deepinfer.engine.intake import RequestIntake, load_tokenizer
from deepinfer.engine.piecewise import PiecewiseGraphs
from deepinfer.engine.runner import ModelRunner
from deepinfer.engine.scheduler import ReplayStart, Scheduler
from deepinfer.engine.speculation import Speculator
from deepinfer.engine.tail_graphs import TailGraphs
from deepinfer.errors import ConfigError, ModelLoadError
from deepinfer.interfaces import (
    CacheLayout,
    Drafter,
    EngineInfo,
    GraphDrafter,
    RunRequirements,
    SlotCachingDrafterFactory,
    VerificationPlan,
)
from deepinfer.kv.blocks import KVCacheManager
from deepinfer.kv.fp8 import kv_storage_dtype
from deepinfer.kv.pools import RESERVED_BLOCKS, KVPool, bytes_per_block, check_kv_dtype, num_blocks_for, state_bytes
from deepinfer.kv.state import has_state, num_state_slots_for
from deepinfer.kv.tiers import build_tiers
from deepinfer.model.assets import resolve_model_path
from deepinfer.model.layers.norm import BATCH_INVARIANT_CUDA_ROWS, RMSNorm
from deepinfer.model.loader import LoadReport, init_dummy, load_checkpoint, read_hf_config
from deepinfer.model.registry import resolve_architecture
from deepinfer.parallel.sizes import current_rank, parallel_sizes, rank_experts
from deepinfer.plugins import InstalledPlugin, PluginHost, config_aliases, discover_plugins
from deepinfer.tokenizer import eos_token_ids

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_DEFAULT_KV_BYTES = 2 << 30


def resolve_config(model: str | None, config: Any, overrides: Mapping[str, Any] | None
                   ) -> tuple[ResolvedConfig, dict[str, InstalledPlugin]]:
    """The layered config of an engine (``model`` sets ``model.path``) with every installed plugin's
    aliases, and the installed plugins (for the ``PluginHost``)."""
    installed = discover_plugins()
    tree = dict(overrides or {})
    if model is not None:
        tree.setdefault("model", {})["path"] = model
    return build_config(config=config, overrides=tree, aliases=config_aliases(installed)), installed


def resolve_device(name: str) -> torch.device:
    """``model.device``: ``auto`` is CUDA when torch sees a device, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("model.device: 'cuda' was asked for but torch sees no CUDA device")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``model.dtype``: ``auto`` is float32 on the CPU and bfloat16 on a GPU."""
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return _DTYPES[name]


@dataclass(frozen=True)
class SpecSettings:
    """The resolved ``speculative`` section: drafter and plan names, most drafts per step."""

    drafter: str
    plan: str
    max_draft: int


class StartUp:
    """Builds, in order, the parts of one ``LLMEngine`` (see the module docstring); each is an attribute
    named as the engine names it. Raises ``ConfigError``/``ModelLoadError`` naming what is wrong."""

    def __init__(self, config: EngineConfig, host: PluginHost) -> None:
        self.config = cfg = config
        self.host = host
        kv_stores = host.kv_store_factories(cfg.cache.kv_store)  # unknown names fail before the model loads
        if kv_stores and not cfg.cache.prefix_caching:
            raise ConfigError(f"cache.kv_store={cfg.cache.kv_store!r} keeps blocks evicted from the prefix cache, "
                              "but cache.prefix_caching is false; turn it on or leave cache.kv_store unset")
        # Several ranks are the business of ``LLM`` (deepinfer.parallel): inside a rank process this
        # engine is that rank's; anywhere else a world size > 1 must not silently run on one process.
        self.world_size, _ = parallel_sizes(cfg.parallel)
        if kv_stores and self.world_size > 1:
            raise ConfigError(f"cache.kv_store={cfg.cache.kv_store!r}: KV tiers run on one rank only so far "
                              "(issue 34); leave cache.kv_store unset or set parallel.expert_parallel_size and "
                              "data_parallel_size to 1")
        if self.world_size > 1 and current_rank() is None:
            raise ConfigError(f"parallel: {self.world_size} ranks are started by deepinfer.LLM only; this entry "
                              "point runs one process (set parallel.expert_parallel_size and data_parallel_size to 1)")
        self.model_path = resolve_model_path(cfg.model.path)
        self.hf_config = read_hf_config(self.model_path)
        self.device = resolve_device(cfg.model.device)
        self.dtype = resolve_dtype(cfg.model.dtype, self.device)
        self.tokenizer = load_tokenizer(cfg.model.tokenizer, self.model_path, self.hf_config)
        self.eos_token_ids = eos_token_ids(self.model_path, self.hf_config, self.tokenizer)
        self.max_model_len = cfg.model.max_model_len or int(self.hf_config.get("max_position_embeddings", 8192))
        self.rank_experts = rank_experts(cfg, host)
        self.model = self._build_model()
        specs = self.model.cache_specs()
        self.spec_settings = self._spec_settings()
        max_draft = self.spec_settings.max_draft if self.spec_settings else 0
        self.max_backtrack = max_draft + 1 if cfg.cache.max_backtrack == "auto" else int(cfg.cache.max_backtrack)
        # Models with per-request state (DeepSeek-V4 rings, kv/state.py) get one state slot per request.
        self.num_state_slots = (num_state_slots_for(cfg.scheduler.max_num_seqs)
                                if any(has_state(s) for s in specs) else 0)
        self.info = EngineInfo(
            architecture=self.hf_config["architectures"][0], num_layers=len(specs),
            vocab_size=self.model.vocab_size, max_model_len=self.max_model_len,
            layout=CacheLayout(tuple(s.info() for s in specs), cfg.cache.block_size, self.max_backtrack),
            has_mtp=self.model_has_mtp, max_draft=max_draft, seed=cfg.sampling.seed,
            model_path=str(self.model_path), device=self.device.type,
            dtype=str(self.dtype).removeprefix("torch."), world_size=self.world_size,
            cuda_graphs=self.device.type == "cuda" and cfg.kernels.cuda_graphs,
        )
        host.notify("deepinfer_validate_config", config=cfg, info=self.info)
        # Paged KV rows are stored in this dtype (kv/fp8.py); per-request state stays in the model dtype but
        # for V4/V4.1's sliding rings (kv/v41_cache.py). Checked before the backends, which name only the gap.
        self.kv_dtype = kv_storage_dtype(cfg.cache.kv_dtype, self.dtype)
        check_kv_dtype(specs, self.kv_dtype, self.dtype, cfg.cache.kv_dtype)
        self.backends = self._select_backends()
        self.load_report = self._load_weights()
        if cfg.kernels.compile == "inductor":  # the fused decode step (engine/compiled.py)
            check_compile_support(self.device, cfg.kernels.batch_invariant)
            self.backends = compile_layers(self.model, self.backends)

        # The mtp drafter's MTP layers cache in the main pool: same block ids, sized from one budget; a drafter
        # that keeps rows per pool slot (dspark's context cache) is counted in that budget too.
        mtp_specs = self._mtp_cache_specs()
        self.drafter_factory = self._drafter_factory()
        drafter_bytes = (self.drafter_factory.cache_bytes_per_slot(model=self.model, info=self.info)
                         if isinstance(self.drafter_factory, SlotCachingDrafterFactory) else 0)
        num_blocks = self._num_kv_blocks([*specs, *mtp_specs], drafter_bytes)
        self.pool = KVPool([*specs, *mtp_specs], num_blocks, cfg.cache.block_size, self.dtype, self.device,
                           num_state_slots=self.num_state_slots, max_backtrack=self.max_backtrack,
                           kv_dtype=self.kv_dtype)
        self.model.bind_cache(self.pool.layers[:len(specs)])
        if mtp_specs:
            self.model.bind_mtp_cache(self.pool.layers[len(specs):])
        self.kv = KVCacheManager(num_blocks, cfg.cache.block_size, cfg.cache.prefix_caching,
                                 num_state_slots=self.num_state_slots)
        # External KV tiers under the prefix cache (kv/tiers.py): keys carry the model and cache layout.
        self.kv_tiers = build_tiers(kv_stores, self.pool.paged, self.device, {
            "model": str(self.model_path), "config": self.hf_config, "load_format": cfg.model.load_format,
            "seed": cfg.sampling.seed if cfg.model.load_format == "dummy" else None, "dtype": str(self.dtype),
            "kv_dtype": str(self.kv_dtype), "block_size": cfg.cache.block_size,
            "specs": [repr(s) for s in (*specs, *mtp_specs)]}) if kv_stores else None
        if self.kv_tiers is not None:
            self.kv.attach_tiers(self.kv_tiers)
        if self.kv.blocks_needed(self.max_model_len) > num_blocks - RESERVED_BLOCKS:
            raise ConfigError(
                f"the KV cache holds {(num_blocks - RESERVED_BLOCKS) * cfg.cache.block_size} tokens but "
                f"model.max_model_len is {self.max_model_len}; raise cache.kv_cache_bytes "
                "(or cache.gpu_memory_utilization) or lower model.max_model_len"
            )

        policy = host.select("deepinfer_schedule_policies", cfg.scheduler.policy, "scheduler.policy")
        # A prefix hit (or a preempted request's surviving blocks) restores paged entries but not the
        # state rings: recompute from the replay planner's first token; the planner may also bound that
        # replay or truncate YoCo prefills (ARCHITECTURE §6, scheduler.ReplayStart).
        planner = host.select("deepinfer_replay_planners", cfg.cache.replay, "cache.replay")
        replay = ReplayStart(planner, self.info.layout, stateful=bool(self.num_state_slots))
        # The drafter before the graphs: a drafter that has the model capture layer features (dspark) must
        # do so before capture, so that the graphs keep them and its engine's steps replay.
        drafting = self._drafting()
        graphs = self._decode_graphs()
        piecewise = self._piecewise_graphs(graphs)
        self.runner, self.speculator = self._runner_and_speculator(graphs, piecewise, drafting)
        self.tail = self._tail_graphs(graphs)
        self.scheduler = Scheduler(self.kv, policy, max_num_seqs=cfg.scheduler.max_num_seqs,
                                   max_num_batched_tokens=cfg.scheduler.max_num_batched_tokens,
                                   chunked_prefill=cfg.scheduler.chunked_prefill,
                                   draft_planner=self.speculator.plan_drafts if self.speculator else None,
                                   drafting_paused=self.speculator.paused if self.speculator else None,
                                   draft_reserve=self.spec_settings.max_draft - 1 if self.uses_mtp else 0,
                                   max_model_len=self.max_model_len,
                                   follow_ups=self.device.type != "cuda" or not self.runner.reads_host_lists,
                                   replay=replay, share_prefixes=cfg.cache.in_step_prefix_sharing)
        if not cfg.scheduler.chunked_prefill and cfg.scheduler.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"scheduler.max_num_batched_tokens ({cfg.scheduler.max_num_batched_tokens}) must be >= "
                f"model.max_model_len ({self.max_model_len}) when scheduler.chunked_prefill is false"
            )
        # Resolved now, though only data parallelism routes, so that a misspelt name fails at start-up.
        host.select("deepinfer_request_routers", cfg.parallel.router, "parallel.router")
        self.intake = RequestIntake(self.tokenizer, self.model_path, vocab_size=self.model.vocab_size,
                                    max_model_len=self.max_model_len, eos_token_ids=self.eos_token_ids,
                                    seed=cfg.sampling.seed, truncation=replay.truncation)

    @property
    def model_has_mtp(self) -> bool:
        """Whether the model declares MTP layers (``num_nextn_predict_layers`` > 0)."""
        return int(self.hf_config.get("num_nextn_predict_layers", 0) or 0) > 0

    @property
    def uses_mtp(self) -> bool:
        """Whether the drafter is ``mtp``: the MTP layers' cache is then allocated and the runner keeps
        each step's hidden states for it."""
        return self.spec_settings is not None and self.spec_settings.drafter == "mtp"

    # ------------------------------------------------------------------------------------------ model

    def _build_model(self) -> Any:
        cfg = self.config
        offers = self.host.named_offers("deepinfer_model_architectures")
        architectures = {name: offer.value for name, offer in offers.items()}
        model_cls = resolve_architecture(self.hf_config, architectures, str(self.model_path))
        # Engine switches a model may honour travel as documented hf_config keys (the model protocol
        # takes only hf_config): kernels.force_balanced_routing → "deepinfer_force_balanced_routing";
        # inside an expert-parallel rank, the routed experts it holds → "deepinfer_expert_shard"
        # (``parallel.placement.ExpertShard``: the model allocates, and the loader reads, only those).
        model_config = dict(self.hf_config, deepinfer_force_balanced_routing=cfg.kernels.force_balanced_routing,
                            deepinfer_expert_shard=self.rank_experts.shard if self.rank_experts else None)
        try:
            with torch.device(self.device):
                model = model_cls(model_config, dtype=self.dtype, device=self.device, max_positions=self.max_model_len)
        except (TypeError, ValueError, KeyError, IndexError, ZeroDivisionError) as exc:
            if isinstance(exc, ConfigError | ModelLoadError):  # already names what is wrong
                raise
            # A field of the right type but an impossible value (or one missing): name the file, not a frame.
            missing = f"the field {exc} is missing" if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"
            raise ModelLoadError(f"{str(self.model_path / 'config.json')!r}: a {model_cls.__name__} cannot be built "
                                 f"from it ({missing})") from exc
        model.eval()
        if cfg.kernels.batch_invariant:  # RMSNorm statistics the same bits in any batch on CUDA too
            for module in model.modules():
                if isinstance(module, RMSNorm):
                    module.min_cuda_rows = BATCH_INVARIANT_CUDA_ROWS
        return model

    def _load_weights(self) -> LoadReport | None:
        """Dummy or checkpoint weights, then each GEMM weight in the GEMM backend's layout; what the
        checkpoint load read (None: dummy weights)."""
        cfg = self.config
        report = None
        if cfg.model.load_format == "dummy":
            if self.uses_mtp:
                self.model.build_mtp_layers()  # dummy MTP layers for the mtp drafter
            init_dummy(self.model, cfg.sampling.seed)
        else:
            # An expert-parallel rank keeps every expert of the MTP layers, for the mtp drafter to run them
            # locally; without that drafter it does not read them at all (``model.mtp_weight``).
            drops_mtp = self.rank_experts is not None and not self.uses_mtp
            skip = getattr(self.model, "mtp_weight", None) if drops_mtp else None
            report = load_checkpoint(self.model, self.model_path, self.dtype, skip=skip)
        gemm = self.backends["linear"]
        with torch.no_grad():
            for weight in self.model.gemm_weights():
                weight.data = gemm.prepare_weight(weight.data)
        return report

    def _select_backends(self) -> dict[str, Any]:
        k = self.config.kernels
        kv_dtype = self.config.cache.kv_dtype
        if kv_storage_dtype(kv_dtype, self.dtype) == self.dtype:
            kv_dtype = "auto"  # e.g. bf16 on a bf16 model: the cache every backend reads
        req = RunRequirements(device=self.device.type, dtype=self.dtype, kv_dtype=kv_dtype, graph_safe=False,
                              batch_invariant=k.batch_invariant)
        backends: dict[str, Any] = {}
        for hook, chosen, path in (("deepinfer_attention_backends", k.attention, "kernels.attention"),
                                   ("deepinfer_moe_backends", k.moe, "kernels.moe"),
                                   ("deepinfer_gemm_backends", k.gemm, "kernels.gemm")):
            # Only attention backends read the KV cache; MoE and GEMM backends are not asked about its dtype.
            hook_req = req if hook == "deepinfer_attention_backends" else dataclasses.replace(req, kv_dtype="auto")
            backends.update(self.host.select_backends(hook, chosen, path, hook_req,
                                                      getattr(self.model, "backend_ops", None)))
        if k.dispatch != "auto":  # the expert-parallel ops, offered with the MoE backends
            picked = self.host.select_backends("deepinfer_moe_backends", k.dispatch, "kernels.dispatch",
                                               dataclasses.replace(req, kv_dtype="auto"))
            if picked.get("dispatch") is None or picked["dispatch"].name != k.dispatch:
                raise ConfigError(f"kernels.dispatch: backend {k.dispatch!r} does not implement ops dispatch/combine; "
                                  "choose torch_all_to_all, torch_all_to_all_capacity or auto")
            backends.update(dispatch=picked["dispatch"], combine=picked["combine"])
        return backends

    # ------------------------------------------------------------------------------------ speculation

    def _spec_settings(self) -> SpecSettings | None:
        """The ``speculative`` section as the engine runs it: None when no enabled plugin offers drafters
        or ``max_draft`` is 0. ``auto`` is ``mtp`` on a model whose config declares MTP layers and whose
        class can run them, else ``ngram``; an explicit ``mtp`` on any other model is refused here,
        before the weights load."""
        spec = self.config.speculative
        if not self.host.named_offers("deepinfer_drafters"):
            return None
        if spec.max_draft == 0:  # DEEPINFER_USE_NEXTN_DECODE=0: the reference's "no speculation"
            logger.info("speculative.max_draft is 0: speculative decoding is off")
            return None
        drafter = spec.drafter
        runs_mtp = hasattr(self.model, "mtp_hidden") and hasattr(self.model, "bind_mtp_cache")
        if drafter == "auto":
            drafter = "mtp" if self.model_has_mtp and runs_mtp else "ngram"
        elif drafter == "mtp" and not (self.model_has_mtp and runs_mtp):
            arch = self.hf_config["architectures"][0]
            why = ("its config.json has no num_nextn_predict_layers > 0" if runs_mtp
                   else f"{arch} cannot run its MTP layers as a drafter yet")
            raise ConfigError(f"speculative.drafter='mtp' needs a model with MTP layers, but {why}; "
                              "choose drafter 'ngram' (or 'auto')")
        return SpecSettings(drafter, spec.plan, spec.max_draft)

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
        if self.config.speculative.drafter == "auto":
            logger.warning("speculative.drafter='auto': %s; drafting with 'ngram' instead", missing)
            self.spec_settings = dataclasses.replace(self.spec_settings, drafter="ngram")
            return []
        raise ConfigError(f"speculative.drafter='mtp': {missing}; choose drafter 'ngram' (or 'auto')")

    def _drafting(self) -> tuple[Drafter, VerificationPlan] | None:
        """The drafter and the verification plan (None without speculative decoding). Built before the
        runner and the graphs: a drafter that calls the model's ``capture_hidden`` (dspark) decides which
        layers' features both keep."""
        if self.drafter_factory is None:  # no speculative decoding
            return None
        plan = self.host.select("deepinfer_verification_plans", self.spec_settings.plan, "speculative.plan")
        return self.drafter_factory(model=self.model, info=self.info), plan

    def _drafter_factory(self) -> Any:
        """The chosen drafter's factory (None without speculative decoding); chosen before the pool is sized,
        which counts the rows a ``SlotCachingDrafterFactory``'s drafter keeps."""
        settings = self.spec_settings
        if settings is None:
            return None
        return self.host.select("deepinfer_drafters", settings.drafter, "speculative.drafter")

    def _runner_and_speculator(self, graphs: DecodeGraphs | None, piecewise: PiecewiseGraphs | None,
                               drafting: tuple[Drafter, VerificationPlan] | None
                               ) -> tuple[ModelRunner, Speculator | None]:
        """The runner, and the speculator over it and ``drafting`` (``_drafting``)."""
        settings = self.spec_settings
        stateful = bool(self.num_state_slots)
        block_size = self.config.cache.block_size
        if settings is None or drafting is None:
            return ModelRunner(self.model, self.backends, block_size, self.device, graphs=graphs,
                               piecewise=piecewise, stateful=stateful), None
        drafter, plan = drafting
        # dspark reads the captured layers' features of the committed rows (CommittedRows.hidden); the mtp
        # drafter writes MTP cache rows for every committed token: both need each step's hidden states.
        hidden_layers = tuple(getattr(self.model, "captured_layers", ()))
        keep_hidden = self.uses_mtp or bool(hidden_layers)
        runner = ModelRunner(self.model, self.backends, block_size, self.device, graphs=graphs, piecewise=piecewise,
                             stateful=stateful, keep_hidden=keep_hidden, hidden_layers=hidden_layers)
        sched = self.config.scheduler
        largest = min(sched.max_num_seqs * (1 + settings.max_draft), sched.max_num_batched_tokens)

        def measure(query_tokens: int) -> float:
            # Verification-shaped rows (1 + max_draft tokens per request): what the plan's budget buys.
            return time_call(lambda: runner.placeholder_step(query_tokens, 1 + settings.max_draft), self.device)

        # A runner that keeps layer features the graphs do not (dspark's) runs every step eagerly.
        served = graphs if graphs is not None and graphs.keeps(hidden_layers) else None
        cost = self._step_cost(measure, largest, 1 + settings.max_draft, served)
        tokens = TokenCache(self.pool.num_blocks * block_size, block_size, self.device)
        return runner, Speculator(drafter, plan, cost, settings.max_draft, block_size=block_size,
                                  reads_rows=keep_hidden, token_cache=tokens, exact_host_lists=runner.exact_host_lists)

    def _tail_graphs(self, graphs: DecodeGraphs | None) -> TailGraphs | None:
        """The speculative tail's CUDA graphs (``engine/tail_graphs.py``): when verification steps replay graphs
        that keep what the drafter reads, on a model without per-request state, and the drafter can be
        captured (``interfaces.GraphDrafter``); else None (the tail runs eagerly)."""
        spec, runner = self.speculator, self.runner
        if spec is None or graphs is None or self.num_state_slots or not graphs.keeps(runner.hidden_layers):
            return None
        drafter = spec.drafter
        if not isinstance(drafter, GraphDrafter) or not drafter.graph_capturable:
            return None
        return TailGraphs(graphs, spec, runner.hidden_layers)

    def _step_cost(self, measure: Callable[[int], float], largest: int, query_len: int,
                   graphs: DecodeGraphs | None) -> StepCost:
        """The varlen plan's step-cost model: its curve profiled on demand on eager placeholder steps, or,
        when ``graphs`` serve verification steps, at start-up from one replay per graph bucket, each step then
        charged as its bucket. With ``scheduler.step_cost_cache_dir`` set, the points profiled so far are kept
        on disk per run shape and a later engine of the same shape starts from them (an eager curve then
        profiles only the sizes its predecessors never reached)."""
        bucketed = graphs is not None and query_len in graphs.max_query_lens  # else verification runs eagerly
        if bucketed:
            assert graphs is not None

            def replay(query_tokens: int) -> float:
                graphs.load_placeholder((query_tokens, query_len))
                return time_call(lambda: graphs.replay((query_tokens, query_len)), self.device)

            cost = StepCost(replay, largest, sizes=graphs.buckets, bucketed=True)  # a step replays its bucket's graph
        else:  # powers of two, and both sides of every row count where the GEMM backend changes its kernel
            breaks = getattr(self.backends["linear"], "row_breaks", None)
            sizes = set(profile_sizes(largest))
            if breaks is not None:
                sizes |= {n for b in breaks(self.dtype) for n in (b, b + 1) if 0 < n <= largest}
            cost = StepCost(measure, largest, sizes=sorted(sizes))
        sched = self.config.scheduler
        folder = sched.step_cost_cache_dir
        if folder:
            cache = CurveCache(folder, sched.step_cost_cache_ttl_s)
            device = (torch.cuda.get_device_name(self.device) if self.device.type == "cuda"
                      else f"{platform.machine()} {platform.processor()} x{torch.get_num_threads()} threads")
            key = {"model": str(self.model_path), "architecture": self.info.architecture, "dtype": self.info.dtype,
                   "device": device, "backends": sorted(f"{op}={self.backends[op].name}" for op in self._model_ops()
                                                        if op in self.backends),
                   "buckets": graphs.buckets if bucketed and graphs is not None else "eager", "largest": largest,
                   "query_len": query_len, "block_size": self.config.cache.block_size, "kv_dtype": str(self.kv_dtype),
                   "placeholder": "random ids, distinct positions"}
            cached = cache.load(key)
            if cached:
                cost.load(cached)
            cost.on_profiled = lambda points: cache.save(key, points)
        if bucketed:
            cost.profile_all()
        return cost

    # ------------------------------------------------------------------------------ cache and graphs

    def _model_ops(self) -> frozenset[str]:
        """The ops the model calls (its ``backend_ops``; every selected op when it names none): an op it does
        not call may hold a backend that cannot serve this run (``UnfitBackend``), which nothing may touch."""
        return getattr(self.model, "backend_ops", None) or frozenset(self.backends)

    def _decode_graphs(self) -> DecodeGraphs | None:
        """CUDA graphs for decode-shaped steps (``engine/graphs.py``), captured now; None when the run is
        not on CUDA, ``kernels.cuda_graphs`` is off, or something in the step cannot be captured (then
        a warning names it and the GPU runs eagerly)."""
        k = self.config.kernels
        if self.device.type != "cuda" or not k.cuda_graphs:
            return None
        backends = self.backends
        ops = self._model_ops()
        blockers = [f"{op} backend {backends[op].name!r} is not graph_safe" for op in sorted(ops)
                    if op in backends and not backends[op].capabilities.graph_safe]
        if self.world_size > 1:
            blockers.append("expert parallelism exchanges split sizes on the host")
        if blockers:
            logger.warning("kernels.cuda_graphs: running eagerly: %s (enable a plugin that offers graph-safe "
                           "backends, e.g. plugins.attention, or set kernels.cuda_graphs=false)", "; ".join(blockers))
            return None
        sched = self.config.scheduler
        max_draft = self.spec_settings.max_draft if self.spec_settings else 0
        # A model with per-request state (DeepSeek-V4) updates it on the device in steps of at most
        # cache.max_backtrack + 1 query tokens per request, which covers verification (max_draft + 1).
        graphs = DecodeGraphs(self.model, backends, self.config.cache.block_size, self.device,
                              max_tokens=min(sched.max_num_seqs * (1 + max_draft), sched.max_num_batched_tokens),
                              max_query_lens=(1, 1 + max_draft), max_blocks=self.kv.blocks_needed(self.max_model_len),
                              interval=k.cuda_graph_interval, stateful=bool(self.num_state_slots))
        graphs.capture()
        return graphs

    def _piecewise_graphs(self, graphs: DecodeGraphs | None) -> PiecewiseGraphs | None:
        """The forward captured in pieces for steps with prompt rows (``engine/piecewise.py``), captured now;
        None when the decode graphs are off (``_decode_graphs``), ``kernels.piecewise_max_tokens`` is 0, the
        model keeps per-request state, or its layers are compiled."""
        k, sched = self.config.kernels, self.config.scheduler
        if graphs is None or not k.piecewise_max_tokens or self.num_state_slots or k.compile != "off":
            return None
        piecewise = PiecewiseGraphs(self.model, self.backends, self.config.cache.block_size, self.device,
                                    max_tokens=min(k.piecewise_max_tokens, sched.max_num_batched_tokens))
        piecewise.capture()
        return piecewise

    def _num_kv_blocks(self, specs: list, drafter_bytes_per_slot: int = 0) -> int:
        """Blocks of the pool for ``specs`` within the KV budget, of which the state slots' rings and the
        drafter's rows (``drafter_bytes_per_slot`` per pool slot) take their share."""
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
        state = state_bytes(specs, self.num_state_slots, self.max_backtrack, self.dtype, self.kv_dtype)
        if state and state >= budget:
            raise ConfigError(
                f"the model's per-request state takes {state} bytes for {self.num_state_slots} state slots "
                f"(from scheduler.max_num_seqs={self.config.scheduler.max_num_seqs}), more than the KV budget "
                f"of {budget} bytes; raise cache.kv_cache_bytes or lower scheduler.max_num_seqs")
        budget -= state
        drafter_block = drafter_bytes_per_slot * cache.block_size
        blocks = num_blocks_for(budget, specs, cache.block_size, self.kv_dtype, extra_per_block=drafter_block)
        logger.info("KV cache: %d blocks of %d tokens (%d bytes each%s)", blocks, cache.block_size,
                    bytes_per_block(specs, cache.block_size, self.kv_dtype),
                    f", and {drafter_block} for the drafter's rows" if drafter_block else "")
        return blocks
