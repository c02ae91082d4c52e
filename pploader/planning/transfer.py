"""How a rank's bytes arrive: one of four transfer kinds, decided here at planning time.

Every rank decides deterministically, from the peers' plans (computed once, here, with the
same checkpoint roles), so all ranks of a group agree on who reads what without talking:

- ``direct``: the rank reads its own items (the default);
- ``exchange``: strided TP slices are read as row shares and swapped with all-to-alls over
  the TP group (``RankPlan.redistribute``, planning/redistribute.py); the rest direct;
- ``stage_read_once``: items several ranks of the stage plan identically are read by one of
  them and broadcast (planning/share.py ``share_reads``);
- ``node_read_once``: bytes several ranks of one node need are read by one of them and sent
  point to point (``share_node_reads``); strided TP slices still exchanged when planned so.

Pure: no I/O beyond headers, no torch.distributed. ``io/transfer/`` runs each kind.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Sequence

from ..errors import PlanError
from .checkpoint import CheckpointIndex
from .partition import StageWindow
from .plan import RankPlan, plan_rank
from .roles import CheckpointRoles
from .share import NodePlan, SharedPlan, share_node_reads, share_reads
from .spec import ModelSpec

__all__ = ["TransferKind", "TRANSFER_KINDS", "Transfer", "plan_transfer"]

TransferKind = Literal["direct", "exchange", "stage_read_once", "node_read_once"]
TRANSFER_KINDS: tuple[str, ...] = ("direct", "exchange", "stage_read_once", "node_read_once")


@dataclass(frozen=True)
class Transfer:
    """How this rank's planned bytes arrive (see the module docstring).

    ``ranks``: every rank taking part (the TP group, the stage group or the node; this rank
    alone for ``direct``). ``shared`` (``stage_read_once``) and ``node`` (``node_read_once``):
    this rank's part of the group's sharing, worked out from every peer's plan."""

    kind: TransferKind
    ranks: tuple[int, ...]
    shared: Optional[SharedPlan] = None
    node: Optional[NodePlan] = None

    @property
    def node_exchange(self) -> bool:
        """``node_read_once`` whose own items still go through the TP exchange (every
        exchanged target is among the node plan's own items)."""
        node = self.node
        if node is None or node.own.redistribute is None:
            return False
        return node.own.redistribute.targets <= {i.target for i in node.own.items}


def plan_transfer(spec: ModelSpec, index: CheckpointIndex, plan: RankPlan,
                  windows: Sequence[StageWindow], roles: CheckpointRoles, *,
                  read_once: bool = False, node_ranks: Optional[Sequence[int]] = None
                  ) -> Transfer:
    """This rank's transfer: ``node_ranks`` given: ``node_read_once`` over them; else
    ``read_once``: ``stage_read_once``; else ``exchange`` when the plan chose
    redistribution for some tensor (``exchange_cost`` off: none); else ``direct``.

    ``windows``: every stage's window (the node's peers may sit on other stages); ``roles``:
    the classification ``plan`` was made with, shared by the peers' plans. The peers are
    planned with ``strict=False`` (this rank's plan was checked; theirs are the same
    checkpoint's) and without redistribution (read-once moves whole items)."""
    topo = plan.topology
    if read_once and node_ranks is not None:
        raise PlanError("read once per stage and read once per node exclude each other: "
                        "choose one", rank=topo.rank)

    def peer(rank: int) -> RankPlan:
        if rank == topo.rank:
            return plan
        other = topo.with_rank(rank)
        return plan_rank(spec, index, other, windows[other.pp_rank], strict=False,
                         range_cost_bytes=plan.range_cost_bytes, exchange_cost=None,
                         roles=roles)

    if node_ranks is not None:
        ranks = tuple(sorted(set(node_ranks)))
        if topo.rank not in ranks or not all(0 <= r < topo.world_size for r in ranks):
            raise PlanError(f"node ranks {list(ranks)} must include this rank and lie in the "
                            f"world of {topo.world_size}", rank=topo.rank)
        node = share_node_reads([peer(r) for r in ranks])[topo.rank]
        return Transfer("node_read_once", ranks, node=node)
    if read_once:
        ranks = topo.stage_group()
        shared = share_reads([peer(r) for r in ranks])[topo.rank]
        return Transfer("stage_read_once", ranks, shared=shared)
    if plan.redistribute is not None:
        return Transfer("exchange", tuple(plan.redistribute.group))
    return Transfer("direct", (topo.rank,))
