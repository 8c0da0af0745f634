"""``ParallelEngine``: the caller's side of ``LLM(model, expert_parallel_size=N)`` (API.md §4).

The driver is not a rank. It starts N rank processes as fresh interpreters
(``python -m deepinfer.parallel.worker``, never a re-import of the caller's script), hosts the
``TCPStore`` they meet through (bound to a free port by the OS, so every ``LLM`` has its own) and a
command connection to each (``multiprocessing.connection``, authenticated with a random key). It
validates and numbers requests exactly like a single engine (a ``RequestIntake``, engine/intake.py,
over the facts rank 0 reports), routes each one to a rank with the configured ``RequestRouter`` and
sends it there at once; aborts go the same way. The ranks step on their own loops, in step with each
other through one small all-reduce per step (``worker.serve``), and send a reply after every step:
``step()`` only reads the replies that arrived — finished outputs and, with ``stream`` on (``AsyncLLM``
sets it), the tokens each unfinished request committed, from which the driver builds the cumulative
outputs a single engine streams. There is no per-step round trip. Ranks are
torn down by ``shutdown()``, at garbage collection and at interpreter exit (``weakref.finalize``); a
rank that fails takes the whole group down with its traceback in the error, since the others can no
longer complete their collectives.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Listener, wait
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from deepinfer.config import EngineConfig
from deepinfer.engine.intake import RequestIntake, load_tokenizer
from deepinfer.engine.request import Request
from deepinfer.engine.startup import resolve_config
from deepinfer.errors import ConfigError
from deepinfer.interfaces import RequestRouter
from deepinfer.model.assets import resolve_model_path
from deepinfer.model.loader import read_hf_config
from deepinfer.outputs import RequestOutput
from deepinfer.parallel.loads import RankLoads
from deepinfer.parallel.messages import StepReply, TokenDelta
from deepinfer.parallel.sizes import parallel_sizes
from deepinfer.plugins import PluginHost
from deepinfer.sampling.params import SamplingParams

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
POLL_S = 0.2
SHUTDOWN_WAIT_S = 20.0
# Ratios and means in plugin counters that cannot be summed across ranks; they are averaged instead
# (e.g. spec_decode's mean_acceptance_length, acceptance_per_position, confidence_calibration_error),
# weighted by the count of a dict that has one (a rank that verified nothing adds nothing to the means).
_RATIO_SUFFIXES = ("_fraction", "_rate", "_ratio", "_error")
_MEAN_MARKERS = ("mean_", "_per_")
_COUNT_KEYS = ("verify_steps",)


class RankFailure(RuntimeError):
    """A rank process failed or exited; the rank group is torn down."""


@dataclass
class _RankGroup:
    """The processes and connections of one ``ParallelEngine``; owned by its finalizer, so it must
    not refer back to the engine."""

    procs: list[subprocess.Popen] = field(default_factory=list)
    conns: list[Connection] = field(default_factory=list)
    listener: Listener | None = None
    store: dist.TCPStore | None = None
    closed: bool = False

    def close(self) -> None:
        """Ask every rank to leave, wait a while, kill what is left; idempotent."""
        if self.closed:
            return
        self.closed = True
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(("shutdown", None))
        # Ranks still stepping send replies until they all have the command; read and drop them, so that
        # none blocks on a full connection buffer before it gets there.
        deadline = time.monotonic() + SHUTDOWN_WAIT_S
        reading = list(self.conns)
        while any(proc.poll() is None for proc in self.procs) and time.monotonic() < deadline:
            if not reading:
                time.sleep(POLL_S)
                continue
            for conn in wait(reading, POLL_S):
                try:
                    conn.recv()
                except (EOFError, OSError):
                    reading.remove(conn)
        for proc in self.procs:
            if proc.poll() is None:
                logger.warning("rank process %d did not exit; killing it", proc.pid)
                proc.kill()
            proc.wait()
        for conn in self.conns:
            conn.close()
        if self.listener is not None:
            self.listener.close()
        self.store = None


class ParallelEngine:
    """Routes requests over N rank processes that run DP attention and EP MoE, stepping on their own.

    It offers what ``LLM`` and ``AsyncLLM`` use of an ``LLMEngine`` (``entrypoints.llm.Engine``); with
    ``stream`` on, ``step()`` also returns an output for every unfinished request that got tokens.
    """

    def __init__(self, model: str | None = None, *, config: Any = None,
                 overrides: Mapping[str, Any] | None = None) -> None:
        resolved, installed = resolve_config(model, config, overrides)
        self.config: EngineConfig = resolved.config
        self.config_sources = resolved.sources
        self.world, self.expert_parallel_size = parallel_sizes(self.config.parallel)
        # Plugins are built here too: their config sections are validated before any rank starts, and
        # the router is a strategy like any other.
        self.host = PluginHost(self.config.plugins, installed)
        self.host.check_kv_store(self.config.cache.kv_store)
        self.router: RequestRouter = self.host.select("deepinfer_request_routers", self.config.parallel.router,
                                                      "parallel.router")
        self.model_path = resolve_model_path(self.config.model.path)
        # refused before ranks start
        self.tokenizer = load_tokenizer(self.config.model.tokenizer, self.model_path, read_hf_config(self.model_path))
        self._group = _RankGroup()
        self._finalizer = weakref.finalize(self, _RankGroup.close, self._group)
        self._replies: list[StepReply] = []  # read while waiting for a command's answer, not yet applied
        self._owner: dict[str, int] = {}  # unfinished request id -> rank
        self._requests: dict[str, Request] = {}  # unfinished request id -> its copy here, advanced by deltas
        self.stream = False
        self.loads = RankLoads(self.world, self.config.cache.block_size)
        try:
            infos = self._start()
        except BaseException:
            self._finalizer()
            raise
        info = infos[0]
        self.max_model_len = int(info["max_model_len"])
        self.eos_token_ids = frozenset(info["eos_token_ids"])
        self.device, self.dtype = torch.device(info["device"]), info["dtype"]  # rank 0's, as reports need
        self.rank_info = infos
        # Requests are validated and numbered here exactly as a single engine does, against rank 0's
        # facts. A structured request is checked here as in one process (a tokenizer, xgrammar installed)
        # but its grammar compiles on the rank that runs it, where its matcher lives (``LLMEngine.add``):
        # a schema that does not compile finishes its request alone there, with the single process's
        # error, and routing stays independent of compile times (which ``torchrun`` processes could not
        # agree on). The replay planners live in the ranks: prompt logprobs are not refused here under
        # YoCo prefill truncation (docs/status.md).
        self.intake = RequestIntake(self.tokenizer, self.model_path, vocab_size=int(info["vocab_size"]),
                                    max_model_len=self.max_model_len, eos_token_ids=self.eos_token_ids,
                                    seed=self.config.sampling.seed)

    # ---------------------------------------------------------------------------------------- start-up

    def _start(self) -> list[dict[str, Any]]:
        group = self._group
        authkey = secrets.token_bytes(32)
        group.store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
        group.listener = Listener((HOST, 0), authkey=authkey)
        host, port = group.listener.address
        # The ranks import what this process can import (plugins made visible at run time included).
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        for r in range(self.world):
            cmd = [sys.executable, "-m", "deepinfer.parallel.worker", "--rank", str(r), "--world", str(self.world),
                   "--driver", f"{host}:{port}", "--store-port", str(group.store.port)]
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, env=env)
            assert proc.stdin is not None
            proc.stdin.write(authkey.hex().encode() + b"\n")
            proc.stdin.close()
            group.procs.append(proc)
        accepted: list[Connection] = []
        listener = group.listener

        def accept_all() -> None:
            for _ in range(self.world):
                accepted.append(listener.accept())

        acceptor = threading.Thread(target=accept_all, daemon=True)
        acceptor.start()
        while acceptor.is_alive():
            acceptor.join(POLL_S)
            self._check_alive()
        by_rank: dict[int, Connection] = {}
        for conn in accepted:
            _, rank = conn.recv()
            by_rank[rank] = conn
        group.conns = [by_rank[r] for r in range(self.world)]
        overrides = self.config.model_dump()
        for conn in group.conns:
            conn.send(("config", overrides))
        return [self._recv(r, expect="ready") for r in range(self.world)]

    def _check_alive(self) -> None:
        """Raise if a rank process has exited: the error it reported before it exited when there is one
        (``_next``), else its exit code."""
        conns = self._group.conns  # empty until every rank said hello
        for r, proc in enumerate(self._group.procs):
            code = proc.poll()
            if code is None:
                continue
            with contextlib.suppress(EOFError, OSError):
                while r < len(conns) and conns[r].poll():
                    kind, payload = conns[r].recv()
                    if kind == "error":
                        self._raise_error(r, payload)
            self._fail(f"rank {r} exited with code {code} (its stderr has the reason)")

    def _stop_ranks(self) -> None:
        for proc in self._group.procs:
            if proc.poll() is None:
                proc.kill()
        self._finalizer()

    def _fail(self, message: str) -> NoReturn:
        """Stop every rank (the collectives can no longer match) and raise ``RankFailure(message)``."""
        self._stop_ranks()
        raise RankFailure(message) from None

    def _next(self, rank: int) -> tuple[str, Any]:
        """The next message of ``rank`` (it is ready: ``conn.poll`` said so); a rank error is re-raised
        here (``ConfigError`` as itself)."""
        try:
            kind, payload = self._group.conns[rank].recv()
        except (EOFError, OSError):
            self._fail(f"rank {rank} closed its connection")
        if kind == "error":
            self._raise_error(rank, payload)
        return kind, payload

    def _raise_error(self, rank: int, report: tuple[str, str, str]) -> NoReturn:
        """Stop every rank and raise the error ``rank`` reported (``ConfigError`` as itself)."""
        name, message, trace = report
        if name == "ConfigError":
            self._stop_ranks()
            raise ConfigError(message)
        self._fail(f"rank {rank} failed: {name}: {message}\n{trace}")

    def _recv(self, rank: int, expect: str) -> Any:
        """The payload of ``rank``'s next message, which must be an ``expect`` (start-up)."""
        conn = self._group.conns[rank]
        while not conn.poll(POLL_S):
            self._check_alive()
        kind, payload = self._next(rank)
        if kind != expect:
            self._fail(f"rank {rank} answered {kind!r}, expected {expect!r}")
        return payload

    def _read(self) -> dict[int, Any]:
        """Every message the ranks have sent so far, waiting up to ``POLL_S`` for one: step replies are
        kept for ``step()``, command answers returned by rank. Reading every rank at once keeps any rank
        from blocking on a full pipe while another is awaited."""
        if self._group.closed:
            raise RankFailure("the rank processes have been shut down")
        conns = self._group.conns
        ready = wait(conns, POLL_S)
        if not ready:
            self._check_alive()
        answers: dict[int, Any] = {}
        for conn in ready:
            rank = conns.index(conn)  # type: ignore[arg-type]
            while conn.poll():
                kind, payload = self._next(rank)
                if kind == "step":
                    self._replies.append(payload)
                elif kind == "ok" and rank not in answers:
                    answers[rank] = payload
                else:
                    self._fail(f"rank {rank} sent {kind!r} out of turn")
        return answers

    def _send(self, rank: int, message: tuple[str, Any]) -> None:
        if self._group.closed:
            raise RankFailure("the rank processes have been shut down")
        try:
            self._group.conns[rank].send(message)
        except OSError:
            self._fail(f"rank {rank} closed its connection")

    def _all(self, kind: str) -> list[Any]:
        """Send one collective command to every rank (they run it together once all have it), then
        collect the answers."""
        for r in range(self.world):
            self._send(r, (kind, None))
        answers: dict[int, Any] = {}
        while len(answers) < self.world:
            for rank, answer in self._read().items():
                if rank in answers:
                    self._fail(f"rank {rank} answered {kind!r} twice")
                answers[rank] = answer
        return [answers[r] for r in range(self.world)]

    # ---------------------------------------------------------------------------------------- requests

    def make_request(self, prompt: str | list[int], params: SamplingParams, *, text: str | None = None) -> Request:
        """Validate, number and seed one request as a single engine would (``RequestIntake``); raises
        ``ValueError`` naming the problem. Nothing is routed yet."""
        return self.intake.make_request(prompt, params, text=text)

    def add(self, request: Request) -> None:
        """Route ``request`` to a rank and send it there now."""
        self._send(self._route(request), ("add", ([request], self.stream)))

    def _route(self, request: Request) -> int:
        """The rank ``request`` goes to (the ``RequestRouter``), counted in that rank's load until a load
        it reports counts it, and the request recorded as unfinished."""
        rank = int(self.router.route(request, self.loads.current()))
        if not 0 <= rank < self.world:
            raise ValueError(f"router {self.config.parallel.router!r} chose rank {rank} of {self.world}")
        self.loads.routed_to(rank, request.num_tokens)
        self._owner[request.request_id] = rank
        self._requests[request.request_id] = request
        return rank

    def abort(self, request_id: str) -> bool:
        """Abort an unfinished request; its output (``finish_reason="abort"``) comes with a later step."""
        rank = self._owner.get(request_id)
        if rank is None:
            return False
        self._send(rank, ("abort", [request_id]))
        return True

    def has_unfinished(self) -> bool:
        """Whether a request routed here has not returned its finished output yet."""
        return bool(self._owner)

    def step(self) -> list[RequestOutput]:
        """The rank steps' replies that arrived since the last call (waiting for at least one): their
        finished outputs and, with ``stream`` on, the cumulative output of every unfinished request that
        got tokens. The ranks step on their own; nothing is sent here."""
        if not self._owner:
            return []
        while not self._replies:
            if self._read():
                self._fail("a rank answered a command that was not sent")
        replies, self._replies = self._replies, []
        return self._apply(replies)

    def _apply(self, replies: list[StepReply]) -> list[RequestOutput]:
        """The outputs of the ranks' step replies, with the loads they report taken in."""
        outputs: list[RequestOutput] = []
        for reply in replies:
            self.loads.reported(reply.load, reply.requests_received)
            for out in reply.finished:
                self._owner.pop(out.request_id, None)
                self._requests.pop(out.request_id, None)
            outputs.extend(reply.finished)
            outputs.extend(self._advance(delta) for delta in reply.deltas)
        return outputs

    def _advance(self, delta: TokenDelta) -> RequestOutput:
        """Apply a rank's delta to the request's copy here and build its cumulative output."""
        req = self._requests[delta.request_id]
        req.all_token_ids.extend(delta.token_ids)
        if req.logprobs is not None and delta.logprobs is not None:
            req.logprobs.extend(delta.logprobs)
        if delta.prompt_logprobs is not None:
            req.prompt_logprobs = delta.prompt_logprobs
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = time.time()
        return req.to_output(self.tokenizer.decode(req.output_token_ids) if self.tokenizer is not None else "")

    # --------------------------------------------------------------------------------- expert placement

    def rebalance(self) -> None:
        """Rebalance the experts now with the configured placement policy (needs ``plugins.eplb``)."""
        self._all("rebalance")

    def expert_layout(self) -> list[dict[str, Any]]:
        """Per rank: its placement rows; per MoE layer and local slot, ``(logical expert, Σ w13, Σ w2)``
        of the weights it holds (float64 sums, to check weights against a reference); the rows of its
        expert tensors per layer; what its checkpoint load read; its MTP parameters' elements
        (``worker.Rank.layout``)."""
        return self._all("layout")

    # ------------------------------------------------------------------------------------------ stats

    def get_stats(self) -> dict[str, Any]:
        """Counters summed over ranks; the prefix-cache hit rate recomputed from the summed parts,
        plugin ratios (``*_fraction``, ``*_rate``, ``*_ratio``) averaged; ``parallel`` describes the
        ranks and ``eplb`` holds the global balance numbers (the same on every rank)."""
        per_rank = self._all("stats")
        comm = [s.pop("_parallel", None) for s in per_rank]
        eplb = [s.pop("_eplb", None) for s in per_rank]
        stats = _sum_dicts(per_rank)
        lookups = stats["prefix_cache_lookup_tokens"]
        stats["prefix_cache_hit_rate"] = stats["prefix_cache_hit_tokens"] / lookups if lookups else 0.0
        parallel: dict[str, Any] = {"world_size": self.world, "expert_parallel_size": self.expert_parallel_size,
                                    "requests_per_rank": list(self.loads.routed)}
        if comm[0] is not None:
            calls = sum(c["dispatch_calls"] for c in comm)
            parallel["dispatch_calls"] = calls
            parallel["dispatch_seconds"] = sum(c["dispatch_seconds"] for c in comm)
            parallel["combine_seconds"] = sum(c["combine_seconds"] for c in comm)
            parallel["dispatch_seconds_per_layer"] = parallel["dispatch_seconds"] / calls if calls else 0.0
            parallel["combine_seconds_per_layer"] = parallel["combine_seconds"] / calls if calls else 0.0
            if "dispatch_overflow_pairs" in comm[0]:  # fixed-capacity dispatch (kernels.dispatch)
                parallel["dispatch_overflow_pairs"] = sum(c["dispatch_overflow_pairs"] for c in comm)
                # every rank counts the same exchanges (they are collectives): rank 0's
                parallel["dispatch_overflow_exchanges"] = comm[0]["dispatch_overflow_exchanges"]
        stats["parallel"] = parallel
        if eplb[0] is not None and "eplb" in self.host.enabled:
            stats["eplb"] = {**stats.get("eplb", {}), **eplb[0]}
        return stats

    def shutdown(self) -> None:
        """Stop every rank (idempotent)."""
        self._finalizer()


