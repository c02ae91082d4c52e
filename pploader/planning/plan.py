"""LoadPlan: exactly which bytes each rank reads. Pure: headers in, frozen data out.

Called on any process (no torch.distributed); ``pploader plan`` prints it for every rank.
"""
from __future__ import annotations

import logging
from itertools import repeat
from operator import add, attrgetter, itemgetter, mul
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

from .gcpause import without_gc
from .checkpoint import CheckpointIndex, TensorEntry
from ..errors import PlanError
from ..families.base import Family, TensorRole
from ..families.heads import check_tp_heads
from .partition import (ENGINES, EngineSplit, StageWindow, balanced_windows, engine_windows,
                        even_windows, explicit_windows)
from .accounting import check_expected, check_mtp
from .quant import QuantScheme, quant_scheme
from .quant_groups import mixed_columns
from .roles import CheckpointRoles, checkpoint_roles
from .items import (ReadItem, make_item, peer_selection, read_item, shift_ranges,
                    tensor_selection)
from .shard import DEFAULT_RANGE_COST_BYTES, Selection, local_experts
from .rank_plan import RankPlan
from .spec import ModelSpec
from .topology import Topology

if TYPE_CHECKING:  # pragma: no cover
    from .redistribute import Exchanger

logger = logging.getLogger(__name__)

#: Cost of exchanging one byte over the TP group's link (the larger of sent and received per
#: rank) in bytes of sequential storage read (planning/redistribute.py; None = never exchange).
#: Measured on the 2-core VM (docs/tensor-parallel.md); NVLink vs NVMe is far below it.
DEFAULT_EXCHANGE_COST: Optional[float] = 0.5

__all__ = ["ReadItem", "RankPlan", "Partition", "make_windows", "plan_rank", "plan_all",
           "plan_mtp", "layer_bytes", "read_item", "CheckpointRoles", "checkpoint_roles"]

#: field getters of the C passes (``map``) over a stage's entries, roles and items
_ranges_of, _file_of, _target_of = attrgetter("ranges"), attrgetter("file"), attrgetter("target")
_shape_of, _dtype_of, _start_of = attrgetter("shape"), attrgetter("dtype"), attrgetter("start")
_component_of, _fused_of = attrgetter("component"), attrgetter("fused_experts")
_first, _second = itemgetter(0), itemgetter(1)

#: "even", "balanced", "vllm", "sglang", explicit layer counts per stage, or an EngineSplit.
Partition = Union[str, Sequence[int], EngineSplit]


def layer_bytes(spec: ModelSpec, index: CheckpointIndex,
                roles: Optional[CheckpointRoles] = None) -> tuple[list[int], int, int]:
    """Bytes per decoder layer, of first-stage globals and of last-stage globals (headers)."""
    index.validate_all()
    roles = roles or checkpoint_roles(spec, index)
    spec = roles.spec
    per_layer, first, last = [0] * spec.num_layers, 0, 0
    everything = roles.items()
    for name, role in everything:
        nbytes = index.entry(name).nbytes
        if role.placement == "layer":
            per_layer[role.layer] += nbytes  # type: ignore[index]
        elif role.placement == "first":
            first += nbytes
        elif role.placement == "last":
            last += nbytes
    if spec.tie_word_embeddings:
        last += sum(index.entry(n).nbytes for n, r in everything if r.role == "embed")
    return per_layer, first, last


@without_gc
def make_windows(spec: ModelSpec, index: CheckpointIndex, pp: int,
                 partition: Partition = "even", *,
                 cache_bytes: Optional[Sequence[int]] = None,
                 roles: Optional[CheckpointRoles] = None) -> tuple[StageWindow, ...]:
    """Stage windows for all PP ranks (balanced reads every header; even/explicit none).

    ``cache_bytes`` (per layer, e.g. ``pools.layer_cache_bytes`` at a target load) is added to
    the weight bytes ``balanced`` weighs, so stages with cache-heavy layers get fewer layers.
    """
    if isinstance(partition, str) and partition in ENGINES:
        partition = EngineSplit(partition)  # the formula (its partition variable: EngineSplit)
    if isinstance(partition, EngineSplit):
        windows = engine_windows(partition.engine, spec.num_layers, pp, partition.layer_partition)
        for w in windows:
            if w.num_layers == 0:
                raise PlanError(f"{partition} gives stage {w.pp_rank} no layer ({spec.num_layers} "
                                f"layers over {pp} stages); pploader plans stages of at least "
                                "one layer")
        return windows
    if isinstance(partition, str):
        if partition == "even":
            return even_windows(spec.num_layers, pp)
        if partition == "balanced":
            per_layer, first, last = layer_bytes(spec, index, roles)
            if cache_bytes is not None:
                per_layer = [w + c for w, c in zip(per_layer, cache_bytes, strict=True)]
            return balanced_windows(per_layer, pp, first_extra=first, last_extra=last)
        raise PlanError(f"unknown partition {partition!r}: use even, balanced, vllm, sglang or "
                        "counts like 8,8,9,7")
    return explicit_windows(list(partition), spec.num_layers, pp)


