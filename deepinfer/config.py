"""The engine configuration: one pydantic tree, built from layered sources.

Sources, lowest to highest precedence (API.md §5): the field defaults, a YAML/JSON file, ``DEEPINFER_*``
environment variables, then keyword arguments / ``--set`` flags. Every leaf that does not come from
the defaults remembers its source, so ``deepinfer config show`` can say where a value came from.
Plugin sections (``plugins.<name>``) are kept as plain dicts here and validated by each plugin's own
``config_model`` when the plugin host builds it.
"""

from __future__ import annotations

import copy
import difflib
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from deepinfer.errors import ConfigError

logger = logging.getLogger(__name__)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSection(_Section):
    """What to load and how."""

    path: str = "smollm2-135m-instruct"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    load_format: Literal["auto", "dummy"] = "auto"
    # Weight-only quantization of the GEMM weights (``none``: the model dtype, the default oracle); a value
    # needs an enabled plugin that serves it (``plugins.cpu``: ``int8``, ``q4_1`` on CPU in float32).
    quantization: Literal["none", "int8", "q4_1"] = "none"
    tokenizer: str | None = None
    max_model_len: int | None = Field(default=None, ge=1)


class CacheSection(_Section):
    """The paged KV cache."""

    block_size: int = Field(default=128, ge=1, le=4096)
    gpu_memory_utilization: float = Field(default=0.9, gt=0.0, le=1.0)
    kv_cache_bytes: int | None = Field(default=None, ge=1)
    # fp8: MXFP8 rows (kv/fp8.py); fp4: DeepSeek-V4.1's FP4 main KV with MXFP8 sliding-window KV (kv/v41_cache.py),
    # V4.1 only. Each model's caches name the values they store; others fail at start-up (kv/pools.check_kv_dtype).
    kv_dtype: Literal["auto", "bf16", "fp8", "fp4"] = "auto"
    prefix_caching: bool = True
    # In-step prefix sharing (engine/scheduler.py): admission holds a request back while a request of the
    # step's batch computes its next prefix blocks, so it hits them instead of computing them beside it.
    in_step_prefix_sharing: bool = True
    max_backtrack: Literal["auto"] | int = "auto"
    replay: str = "auto"
    # External KV tiers under the prefix cache (kv/tiers.py): a store name, or a chain fastest first joined
    # by "+" ("host+disk"), each offered by an enabled plugin (plugins.kv_store); None: none.
    kv_store: str | None = None


class SamplingSection(_Section):
    """Engine-wide sampling defaults, and the structured-output compiler (threads, timeout, cache)."""

    seed: int = 0
    grammar_threads: int = Field(default=2, ge=1, le=64)
    grammar_timeout_s: float = Field(default=20.0, gt=0)
    grammar_cache: bool = True


class SchedulerSection(_Section):
    """Continuous batching limits and the strategies that drive it."""

    max_num_seqs: int = Field(default=256, ge=1)
    max_num_batched_tokens: int = Field(default=4096, ge=1)
    chunked_prefill: bool = True
    policy: str = "fcfs"
    executor: str = "auto"
    step_cost_cache_dir: str | None = None
    step_cost_cache_ttl_s: float = Field(default=3600.0, gt=0)


class ParallelSection(_Section):
    """Data-parallel attention and expert-parallel MoE."""

    data_parallel_size: int = Field(default=1, ge=1)
    expert_parallel_size: int = Field(default=1, ge=1)
    router: str = "round_robin"
    # Used when an enabled plugin offers placement policies (plugins.eplb): the one that rebalances the
    # experts of an expert-parallel run; without such a plugin the initial placement stays.
    placement_policy: str = "greedy_multistep"
    # Fixed-capacity dispatch (kernels.dispatch: torch_all_to_all_capacity) only: rows per (source,
    # destination) rank pair = ceil(factor · T · top_k / ranks), T the most tokens any rank has in the
    # forward, capped at the worst case T · top_k. None: the worst case, which never
    # overflows and needs no check; a factor: pairs past it take a counted exact-split exchange.
    dispatch_capacity_factor: float | None = Field(default=None, gt=0, le=64)


