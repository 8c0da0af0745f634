"""Strategy and backend interfaces, and the small typed payloads that cross the hook boundary.

A strategy is a small object behind a Protocol: it makes one decision on small, typed inputs and
never sees the engine. Payloads are frozen dataclasses of plain values and tensors. The hooks that
offer these objects are declared in ``deepinfer.hookspecs``; API.md §2 fixes the names.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from deepinfer.outputs import RequestOutput

# --------------------------------------------------------------------------------------------------
# Engine facts and per-step observations


@dataclass(frozen=True)
class LayerCacheInfo:
    """How one layer uses the cache: ``kind`` is ``full`` (paged KV), ``sliding`` (a ring in a state
    slot) or ``compressed``; ``window`` is the sliding window in tokens (0 if none); ``ratio`` the
    compression ratio (1 if none); ``role`` is ``producer`` or ``consumer`` under YoCo, else ``plain``."""

    kind: Literal["full", "sliding", "compressed"]
    window: int = 0
    ratio: int = 1
    role: Literal["plain", "producer", "consumer"] = "plain"


@dataclass(frozen=True)
class CacheLayout:
    """Every layer's cache use, in layer order."""

    layers: tuple[LayerCacheInfo, ...]
    block_size: int
    max_backtrack: int


@dataclass(frozen=True)
class EngineInfo:
    """Facts resolved before plugins are built, for ``deepinfer_validate_config`` and observers.
    ``seed`` is the engine seed (``sampling.seed``), for weights a plugin initializes at random;
    ``model_path`` the model folder (for plugins that key caches by the target, e.g. a trained drafter);
    ``cuda_graphs`` whether the engine replays CUDA graphs (``kernels.cuda_graphs`` on a CUDA device): a plugin
    may then capture its own device work (the ``dspark`` drafter does)."""

    architecture: str
    num_layers: int
    vocab_size: int
    max_model_len: int
    layout: CacheLayout
    has_mtp: bool
    max_draft: int
    device: str
    dtype: str
    world_size: int
    seed: int = 0
    model_path: str = ""
    cuda_graphs: bool = False


@dataclass(frozen=True)
class StepStats:
    """One executor step, observed after it finished (times in seconds).

    ``timings`` has the keys ``schedule``, ``prepare``, ``forward``, ``sample``, ``process``.
    ``num_decode_tokens`` counts the query tokens of decode rows (1 + verified drafts each).
    Speculative decoding, one entry per request that verified drafts this step (empty otherwise):
    ``verified_drafts`` how many, ``accepted_drafts`` how many were accepted, ``draft_confidence``
    the confidences the plan ranked them by (calibrated) and ``draft_raw_confidence`` the drafter's
    own. ``router_loads`` is ``[layers, experts]`` tokens per expert, or None for dense models.
    """

    step: int
    num_requests: int
    num_prefill_tokens: int
    num_decode_tokens: int
    timings: Mapping[str, float]
    verified_drafts: tuple[int, ...] = ()
    accepted_drafts: tuple[int, ...] = ()
    draft_confidence: tuple[tuple[float, ...], ...] = ()
    draft_raw_confidence: tuple[tuple[float, ...], ...] = ()
    router_loads: torch.Tensor | None = None


# --------------------------------------------------------------------------------------------------
# Scheduling


@runtime_checkable
class SchedulableRequest(Protocol):
    """The read-only view of a request that scheduling policies and routers see."""

    @property
    def request_id(self) -> str: ...
    @property
    def arrival_time(self) -> float: ...
    @property
    def priority(self) -> int: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def num_output_tokens(self) -> int: ...
    @property
    def num_computed_tokens(self) -> int: ...


class SchedulePolicy(Protocol):
    """Which waiting request is admitted first, and which running request is preempted first."""

    def order(self, waiting: Sequence[SchedulableRequest], now: float) -> list[SchedulableRequest]:
        """Return ``waiting`` in admission order (a permutation; the scheduler admits front first).
        ``now`` is ``time.monotonic()``. Requests preempted earlier are in ``waiting`` too."""
        ...

    def preemption_victim(self, running: Sequence[SchedulableRequest]) -> SchedulableRequest:
        """Pick the running request to preempt when KV blocks run out (``running`` is non-empty)."""
        ...


class StepContext(Protocol):
    """The core's step primitives that an executor composes into ``step()`` (API.md §3;
    ``deepinfer/engine/core.py``).

    ``schedule()`` picks a batch on optimistic state (tokens of steps whose results are unread stand
    as pending). ``prepare(scheduled, previous)`` builds the step's tensors on the host and the remap
    of its pending input tokens onto ``previous``'s sampled rows. ``run(prepared, previous_results)``
    is the device part (fill pending inputs, forward, sample) and never reads the device.
    ``process(scheduled, results)`` is where the host reads a step's tokens (one sync), commits them,
    applies stops and returns outputs; ``process(None, None)`` only flushes outputs of aborts.
    ``execute(scheduled)`` is prepare + run when nothing is in flight. ``has_work()`` tells whether
    anything is queued or running.
    """

    def schedule(self) -> Any: ...
    def prepare(self, scheduled: Any, previous: Any = None) -> Any: ...
    def run(self, prepared: Any, previous_results: Any = None) -> Any: ...
    def execute(self, scheduled: Any) -> Any: ...
    def process(self, scheduled: Any, results: Any) -> list[RequestOutput]: ...
    def has_work(self) -> bool: ...