@without_gc
def plan_rank(spec: ModelSpec, index: CheckpointIndex, topology: Topology,
              window: StageWindow, *, strict: bool = True,
              range_cost_bytes: int = DEFAULT_RANGE_COST_BYTES,
              exchange_cost: Optional[float] = DEFAULT_EXCHANGE_COST,
              exchange_batch_bytes: Optional[int] = None,
              roles: Optional[CheckpointRoles] = None) -> RankPlan:
    """The plan of one rank: its window's layers, globals, local experts and TP slices.

    ``exchange_cost`` (None = off): strided TP slices may be planned as row shares + an
    all-to-all of the TP group (``RankPlan.redistribute``, see planning/redistribute.py), chosen per
    tensor when cheaper than direct reads at ``range_cost_bytes``. ``roles``
    (``checkpoint_roles(spec, index)``) lets several plans of one checkpoint share the
    classification of its names; computed here when not given."""
    if window.pp_rank != topology.pp_rank:
        raise PlanError(f"window of stage {window.pp_rank} given to {topology.describe()}")
    roles = roles or checkpoint_roles(spec, index)
    spec = roles.spec
    check_tp_heads(spec, topology.tp_size)
    if spec.family.check_sizes is not None:
        spec.family.check_sizes(spec, topology.tp_size, topology.ep_size)
    experts = (local_experts(spec.num_experts, topology.ep_size, topology.ep_rank)
               if spec.num_experts and topology.ep_size > 1 else None)
    if topology.ep_size > 1 and not spec.num_experts:
        raise PlanError(f"ep={topology.ep_size} but {spec.architecture} has no experts: leave "
                        "--ep at 1 (use --tp to split the stage)")
    # what a stage (and EP rank) reads, and its per-tensor columns, are the same for every TP
    # rank of it: worked out once and kept in ``roles`` (``plan_all``, read-once groups)
    chosen, needed_files, names, targets, role_list, tensors = roles.stage_value(
        ("reads", window, experts), partial(_stage_reads, spec, index, roles, window, experts))
    index.require(needed_files, topology.rank)  # absent shards: all at once
    if strict and not roles.stage_checked(window, experts):  # once per stage and EP rank
        check_expected(roles, index, chosen, window, experts, topology)
        roles.mark_checked(window, experts)
    scheme = quant_scheme(spec)
    exchanger = _exchanger(topology, range_cost_bytes, exchange_cost, exchange_batch_bytes)
    # selections: same rule, shape, dtype -> same slice; relative: same shape, dtype, slice ->
    # same relative runs; done: (component, fused, shape, dtype, weight shape, weight dtype)
    # -> (item at offset 0, exchange choice), what ``_plan_one`` derives from exactly these,
    # so a tensor equal in them to one planned before (the same component in another layer)
    # reuses it. Kept in ``roles`` per everything else they depend on (the TP rank and size,
    # the local experts, the cost rules), so the ranks of ``plan_all`` share them.
    selections, relative, done = roles.plan_memo((
        topology.tp_rank, topology.tp_size, experts, range_cost_bytes,
        exchange_cost if exchanger is not None else None))
    # every per-tensor step below is a C pass over the stage's columns; Python runs only
    # for the first tensor of each kind (``_plan_one``) and for multi-range items
    ents, weights, wents, keys, starts = roles.stage_value(
        ("columns", window, experts),
        partial(_stage_columns, index, roles, needed_files, names, role_list, scheme))
    found: list[Any] = list(map(done.get, keys))
    at = -1
    qdtypes = scheme.weight_dtypes if scheme is not None else frozenset()
    while True:  # the first tensor of each kind
        try:
            at = found.index(None, at + 1)
        except ValueError:
            break
        key = keys[at]
        got = done.get(key)
        if got is None:
            got = done[key] = _plan_one(
                spec, index, topology, experts, scheme, range_cost_bytes, exchanger,
                selections, relative, roles.rule_index, qdtypes, names[at], role_list[at],
                ents[at], weights[at], wents[at])
        found[at] = got
    made = list(map(_first, found))
    if exchanger is not None:
        choices = list(map(_second, found))
        exchanger.take_many(ents, targets, choices)
    # ``made`` moved to each tensor's name, file and offset (frozen copies, no __init__)
    rels = list(map(_ranges_of, made))
    if set(map(len, rels)) == {1}:  # one range each (the usual case)
        firsts = list(map(_first, rels))
        ranges: list = list(zip(zip(map(add, starts, map(_first, firsts)),
                                    map(_second, firsts))))
    else:
        ranges = list(map(shift_ranges, rels, starts))
    items = list(map(make_item, zip(
        names, targets, map(_file_of, ents),
        *(map(attrgetter(f), made) for f in ("dtype", "shape", "source_shape")),
        ranges, *(map(attrgetter(f), made) for f in ("buffer_shape", "gather", "pad_rows")))))
    plan = _finish(spec, index, topology, window, experts, items, tensors)
    redistribute = exchanger.finish({f: i for i, f in enumerate(sorted(index.paths))}) \
        if exchanger is not None else None
    plan = replace(plan, range_cost_bytes=range_cost_bytes, redistribute=redistribute)
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("%s: %d item(s), %d bytes to read, files %s", topology.describe(),
                     len(plan.items), plan.read_bytes, ", ".join(plan.files))
    return plan


