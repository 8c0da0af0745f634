"""``TorchrunEngine``: ``LLM(model, expert_parallel_size=N)`` in a process that ``torchrun`` started.

Under ``torchrun`` (one host or several) nothing is spawned: each of the ``WORLD_SIZE`` processes is
one rank itself (``worker.Rank``, joined through ``env://``; gloo on CPU, NCCL on CUDA with the GPU
``LOCAL_RANK``), and ``WORLD_SIZE`` must equal the ranks the config asks for. The processes run the
same script (SPMD): they number and validate requests identically (``ParallelEngine``'s
``make_request``), route them with the same ``RequestRouter`` over the same loads, and each runs
only the requests routed to it, in lock-step (a placeholder forward when it has none). Every command
that the driver would send to its ranks runs here on this process's rank, and the replies — finished
outputs and loads, statistics, layouts — are all-gathered (over a gloo group), so every process
holds the driver's view: ``generate()`` returns every output, in input order, on every process.

``generate()``, ``chat()``, ``abort()``, ``get_stats()``, ``rebalance()``, ``expert_layout()`` and
``shutdown()`` are therefore collectives: every process must call them in the same order with the same
arguments. A process that fails exits, and ``torchrun`` then stops the others.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from deepinfer.engine.request import Request
from deepinfer.errors import ConfigError
from deepinfer.outputs import RequestOutput
from deepinfer.parallel.driver import ParallelEngine, RankFailure
from deepinfer.parallel.launch import TorchrunLaunch
from deepinfer.parallel.worker import Rank


class TorchrunEngine(ParallelEngine):
    """A ``ParallelEngine`` whose ranks are the ``torchrun`` processes, this one among them."""

    def __init__(self, model: str | None = None, *, launch: TorchrunLaunch, config: Any = None,
                 overrides: Mapping[str, Any] | None = None) -> None:
        self.launch = launch
        super().__init__(model, config=config, overrides=overrides)

    @property
    def stream(self) -> bool:
        """Always off: streaming serves requests that reach one process only, which SPMD cannot."""
        return False

    @stream.setter
    def stream(self, on: bool) -> None:
        if on:
            raise ConfigError("AsyncLLM and `deepinfer serve` do not run under torchrun (every torchrun process "
                              "must get the same requests); use LLM there, or start the server without torchrun")

    def _start(self) -> list[dict[str, Any]]:
        launch = self.launch
        if launch.world != self.world:
            raise ConfigError(
                f"torchrun started WORLD_SIZE={launch.world} processes but the config asks for {self.world} "
                f"rank(s) (parallel.expert_parallel_size={self.expert_parallel_size}, "
                f"parallel.data_parallel_size={self.config.parallel.data_parallel_size}); each torchrun "
                f"process is one rank, so they must be equal")
        self._finalizer.detach()  # there are no rank processes to stop: this process is the rank
        self._rank = Rank(launch.rank, launch.world, self.config.model_dump(), None,
                          local_rank=launch.local_rank, num_nodes=launch.num_nodes)
        self._finalizer = weakref.finalize(self, self._rank.shutdown)
        # Python objects travel over gloo: NCCL would stage every pickle through the GPU.
        self._objects = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        return self._gather(self._rank.info())

    def _gather(self, reply: Any) -> list[Any]:
        """Every rank's ``reply``, by rank (a collective)."""
        replies: list[Any] = [None] * self.world
        dist.all_gather_object(replies, reply, group=self._objects)
        return replies

    def _all(self, kind: str) -> list[Any]:
        """Run one command on this process's rank and gather every rank's reply."""
        if not self._finalizer.alive:
            raise RankFailure("this rank has been shut down")
        return self._gather(self._rank.run(kind))

    def add(self, request: Request) -> None:
        """Route ``request`` (every process the same way); this process's rank queues it if it is its."""
        if self._route(request) == self._rank.rank:
            self._rank.add([request])

    def abort(self, request_id: str) -> bool:
        """Abort an unfinished request (on the process whose rank runs it); its output comes with the next
        step."""
        rank = self._owner.get(request_id)
        if rank is None:
            return False
        if rank == self._rank.rank:
            self._rank.abort([request_id])
        return True

    def step(self) -> list[RequestOutput]:
        """One lock-step of every process's rank; every rank's finished outputs (a collective)."""
        if not self._owner:
            return []
        if not self._finalizer.alive:
            raise RankFailure("this rank has been shut down")
        return self._apply(self._gather(self._rank.step_once(False)))

    def shutdown(self) -> None:
        """Leave the process group once every process got here (idempotent; a collective)."""
        if self._finalizer.alive:
            dist.barrier(group=self._objects)
            self._finalizer()