class SpeculativeSection(_Section):
    """Speculative decoding: on when an enabled plugin offers drafters (``plugins.spec_decode``) and
    ``max_draft`` > 0.

    ``drafter``: a drafter offered by a plugin, or ``auto`` (``mtp`` when the model declares MTP
    layers and its class can run them, else ``ngram``). ``plan``: a verification plan offered by a
    plugin (default ``fixed``, the reference's: no measurement has ``varlen`` ahead everywhere yet).
    ``max_draft``: drafts proposed per request per step (0: no speculation; the engine's
    rollback reserve ``cache.max_backtrack: auto`` is ``max_draft + 1``).
    """

    drafter: str = "auto"
    plan: str = "fixed"
    max_draft: int = Field(default=5, ge=0, le=32)

    @field_validator("plan", mode="before")
    @classmethod
    def _varlen_switch(cls, value: Any) -> Any:
        """The reference's ``DEEPINFER_ENABLE_MTP_VARLEN`` arrives as 1/0 (an int or a bool)."""
        if isinstance(value, bool | int):
            return "varlen" if value else "fixed"
        return value


class KernelsSection(_Section):
    """Backend choice per op, and kernel-wide switches."""

    attention: str = "auto"
    moe: str = "auto"
    gemm: str = "auto"
    # Expert-parallel ops dispatch/combine (offered with the MoE backends): torch_all_to_all (exact
    # split sizes, the oracle) or torch_all_to_all_capacity (fixed per-pair capacity, equal splits).
    dispatch: str = "auto"
    batch_invariant: bool = False
    cuda_graphs: bool = True
    cuda_graph_interval: int = Field(default=8, ge=1)
    # Steps with prompt rows replay the forward captured in pieces cut at the attention calls
    # (engine/piecewise.py), up to this many query tokens (0: such steps run eagerly).
    piecewise_max_tokens: int = Field(default=2048, ge=0)
    force_balanced_routing: bool = False
    compile: Literal["off", "inductor"] = "off"

    @field_validator("compile", mode="before")
    @classmethod
    def _compile_switch(cls, value: Any) -> Any:
        """YAML reads ``off`` (``--set kernels.compile=off``) as false; true means ``inductor``."""
        if isinstance(value, bool):
            return "inductor" if value else "off"
        return value


class EngineConfig(_Section):
    """The whole engine configuration (API.md §5)."""

    model: ModelSection = Field(default_factory=ModelSection)
    cache: CacheSection = Field(default_factory=CacheSection)
    sampling: SamplingSection = Field(default_factory=SamplingSection)
    scheduler: SchedulerSection = Field(default_factory=SchedulerSection)
    parallel: ParallelSection = Field(default_factory=ParallelSection)
    kernels: KernelsSection = Field(default_factory=KernelsSection)
    speculative: SpeculativeSection = Field(default_factory=SpeculativeSection)
    plugins: dict[str, dict[str, Any]] = Field(default_factory=dict)


SECTIONS = ("model", "cache", "sampling", "scheduler", "parallel", "kernels", "speculative")

# Flat keyword overrides of ``LLM(...)`` (API.md §4): field name -> section. Unique across sections.
FLAT_OVERRIDES: dict[str, str] = {
    "dtype": "model",
    "device": "model",
    "load_format": "model",
    "quantization": "model",
    "tokenizer": "model",
    "max_model_len": "model",
    "max_num_seqs": "scheduler",
    "max_num_batched_tokens": "scheduler",
    "block_size": "cache",
    "gpu_memory_utilization": "cache",
    "kv_cache_bytes": "cache",
    "kv_dtype": "cache",
    "seed": "sampling",
    "data_parallel_size": "parallel",
    "expert_parallel_size": "parallel",
}

# Whole-section keyword overrides; ``model_config`` because ``model`` is LLM's first argument.
SECTION_OVERRIDES: dict[str, str] = {
    "model_config": "model",
    "cache": "cache",
    "scheduler": "scheduler",
    "parallel": "parallel",
    "kernels": "kernels",
    "sampling": "sampling",
    "speculative": "speculative",
    "plugins": "plugins",
}

