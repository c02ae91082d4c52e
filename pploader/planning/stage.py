"""One rank's stage plan: what it reads (``RankPlan``) and how those bytes arrive
(``Transfer``), with what it was made from. Frozen; made once per load, never re-planned
while loading.

Pure: config.json and the needed shards' headers only, no torch.distributed.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping, Optional, Sequence

from ..errors import ArgumentError, PPLoaderError
from .checkpoint import CheckpointIndex, open_checkpoint
from .partition import EngineSplit, StageWindow
from .plan import DEFAULT_EXCHANGE_COST, Partition, RankPlan, make_windows, plan_rank
from .roles import CheckpointRoles, checkpoint_roles
from .shard import DEFAULT_RANGE_COST_BYTES
from .spec import ModelSpec, load_spec
from .topology import Topology
from .transfer import Transfer, plan_transfer

if TYPE_CHECKING:  # pragma: no cover
    import torch

logger = logging.getLogger(__name__)

__all__ = ["OpenedModel", "open_model", "StagePlan", "plan_stage", "stage_window"]


@dataclass(frozen=True)
class OpenedModel:
    """A model directory opened once per rank: its spec (named as stored on disk) and its
    checkpoint index. Whatever needs the checkpoint (a cache-aware partition, the exchange
    cost, the plan) takes this instead of reopening the directory."""

    spec: ModelSpec
    index: CheckpointIndex


def open_model(model_dir: os.PathLike | str, *,
               allowed_roots: Sequence[str] = ()) -> OpenedModel:
    """config.json and the index (shard headers are parsed later, when needed)."""
    spec = load_spec(model_dir, allowed_roots=allowed_roots)
    index = open_checkpoint(model_dir, allowed_roots=allowed_roots)
    return OpenedModel(spec.for_checkpoint(index.weight_map), index)


def stage_window(spec: ModelSpec, index: CheckpointIndex, topology: Topology,
                 partition: Partition = "even", *,
                 roles: Optional[CheckpointRoles] = None) -> StageWindow:
    """This rank's window: its stage's ``[start_layer, end_layer)`` under ``partition``."""
    return make_windows(spec, index, topology.pp_size, partition, roles=roles)[topology.pp_rank]


@dataclass(frozen=True)
class StagePlan:
    """A rank's plan together with what it was made from and how its bytes arrive.

    ``casts``: targets whose stored dtype is cast (planning/dtypes.py); ``transfer``: the
    transfer kind and its group's sharing (planning/transfer.py), run by io/transfer/."""

    spec: ModelSpec
    index: CheckpointIndex
    plan: RankPlan
    casts: Mapping[str, "torch.dtype"] = field(default_factory=dict)
    transfer: Optional[Transfer] = None

    @property
    def kind(self) -> str:
        """The transfer kind (``direct`` when none was planned)."""
        return self.transfer.kind if self.transfer is not None else "direct"

    @property
    def progress_bytes(self) -> int:
        """Bytes a load of this plan reports as loaded (received bytes of the read-once
        kinds count as read, as planned; the exchange counts its row shares)."""
        if self.kind == "exchange":
            return self.plan.planned_read_bytes
        return self.plan.read_bytes


def plan_stage(model_dir: os.PathLike | str, topology: Topology, *,
               partition: Partition = "even", strict: bool = True,
               allowed_roots: Sequence[str] = (),
               range_cost_bytes: int = DEFAULT_RANGE_COST_BYTES,
               exchange_cost: Optional[float] = DEFAULT_EXCHANGE_COST,
               exchange_batch_bytes: Optional[int] = None,
               read_once: bool = False, node_ranks: Optional[Sequence[int]] = None,
               opened: Optional[OpenedModel] = None) -> StagePlan:
    """Plan this rank's stage from config.json and the needed shards' headers.

    Every check (headers, shapes, dtype policy) happens here, before anything is allocated;
    errors name this rank. ``range_cost_bytes``: what one extra positional read costs in
    bytes of transfer; strided (dim-1) TP slices are read row by row when that is cheaper
    than reading the covering box (0 = always row by row, i.e. exactly the ideal bytes).
    ``exchange_cost`` (None = off): per tensor, strided slices may instead be read as row
    shares and redistributed over the TP group (planning/redistribute.py).

    The transfer (planning/transfer.py): ``read_once`` reads replicated items once per
    stage group and broadcasts them; ``node_ranks`` (this rank's node) reads bytes several
    ranks of the node need once and sends them; else the exchange when planned, else direct.
    The peers' plans these need are made here, once. ``opened``: the model already opened
    by this rank (:func:`open_model`), so the directory is not parsed again."""
    from ..arguments import check, check_type
    from .dtypes import dtype_casts
    if not isinstance(topology, Topology):
        raise ArgumentError(f"topology={topology!r}: not a Topology; give "
                            "Topology.for_world(world_size, rank, pp=..., tp=...)",
                            argument="topology")
    check(range_cost_bytes=range_cost_bytes, exchange_cost=exchange_cost,
          exchange_batch_bytes=exchange_batch_bytes)
    check_type("opened", opened, OpenedModel, "an OpenedModel (from open_model)")
    check_type("partition", partition, (str, list, tuple, EngineSplit),
               "even, balanced, vllm, sglang, an EngineSplit or layer counts", optional=False)
    if node_ranks is not None and not (isinstance(node_ranks, (list, tuple, range)) and all(
            isinstance(r, int) and not isinstance(r, bool) for r in node_ranks)):
        raise ArgumentError(f"node_ranks={node_ranks!r:.60}: give this node's ranks (a "
                            "sequence of integers) or None", argument="node_ranks")
    try:
        opened = opened if opened is not None else open_model(model_dir,
                                                              allowed_roots=allowed_roots)
        spec, index = opened.spec, opened.index
        roles = checkpoint_roles(spec, index)  # classified once, for this rank and its peers
        windows = make_windows(spec, index, topology.pp_size, partition, roles=roles)
        plan = plan_rank(spec, index, topology, windows[topology.pp_rank], strict=strict,
                         range_cost_bytes=range_cost_bytes, exchange_cost=exchange_cost,
                         exchange_batch_bytes=exchange_batch_bytes, roles=roles)
        transfer = plan_transfer(spec, index, plan, windows, roles, read_once=read_once,
                                 node_ranks=node_ranks)
        staged = StagePlan(spec, index, plan, dtype_casts(spec, plan), transfer)
        logger.info("%s: planned layers %d-%d%s%s: %d tensors, %d bytes to read (ideal %d) "
                    "from %d file(s); transfer %s", topology.describe(),
                    plan.window.start_layer, plan.window.end_layer - 1,
                    " + embedding" if plan.window.has_embed else "",
                    " + head" if plan.window.has_head else "", len(plan.items),
                    plan.planned_read_bytes, plan.ideal_bytes, len(plan.files), transfer.kind)
        return staged
    except PPLoaderError as exc:
        raise exc.on_rank(topology.rank)