def _stage_reads(spec: ModelSpec, index: CheckpointIndex, roles: CheckpointRoles,
                 window: StageWindow, experts: Optional[tuple[int, int]]
                 ) -> tuple[dict[str, TensorRole], set[str], list[str], list[str],
                            list[TensorRole], tuple[str, ...]]:
    """What a stage (and EP rank) reads: names -> roles (the tied head's replica included),
    their files, the checkpoint names, targets and roles in planning order, and the names
    sorted (``RankPlan.tensors``)."""
    own = chosen = roles.stage_roles(window, experts)   # a fresh dict, read as themselves
    extra: list[tuple[str, TensorRole, str]] = []      # (checkpoint name, role, target)
    if window.has_head and not window.has_embed and spec.tie_word_embeddings \
            and not roles.stores_head:
        # the declared replica: the last stage reads the embedding as its head (a stage
        # holding both reads it once; the model ties the head to it)
        chosen = dict(own)
        for name, role in roles.others.items():
            if role.role == "embed":
                extra.append((name, role, _head_name(spec.family)))
                chosen.setdefault(name, role)
    shared = roles.shared_reads(window, experts)  # tied copies whose source is elsewhere
    if shared:
        chosen = dict(chosen) if chosen is own else chosen
        extra.extend(shared)
        chosen.update({name: role for name, role, _ in shared if name not in chosen})
    names = list(own)
    role_list = list(own.values())
    targets = names
    if extra:
        names = names + [n for n, _, _ in extra]
        role_list += [r for _, r, _ in extra]
        targets = list(own) + [t for _, _, t in extra]
    return (chosen, set(map(index.weight_map.__getitem__, chosen)), names, targets, role_list,
            tuple(sorted(chosen)))


def _stage_columns(index: CheckpointIndex, roles: CheckpointRoles, needed_files: set[str],
                   names: list[str], role_list: list[TensorRole],
                   scheme: Optional[QuantScheme]) -> tuple[list, ...]:
    """Per tensor of a stage: its entry, its weight's name and entry (quantization
    companions; None otherwise), its planning key and its start offset (read-only lists
    the stage's TP ranks share). The key is what ``_plan_one`` derives an item from:
    (component, fused, shape, dtype, weight shape, weight dtype)."""
    entries = index.entry_map(needed_files)
    ents = list(map(entries.__getitem__, names))
    weights = list(map(roles.links.get, names))
    wents: list = weights
    wshapes: Any = repeat(None)
    wdtypes: Any = wshapes
    if weights.count(None) != len(weights):  # companions: their weights' shapes and dtypes
        wents = [None if w is None else entries.get(w) or index.entry(w) for w in weights]
        wshapes = [None if w is None else w.shape for w in wents]
        wdtypes = [None if w is None else w.dtype for w in wents]
    columns = [map(_component_of, role_list), map(_fused_of, role_list),
               map(_shape_of, ents), map(_dtype_of, ents), wshapes, wdtypes]
    if scheme is not None and scheme.mixed:  # a scheme per weight: checked, and in the key
        columns.append(mixed_columns(scheme, names, role_list, ents, weights,
                                     roles.layer_roles, roles.stage_value,
                                     roles.spec.family.fused_targets))
    keys = list(zip(*columns))
    return ents, weights, wents, keys, list(map(_start_of, ents))