# The reference system's knobs that the core implements: env name -> (config path, converter).
_CORE_KNOBS: dict[str, tuple[str, Any]] = {
    "DEEPINFER_BATCH_INVARIANT": ("kernels.batch_invariant", lambda v: _flag(v)),
    "DEEPINFER_ENFORCE_EAGER": ("kernels.cuda_graphs", lambda v: not _flag(v)),
    "DEEPINFER_CUDAGRAPH_BATCH_SIZE_INTERVAL": ("kernels.cuda_graph_interval", lambda v: _parse_scalar(v)),
    "DEEPINFER_DECODE_PERF_CACHE_DIR": ("scheduler.step_cost_cache_dir", lambda v: v),
    "DEEPINFER_DECODE_PERF_CACHE_TTL_SEC": ("scheduler.step_cost_cache_ttl_s", lambda v: _parse_scalar(v)),
    "DEEPINFER_FORCE_LOAD_BALANCE": ("kernels.force_balanced_routing", lambda v: _flag(v)),
    "DEEPINFER_XGRAMMAR_TIMEOUT": ("sampling.grammar_timeout_s", lambda v: _parse_scalar(v)),
    "DEEPINFER_SO_BUILDER_CPUS": ("sampling.grammar_threads", lambda v: _parse_scalar(v)),
    "DEEPINFER_XGRAMMAR_DISABLE_CACHE": ("sampling.grammar_cache", lambda v: not _flag(v)),
    # The reference's ring is window + this many tokens (cache_engine); ours is window + cache.max_backtrack.
    "DEEPINFER_MAX_BACKTRACKING_TOKENS": ("cache.max_backtrack", lambda v: _parse_scalar(v)),
}

# DEEPINFER_* variables read outside the config tree (the server key, the model cache, the GPU test device).
OTHER_ENV = frozenset({"DEEPINFER_API_KEY", "DEEPINFER_METRICS_API_KEY", "DEEPINFER_CACHE_DIR",
                       "DEEPINFER_GPU_TEST_DEVICE"})
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")

# Every knob the reference documents (reference/deepinfer.md §1.5). Those nobody maps give one warning.
REFERENCE_KNOBS = frozenset((
    "ACCELERATOR", "COMPUTE_SUM_SMALLER_PROBS", "JIT_CACHE_DIR", "NCCL_NUM_SMS", "USERBUFFER_COMM_SMS",
    "GLOO_TIMEOUT", "REARRANGE_P2P_GROUPS", "OVERRIDE_NUM_EXTRA_EXPERTS", "EXPERT_COUNT_WINDOW_SIZE",
    "EXPERT_REARRANGEMENT_STEP_INTERVAL", "REARRANGE_AFTER_PREFILL_IN_NORMAL_ENGINE", "MOE_LB_STAT_INTERVAL",
    "FORCE_IMBALANCE_RATIO", "FORCE_LOAD_BALANCE", "SHOW_EPLB_DETAIL", "PREFILL_MAX_SUM_SEQLEN_K",
    "INDEX_ATTN_MEMORY_LIMIT", "USE_NEXTN_DECODE", "ENABLE_MTP_VARLEN", "MAX_BACKTRACKING_TOKENS",
    "DFLASH_CONFIDENCE_HEAD_TEMPERATURE", "ENGRAM_PAD_TOKEN", "ENGRAM_FORCE_GPU_STORAGE", "SAMPLER_FORCE_TOPK",
    "DECODE_TOKEN_BLACKLIST", "ENFORCE_EAGER", "CUDAGRAPH_BATCH_SIZE_INTERVAL", "DFLASH_ENFORCE_EAGER",
    "DFLASH_CUDAGRAPH_BATCH_SIZE_INTERVAL", "DECODE_PERF_CACHE_DIR", "DECODE_PERF_CACHE_TTL_SEC",
    "NUM_STATE_SLOTS_RATIO", "PREFILL_STORE_EXTRA_STATE", "PREFILL_STORE_EXTRA_SIZE", "XGRAMMAR_DEBUG",
    "XGRAMMAR_TIMEOUT", "XGRAMMAR_DISABLE_CACHE", "XGRAMMAR_CACHE_LIMIT_BYTES", "SO_BUILDER_CPUS",
    "PREFILL_ATTEMPT_INTERVAL", "PREFILL_ANY_ATTEMPT_INTERVAL", "ZERO_OVERHEAD_SCHEDULING",
    "LOGGING_INTERVAL_STEP", "NCCL_MEMORY_SAMPLE_INTERVAL_STEPS", "RINGBUFFER_WARNING_INTERVAL",
    "GC_INTERVAL_STEP", "YOCO_PREFILL_TRUNCATION_MODE", "YOCO_PREFILL_KEEP_TOKENS", "DISABLE_SYNC_GUARD",
    "PROFILE_TORCH_CUDA_MEMORY", "ENABLE_MEMORY_TRACING", "PROFILE_HTTP_ENABLE", "PROFILE_HTTP_PORT_BASE",
    "TORCH_PROFILER_DIR", "USE_MULTIMODAL_POOL", "MULTIMODAL_POOL_SIZE_GB", "MULTI_MODAL_BUFFER_SIZE",
    "MULTI_MODAL_WORKER_TIMEOUT", "CPP_LOG_LEVEL", "HF_MODEL_DIR",
))