class StepExecutor(Protocol):
    """Runs one engine step and returns the outputs it produced (finished or streaming). When ``step``
    raises (an interrupt, a failing plugin), it first forgets the steps it has in flight, once the device
    is done with them; the engine then aborts every live request (``EngineCore.abort_after_failed_step``)."""

    def step(self) -> list[RequestOutput]: ...


StepExecutorFactory = Callable[[StepContext], StepExecutor]


@dataclass(frozen=True)
class RankLoad:
    """What a router sees of one data-parallel rank: queued and running requests and their tokens, and
    the KV blocks in use. Each rank reports its load with every step reply (no extra round trip); the
    driver adds the requests it routed there since (their tokens, and ``ceil(tokens / block_size)``
    blocks each)."""

    rank: int
    num_requests: int
    num_tokens: int
    num_kv_blocks: int = 0


class RequestRouter(Protocol):
    """Chooses the data-parallel rank that owns a new request."""

    def route(self, request: SchedulableRequest, rank_loads: Sequence[RankLoad]) -> int: ...


# --------------------------------------------------------------------------------------------------
# Speculative decoding


@dataclass(frozen=True)
class DraftInputs:
    """What a drafter gets right after a step, on the model's device (drafting runs on the device
    between the step's sampling and the next forward: reference/deepinfer.md §2, API.md §2).

    Everything here may depend on the step's results, which the host has not read: how many drafts each
    request accepted moves its last token and position, so they are device tensors, never host values.
    ``last_tokens [B]`` the last committed token per request (the step's final emitted token);
    ``positions [B]`` its position; ``history [B, H]`` each request's committed tokens, right-aligned and
    −1 padded (``last_tokens`` in the last column), built on first use (drafters that read no history pay
    nothing for it); ``seeds [B]`` the requests' seeds and ``temperature [B]`` their temperatures
    (0 = greedy), for drafters that sample; ``sampling``: whether any request samples (known on the host,
    so a drafter decides whether to report distributions without reading the device); ``k`` the most
    drafts wanted per request; ``rows`` the main model's rows of the step, with their hidden states (the
    final ones, or the layers the drafter had the model ``capture_hidden``), for drafters that run layers
    of their own over them (``mtp``, ``dspark``; None for the others). ``B`` may be 0 when only ``rows``
    has work (a prefill chunk that sampled nothing still fills an MTP cache). The core drops every draft
    a request may not use (past what it may still emit) from the proposal.
    """

    last_tokens: torch.Tensor
    positions: torch.Tensor
    seeds: torch.Tensor
    temperature: torch.Tensor
    k: int
    rows: CommittedRows | None = None
    sampling: bool = False
    history_of: Callable[[], torch.Tensor] | None = None

    @functools.cached_property
    def history(self) -> torch.Tensor:
        """``[B, H]`` int64 on ``last_tokens``' device: each request's tokens, right-aligned, −1 padded."""
        if self.history_of is None:
            raise RuntimeError("DraftInputs.history: these inputs carry no token history (history_of is unset)")
        return self.history_of()


@dataclass(frozen=True)
class CommittedRows:
    """Every row the step computed, for a drafter with its own cache on the main paging (MTP, dspark).

    ``hidden [R, H]``: the main model's final hidden state (after its final norm: what ``forward``
    returns) — or, when the drafter had the model ``capture_hidden(layer_ids)`` (``dspark``), those
    layers' inputs concatenated in that order, ``[R, H · len(layer_ids)]`` — of every row of the step
    (prefill chunks, every request's last token and its verified drafts; a CUDA graph's padding rows
    too, which sit on the reserved scratch block). ``next_tokens [R]``: the id of the token after each
    row (the next prompt token, or a token the step emitted; for a draft the step rejected, and the rows
    after it, any id), made by ``next_tokens_of`` on first read (a drafter that reads features, not
    tokens, never pays for it: on the CPU ~0.1 ms of host time a step). ``ctx``: a ``ForwardContext`` over
    exactly these rows on the main model's paging (``ctx.positions`` their positions), so a cache sharing the
    main pool's block ids gets the row of position p in the slot of p. Rows of rejected drafts land past the
    request's committed length: nothing reads them before those positions are computed (and written again) for
    real.
    ``last_rows [B]``: for each drafting request (``DraftInputs`` order), its last committed row, whose
    next token is the request's last token. ``chain(offset)``: a ``ForwardContext`` of one decode row per
    drafting request at ``DraftInputs.positions + offset`` (offset 0 is the last token, offset j the j-th
    draft), KV length ``position + 1``, for chained drafts that write their own cache rows past the
    committed tokens; the scheduler reserved blocks for those positions where it could, and a request's
    rows past what it may still emit, or past its blocks, run on the reserved scratch block (the core
    drops the drafts that depend on them).
    """

    hidden: torch.Tensor
    next_tokens_of: Callable[[], torch.Tensor]
    ctx: ForwardContext
    last_rows: torch.Tensor
    chain: Callable[[int], ForwardContext]

    @functools.cached_property
    def next_tokens(self) -> torch.Tensor:
        return self.next_tokens_of()


