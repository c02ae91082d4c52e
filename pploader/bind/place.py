"""Binding a stage into an ``nn.Module``: names, fused/stacked targets, strict accounting.

``load_stage_into`` is called on every rank, each with its own stage module (built on the meta
device or on its target device). Phases, so that nothing is written unless everything fits:

1. plan + bind (pure): every read item gets a :class:`Slot` in a module tensor - its own
   tensor, or a slice of a fused one (``Family.fused_targets``: q/k/v -> ``qkv_proj``,
   experts -> stacked ``w13``/``w2``); strict ``(missing, unexpected)`` accounting.
2. agree: with a ``Comm``, every rank learns every rank's verdict before any write.
3. materialise the stage's meta tensors only (other layers stay on meta), then write: bytes
   go straight into the destination (slice) when it is contiguous and of the checkpoint dtype,
   from the device's read backend (io/registry.py: positional reads on CPU, a pinned ring and
   asynchronous H2D copies on CUDA); anything else (casts, strided slices) through a borrowed
   ring and one ``copy_``.
4. record what was filled (``BindResult.record``: the caller keeps it and passes it to
   ``reload_from_disk`` / ``load_layerwise``), run ``process_weights_after_loading``.

Both agreements are :func:`pploader.distributed.comm.run_guarded` steps.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from ..planning.checkpoint import DTYPES
from ..errors import NotReadyError, PlanError
from ..families.base import Family
from ..families.fused import FusedMatch, match_fused
from .names import NameMap, NameRule
from ..planning.partition import StageWindow
from ..planning.plan import Partition, RankPlan, ReadItem
from .postprocess import mark_not_ready, mark_ready, run_post_processing
from ..io.read import ReadStats
from ..planning.spec import ModelSpec
from ..planning.stage import StagePlan, plan_stage
from .stage_layers import placeholder_problems
from ..planning.topology import Topology
from ..distributed.comm import run_guarded
from .write import module_tensors, write_binding

if TYPE_CHECKING:  # pragma: no cover
    from ..distributed.comm import Comm

__all__ = ["NameMap", "NameRule", "Slot", "Binding", "BindResult", "TensorSnapshot", "LoadRecord",
           "module_tensors", "bind_stage", "write_binding", "load_stage_into", "commit_writes"]

#: the default name mapping: module names are checkpoint names
_SAME_NAMES = NameMap()


@dataclass(frozen=True)
class Slot:
    """Where one read item lands: module tensor ``param``, row ``index`` of its leading dim
    (stacked experts), and ``[offset, offset + length)`` along ``dim`` (fused parts)."""

    source: str
    param: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    index: Optional[int] = None
    dim: int = 0
    offset: int = 0
    length: Optional[int] = None
    layer: Optional[int] = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def view(self, base: torch.Tensor) -> torch.Tensor:
        """The slice of ``base`` (the module tensor) this piece fills."""
        t = base if self.index is None else base[self.index]
        return t if self.length is None else t.narrow(self.dim, self.offset, self.length)


@dataclass(frozen=True)
class Binding:
    """Every planned item's slot plus the strict accounting; pure data, nothing written."""

    slots: Mapping[str, Slot]          # by read-item target (checkpoint name)
    missing: tuple[str, ...]           # module tensors of the stage nothing fills (fully)
    unexpected: tuple[str, ...]        # planned checkpoint tensors with no module tensor
    details: Mapping[str, str]         # why a missing tensor is missing (partial, parts absent)
    problems: tuple[str, ...]          # shape / dtype misfits: errors even when not strict
    where: str

    @property
    def params(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s.param for s in self.slots.values()))

    def check(self, strict: bool, rank: Optional[int]) -> None:
        """Raise PlanError for misfits, and (strict) for missing or unexpected tensors."""
        if self.problems:
            raise PlanError(f"{self.where}: {len(self.problems)} checkpoint tensor(s) do not fit "
                            "the module: " + "; ".join(self.problems[:8])
                            + (" ..." if len(self.problems) > 8 else ""), rank=rank)
        if strict and (self.missing or self.unexpected):
            parts = []
            if self.missing:
                parts.append(f"{len(self.missing)} module tensor(s) not filled by the "
                             "checkpoint: " + ", ".join(
                                 n + (f" ({self.details[n]})" if n in self.details else "")
                                 for n in self.missing[:8]))
            if self.unexpected:
                parts.append(f"{len(self.unexpected)} checkpoint tensor(s) with no module "
                             "tensor: " + ", ".join(self.unexpected[:8]))
            first = (self.missing or self.unexpected)[0]
            raise PlanError(f"{self.where}: " + "; ".join(parts)
                            + " (strict=False loads anyway and returns both lists)",
                            tensor=first, rank=rank)


