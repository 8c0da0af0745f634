"""``deepseek``: the deepseek-ai EPLB policy (reference/peers.md §4.1), for comparison.

It balances one load vector per layer (here: the window's loads summed over steps).

- *Balanced packing*: items by descending weight, each into the lightest pack that still has room;
  every pack takes exactly n / m items.
- *Replication*: each redundant slot goes to the expert with the highest load per existing replica.
- *Hierarchical* (when the expert groups divide evenly over the nodes): pack expert groups onto nodes
  (group-limited routing then stays node-local), replicate inside each node, pack the node's
  replicas onto its ranks by load ÷ replica count. *Global* (otherwise): the same with one group and
  one node.
"""

from __future__ import annotations

import torch


def balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pack [n], position_in_pack [n])`` for ``weight [n]`` with ``n % num_packs == 0``."""
    n = weight.numel()
    if n % num_packs:
        raise ValueError(f"{n} items do not split into {num_packs} equal packs")
    per_pack = n // num_packs
    pack = torch.empty(n, dtype=torch.int64)
    position = torch.empty(n, dtype=torch.int64)
    pack_weight = [0.0] * num_packs
    pack_items = [0] * num_packs
    for i in torch.argsort(weight.double(), descending=True, stable=True).tolist():
        p = min((k for k in range(num_packs) if pack_items[k] < per_pack), key=lambda k: (pack_weight[k], k))
        pack[i], position[i] = p, pack_items[p]
        pack_items[p] += 1
        pack_weight[p] += float(weight[i])
    return pack, position


def replicate_max_load(weight: torch.Tensor, num_physical: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(phys_to_logical [num_physical], counts [n])``: slot i < n holds expert i; every further slot
    the expert with the highest load per replica (lowest index on ties)."""
    n = weight.numel()
    phys = torch.arange(num_physical, dtype=torch.int64)
    counts = torch.ones(n, dtype=torch.int64)
    w = weight.double()
    for i in range(n, num_physical):
        j = int(torch.argmax(w / counts))
        phys[i] = j
        counts[j] += 1
    return phys, counts


def place_layer_hierarchical(weight: torch.Tensor, num_physical: int, num_groups: int, num_nodes: int,
                             ranks: int) -> torch.Tensor:
    """``phys_to_logical [num_physical]`` for one layer's ``weight [logical]``."""
    num_logical = weight.numel()
    if num_logical % num_groups or num_groups % num_nodes or ranks % num_nodes or num_physical % ranks:
        raise ValueError(f"hierarchical placement needs logical ({num_logical}) % groups ({num_groups}), "
                         f"groups % nodes ({num_nodes}), ranks ({ranks}) % nodes and physical "
                         f"({num_physical}) % ranks to be 0")
    group_size = num_logical // num_groups
    groups_per_node = num_groups // num_nodes
    experts_per_node = num_logical // num_nodes
    phys_per_node = num_physical // num_nodes
    ranks_per_node = ranks // num_nodes
    # 1. groups onto nodes; order the logical experts node by node ("node-major" ids)
    group_node, group_pos = balanced_packing(weight.double().view(num_groups, group_size).sum(dim=1), num_nodes)
    node_major_of_group = group_node * groups_per_node + group_pos  # [groups]
    node_major = (node_major_of_group.unsqueeze(1) * group_size + torch.arange(group_size)).reshape(-1)
    logical_of = torch.empty(num_logical, dtype=torch.int64)
    logical_of[node_major] = torch.arange(num_logical)
    out = []
    for node in range(num_nodes):
        members = logical_of[node * experts_per_node:(node + 1) * experts_per_node]
        w = weight.double()[members]
        # 2. replicate inside the node
        phys, counts = replicate_max_load(w, phys_per_node)
        # 3. pack the node's replicas onto its ranks by per-replica load
        pack, pos = balanced_packing(w[phys] / counts[phys], ranks_per_node)
        slot = pack * (phys_per_node // ranks_per_node) + pos
        ordered = torch.empty_like(phys)
        ordered[slot] = phys
        out.append(members[ordered])
    return torch.cat(out)