_warned_knobs: set[str] = set()
_warned_unknown: set[str] = set()


def _flag(value: str) -> bool:
    """A boolean knob's value: one of 1/true/yes/on or 0/false/no/off (or empty), any case; anything else
    is an error rather than a silent False."""
    word = value.strip().lower()
    if word not in _TRUE + _FALSE:
        raise ValueError(f"expected a boolean ({'/'.join(_TRUE)} or {'/'.join(_FALSE[:-1])}), got {value!r}")
    return word in _TRUE


# An env alias a plugin offers (``deepinfer_config_aliases``): the config path the variable sets, or that
# path and the values it implies for other paths (``env_overrides``).
ConfigAlias = str | tuple[str, Mapping[str, Any]]


def known_env_names(aliases: Mapping[str, ConfigAlias] | None = None) -> list[str]:
    """Every ``DEEPINFER_*`` name deepinfer reads: the ``<SECTION>__<FIELD>`` form of each core config field,
    the implemented and documented reference knobs, plugin aliases, and the variables outside the tree."""
    env_aliases, _ = split_aliases(aliases or {})
    names = {*_CORE_KNOBS, *OTHER_ENV, *(f"DEEPINFER_{k}" for k in REFERENCE_KNOBS), *env_aliases}
    for section, info in EngineConfig.model_fields.items():
        model = info.annotation
        if isinstance(model, type) and issubclass(model, BaseModel):
            names.update(f"DEEPINFER_{section.upper()}__{field.upper()}" for field in model.model_fields)
    return sorted(names)


def split_aliases(aliases: Mapping[str, ConfigAlias]) -> tuple[dict[str, ConfigAlias], dict[str, str]]:
    """``deepinfer_config_aliases`` offers two kinds of alias: environment names (no dot) and old config
    paths (dotted, e.g. ``plugins.spec_decode.max_draft`` → ``speculative.max_draft``). Returns
    ``(env aliases, path aliases)``."""
    env = {name: path for name, path in aliases.items() if "." not in name}
    paths = {old: path for old, path in aliases.items() if "." in old and isinstance(path, str)}
    return env, paths


_MISSING = object()


def _pop_path(tree: dict[str, Any], path: str) -> Any:
    """Remove and return the leaf at ``path`` (``_MISSING`` when absent); empty parents stay."""
    node: Any = tree
    *parents, leaf = path.split(".")
    for key in parents:
        node = node.get(key) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            return _MISSING
    return node.pop(leaf, _MISSING)


def _get_path(tree: Mapping[str, Any], path: str) -> Any:
    node: Any = tree
    for key in path.split("."):
        if not isinstance(node, Mapping) or key not in node:
            return _MISSING
        node = node[key]
    return node


def _move_aliased(tree: dict[str, Any], moved: Mapping[str, str], layer: str) -> dict[str, Any]:
    """One source layer with every old config path moved onto its new path (a copy; ``tree`` is not
    changed). The same layer setting both to different values is a ``ConfigError`` naming both."""
    if not moved:
        return tree
    out = copy.deepcopy(tree)
    for old, new in moved.items():
        value = _pop_path(out, old)
        if value is _MISSING:
            continue
        current = _get_path(out, new)
        if current is not _MISSING and current != value:
            raise ConfigError(f"{layer}: {old}={value!r} and {new}={current!r} set the same field ({old} is the "
                              f"older name of {new}); set only {new}")
        _set_path(out, new, value)
    return out