@dataclass(frozen=True)
class TensorSnapshot:
    """What a filled module tensor looked like; reload refuses to write if it changed."""

    data_ptr: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: str

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorSnapshot":
        return cls(t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device))

    def change(self, t: torch.Tensor) -> Optional[str]:
        """How ``t`` differs from the snapshot (None = same storage, layout and dtype)."""
        now = TensorSnapshot.of(t)
        if now.shape != self.shape:
            return f"reshaped from {list(self.shape)} to {list(now.shape)}"
        if now.dtype != self.dtype:
            return f"changed dtype from {self.dtype} to {now.dtype}"
        if now.device != self.device:
            return f"moved from {self.device} to {now.device}"
        if now.data_ptr != self.data_ptr:
            return "replaced by a new tensor (its data_ptr changed)"
        if now.stride != self.stride:
            return f"re-laid out (strides {list(self.stride)} -> {list(now.stride)})"
        return None


@dataclass(frozen=True)
class LoadRecord:
    """What ``load_stage_into`` did (``BindResult.record``), so that a reload can redo it in
    place: the caller keeps it and passes it to ``reload_from_disk`` / ``load_layerwise``
    (``ReloadResult.record`` is the record after a reload)."""

    family: Family
    num_layers: int
    topology: Topology
    window: StageWindow
    experts: Optional[tuple[int, int]]
    names: NameMap
    ignore: tuple[str, ...]
    allow_cast: bool
    strict: bool
    binding: Binding
    snapshots: Mapping[str, TensorSnapshot]
    #: the plan the stage was last filled from: a reload from a checkpoint of the same layout
    #: keeps it (planning/rebase.py) instead of planning again
    staged: Optional[StagePlan] = None


@dataclass(frozen=True)
class BindResult:
    """Outcome of ``load_stage_into`` (safetensors' ``(missing, unexpected)`` plus details)."""

    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    loaded: tuple[str, ...]
    processed: tuple[str, ...]
    plan: RankPlan
    stats: ReadStats
    record: LoadRecord  # pass it to reload_from_disk / load_layerwise


# ---- binding -----------------------------------------------------------------------------

def _misfit(item: ReadItem, shape: tuple[int, ...], dtype: torch.dtype,
            allow_cast: bool) -> Optional[str]:
    src = DTYPES[item.dtype][0]
    if tuple(item.shape) != tuple(shape):
        return f"shape {list(item.shape)} planned but {list(shape)} in the module"
    if src != dtype and not (allow_cast and src.is_floating_point and dtype.is_floating_point):
        return (f"dtype {src} in the checkpoint but {dtype} in the module (build the module in "
                "the checkpoint's dtype, or pass allow_cast=True)")
    return None


def _in_stage(name: str, spec: ModelSpec, names: NameMap, plan: RankPlan) -> bool:
    """Whether module tensor ``name`` belongs to this rank's stage (unknown names do)."""
    ck = names.to_checkpoint(name)
    role = spec.family.classify(ck, spec.num_layers, spec.num_mtp_layers) if ck else None
    if role is None:
        return True
    if role.placement == "first":
        return plan.window.has_embed
    if role.placement == "last":
        return plan.window.has_head
    if role.placement != "layer" or not plan.window.owns(role.layer):  # type: ignore[arg-type]
        return False
    experts = plan.experts
    return role.expert is None or experts is None or experts[0] <= role.expert < experts[1]


