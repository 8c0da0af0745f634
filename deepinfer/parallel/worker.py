"""The rank process: ``python -m deepinfer.parallel.worker --rank R --world N --driver HOST:PORT
--store-port P`` (started by ``ParallelEngine``, a fresh interpreter: the caller's script is never
re-imported). The driver's authentication key arrives on stdin.

The rank joins the process group through the driver's ``TCPStore`` (gloo on CPU, NCCL on CUDA),
builds its own ``LLMEngine`` from the config the driver sends — which, inside a rank, builds the model
with the rank's ``ExpertShard`` and loads only those routed experts (``model/loader.py``) — hands them
to the expert-parallel layers (``moe.attach_expert_parallel``) and then steps on its own loop (``serve``):
the driver sends requests and aborts whenever it has them and reads replies whenever it likes, and the
ranks keep in step with one small all-reduce per step (``Rank.agree``), not with the driver.

- ``add (requests, stream)``, ``abort (ids)``: applied when read. A request that this rank cannot accept
  finishes alone with ``finish_reason="error"``. A structured request's grammar compiles here, when the
  rank's engine queues it (``LLMEngine.add``), so one that does not compile finishes alone as in one
  process.
- A step, whenever any rank has work: schedule; if this rank has nothing to run, a placeholder forward
  of zero tokens so that it still joins every MoE layer's dispatch and combine (and computes the rows
  other ranks send it); process; record router statistics and move a layer of a due rebalance — then
  send the driver a ``StepReply``: the finished outputs, when ``stream`` is on the tokens each unfinished
  request committed this step (``TokenDelta``: only what the driver has not seen), the rank's load and
  how many requests it had received (the driver counts those routed since: ``loads.RankLoads``).
- ``stats``, ``layout``, ``rebalance``: collectives that every rank runs at the same point, once every
  rank has received them (``agree``). ``shutdown``: the same, then leave the process group and exit
  (``os._exit``, past the interpreter's teardown). A lost driver connection exits too.

Under ``torchrun`` (``torchrun.py``) there is no driver: each process calls ``Rank.step_once`` in lock-step.

An exception anywhere else is fatal for the whole group (the collectives can no longer match): it
is sent to the driver with its traceback and the process exits.

Speculative decoding runs on each rank for its own requests; its step-cost curve is profiled at
start-up on every rank together (the profile's placeholder forwards join the MoE collectives, so no
rank may profile alone when its plan first asks). MTP drafting runs the MTP layers locally: they keep
every expert (``moe.ep_capable_layers``); without the ``mtp`` drafter a rank does not load them at all.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import traceback
from collections import deque
from datetime import timedelta
from multiprocessing.connection import Client, Connection
from typing import Any

import torch
import torch.distributed as dist

from deepinfer.engine.context import SpanLayout, forward_context
from deepinfer.engine.cost import StepCost
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.request import Request
from deepinfer.interfaces import RankLoad, Topology
from deepinfer.outputs import RequestOutput
from deepinfer.parallel.balancer import ExpertBalancer
from deepinfer.parallel.messages import StepReply, TokenDelta
from deepinfer.parallel.moe import attach_expert_parallel, ep_capable_layers
from deepinfer.parallel.placement import initial_placement
from deepinfer.parallel.sizes import set_current_rank

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = timedelta(minutes=10)
IDLE_WAIT_S = 0.01  # while no rank has work, how long each iteration waits for the driver's messages


class Rank:
    """One rank's engine, expert share and balancer.

    ``group_store``: the store the ranks meet through; None joins through ``env://`` (``torchrun``).
    ``local_rank``: this rank's GPU on its host (default: ``rank`` modulo the GPU count);
    ``num_nodes``: the hosts the ranks span, for hierarchical placement policies.
    """

    def __init__(self, rank: int, world: int, config: dict[str, Any], group_store: dist.Store | None, *,
                 local_rank: int | None = None, num_nodes: int = 1) -> None:
        self.rank, self.world = rank, world
        set_current_rank(rank)
        device_name = config.get("model", {}).get("device", "auto")
        use_cuda = device_name == "cuda" or (device_name == "auto" and torch.cuda.is_available())
        if use_cuda:
            torch.cuda.set_device(rank % torch.cuda.device_count() if local_rank is None else local_rank)
        else:
            torch.set_num_threads(1)  # ranks share the host's cores: one intra-op thread each
        dist.init_process_group("nccl" if use_cuda else "gloo", store=group_store, rank=rank, world_size=world,
                                timeout=COLLECTIVE_TIMEOUT)
        self.engine = LLMEngine(overrides=config)  # highest precedence: the driver already layered every source
        self.device = self.engine.device
        self.layers = []
        self.balancer: ExpertBalancer | None = None
        moe = ep_capable_layers(self.engine.model)
        # This rank's shard and placement policy (parallel/sizes.py); None without expert parallelism.
        experts = self.engine.rank_experts
        if moe and experts is not None:
            num_logical = moe[0].num_experts
            slots = experts.shard.slots(num_logical)
            placement = initial_placement(len(moe), num_logical, slots * world)
            self.layers = attach_expert_parallel(self.engine.model, rank=rank, world=world, slots=slots,
                                                 placement=placement, group=None,
                                                 capacity_factor=self.engine.config.parallel.dispatch_capacity_factor)
            topology = Topology(ranks=world, slots_per_rank=slots,
                                num_groups=int(self.engine.hf_config.get("n_group") or 1), num_nodes=num_nodes)
            self.balancer = ExpertBalancer(self.layers, policy=experts.policy, policy_name=experts.policy_name,
                                           topology=topology, group=None, device=self.device)
        speculator = self.engine.speculator
        if speculator is not None and isinstance(speculator.cost, StepCost):
            speculator.cost.profile_all()  # every rank at once: the profile's forwards join the collectives
        self._sent: dict[str, int] = {}  # streaming: output tokens the driver has of each unfinished request
        self._rejected: list[RequestOutput] = []  # finished at ``add``, not sent yet
        self._received = 0  # requests the driver has routed here so far
        # The per-step agreement (``serve``) runs on the process group's device.
        self._flags = torch.zeros(2, dtype=torch.int64, device=self.device)

    def info(self) -> dict[str, Any]:
        """What the driver needs to validate requests like a single engine would."""
        e = self.engine
        return {"vocab_size": e.model.vocab_size, "max_model_len": e.max_model_len,
                "eos_token_ids": e.eos_token_ids, "model_path": str(e.model_path),
                "device": str(e.device), "dtype": e.dtype, "slots_per_rank": self.layers[0].slots if self.layers else 0}

    # ------------------------------------------------------------------------------------- commands

    def run(self, kind: str) -> Any:
        """Run one collective command (``stats``, ``layout``, ``rebalance``) and return its reply."""
        return {"stats": self.stats, "layout": self.layout, "rebalance": self.rebalance}[kind]()

    def add(self, requests: list[Request]) -> None:
        """Queue the requests routed here; one this rank cannot accept finishes with
        ``finish_reason="error"``, its output sent with the next step's reply."""
        self._received += len(requests)
        for req in requests:
            try:
                self._check(req)
                self.engine.add(req)
            except (ValueError, TypeError) as exc:
                req.finish("error", f"rank {self.rank} rejected the request: {exc}")
                self._rejected.append(self.engine.core.output_of(req))

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.engine.core.abort(request_id)

    def has_work(self) -> bool:
        """Requests to run, or rejected requests whose outputs the driver has not been sent."""
        return self.engine.has_unfinished() or bool(self._rejected)

    def step_once(self, stream: bool) -> StepReply:
        """One step of this rank's engine, a placeholder forward when it has nothing to run (see the
        module docstring); the reply holds the rejected requests queued since the last one."""
        core = self.engine.core
        core.stream = stream
        rejected, self._rejected = self._rejected, []
        scheduled = core.schedule()
        if scheduled.is_empty:
            self._placeholder()
            results = None
        else:
            results = core.execute(scheduled)
        outputs = core.process(scheduled, results)
        if self.balancer is not None:
            self.balancer.end_step()
        finished = rejected + [o for o in outputs if o.finished]
        for out in finished:
            self._sent.pop(out.request_id, None)
        return StepReply(finished, [self._delta(o) for o in outputs if not o.finished], self.load(), self._received)

    def _delta(self, out: RequestOutput) -> TokenDelta:
        """The part of an unfinished request's cumulative output that the driver has not received."""
        completion = out.outputs[0]
        sent = self._sent.get(out.request_id, 0)
        self._sent[out.request_id] = len(completion.token_ids)
        logprobs = None if completion.logprobs is None else completion.logprobs[sent:]
        return TokenDelta(out.request_id, completion.token_ids[sent:], logprobs,
                          out.prompt_logprobs if sent == 0 else None)

    def _check(self, req: Request) -> None:
        """The driver validated the request against rank 0; check it against this rank's engine."""
        vocab = self.engine.model.vocab_size
        if any(not 0 <= t < vocab for t in req.prompt_token_ids):
            raise ValueError(f"a prompt token is outside this rank's vocabulary [0, {vocab})")
        if req.num_prompt_tokens >= self.engine.max_model_len:
            raise ValueError(f"prompt has {req.num_prompt_tokens} tokens; max_model_len is {self.engine.max_model_len}")

    def _placeholder(self) -> None:
        """A forward of zero tokens (and no state slots): an idle rank still joins every MoE layer's
        collectives."""
        if not self.layers:
            return
        ids = torch.zeros(0, dtype=torch.int64, device=self.device)
        block_size = self.engine.config.cache.block_size
        ctx = forward_context(SpanLayout.of([], block_size), block_size=block_size,
                              backends=self.engine.runner.backends, device=self.device, state_slots=[])
        with torch.inference_mode():
            self.engine.model.forward(ids, ctx)

    def agree(self, commands: int) -> tuple[bool, int]:
        """One all-reduce over the ranks: whether any rank has work, and the fewest collective commands
        any rank has queued (``commands``: this rank's)."""
        flags = self._flags
        flags[0], flags[1] = int(self.has_work()), -commands
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        any_work, fewest = flags.tolist()
        return bool(any_work), -fewest

    def load(self) -> RankLoad:
        """Queued and running requests, their tokens, and the KV blocks in use (cached free blocks not)."""
        sched = self.engine.scheduler
        live = sched.waiting + sched.running
        pool = self.engine.kv.pool
        return RankLoad(self.rank, len(live), sum(r.num_tokens for r in live), pool.num_usable - pool.num_free)

    def stats(self) -> dict[str, Any]:
        stats = self.engine.get_stats()
        comm = self.engine.runner.backends.get("dispatch")
        timer = getattr(comm, "timer", None)
        if self.layers and timer is not None:
            stats["_parallel"] = {"dispatch_seconds": timer.dispatch_s, "combine_seconds": timer.combine_s,
                                  "dispatch_calls": timer.calls}
            overflow = getattr(comm, "overflow", None)  # a fixed-capacity backend's counts
            if overflow is not None:
                stats["_parallel"].update(dispatch_overflow_pairs=overflow.pairs,
                                          dispatch_overflow_exchanges=overflow.exchanges)
        if self.balancer is not None:
            stats["_eplb"] = self.balancer.stats()
        return stats

    def layout(self) -> dict[str, Any]:
        """This rank's expert slots: the placement rows; per layer and slot, the logical expert and a
        fingerprint of its weights (float64 sums of w13 and w2) to check against a reference; per layer
        the rows its expert tensors have (``[w13 rows, w2 rows]``); what its checkpoint load read
        (``[tensors, bytes]``; None for dummy weights); and the elements of its MTP layers' parameters."""
        report = self.engine.load_report
        mtp = getattr(self.engine.model, "mtp_layers", None)
        return {"rank": self.rank,
                "placement": [ep.phys_to_logical.tolist() for ep in self.layers],
                "slots": [[(e, float(ep.w13[s].double().sum()), float(ep.w2[s].double().sum()))
                           for s, e in enumerate(ep.local_experts)] for ep in self.layers],
                "rows": [[ep.w13.shape[0], ep.w2.shape[0]] for ep in self.layers],
                "read": None if report is None else [report.tensors, report.bytes],
                "mtp_parameters": 0 if mtp is None else sum(p.numel() for p in mtp.parameters())}

    def rebalance(self) -> None:
        if self.balancer is None or self.balancer.policy is None:
            raise RuntimeError("rebalance() needs expert parallelism with plugins.eplb enabled")
        self.balancer.rebalance()

    def shutdown(self) -> None:
        self.engine.shutdown()
        dist.destroy_process_group()


