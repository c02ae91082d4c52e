"""Read once for replicas: items several ranks of a stage plan identically are read by one
of them and broadcast to the others. Pure planning: ``plan_stage(read_once=True)`` plans it
(planning/transfer.py), io/transfer/read_once.py runs it and ``comm.Comm.broadcast_bytes``
moves the bytes.

When it pays: storage slower than the interconnect (network file systems, object-store
mounts, a cold cache shared by many ranks): replicated tensors (norms, routers, MLA's
replicated projections, and with EP > 1 every non-expert tensor) cost storage bytes once per
group instead of once per rank. On local NVMe or a warm page cache reading is as fast as a
broadcast and the extra synchronisation only costs, hence the default is off.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from ..errors import PlanError
from .plan import RankPlan, ReadItem
from .topology import Topology

__all__ = ["SHARE_GROUPS", "SharedItem", "SharedPlan", "share_reads", "NodeTransfer",
           "NodePlan", "share_node_reads"]

#: Topology groups (largest first) within which identical items are read once and broadcast.
SHARE_GROUPS = ("stage", "tp", "replica")


def _group(topo: Topology, group: str) -> tuple[int, ...]:
    return {"stage": topo.stage_group, "tp": topo.tp_group, "replica": topo.replica_group}[group]()


@dataclass(frozen=True)
class SharedItem:
    """An item every rank of ``ranks`` plans identically: ``reader`` reads it from storage and
    broadcasts it over its ``group`` (a Topology group name); the others receive it."""

    item: ReadItem
    group: str
    ranks: tuple[int, ...]
    reader: int


@dataclass(frozen=True)
class SharedPlan:
    """One rank's part of a read-once load.

    ``own``: the rank's unshared items (read as usual). ``shared``: every broadcast it takes
    part in, in the one global order all ranks issue them (by tensor name, then target), so
    ranks in overlapping groups can never wait on each other in a cycle.
    """

    own: RankPlan
    shared: tuple[SharedItem, ...]

    @property
    def rank(self) -> int:
        return self.own.topology.rank

    @property
    def reads(self) -> RankPlan:
        """The shared items this rank reads for its groups, in broadcast order."""
        return replace(self.own, items=tuple(s.item for s in self.shared if s.reader == self.rank))

    @property
    def read_bytes(self) -> int:
        """Bytes this rank plans to read from storage (own + shared items it reads)."""
        return self.own.read_bytes + self.reads.read_bytes

    @property
    def received_bytes(self) -> int:
        return sum(s.item.nbytes for s in self.shared if s.reader != self.rank)


def share_reads(stage_plans: Sequence[RankPlan]) -> dict[int, SharedPlan]:
    """Split the plans of every rank of one stage into own reads and read-once broadcasts.

    An item is shared over the largest group (stage, then tp, then replica) whose members all
    plan it identically (same bytes, same slice); a group is used only when every member
    chose it. Each shared item gets one reader, balanced by bytes (largest first to the
    least-loaded member). Pure and deterministic: every rank computes the same answer from
    the same plans (planning/transfer.py calls it in ``plan_stage(read_once=True)``).
    """
    plans = {p.topology.rank: p for p in stage_plans}
    if not plans:
        return {}
    stage = set(next(iter(plans.values())).topology.stage_group())
    if set(plans) != stage:
        raise PlanError(f"share_reads needs the plans of every rank of one stage {sorted(stage)}, "
                        f"got ranks {sorted(plans)}")
    Key = tuple[str, str]
    items: dict[int, dict[Key, ReadItem]] = {
        r: {(i.name, i.target): i for i in p.items} for r, p in plans.items()}
    choice: dict[tuple[int, Key], str] = {}
    for r, p in plans.items():
        for key, item in items[r].items():
            for g in SHARE_GROUPS:
                ranks = _group(p.topology, g)
                if len(ranks) > 1 and all(items[m].get(key) == item for m in ranks):
                    choice[r, key] = g
                    break
    changed = True
    while changed:  # a group is used only if all its members chose it for this item
        changed = False
        for (r, key), g in list(choice.items()):
            ranks = _group(plans[r].topology, g)
            if any(choice.get((m, key)) != g for m in ranks):
                for m in ranks:
                    if choice.get((m, key)) == g:
                        del choice[m, key]
                changed = True
    readers: dict[tuple[str, tuple[int, ...], Key], int] = {}
    groups = {(g, _group(plans[r].topology, g), key): items[r][key]
              for (r, key), g in choice.items()}
    load = dict.fromkeys(plans, 0)
    for gk in sorted(groups, key=lambda k: (-groups[k].read_bytes, k)):
        reader = min(gk[1], key=lambda m: (load[m], m))
        readers[gk] = reader
        load[reader] += groups[gk].read_bytes
    out = {}
    for r, p in plans.items():
        own: list = []
        shared: list = []
        for item in p.items:
            key = (item.name, item.target)
            g = choice.get((r, key))  # type: ignore[assignment]
            if g is None:
                own.append(item)
                continue
            ranks = _group(p.topology, g)
            shared.append(SharedItem(item, g, ranks, readers[g, ranks, key]))
        shared.sort(key=lambda s: (s.item.name, s.item.target))
        out[r] = SharedPlan(replace(p, items=tuple(own)), tuple(shared))
    return out


# ---- read once per node ----------------------------------------------------------------------
def _bytes_key(item: ReadItem) -> tuple:
    """What makes two items the same bytes in memory, whatever their names and targets (the
    tied head is the embedding read under the head's name)."""
    return (item.file, item.ranges, item.dtype, item.shape, item.buffer_shape, item.gather,
            item.pad_rows)


@dataclass(frozen=True)
class NodeTransfer:
    """Bytes needed by several ranks of one node: ``reader`` reads them (as its ``item``) and
    sends them to every rank of ``receivers``, point to point."""

    key: tuple
    reader: int
    receivers: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class NodePlan:
    """One rank's part of a read-once-per-node load: ``own`` items (read as usual; a plan),
    ``transfers`` every transfer of the node in the one order all its ranks follow, and
    ``mine`` the rank's own item (its target) for each transfer it takes part in."""

    own: RankPlan
    transfers: tuple[NodeTransfer, ...]
    mine: tuple[tuple[int, ReadItem], ...]   # (transfer index, this rank's item)

    @property
    def rank(self) -> int:
        return self.own.topology.rank

    @property
    def read_bytes(self) -> int:
        """Bytes this rank reads from storage: own items (with their redistribution, when
        planned and loaded so) + transfers it is the reader of."""
        return self.own.planned_read_bytes + sum(self.transfers[i].nbytes for i in
                                         {i for i, _ in self.mine}
                                         if self.transfers[i].reader == self.rank)


def share_node_reads(node_plans: Sequence[RankPlan]) -> dict[int, NodePlan]:
    """Split the plans of every rank of one node into own reads and node transfers.

    An item whose bytes several ranks of the node plan (replicated tensors of a stage, and
    across stages the tied head = the embedding, or an identical vocab slice) is read by one of
    them, balanced by bytes (largest first to the least-loaded), and sent to the others: bytes
    read per node = the union of its ranks' items. Pure and deterministic: every rank of the
    node computes the same answer from the same plans.
    """
    plans = {p.topology.rank: p for p in node_plans}
    owners: dict[tuple, list[tuple[int, ReadItem]]] = {}
    for r in sorted(plans):
        for item in plans[r].items:
            if item.ranges:
                owners.setdefault(_bytes_key(item), []).append((r, item))
    shared = {k: v for k, v in owners.items() if len({r for r, _ in v}) > 1}
    load = dict.fromkeys(plans, 0)
    readers: dict[tuple, int] = {}
    for key in sorted(shared, key=lambda k: (-shared[k][0][1].read_bytes, k)):
        ranks = sorted({r for r, _ in shared[key]})
        readers[key] = min(ranks, key=lambda m: (load[m], m))
        load[readers[key]] += shared[key][0][1].read_bytes
    order = sorted(shared)  # (file, ranges, ...): one global order, storage order too
    transfers = tuple(NodeTransfer(k, readers[k], tuple(sorted({r for r, _ in shared[k]}
                                                               - {readers[k]})),
                                   shared[k][0][1].read_bytes) for k in order)
    out = {}
    for r, plan in plans.items():
        mine = tuple((i, item) for i, k in enumerate(order) for m, item in shared[k] if m == r)
        own = tuple(item for item in plan.items if _bytes_key(item) not in shared)
        out[r] = NodePlan(replace(plan, items=own), transfers, mine)
    return out