def bind_stage(module: nn.Module, staged: StagePlan, *, names: NameMap = _SAME_NAMES,
               ignore: Sequence[str] = (), allow_cast: bool = False) -> Binding:
    """Map every item of the stage's plan to a slot of ``module`` (pure: reads shapes only).

    A layer tensor matching a fused part goes to the fused tensor when the module has it,
    else to the tensor of its own name. ``ignore`` holds regexes (full match) of module
    tensors that no checkpoint fills (never reported missing).
    """
    spec = staged.spec.for_checkpoint(staged.index.weight_map)
    family, plan = spec.family, staged.plan
    tensors = module_tensors(module)
    slots: dict[str, Slot] = {}
    groups: dict[tuple, dict[int, ReadItem]] = {}
    group_of: dict[tuple, tuple[FusedMatch, int]] = {}
    unexpected: list[str] = []
    problems: list[str] = []
    for item in plan.items:
        role = family.classify(item.target, spec.num_layers, spec.num_mtp_layers)
        layer = role.layer if role is not None and role.placement in ("layer", "mtp") else None
        fm = match_fused(family.fused_targets, role.component) \
            if role is not None and layer is not None else None
        if fm is not None:
            fused = names.to_module(family.layer_name(layer, fm.target))  # type: ignore[arg-type]
            if fused is not None and fused in tensors:
                key = (fused, fm.values)
                parts = groups.setdefault(key, {})
                if fm.part in parts:
                    problems.append(f"{item.target} and {parts[fm.part].target} both fill part "
                                    f"{fm.part} of {fused}")
                parts[fm.part] = item
                group_of[key] = (fm, layer)  # type: ignore[assignment]
                continue
        plain = names.to_module(item.target)
        if plain is None and names.drops(item.target):
            continue  # dropped by a NameRule(..., new=None): neither read nor unexpected
        if plain is None or plain not in tensors:
            unexpected.append(item.target)
            continue
        dest = tensors[plain]
        misfit = _misfit(item, tuple(dest.shape), dest.dtype, allow_cast)
        if misfit:
            problems.append(f"{item.target} -> {plain}: {misfit}")
        slots[item.target] = Slot(item.target, plain, item.shape, DTYPES[item.dtype][0],
                                  layer=layer)
    details: dict[str, str] = {}
    first_expert = plan.experts[0] if plan.experts else 0
    for key, parts in groups.items():
        fm, layer = group_of[key]
        _bind_group(key[0], tensors[key[0]], fm, layer, parts, family, first_expert, allow_cast,
                    slots, problems, details)
    problems += placeholder_problems(module, plan.window)
    missing = _missing(tensors, slots, spec, names, plan, ignore, problems, details)
    where = (f"stage {plan.window.pp_rank} (layers {plan.window.start_layer}-"
             f"{plan.window.end_layer - 1})")
    ordered = {i.target: slots[i.target] for i in plan.items if i.target in slots}
    return Binding(ordered, tuple(missing), tuple(unexpected), details, tuple(problems), where)


def _bind_group(param: str, dest: torch.Tensor, fm: FusedMatch, layer: int,
                parts: dict[int, ReadItem], family: Family, first_expert: int, allow_cast: bool,
                slots: dict[str, Slot], problems: list[str], details: dict[str, str]) -> None:
    """Slots of one fused group: its parts one after another along the fusion's dim."""
    fusion, values = fm.fusion, dict(fm.values)
    absent = [i for i in range(len(fusion.parts)) if i not in parts]
    if absent:
        names = ", ".join(family.layer_name(layer, fusion.part_name(i, values)) for i in absent)
        details[param] = (details[param] + "; " if param in details else "") + \
            f"fused part(s) absent from the checkpoint: {names}"
        return
    shape, index = tuple(dest.shape), None
    if fusion.stacked:
        index = int(values["e"]) - first_expert
        if not shape or not 0 <= index < shape[0]:
            problems.append(f"expert {values['e']} goes to row {index} of {param} "
                            f"{list(shape)}, which has no such row")
            return
        shape = shape[1:]
    pieces = [parts[i] for i in range(len(fusion.parts))]
    d = fusion.dim
    where = param + (f"[{index}]" if index is not None else "")
    if not _concatenates([p.shape for p in pieces], shape, d):
        problems.append(f"{where} is {list(shape)} but its parts " + ", ".join(
            f"{p.target} {list(p.shape)}" for p in pieces) + f" do not concatenate to it "
            f"along dim {d}")
        return
    offset = 0
    for p in pieces:
        src = DTYPES[p.dtype][0]
        if src != dest.dtype and not (allow_cast and src.is_floating_point
                                      and dest.dtype.is_floating_point):
            problems.append(f"{p.target} -> {where}: dtype {src} in the checkpoint but "
                            f"{dest.dtype} in the module (or pass allow_cast=True)")
        slots[p.target] = Slot(p.target, param, p.shape, src, index, d, offset, p.shape[d], layer)
        offset += p.shape[d]