@dataclass(frozen=True)
class DraftProposal:
    """``tokens [B, k]`` int64, −1 where a request has no further draft; ``probs [B, k, V]`` or
    None (one-hot drafts; a drafter that gives probabilities must draw its drafts from them, or
    verification is not lossless); ``confidence [B, k]`` float32 in [0, 1], the drafter's belief
    that each draft is accepted given its prefix was (what verification plans rank by);
    ``raw_confidence`` the uncalibrated values when ``confidence`` was calibrated (None: the same)."""

    tokens: torch.Tensor
    probs: torch.Tensor | None
    confidence: torch.Tensor
    raw_confidence: torch.Tensor | None = None


class Drafter(Protocol):
    """Proposes up to ``inputs.k`` draft tokens per request."""

    def propose(self, inputs: DraftInputs) -> DraftProposal: ...


@runtime_checkable
class SlotCachingDrafterFactory(Protocol):
    """A drafter factory (``deepinfer_drafters``) whose drafter keeps a cache row per slot of the main KV pool
    (dspark's context cache, indexed like the main cache so it follows its blocks). The core asks for the row's
    size before it sizes the pool and counts ``blocks × block_size × cache_bytes_per_slot`` inside the KV
    budget (``cache.kv_cache_bytes`` or the device's free memory), so the pool shrinks by what the drafter
    will allocate; the drafter then allocates exactly that many bytes per slot."""

    def __call__(self, *, model: Any, info: EngineInfo) -> Drafter: ...

    def cache_bytes_per_slot(self, *, model: Any, info: EngineInfo) -> int:
        """Bytes the drafter will keep per main-pool slot (0: none for this model and configuration)."""
        ...


@runtime_checkable
class GraphDrafter(Protocol):
    """A drafter whose ``propose`` the core may capture in a CUDA graph with the step's verification and
    replay on later steps' inputs (the speculative tail, ``engine/tail_graphs.py``), when
    ``graph_capturable`` is true. ``propose`` must then read no device value on the host, read and write
    only tensors that keep their addresses from call to call (its weights and caches, the inputs), depend
    on host state only through the inputs' shapes, and replay no CUDA graph of its own while the stream is
    capturing (``torch.cuda.is_current_stream_capturing``)."""

    graph_capturable: bool

    def propose(self, inputs: DraftInputs) -> DraftProposal: ...

    def settle(self) -> None:
        """Do now, eagerly, the device work earlier ``propose`` calls deferred (e.g. rows buffered while no
        request drafted): a replayed tail repeats only the work of the call it captured."""
        ...


class StepCostModel(Protocol):
    """Step time (seconds) of a decode step as a function of its total query tokens (``engine/cost.py``).

    The core builds it and hands it to the plan; a plan calls ``step_time`` or, for many sizes at
    once, ``step_times``, and a plan written against ``step_time(query_tokens)`` alone keeps working
    (``requests`` defaults to 0)."""

    def step_time(self, query_tokens: int, *, requests: int = 0) -> float:
        """Seconds of a decode step of ``query_tokens`` (every one a verified row: forward, sampler and
        verification) followed by drafting for ``requests`` requests (0: drafting not charged)."""
        ...

    def step_times(self, query_tokens: torch.Tensor, *, requests: int = 0) -> torch.Tensor:
        """``step_time`` of every size in ``query_tokens`` (int64 ``[N]``, on the host) at once, float64
        ``[N]``: a plan that weighs every candidate total of a step asks once, not per candidate."""
        ...

    def observe(self, query_tokens: int, seconds: float, *, sampler_seconds: float | None = None,
                requests: int = 0, draft_seconds: float | None = None, step_seconds: float | None = None) -> None:
        """A measured decode step: ``seconds`` of forward and LM head, ``sampler_seconds`` of sampling and
        verification, ``draft_seconds`` of drafting for ``requests`` requests after it, ``step_seconds`` of wall
        time from the end of the step before to the end of this one (None: not measured)."""
        ...