def _sum_dicts(dicts: list[dict[str, Any]]) -> dict[str, Any]:
    """Key-wise: numbers summed (ratios and means averaged, lists of them element-wise, weighted by the
    dicts' ``_COUNT_KEYS`` count when they have one), dicts merged recursively, anything else from the first."""
    counts = next(([d.get(k, 0) for d in dicts] for k in _COUNT_KEYS if k in dicts[0]), None)
    weights = counts if counts is not None and sum(counts) > 0 else [1] * len(dicts)

    def mean(column: tuple[float, ...]) -> float:
        return sum(w * v for w, v in zip(weights, column, strict=True)) / sum(weights)

    out: dict[str, Any] = {}
    for key, first in dicts[0].items():
        values = [d.get(key) for d in dicts]
        averaged = key.endswith(_RATIO_SUFFIXES) or any(m in key for m in _MEAN_MARKERS)
        if averaged and all(isinstance(v, list) and len(v) == len(first) for v in values):
            out[key] = [mean(column) for column in zip(*values, strict=True)]
        elif isinstance(first, bool) or not all(isinstance(v, int | float | dict) for v in values):
            out[key] = first
        elif isinstance(first, dict):
            out[key] = _sum_dicts([v for v in values if isinstance(v, dict)])
        elif averaged:
            out[key] = mean(tuple(values))
        else:
            out[key] = sum(values)
    return out