def _mirror_aliased(config: EngineConfig, moved: Mapping[str, str]) -> None:
    """Write each moved field's resolved value back into the plugin section that used to own it, when
    that section is configured, so a plugin reading its own section sees what the core uses."""
    for old, new in moved.items():
        head, _, rest = old.partition(".")
        name, _, field = rest.partition(".")
        if head != "plugins" or not field or "." in field or name not in config.plugins:
            continue
        value = _get_path(config.model_dump(), new)
        if value is not _MISSING:
            config.plugins[name][field] = value


def _parse_scalar(text: str) -> Any:
    """Read an env or ``--set`` value: YAML scalars (ints, floats, bools, null, lists) or a string."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _set_path(tree: dict[str, Any], path: str, value: Any) -> None:
    node = tree
    *parents, leaf = path.split(".")
    for key in parents:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config path {path!r}: {key!r} is not a section")
        node = child
    node[leaf] = value


def _merge(base: dict[str, Any], update: Mapping[str, Any], source: str, prefix: str,
           sources: dict[str, str]) -> None:
    """Deep-merge ``update`` into ``base`` and record ``source`` for every leaf it sets."""
    for key, value in update.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _merge(base[key], value, source, path + ".", sources)
        elif isinstance(value, Mapping):
            base[key] = {}
            _merge(base[key], value, source, path + ".", sources)
        else:
            base[key] = value
            sources[path] = source


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a YAML or JSON config file into a nested dict."""
    file = Path(path)
    if file.is_dir():
        raise ConfigError(f"config file {str(file)!r} is a directory; give a YAML or JSON file")
    if not file.is_file():
        raise ConfigError(f"config file {str(file)!r} does not exist")
    try:
        text = file.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {str(file)!r} is not UTF-8 text (a binary file?): byte {exc.start}") from None
    except OSError as exc:
        raise ConfigError(f"config file {str(file)!r} cannot be read: {exc.strerror or exc}") from None
    is_json = file.suffix == ".json"
    try:
        data = json.loads(text) if is_json else yaml.safe_load(text)
    except RecursionError:
        raise ConfigError(f"config file {str(file)!r} is nested too deeply") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"config file {str(file)!r} is not valid JSON: {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"config file {str(file)!r} is not valid YAML: {problem}{where}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(file)!r} must hold a mapping of sections")
    return data


