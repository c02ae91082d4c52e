"""Where torch's parallel world meets pploader's: a ``DeviceMesh`` gives the ``Topology``, a
``torch.distributed.pipelining`` stage's layer range gives the ``StageWindow``.

One line each, so a torch-native job (``init_device_mesh`` + ``parallelize_module`` +
``PipelineStage``) never restates its sizes and ranks to pploader::

    topo = mesh_topology(mesh)                       # mesh dims named "pp" and "tp"
    window = pipeline_window(stage, range(start, end))  # a PipelineStage (or its index + count)

:func:`resolve_stage` and :func:`check_stage` are how pploader's APIs that take ``mesh=`` /
``window=`` (``build_rank_pools``, ``reload_from_disk``) turn them into a rank's stage, or
check them against the stage a plan or a load record already names.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

from ..errors import TopologyError
from .partition import StageWindow, even_windows
from .topology import Topology

__all__ = ["mesh_topology", "pipeline_window", "resolve_stage", "check_stage"]


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
    elif hasattr(stage, "stage_index") and hasattr(stage, "num_stages"):
        index, count = int(stage.stage_index), int(stage.num_stages)
    else:
        raise TopologyError(f"stage={stage!r:.60}: give a PipelineStage or the stage index "
                            "with num_stages=")
    try:
        owned = sorted(int(n) for n in layers)
    except (TypeError, ValueError):
        raise TopologyError(f"layers={layers!r:.60}: give the stage's layer indices (a range "
                            "or a sequence of integers)") from None
    if not owned or owned != list(range(owned[0], owned[0] + len(owned))):
        raise TopologyError(f"stage {index} owns layers {owned}: a stage's layers must be a "
                            "non-empty contiguous range")
    if not 0 <= index < count:
        raise TopologyError(f"stage index {index} outside {count} stages")
    return StageWindow(index, owned[0], owned[-1] + 1, index == 0, index == count - 1)


def _topology(mesh: Any) -> Topology:
    """``mesh_topology`` with the dims pploader's APIs understand by name: pp, tp, ep (a
    missing one is size 1; a mesh with neither pp nor tp is refused, naming its dims)."""
    names = set(getattr(mesh, "mesh_dim_names", None) or ())
    if not names & {"pp", "tp"}:
        return mesh_topology(mesh)  # raises: the mesh has no dim named pp
    return mesh_topology(mesh, pp_dim="pp" if "pp" in names else None,
                         tp_dim="tp" if "tp" in names else None,
                         ep_dim="ep" if "ep" in names else None)


def _check_window(topo: Topology, window: StageWindow, num_layers: Optional[int]) -> None:
    # a rank may hold several (looped) virtual stages: stage i lives on pp rank i % pp
    if window.pp_rank % topo.pp_size != topo.pp_rank:
        raise TopologyError(f"stage {window.pp_rank} (layers [{window.start_layer}, "
                            f"{window.end_layer})) does not live on pipeline rank "
                            f"{topo.pp_rank} of {topo.pp_size} (stage i runs on rank i % pp)",
                            rank=topo.rank)
    if num_layers is not None and window.end_layer > num_layers:
        raise TopologyError(f"stage {window.pp_rank} owns layers up to {window.end_layer - 1} "
                            f"but the model has {num_layers}", rank=topo.rank)


def resolve_stage(num_layers: int, *, mesh: Any = None, window: Optional[StageWindow] = None,
                  topology: Optional[Topology] = None) -> tuple[Topology, StageWindow]:
    """This rank's ``(Topology, StageWindow)`` from a ``DeviceMesh`` (dims named pp / tp
    [/ ep], :func:`mesh_topology`) or a ``Topology``, and the stage's window
    (:func:`pipeline_window`; default: pploader's even split of ``num_layers`` over the
    mesh's pp size). The window must be a stage of this pipeline rank."""
    if mesh is not None and topology is not None:
        raise TopologyError("give mesh= (a DeviceMesh) or topology=, not both")
    topo = _topology(mesh) if mesh is not None else topology
    if topo is None:
        raise TopologyError("no stage given: pass mesh= (a DeviceMesh with dims named pp / "
                            "tp) or topology=, and optionally window=pipeline_window(...)")
    if window is None:
        window = even_windows(num_layers, topo.pp_size)[topo.pp_rank]
    _check_window(topo, window, num_layers)
    return topo, window


def check_stage(topology: Topology, window: StageWindow, *, mesh: Any = None,
                stage_window: Optional[StageWindow] = None, what: str = "the plan") -> None:
    """TopologyError unless ``mesh`` (its :func:`mesh_topology`) and ``stage_window`` (when
    given) are ``topology`` and ``window``, the stage ``what`` was made for."""
    problems = []
    if mesh is not None:
        got = _topology(mesh)
        if got != topology:
            problems.append(f"the mesh is {got.describe()}, {what} is for "
                            f"{topology.describe()}")
    if stage_window is not None and stage_window != window:
        problems.append(f"the stage window is layers [{stage_window.start_layer}, "
                        f"{stage_window.end_layer}) of stage {stage_window.pp_rank}, {what} "
                        f"has [{window.start_layer}, {window.end_layer}) of stage "
                        f"{window.pp_rank} (pploader's split is not the job's: plan with "
                        "the job's window)")
    if problems:
        raise TopologyError("; ".join(problems), rank=topology.rank)