def _concatenates(pieces: list[tuple[int, ...]], shape: tuple[int, ...], dim: int) -> bool:
    """Whether ``pieces`` concatenated along ``dim`` have exactly ``shape``."""
    if dim >= len(shape):
        return False
    for piece in pieces:
        if len(piece) != len(shape) or any(a != b for k, (a, b) in enumerate(zip(piece, shape))
                                           if k != dim):
            return False
    return sum(piece[dim] for piece in pieces) == shape[dim]


def _missing(tensors: Mapping[str, torch.Tensor], slots: Mapping[str, Slot], spec: ModelSpec,
             names: NameMap, plan: RankPlan, ignore: Sequence[str], problems: list[str],
             details: dict[str, str]) -> list[str]:
    """Stage tensors of the module that the slots leave (partly) unfilled."""
    by_name: dict[str, int] = {}
    for s in slots.values():
        by_name[s.param] = by_name.get(s.param, 0) + math.prod(s.shape)
    by_id: dict[int, int] = {}
    for name, t in tensors.items():
        got = by_name.get(name, 0)
        if got > t.numel():
            problems.append(f"{name}: {got} elements written into {t.numel()}")
        by_id[id(t)] = max(by_id.get(id(t), 0), got)
    skip = [re.compile(p) for p in ignore]
    missing = []
    for name, t in tensors.items():
        got = by_id[id(t)]
        if got >= t.numel() or any(rx.fullmatch(name) for rx in skip):
            continue
        if got == 0 and name not in details and not _in_stage(name, spec, names, plan):
            continue  # another stage's tensor: left as it is (on meta: never materialised)
        if got:
            details[name] = (details[name] + "; " if name in details else "") + \
                f"only {got} of {t.numel()} elements filled"
        missing.append(name)
    return missing


# ---- writing -----------------------------------------------------------------------------

def _materialise(module: nn.Module, binding: Binding, device: Union[str, torch.device]) -> None:
    """Allocate on ``device`` the meta tensors that slots fill (tied names stay tied)."""
    tensors = module_tensors(module)
    partial = set(binding.missing)
    new: dict[int, torch.Tensor] = {}
    for name in binding.params:
        old = tensors[name]
        if old.device.type != "meta" or id(old) in new:
            continue
        alloc = torch.zeros if name in partial else torch.empty
        data = alloc(old.shape, dtype=old.dtype, device=device)
        new[id(old)] = nn.Parameter(data, requires_grad=old.requires_grad) \
            if isinstance(old, nn.Parameter) else data
    if not new:
        return
    for mod in module.modules():
        for table in (mod._parameters, mod._buffers):
            for key, value in table.items():
                if value is not None and id(value) in new:
                    table[key] = new[id(value)]  # type: ignore[assignment]