class VerificationPlan(Protocol):
    """How many drafts each request verifies (API.md §2; reference/deepinfer.md §5)."""

    def budget(self, stale_confidence: torch.Tensor, cost: StepCostModel) -> int:
        """Total query tokens over decode rows, Σ(1 + drafts verified), from host-side confidences
        ``[B, k]`` of the previous round, one row per decode request of the step (all zeros: a request
        without drafts). Fixes the batch bucket. A plan that weighs step time asks
        ``cost.step_time(total, requests=R)``, R the rows with drafts: each of them drafts again after
        the step.

        Confidence matrices hold each request's per-draft conditional confidences in (0, 1]; a
        position past a request's last draft is exactly 0 (nothing to verify there); a draft whose
        confidence is not known yet counts as 1.0."""
        ...

    def split(self, confidence: torch.Tensor, total: int) -> torch.Tensor:
        """Drafts verified per request ``[B]`` (int64) from the newest confidences ``[B, k]``, keeping
        Σ(1 + drafts) == total and never verifying draft j+1 without draft j. Pure tensor code."""
        ...


# --------------------------------------------------------------------------------------------------
# Cache restore


@dataclass(frozen=True)
class ReplayPlan:
    """Which tokens to recompute to rebuild per-request state: from ``first_token`` (absolute
    position), with sliding-window attention not looking below ``visibility_floor``; ``layers`` None
    means all.

    Reason ``prefill``: mode ``mask`` or ``compact`` truncates a YoCo model's prefill (reference/deepinfer.md
    §6): ``layers`` are the YoCo consumer layers, which need queries only from ``visibility_floor`` on
    (``compact`` removes the rows below, ``mask`` keeps them with their window emptied); ``full`` means no
    truncation. Reasons ``prefix_hit`` and ``preempted``: mode ``full``; a floor above 0 is a bounded
    restore, and the floor stays with the request while it runs."""

    first_token: int
    visibility_floor: int
    mode: Literal["full", "mask", "compact"]
    layers: tuple[int, ...] | None = None


class ReplayPlanner(Protocol):
    """Plans the recomputation that restores sliding-window state (ARCHITECTURE §6)."""

    def plan(self, request: SchedulableRequest, layout: CacheLayout,
             reason: Literal["prefill", "prefix_hit", "preempted"]) -> ReplayPlan: ...


@dataclass(frozen=True)
class KVStoreSpec:
    """What a KV store is built for (``KVStoreFactory``): every block it will hold is ``block_bytes`` bytes
    (one full block's paged entries of every layer, packed by the core); ``device`` is the engine's device
    type (``cpu`` or ``cuda``: a host store pins its memory for the latter); ``namespace`` is a hex digest
    of the model identity and cache layout, already mixed into every key (a store may use it to name
    files or keep engines of different models apart)."""

    block_bytes: int
    device: str
    namespace: str


@runtime_checkable
class KVStore(Protocol):
    """An external tier of KV blocks (host memory, disk, ...), keyed by 16-byte block keys.

    A key is the core's chained prefix hash of a full block mixed with ``KVStoreSpec.namespace`` (model
    identity, dtype, KV dtype, block size and per-layer cache specs), so a block saved by another model or
    layout is never found. A block's payload is a flat ``uint8`` CPU tensor of ``block_bytes`` bytes: all
    layers' paged entries of that block (per-request state — sliding-window rings, V4 state slots — is
    never stored; the replay planners rebuild it after a load). The core calls ``save`` from its writer
    thread, ``contains``/``load`` from the scheduling thread and from its reader thread (the read-ahead of
    queued requests' blocks), so every method must be thread-safe; a store never raises for a block it
    cannot keep or read back: it returns False and counts it. A store whose ``load`` is a copy from memory
    may say so with a class attribute ``in_memory = True``: the core does not read its blocks ahead. Such a
    store may also lend its memory: ``view(key) -> torch.Tensor | None`` returns the block in place
    (``uint8 [block_bytes]``; pinned for a CUDA engine) and holds it — never evicted or rewritten — until
    ``release(key)``; a promotion then copies to the device straight from it, and releases it once the
    device copies are done."""

    name: str

    def contains(self, keys: Sequence[bytes]) -> int:
        """How many leading keys of ``keys`` the store holds (a lookup at admission; no I/O of payloads)."""
        ...

    def save(self, key: bytes, block: torch.Tensor) -> bool:
        """Keep a copy of ``block`` (``uint8 [block_bytes]`` on the CPU; the caller may reuse it after the
        call returns) under ``key``, evicting by the store's policy when full. False if it was not kept."""
        ...

    def load(self, key: bytes, out: torch.Tensor) -> bool:
        """Copy the block under ``key`` into ``out`` (``uint8 [block_bytes]`` on the CPU). False, with
        ``out`` in an unspecified state, when the block is missing, truncated or fails its checksum."""
        ...

    def stats(self) -> dict[str, float]:
        """Counters: at least ``blocks``, ``bytes``, ``capacity_bytes``, ``hits``, ``misses``, ``saves``,
        ``evictions`` and ``errors`` (corrupt, truncated or unwritable blocks)."""
        ...

    def close(self) -> None:
        """Release what the store holds open (files, memory); called once at engine shutdown."""
        ...


KVStoreFactory = Callable[[KVStoreSpec], KVStore]
"""Builds a store for one engine from its ``KVStoreSpec``; raises ``ConfigError`` naming the plugin's
setting when the store cannot be built (e.g. a disk store without a directory)."""