def _plan_one(spec: ModelSpec, index: CheckpointIndex, topology: Topology,
              experts: Optional[tuple[int, int]], scheme: Optional[QuantScheme],
              range_cost_bytes: int, exchanger: "Optional[Exchanger]",
              selections: dict[tuple, Selection], relative: dict[tuple, ReadItem],
              rule_index: Callable[[str], int], qdtypes: frozenset[str], name: str,
              role: TensorRole, entry: TensorEntry, weight: Optional[str],
              wentry: Optional[TensorEntry]) -> tuple[ReadItem, Any]:
    """One tensor's read at offset 0 and its exchange choice (None: read directly)."""
    if weight is None:  # the selection depends on the TP rule, not on the name: tensors
        # with one rule, shape and dtype share it (e.g. all experts)
        quantized = entry.dtype in qdtypes and scheme.is_quantized(  # type: ignore[union-attr]
            name, entry.dtype, len(entry.shape))
        own = scheme.resolve(name) if quantized else None  # type: ignore[union-attr]
        component = own.naming.logical_of(role.component) if own is not None else role.component
        key: tuple = (rule_index(component), role.fused_experts, entry.shape, entry.dtype, own)
    else:  # a quantization companion: sliced from its weight's logical selection
        naming = scheme.naming_of(weight)  # type: ignore[union-attr]  # the family's, as stored
        wcomp = naming.logical_of(naming.weight_component(role.component, name, weight))
        key = (rule_index(wcomp), role.fused_experts, entry.shape, entry.dtype,
               name[len(weight) - len(naming.weight):], wentry.shape, wentry.dtype,  # type: ignore[union-attr]
               scheme.resolve(weight))  # type: ignore[union-attr]
    sel = selections.get(key)
    choice = None
    try:
        if sel is None:
            sel = selections[key] = tensor_selection(spec, role, entry, topology, experts, index,
                                               scheme)
        if exchanger is not None:
            choice = exchanger.choice(entry, sel, key, partial(
                peer_selection, spec, role, entry, experts, index, scheme))
            if choice.box is None:
                choice = None  # read directly: nothing to record
    except PlanError as exc:  # name the file and rank of the tensor being planned
        raise PlanError(exc.detail, file=exc.file or entry.file,
                        tensor=exc.tensor or name, rank=topology.rank) from None
    shape_key = (entry.shape, entry.dtype, sel)
    made = relative.get(shape_key)
    if made is None:  # byte runs relative to the tensor's start, shared by equal tensors
        made = relative[shape_key] = read_item(
            TensorEntry("", "", entry.dtype, entry.shape, 0, entry.nbytes), "", sel,
            range_cost_bytes)
    return made, choice


def _exchanger(topology: Topology, range_cost_bytes: int, exchange_cost: Optional[float],
               batch_bytes: Optional[int]) -> "Optional[Exchanger]":
    """The per-tensor direct-vs-exchange chooser, or None (TP 1 or exchange off)."""
    if exchange_cost is None or topology.tp_size == 1:
        return None
    from .redistribute import DEFAULT_EXCHANGE_BATCH_BYTES, Exchanger
    return Exchanger(topology, range_cost_bytes=range_cost_bytes, exchange_cost=exchange_cost,
                     batch_bytes=batch_bytes or DEFAULT_EXCHANGE_BATCH_BYTES)


def _head_name(family: Family) -> str:
    """The name the tied embedding is read as: the family's head (it owns names)."""
    head = family.head_name()
    if head is None:
        raise PlanError(f"{family.name} ties embeddings but declares no head tensor by name "
                        "(GlobalRule.exact(..., role='head'))")
    return head