def env_overrides(environ: Mapping[str, str], aliases: Mapping[str, ConfigAlias] | None = None) -> dict[str, Any]:
    """Collect ``DEEPINFER_<SECTION>__<FIELD>`` variables and the reference knobs that are mapped.

    ``aliases`` maps further env names onto config paths (plugins provide them through
    ``deepinfer_config_aliases``): a path, or ``(path, implied)`` where ``implied`` maps further paths to
    the values the variable implies unless another variable sets them (the reference's
    ``DEEPINFER_USE_NEXTN_DECODE=k`` alone turns speculation on with the fixed plan). A documented
    reference knob that nobody maps warns once.
    """
    tree: dict[str, Any] = {}
    aliases = aliases or {}
    implied: dict[str, Any] = {}
    for name, raw in sorted(environ.items()):
        if not name.startswith("DEEPINFER_"):
            continue
        rest = name[len("DEEPINFER_"):]
        if "__" in rest:
            section, _, field = rest.partition("__")
            path = f"{section.lower()}.{field.lower().replace('__', '.')}"
            _set_path(tree, path, _parse_scalar(raw))
        elif name in _CORE_KNOBS:
            path, convert = _CORE_KNOBS[name]
            try:
                value = convert(raw)
            except ValueError as exc:
                raise ConfigError(f"environment variable {name} (sets {path}): {exc}") from None
            _set_path(tree, path, value)
        elif name in aliases:
            alias = aliases[name]
            path, also = (alias, {}) if isinstance(alias, str) else alias
            _set_path(tree, path, _parse_scalar(raw))
            implied.update(also)
        elif rest in REFERENCE_KNOBS:
            if name not in _warned_knobs:
                _warned_knobs.add(name)
                logger.warning("%s is a reference-system knob that deepinfer does not implement; ignored", name)
        elif name not in OTHER_ENV and name not in _warned_unknown:
            # A misspelt name would otherwise be dropped without a word (e.g. one underscore for two).
            _warned_unknown.add(name)
            close = difflib.get_close_matches(name, known_env_names(aliases), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else " (config fields are DEEPINFER_<SECTION>__<FIELD>)"
            logger.warning("%s is not a deepinfer environment variable; ignored%s", name, hint)
    for path, value in implied.items():
        if _get_path(tree, path) is _MISSING:
            _set_path(tree, path, value)
    return tree



def overrides_to_tree(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Turn ``LLM(**overrides)`` keywords (flat fields or whole sections) into a nested dict."""
    tree: dict[str, Any] = {}
    for key, value in overrides.items():
        if key in FLAT_OVERRIDES:
            _set_path(tree, f"{FLAT_OVERRIDES[key]}.{key}", value)
        elif key in SECTION_OVERRIDES:
            if not isinstance(value, Mapping):
                raise ConfigError(f"{key}= must be a mapping of fields, got {type(value).__name__}")
            section = SECTION_OVERRIDES[key]
            _merge(tree.setdefault(section, {}), value, "", "", {})
        else:
            allowed = ", ".join(sorted([*FLAT_OVERRIDES, *SECTION_OVERRIDES]))
            raise ConfigError(f"unknown keyword argument {key!r}; allowed: {allowed}")
    return tree


def set_flags_to_tree(assignments: list[str]) -> dict[str, Any]:
    """Turn ``--set section.field=value`` strings into a nested dict."""
    tree: dict[str, Any] = {}
    for item in assignments:
        path, sep, raw = item.partition("=")
        if not sep or "." not in path:
            raise ConfigError(f"--set {item!r}: expected section.field=value")
        _set_path(tree, path.strip(), _parse_scalar(raw))
    return tree


class ResolvedConfig:
    """A validated ``EngineConfig`` and the source of each non-default leaf."""

    def __init__(self, config: EngineConfig, sources: dict[str, str]) -> None:
        self.config = config
        self.sources = sources


def build_config(
    *,
    config: str | os.PathLike[str] | Mapping[str, Any] | EngineConfig | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    aliases: Mapping[str, str] | None = None,
) -> ResolvedConfig:
    """Layer defaults < file < environment < overrides and validate the result.

    ``config`` is a file path, a dict, or an ``EngineConfig``; ``overrides`` is a nested dict (use
    ``overrides_to_tree`` / ``set_flags_to_tree`` to build it). ``aliases`` (``config_aliases``) maps
    environment names and old config paths onto config paths; an old path is moved onto its new one
    in each source before the layers merge, so precedence holds whichever name a source uses.
    Raises ``ConfigError`` naming the field path and the allowed values.
    """
    env_aliases, moved = split_aliases(aliases or {})
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    layers: list[tuple[str, Mapping[str, Any]]] = []
    if isinstance(config, EngineConfig):
        layers.append(("config object", config.model_dump(exclude_defaults=True)))
    elif isinstance(config, Mapping):
        layers.append(("config dict", config))
    elif config is not None:
        layers.append((f"file {config}", read_config_file(config)))
    env = os.environ if environ is None else environ
    layers.append(("environment", env_overrides(env, env_aliases)))
    layers.append(("override", overrides or {}))
    for source, tree in layers:
        _merge(merged, _move_aliased(dict(tree), moved, source), source, "", sources)
    try:
        validated = EngineConfig.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, model=EngineConfig)) from None
    _mirror_aliased(validated, moved)
    return ResolvedConfig(validated, sources)


def _fields_at(model: type[BaseModel] | None, loc: tuple[Any, ...]) -> list[str]:
    """The field names of the (sub)model of ``model`` found at ``loc`` (empty if not a model)."""
    for part in loc:
        field = model.model_fields.get(str(part)) if model is not None else None
        annotation = field.annotation if field is not None else None
        model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    return list(model.model_fields) if model is not None else []


def format_validation_error(exc: ValidationError, prefix: str = "", model: type[BaseModel] | None = None) -> str:
    """One line per problem: ``path: message`` (pydantic's message carries the allowed values; for an
    unknown key, the allowed keys come from ``model``, the validated model, when given)."""
    lines = []
    for err in exc.errors():
        path = prefix + ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            allowed = _fields_at(model, tuple(err["loc"][:-1]))
            close = difflib.get_close_matches(str(err["loc"][-1]), allowed, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            hint += f"; allowed: {', '.join(allowed)}" if allowed else ""
            lines.append(f"{path}: unknown config key{hint}")
        else:
            lines.append(f"{path}: {err['msg']} (got {err.get('input')!r})")
    return "invalid config: " + "; ".join(lines)