def serve(conn: Connection, rank: Rank) -> None:
    """Step on this rank's own loop until every rank has received ``shutdown`` or the driver is gone.

    Each iteration reads the driver's messages without waiting (up to ``IDLE_WAIT_S`` while no rank has
    work): ``add`` (requests routed here, and whether to stream) and ``abort`` apply at once; the
    collective commands (``stats``, ``layout``, ``rebalance``, ``shutdown``) queue. Then one all-reduce of
    two integers (``agree``) tells every rank whether any of them has work and how many queued commands
    every rank has received; those run, in order, at the same point on every rank, each answered with
    ``("ok", result)``. If any rank has work, every rank steps (a placeholder forward when it has none,
    so that it joins the MoE collectives) and sends ``("step", StepReply)``; the driver reads the replies
    when it likes (no per-step round trip)."""
    commands: deque[str] = deque()
    busy = False
    stream = False
    while True:
        wait = 0.0 if busy else IDLE_WAIT_S
        try:
            while conn.poll(wait):
                wait = 0.0
                kind, payload = conn.recv()
                if kind == "add":
                    requests, stream = payload
                    rank.add(requests)
                elif kind == "abort":
                    rank.abort(payload)
                else:
                    commands.append(kind)
        except (EOFError, OSError):
            logger.warning("rank %d: the driver went away; exiting", rank.rank)
            return
        busy, ready = rank.agree(len(commands))
        for _ in range(ready):
            kind = commands.popleft()
            if kind == "shutdown":
                rank.shutdown()
                with contextlib.suppress(OSError):
                    conn.send(("ok", None))
                return
            conn.send(("ok", rank.run(kind)))
        if busy:
            conn.send(("step", rank.step_once(stream)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deepinfer.parallel.worker")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--driver", required=True, help="HOST:PORT of the driver's command listener")
    parser.add_argument("--store-port", type=int, required=True, help="the driver's TCPStore port")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format=f"[rank {args.rank}] %(levelname)s %(name)s: %(message)s")
    authkey = bytes.fromhex(sys.stdin.readline().strip())
    host, port = args.driver.rsplit(":", 1)
    conn = Client((host, int(port)), authkey=authkey)
    conn.send(("hello", args.rank))
    try:
        _, config = conn.recv()
        store = dist.TCPStore(host, args.store_port, is_master=False, timeout=COLLECTIVE_TIMEOUT)
        rank = Rank(args.rank, args.world, config, store)
        conn.send(("ready", rank.info()))
        serve(conn, rank)
    except BaseException as exc:  # report any failure to the driver, then exit non-zero
        with contextlib.suppress(OSError):
            conn.send(("error", (type(exc).__name__, str(exc), traceback.format_exc())))
        return 1
    return 0


if __name__ == "__main__":
    code = main()
    # Leave without the interpreter's teardown: once the process group is destroyed, a C++ thread of the
    # distributed runtime can still be joinable when its static objects are destroyed, and the process
    # would end in std::terminate (SIGABRT) instead of the code it chose. Everything is already sent.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
