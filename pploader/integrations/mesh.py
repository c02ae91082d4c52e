"""Where torch's parallel world meets pploader's: a ``DeviceMesh`` gives the ``Topology``, a
``torch.distributed.pipelining`` stage's layer range gives the ``StageWindow``.

One line each, so a torch-native job (``init_device_mesh`` + ``parallelize_module`` +
``PipelineStage``) never restates its sizes and ranks to pploader::

    topo = mesh_topology(mesh)                       # mesh dims named "pp" and "tp"
    window = pipeline_window(stage, range(start, end))  # a PipelineStage (or its index + count)
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

from ..errors import TopologyError
from ..planning.partition import StageWindow
from ..planning.topology import Topology

__all__ = ["mesh_topology", "pipeline_window"]


def _dim_size_rank(mesh: Any, dim: Optional[str]) -> tuple[int, int]:
    """(size, this rank's coordinate) of mesh dim ``dim``; (1, 0) when ``dim`` is None."""
    if dim is None:
        return 1, 0
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if dim not in names:
        raise TopologyError(f"the device mesh has no dim named {dim!r} (its dims: "
                            f"{list(names) or 'unnamed'}): name them with "
                            "init_device_mesh(..., mesh_dim_names=(...)) or pass pp_dim= / "
                            "tp_dim= / ep_dim=")
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise TopologyError("this rank is not part of the device mesh")
    return int(mesh.size(names.index(dim))), int(coordinate[names.index(dim)])


def mesh_topology(mesh: Any, *, pp_dim: Optional[str] = "pp", tp_dim: Optional[str] = "tp",
                  ep_dim: Optional[str] = None) -> Topology:
    """pploader's ``Topology`` of this rank from a ``DeviceMesh`` with named dims.

    Sizes and coordinates come from the mesh; a dim given as None (or absent by default: a
    1-d TP-only mesh passes ``pp_dim=None``) counts as size 1. The rank is pploader's order
    (TP innermost, then EP, then PP), which is the mesh's own rank when its dims are in
    (pp, ep, tp) order as ``init_device_mesh`` lays them out; other dims of the mesh (data
    parallel replicas, FSDP) load the same stage and are not part of the topology."""
    pp, pp_rank = _dim_size_rank(mesh, pp_dim)
    tp, tp_rank = _dim_size_rank(mesh, tp_dim)
    ep, ep_rank = _dim_size_rank(mesh, ep_dim)
    topo = Topology(pp, tp, ep, 0)
    return topo.with_rank(topo.rank_of(pp_rank, ep_rank, tp_rank))


def pipeline_window(stage: Any, layers: Iterable[int], num_stages: Optional[int] = None
                 ) -> StageWindow:
    """The ``StageWindow`` of a pipeline stage owning decoder ``layers`` (contiguous).

    ``stage``: a ``torch.distributed.pipelining.PipelineStage`` (its ``stage_index`` and
    ``num_stages``) or the stage index with ``num_stages``. The first stage has the
    embedding, the last one the head."""
    if isinstance(stage, int):
        if num_stages is None:
            raise TopologyError("pipeline_window(index, layers) needs num_stages=")
        index, count = stage, num_stages
    else:
        index, count = int(stage.stage_index), int(stage.num_stages)
    owned = sorted(layers)
    if not owned or owned != list(range(owned[0], owned[0] + len(owned))):
        raise TopologyError(f"stage {index} owns layers {owned}: a stage's layers must be a "
                            "non-empty contiguous range")
    if not 0 <= index < count:
        raise TopologyError(f"stage index {index} outside {count} stages")
    return StageWindow(index, owned[0], owned[-1] + 1, index == 0, index == count - 1)
