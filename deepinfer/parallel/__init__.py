"""Distributed execution in the core (ARCHITECTURE §10): data-parallel attention and expert-parallel
MoE over ``torch.distributed`` (gloo on CPU, NCCL on CUDA).

- ``driver.py``: ``ParallelEngine``, what ``LLM(model, expert_parallel_size=N)`` runs: starts the rank
  processes, routes requests (``RequestRouter``) and sends them, reads the ranks' replies, sums statistics.
- ``worker.py``: one rank: its engine, its expert share, its own step loop with a placeholder forward;
  ``messages.py``: its step replies (finished outputs, streamed token deltas, load).
- ``torchrun.py``: ``TorchrunEngine``, the same under ``torchrun``: this process is one of the ranks.
- ``moe.py`` / ``dispatch.py``: the expert-parallel MoE layer and the all-to-all dispatch/combine.
- ``placement.py``: placements as data (replica maps, replica routing, move plans, balance).
- ``balancer.py`` / ``shuffle.py``: router statistics, rebalancing with a ``PlacementPolicy``
  (plugins decide, e.g. ``deepinfer-eplb``), and the expert weight moves.
- ``sizes.py`` / ``launch.py``: how many ranks a config asks for, which rank this process is, and
  whether ``torchrun`` started it.

Modules are imported lazily by their users, so importing the core never initialises a process group.
"""