def _finish(spec: ModelSpec, index: CheckpointIndex, topology: Topology, window: StageWindow,
            experts: Optional[tuple[int, int]], items: list[ReadItem],
            tensors: tuple[str, ...]) -> RankPlan:
    """The plan of ``items`` in reading order (file, start); ``tensors``: the checkpoint
    names it covers, sorted."""
    order = {f: i for i, f in enumerate(sorted(index.paths))}
    ranges = list(map(_ranges_of, items))
    keys: list = []
    if ranges and all(ranges):  # every item reads bytes (the usual case): its keys in C passes
        at = list(map(order.__getitem__, map(_file_of, items)))
        starts = list(map(_first, map(_first, ranges)))
        flat = list(map(add, map(mul, at, repeat(max(starts) + 1)), starts))
        # (file, start) as one int when no two items start at one byte (else the target
        # breaks the tie)
        keys = flat if len(set(flat)) == len(flat) else \
            list(zip(at, starts, map(_target_of, items)))
    else:
        keys = [(order[it.file], it.ranges[0][0] if it.ranges else 0, it.target) for it in items]
    items = list(map(items.__getitem__, sorted(range(len(items)), key=keys.__getitem__)))
    files = list(dict.fromkeys(map(attrgetter("file"), items)))
    headers = {f: index.header(f) for f in files}
    return RankPlan(
        model=str(index.root), topology=topology, window=window, experts=experts,
        items=tuple(items), paths={f: str(h.path) for f, h in headers.items()},
        identities={f: h.identity for f, h in headers.items()},
        header_bytes=sum(8 + h.header_bytes for h in headers.values()),
        tensors=tensors)


@without_gc
def plan_all(spec: ModelSpec, index: CheckpointIndex, pp: int, tp: int = 1, ep: int = 1, *,
             partition: Partition = "even", strict: bool = True,
             cache_bytes: Optional[Sequence[int]] = None,
             range_cost_bytes: int = DEFAULT_RANGE_COST_BYTES,
             exchange_cost: Optional[float] = DEFAULT_EXCHANGE_COST,
             exchange_batch_bytes: Optional[int] = None,
             ranks: Optional[Sequence[int]] = None) -> list[RankPlan]:
    """Plans of every rank of a PP x EP x TP layout (what ``pploader plan`` prints), or of
    ``ranks`` only (``pploader plan --rank``: the same plans, the other stages not planned)."""
    roles = checkpoint_roles(spec, index)
    windows = make_windows(roles.spec, index, pp, partition, cache_bytes=cache_bytes, roles=roles)
    topo = Topology(pp, tp, ep)
    plans = [plan_rank(roles.spec, index, t, windows[t.pp_rank], strict=strict,
                       range_cost_bytes=range_cost_bytes, exchange_cost=exchange_cost,
                       exchange_batch_bytes=exchange_batch_bytes, roles=roles)
             for t in topo.all_ranks() if ranks is None or t.rank in ranks]
    if logger.isEnabledFor(logging.INFO):  # the sums walk every item: only when logged
        logger.info("planned %d rank(s) (pp %d x ep %d x tp %d, %s): %d bytes to read in all, "
                    "ideal %d", len(plans), pp, ep, tp, partition,
                    sum(p.planned_read_bytes for p in plans), sum(p.ideal_bytes for p in plans))
    return plans


@without_gc
def plan_mtp(spec: ModelSpec, index: CheckpointIndex, mtp_layer: int,
             topology: Optional[Topology] = None) -> RankPlan:
    """Plan of a draft model: MTP layer ``mtp_layer`` renamed to layer 0 of the draft."""
    if not 0 <= mtp_layer < spec.num_mtp_layers:
        raise PlanError(f"MTP layer {mtp_layer} requested; the checkpoint config has "
                        f"{spec.num_mtp_layers} (num_nextn_predict_layers)")
    topo = topology or Topology(1)
    roles = checkpoint_roles(spec, index)
    spec = roles.spec
    layer = spec.num_layers + mtp_layer
    window = StageWindow(topo.pp_rank, layer, layer + 1, False, False)
    experts = (local_experts(spec.num_experts, topo.ep_size, topo.ep_rank)
               if spec.num_experts and topo.ep_size > 1 else None)
    items, names = [], []
    scheme = quant_scheme(spec)
    index.require({index.weight_map[n] for n in roles.layers.get(layer, ())}, topo.rank)
    for name, role in roles.layer_roles(layer).items():
        if role.placement == "mtp" and role.layer == layer and (
                role.expert is None or experts is None or experts[0] <= role.expert < experts[1]):
            entry = index.entry(name)
            sel = tensor_selection(spec, role, entry, topo, experts, index, scheme)
            items.append(read_item(entry, spec.family.layer_name(0, role.component), sel))
            names.append(name)
    if not items:
        raise PlanError(f"no tensors for MTP layer {mtp_layer} (global layer {layer})")
    check_mtp(spec, index, layer, names, experts)
    return _finish(spec, index, topo, window, experts, items, tuple(sorted(set(names))))