# --------------------------------------------------------------------------------------------------
# Expert placement


@dataclass(frozen=True)
class Topology:
    """Where expert slots live: ``ranks`` × ``slots_per_rank`` physical slots, ``num_groups`` expert
    groups (group-limited routing), ``num_nodes`` hosts."""

    ranks: int
    slots_per_rank: int
    num_groups: int = 1
    num_nodes: int = 1


class PlacementPolicy(Protocol):
    """Maps logical experts onto physical slots from recent load (reference/deepinfer.md §7)."""

    num_redundant_experts: int
    window: int

    def place(self, load: torch.Tensor, topology: Topology) -> torch.Tensor:
        """``load [steps, layers, logical]`` tokens → ``phys_to_logical [layers, ranks·slots]``."""
        ...

    def due(self, step: int) -> bool:
        """Whether to rebalance after ``step``."""
        ...


# --------------------------------------------------------------------------------------------------
# Kernel backends


@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend can serve; the host matches it against ``RunRequirements`` per op."""

    devices: frozenset[str] = frozenset({"cpu", "cuda"})
    dtypes: frozenset[torch.dtype] = frozenset({torch.float32, torch.bfloat16, torch.float16})
    # cache.kv_dtype values its attention reads; ``auto`` is also what a run asks when the setting names the
    # model's own dtype (bf16 on a bf16 model), so only a backend that reads another dtype declares more.
    kv_dtypes: frozenset[str] = frozenset({"auto"})
    graph_safe: bool = False
    batch_invariant: bool = False
    varlen: bool = True


@dataclass(frozen=True)
class RunRequirements:
    """What this run needs from a backend."""

    device: str
    dtype: torch.dtype
    kv_dtype: str
    graph_safe: bool
    batch_invariant: bool
    varlen: bool = True

    def missing(self, caps: BackendCapabilities) -> list[str]:
        """The capabilities ``caps`` lacks for this run, as readable strings (empty: it fits)."""
        gaps = []
        if self.device not in caps.devices:
            gaps.append(f"device {self.device}")
        if self.dtype not in caps.dtypes:
            gaps.append(f"dtype {self.dtype}")
        if self.kv_dtype not in caps.kv_dtypes:
            gaps.append(f"kv_dtype {self.kv_dtype}")
        if self.graph_safe and not caps.graph_safe:
            gaps.append("graph_safe")
        if self.batch_invariant and not caps.batch_invariant:
            gaps.append("batch_invariant")
        if self.varlen and not caps.varlen:
            gaps.append("varlen")
        return gaps


class Backend(Protocol):
    """Common face of attention, MoE and GEMM backends."""

    name: str
    priority: int
    ops: frozenset[str]
    capabilities: BackendCapabilities

    def available(self) -> bool:
        """Whether its library imports and the device supports it (cheap, no side effects)."""
        ...


@dataclass
class ForwardContext:
    """Per-step attention metadata, built once by the runner and read by every layer.

    Shapes: ``T`` tokens in the step, ``B`` requests. ``positions [T]``, ``slot_mapping [T]`` (flat
    cache slot of each new token), ``query_start_loc [B+1]``, ``seq_lens [B]`` (KV length after
    this step), ``block_tables [B, max_blocks]``. ``num_decodes``: the first rows are decode rows
    with exactly one query token each. Host copies (``*_host``) let reference backends loop without
    reading the device. ``backends`` maps op name to the selected backend object.

    Models with per-request state (``kv/state.py``) also get ``state_slots [B]`` (each request's state
    slot, host copy ``state_slots_host``) and ``write_floor_host`` (per request, the positions below
    which its blocks are shared through the prefix cache: rows there only rebuild state, exact replay,
    and must not rewrite paged entries); all three are None for other models.

    ``max_query_len`` bounds the query tokens of every request in the step (0: not stated). A step
    replayed from a CUDA graph (``engine/graphs.py``) states the graph's bound, and its host lists and
    ``num_decodes`` are the capture's, not the step's: a ``graph_safe`` backend that serves requests of
    up to ``max_query_len`` query tokens must then read only the device tensors. Its ``T`` rows are then
    the graph's bucket, and only the first ``num_real_tokens`` (a 0-d int64 device tensor) belong to the
    step: the rest are padding, which statistics such as the MoE layers' router counts must skip
    (``deepseek_v3.count_routed_tokens``). None: every row is real.

    Bounded replay (``ReplayPlan``, ARCHITECTURE §6); None when no request of the step needs it:
    ``visibility_floor [B]`` (host copy ``visibility_floor_host``): in sliding-window attention (a layer
    called with ``window`` > 0, a DeepSeek-V4 layer's window part) a key below its request's floor is
    invisible, except a query's own key (a query below the floor sees only itself); set after a bounded
    state restore, for as long as the request runs. ``truncation_floor_host`` and
    ``truncation_compact_host``: YoCo prefill truncation (reference/deepinfer.md §6), per request the
    position below which the model's YoCo consumer layers need no queries (0: none), and whether those
    rows are removed (compact: the model's output rows for them are zeros) or kept (mask). In consumer
    layers the truncation floor is also a visibility floor, so both modes give the same kept rows.
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    num_decodes: int
    query_start_loc_host: list[int]
    seq_lens_host: list[int]
    block_size: int
    backends: Mapping[str, Any]
    state_slots: torch.Tensor | None = None
    state_slots_host: list[int] | None = None
    write_floor_host: list[int] | None = None
    max_query_len: int = 0
    visibility_floor: torch.Tensor | None = None
    visibility_floor_host: list[int] | None = None
    truncation_floor_host: list[int] | None = None
    truncation_compact_host: list[bool] | None = None
    num_real_tokens: torch.Tensor | None = None


class AttentionBackend(Backend, Protocol):
    """Implements op ``paged_attention``: write this step's K/V into the paged cache, then attend.

    ``q [T, Hq, D]``, ``k, v [T, Hkv, D]``; ``kv_cache`` is the layer's ``(k_cache, v_cache)`` each
    ``[num_blocks, block_size, Hkv, D]`` (with ``cache.kv_dtype: fp8``, ``(k, v, k_scales, v_scales)``:
    e4m3 data and UE8M0 scale bytes per 32 elements, ``kv/fp8.py``; only backends declaring ``fp8`` in
    ``kv_dtypes`` get one). Returns ``[T, Hq, D]``. Causal within a request; a query at
    position p sees cached positions ≤ p of its own request (``window`` > 0: only the last ``window``,
    and none below ``ctx.visibility_floor`` but its own).
    """

    def paged_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        kv_cache: tuple[torch.Tensor, torch.Tensor], ctx: ForwardContext, *,
                        scale: float, window: int = 0) -> torch.Tensor: ...


class MoEBackend(Backend, Protocol):
    """Implements op ``experts``: ``x [T, H]``, ``topk_ids``/``topk_weights [T, k]`` → ``[T, H]``,
    the weighted sum of each token's experts (SwiGLU). ``swiglu_limit`` (DeepSeek-V4), when given, clamps
    the gate to ``≤ limit`` and the up projection to ``[-limit, limit]`` before ``silu(gate)·up``.
    ``dispatch``/``combine`` serve expert parallelism; the core's all-to-all is the reference.

    Optional ``prepare_experts(w13, w2) -> Any``: the model calls it once per MoE layer with the layer's
    parameters ``w13 [E, 2I, H]`` (gate rows then up rows) and ``w2 [E, H, I]`` once they are loaded
    (``DeepseekV3ForCausalLM.prepare_experts``, or on the layer's first forward), and hands what it
    returns back to ``experts`` as ``weights``; a backend without it gets ``(w13, w2)``. It may re-lay
    the parameters out in place (``param.data = ...``, same shape and values, as
    ``GemmBackend.prepare_weight`` does) or return its own copy (e.g. FP8 with block scales, which then
    adds its bytes next to the originals and does not follow later writes to them). Weights reaching
    ``experts`` without it (expert parallelism's local slots) are raw ``(w13, w2)``; a backend that
    cannot use those raises.

    Optional ``select_experts(logits, bias, positions, spec) -> (topk_ids, topk_weights) | None``: the
    router after its gate GEMM in fewer launches (one fused kernel). ``logits [T, E]`` float32, ``bias
    [E]`` float32 or None (``e_score_correction_bias``), ``positions [T]`` (read by the balanced draw),
    ``spec`` a ``RoutingSpec``; returns ``topk_ids [T, k]`` int64 and ``topk_weights [T, k]`` float32
    equal to ``deepinfer.model.layers.routing.route`` (ids as sets per row, weights to float32
    rounding), or None when it cannot serve this spec or shape, and the model then runs that reference.
    The model calls it with whatever ``experts`` backend the run selected, compiled or not, so it must
    not be traced by ``torch.compile`` (``torch.compiler.disable``) and must not read the device from
    the host.

    Optional ``experts_fp4(x, topk_ids, topk_weights, weights, *, swiglu_limit) -> Tensor | None``: the same op
    over experts stored in FP4 (``Fp4ExpertWeights``, DeepSeek-V4.1's ``expert_dtype: fp4``), read as stored
    (no dequantized copy of the experts); None when it cannot serve the call (device, shapes), and the model
    runs its plain-torch reference (``deepseek_v4/fp4_moe.py``), which dequantizes one active expert at a
    time. Dequantization is exact (``deepinfer.ops.dequantize_e2m1``), so on the same weights it equals the
    bf16 op up to the order of the sums."""

    def experts(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                weights: Any, *, swiglu_limit: float | None = None) -> torch.Tensor: ...


@dataclass(frozen=True, eq=False)
class Fp4ExpertWeights:
    """A MoE layer's routed experts in FP4, as DeepSeek-V4.1 checkpoints store them: ``w13 uint8 [E, 2I, H/2]``
    (each expert's gate rows then up rows; e2m1 codes two a byte, the even input index in the low nibble) with
    ``w13_scale uint8 [E, 2I, H/block]`` (ue8m0: ``2^(b-127)``, one per ``block`` inputs), ``w2 uint8 [E, H,
    I/2]`` with ``w2_scale uint8 [E, H, I/block]`` (``MoEBackend.experts_fp4``)."""

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    block: int = 32


@dataclass(frozen=True)
class RoutingSpec:
    """How a DeepSeek-style router turns gate logits into each token's ``top_k`` experts (see
    ``deepinfer.model.layers.routing``, the reference).

    ``scoring``: ``sigmoid`` (V3) or ``softmax`` (V2) of the logits. ``method``: ``noaux_tc`` (V3: choose
    on score + bias; a group's score is the sum of its two best; ``topk_group`` of ``n_group`` groups
    stay, the rest are −inf), ``greedy`` (plain top-k of the scores), ``group_limited_greedy`` (V2:
    group score = max, other groups' scores set to 0), ``balanced`` (the benchmark's forced routing:
    ``top_k`` distinct experts drawn from a hash of (position, ``layer``, expert); the router's choice
    is not computed). Weights are the chosen experts' scores (``noaux_tc``/``balanced``: without the
    bias; ``group_limited_greedy``: after masking), divided by their sum + 1e-20 when ``normalize``,
    times ``scaling``."""

    top_k: int
    scoring: Literal["sigmoid", "softmax"] = "sigmoid"
    method: Literal["noaux_tc", "greedy", "group_limited_greedy", "balanced"] = "noaux_tc"
    n_group: int = 1
    topk_group: int = 1
    normalize: bool = False
    scaling: float = 1.0
    layer: int = 0


@dataclass(frozen=True, eq=False)
class DenseDecoderLayer:
    """One Llama-family decoder layer's tensors as a fused decode step reads them (``DenseDecoderStack``):
    ``input_norm`` and ``post_norm`` ``[hidden]`` (RMSNorm weights), ``qkv [(heads + 2·kv_heads)·head_dim,
    hidden]`` (q, k, v rows stacked) with ``qkv_bias`` or None, ``o_proj [hidden, heads·head_dim]``,
    ``gate_up [2·intermediate, hidden]`` (gate rows, then up rows), ``down [hidden, intermediate]``, the
    layer's paged cache ``kv_cache`` (``AttentionBackend``'s layout), and Qwen3's per-head RMSNorm weights
    ``q_norm``, ``k_norm [head_dim]`` applied to q's and k's heads before rope (None: no such norm)."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    kv_cache: tuple[torch.Tensor, ...]
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


@dataclass(frozen=True, eq=False)
class DenseDecoderStack:
    """A Llama-family model's decoder layers, for ``GemmBackend.decode_stack``: per layer ``x += o_proj ·
    attention(rope(qkv · RMSNorm(x)))`` (q's and k's heads RMS-normed first where the layer has ``q_norm``),
    then ``x += down · (silu(gate) · up)(gate_up · RMSNorm(x))``, with RMSNorm's statistics in float32
    (``deepinfer.ops.RMSNorm``), rope in the rotate-half layout over ``rope_cos`` and ``rope_sin_signed
    [max_positions, head_dim]`` (float32; sin with its first half negated, so ``rotate_half(x)·sin = roll(x,
    head_dim/2)·rope_sin_signed``), causal attention with ``scale`` over the paged cache; after the last layer the
    model's output RMSNorm with ``final_norm [hidden]``. ``captured_layers``: the layers whose input the caller
    keeps (``StackedDecoderLM.capture_hidden``; id ``len(layers)``: the last layer's output, before the output
    norm). The model keeps one per binding of its weights and caches (identity hash: a backend may key what it
    derives from it)."""

    layers: tuple[DenseDecoderLayer, ...]
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    scale: float
    rope_cos: torch.Tensor
    rope_sin_signed: torch.Tensor
    final_norm: torch.Tensor
    captured_layers: tuple[int, ...] = ()


@dataclass(frozen=True, eq=False)
class BlockDrafterLayer:
    """One layer of a ``BlockDrafterStack``: ``attn_norm``, ``mlp_norm [hidden]`` (RMSNorm weights), ``qkv
    [3·hidden, hidden]`` (q, k, v rows stacked), ``ctx_kv [2·hidden, hidden]`` (the context rows' k, v), ``o
    [hidden, hidden]``, ``gate_up [2·intermediate, hidden]`` (gate rows, then up rows), ``down [hidden,
    intermediate]``."""

    attn_norm: torch.Tensor
    qkv: torch.Tensor
    ctx_kv: torch.Tensor
    o: torch.Tensor
    mlp_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


@dataclass(frozen=True, eq=False)
class BlockDrafterStack:
    """A block drafter's dense network (the ``spec_decode`` plugin's ``dspark``, whose docstring derives it) for
    ``GemmBackend.draft_context`` and ``draft_block``; every weight in the drafter's dtype, RMSNorm as
    ``deepinfer.ops.RMSNorm`` (statistics in float32), rope in the halves layout ``[x1·cos − x2·sin, x2·cos +
    x1·sin]`` over the angles ``position · inv_freq`` (float32 ``[head_dim / 2]``), cos and sin cast to the dtype.

    The context write: target features ``f [N, hidden·L]`` → ``c = main_norm(main_proj · f)``; per layer the
    row's key and value ``ctx_kv · c`` (the key's heads roped at the row's position) stored in the cache ``[slots,
    layers, 2, hidden]`` at the row's slot. The block: ``k`` embedded rows per request at positions ``p … p + k −
    1``; per layer ``x += o · attention`` (``q, k, v = qkv · attn_norm(x)``, q's and k's heads roped, each block
    row attending without a causal mask over the request's visible window rows of the cache and all ``k`` block
    rows, scaled by ``head_dim^-½``), then ``x += down · (silu(gate) · up)(gate_up · mlp_norm(x))``; logits
    ``head · norm(x)`` over the draft vocabulary (float32). Then, in order of the block's rows, greedily: row
    ``i``'s logits plus ``markov_head · markov_embed[previous]`` (``previous``: the request's golden token as a
    draft id for ``i = 0``, draft ``i − 1`` after), its argmax the draft; its confidence ``sigmoid(clamp(z /
    confidence_temperature[i], ±60))``, ``z = confidence_weight · [x_i, markov_embed[previous]] +
    confidence_bias`` (``x_i`` the row before the final norm). ``d2t [Vd]`` maps draft ids to target ids and
    ``t2d [V]`` back (``Vd``, the Markov embedding's extra row, outside the draft vocabulary); both None when
    the draft vocabulary is the target's. ``heads`` divides ``hidden``; ``eps`` is every RMSNorm's."""

    main_proj: torch.Tensor
    main_norm: torch.Tensor
    layers: tuple[BlockDrafterLayer, ...]
    norm: torch.Tensor
    head: torch.Tensor
    markov_embed: torch.Tensor
    markov_head: torch.Tensor
    confidence_weight: torch.Tensor
    confidence_bias: torch.Tensor
    confidence_temperature: torch.Tensor
    inv_freq: torch.Tensor
    d2t: torch.Tensor | None
    t2d: torch.Tensor | None
    heads: int
    eps: float


class GemmBackend(Backend, Protocol):
    """Implements op ``linear``: ``x [T, in] @ weight[out, in]ᵀ (+ bias)``.

    ``prepare_weight`` is called once per GEMM weight after loading; it returns a tensor with the
    same shape and values, laid out (or packed) the way this backend's ``linear`` reads fastest.

    Optional ``decode_stack(stack, x, ctx) -> (out, captured) | None``: a whole ``DenseDecoderStack`` over a
    step, in fewer calls than the model's layers make (a batch-1 CPU step pays per op, issue 36). ``x [T,
    hidden]`` is the embedded input; it returns the output norm (``stack.final_norm``) of the residual stream after
    the last layer ``[T, hidden]`` (the model's hidden state for the LM head) and the inputs of
    ``stack.captured_layers`` (layer id → ``[T, hidden]``), having written the step's keys and values to the
    caches as the attention backend would; or None, before touching anything, when it does not serve this step
    (shape, dtype, the run's attention backend), and the model then runs its layers (and the norm). Its results
    equal the layers' within the rounding of another summation order.

    Optional ``draft_context(stack, features, positions, slots, cache) -> bool`` and ``draft_block(stack, cache,
    slots, visible, embedded, last_tokens, positions) -> (tokens, confidence) | None``: a ``BlockDrafterStack``'s
    two passes (a drafting step on the CPU pays per op, issue 28). ``draft_context`` writes the context rows of
    ``features [N, hidden·L]`` at ``positions`` and ``slots [N]`` into ``cache``; ``draft_block`` drafts greedily
    for ``B`` requests: ``embedded [B, k, hidden]`` the blocks' rows, ``slots``, ``visible [B, W]`` each window's
    cache slots and which exist, ``last_tokens``, ``positions [B]`` the golden tokens and their positions; it
    returns the drafts as target ids ``[B, k]`` (int64) and their confidences ``[B, k]`` (float32). Each serves
    what it can and otherwise (shape, dtype) returns False / None before touching anything; its results equal
    the stack's torch computation within the rounding of other summation orders.

    Optional ``row_breaks(dtype) -> Sequence[int]``: the row counts ``n`` after which the backend's kernel
    changes (a call of ``n`` rows and one of ``n + 1`` run different kernels, at different costs per row:
    ``onednn``'s GEMV and fused steps up to ``min_rows − 1`` rows, oneDNN from ``min_rows``). The ``varlen``
    plan's step-cost curve is profiled on both sides of each, where powers of two alone would draw a line
    over the jump.
    """

    def prepare_weight(self, weight: torch.Tensor) -> torch.Tensor: ...
    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor: ...