def commit_writes(model: nn.Module, binding: Binding, plan: RankPlan, *, action: str,
                  comm: Optional["Comm"], process: bool,
                  after_write: Optional[Callable[[], None]] = None,
                  **reader: object) -> tuple[ReadStats, tuple[str, ...]]:
    """Write, post-process, agree (one ``run_guarded`` step); ``model`` is marked not ready
    from the first write until every rank succeeded, so a fault midway can never leave
    silently mixed weights."""
    rank = plan.topology.rank
    mark_not_ready(model, f"{action} in progress (or interrupted) on rank {rank}")

    def write() -> tuple[ReadStats, tuple[str, ...]]:
        stats = write_binding(model, binding, plan, **reader)  # type: ignore[arg-type]
        if after_write is not None:
            after_write()
        return stats, tuple(run_post_processing(model)) if process else ()

    try:
        stats, processed = run_guarded(comm, write, rank=rank)
    except Exception as exc:  # noqa: BLE001
        reason = (f"{action} failed after writing started ({type(exc).__name__}: {exc}); the "
                  "weights may mix two checkpoints. Restore them on every rank of the job: "
                  "reload_from_disk(model, <a good checkpoint>, record=...) after a reload, "
                  "load_stage_into again after a load")
        mark_not_ready(model, reason)
        raise NotReadyError(reason, rank=rank) from exc
    mark_ready(model)
    return stats, processed


def load_stage_into(module: nn.Module, model: Union[StagePlan, os.PathLike, str],
                    topology: Optional[Topology] = None, *, partition: Partition = "even",
                    device: Union[str, torch.device] = "cpu", strict: bool = True,
                    names: NameMap = _SAME_NAMES, ignore: Sequence[str] = (),
                    allow_cast: bool = False, process: bool = True,
                    window_bytes: Optional[int] = None, threads: int = 1,
                    comm: Optional["Comm"] = None,
                    on_progress: Optional[Callable[[int], None]] = None,
                    io_backend: Optional[str] = None) -> BindResult:
    """Load this rank's stage into ``module`` (called on every rank with its stage module).

    ``model`` is a model directory (with ``topology``) or a ``StagePlan``. Meta tensors the
    stage fills are allocated on ``device``; those of other stages stay on meta. Strict
    (default): any module tensor of the stage left unfilled, or checkpoint tensor with no
    module tensor, raises PlanError naming them before a byte is read. ``io_backend``: the
    read backend of the writes (io/registry.py; None = the device's default).
    """
    from ..arguments import check_device, check_type
    check_type("module", module, nn.Module, "a torch.nn.Module", optional=False)
    check_type("topology", topology, Topology, "a Topology")
    check_type("names", names, NameMap, "a NameMap", optional=False)
    check_device("device", device)
    rank: Optional[int] = comm.rank if comm is not None else (
        model.plan.topology.rank if isinstance(model, StagePlan)
        else topology.rank if topology is not None else None)

    def prepare() -> tuple[StagePlan, Binding]:
        if isinstance(model, StagePlan):
            staged = model
        elif topology is None:
            raise PlanError("load_stage_into(module, model_dir, topology): topology missing")
        else:
            staged = plan_stage(model, topology, partition=partition, strict=strict)
        binding = bind_stage(module, staged, names=names, ignore=ignore, allow_cast=allow_cast)
        binding.check(strict, rank)
        return staged, binding

    staged, binding = run_guarded(comm, prepare, rank=rank)  # every rank bound, or none
    _materialise(module, binding, device)
    snapshots: dict[str, TensorSnapshot] = {}

    def snapshot() -> None:  # after the writes, before post-processing may alias anything
        tensors = module_tensors(module)
        snapshots.update({n: TensorSnapshot.of(tensors[n]) for n in binding.params})

    stats, processed = commit_writes(
        module, binding, staged.plan, action="load_stage_into", comm=comm, process=process,
        after_write=snapshot, window_bytes=window_bytes, threads=threads, on_progress=on_progress,
        io_backend=io_backend)
    plan = staged.plan
    record = LoadRecord(staged.spec.family, staged.spec.num_layers, plan.topology, plan.window,
                        plan.experts, names, tuple(ignore), allow_cast, strict, binding,
                        snapshots, staged)
    return BindResult(binding.missing, binding.unexpected, binding.params, processed,
                      staged.plan, stats, record)
