"""One tensor's read: ``ReadItem``, the rank's selection of a tensor (TP rule, local
experts, quantization companions) and its byte runs. Pure; ``plan.plan_rank`` calls these
once per kind of tensor and copies the result to every tensor of that kind."""
from __future__ import annotations

import math
from collections import Counter
from functools import lru_cache, partial
from itertools import chain, compress, repeat
from operator import add, attrgetter, itemgetter, lt, not_
from typing import TYPE_CHECKING, Iterable, NamedTuple, Optional, Sequence

from ..errors import PlanError
from .checkpoint import CheckpointIndex, TensorEntry
from .dtype_table import ITEMSIZE
from .shard import DEFAULT_RANGE_COST_BYTES, Interval, Selection, byte_runs, tp_selection
from .topology import Topology

if TYPE_CHECKING:  # pragma: no cover - the families and quant modules load on first use
    from ..families.base import TensorRole
    from .quant import QuantScheme
    from .spec import ModelSpec

__all__ = ["ReadItem", "read_item", "relative_item", "placed_item", "shift_ranges", "make_item", "tensor_selection", "peer_selection",
           "total_read_bytes", "total_ideal_bytes", "read_method_items"]


class ReadItem(NamedTuple):
    """One tensor (or slice) to read: byte ``ranges`` concatenated form ``buffer_shape``;
    ``gather`` then narrows it (coalesced strided reads); ``pad_rows`` zero rows follow.

    An immutable named tuple, not a frozen dataclass: a rank of a large MoE plans ~100 k of
    them, built in C passes from one item per tensor kind (``plan_rank``)."""

    name: str
    target: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    source_shape: tuple[int, ...]
    ranges: tuple[tuple[int, int], ...]
    buffer_shape: tuple[int, ...]
    gather: tuple[tuple[int, tuple[Interval, ...]], ...] = ()
    pad_rows: int = 0

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def read_bytes(self) -> int:
        return sum(map(_length_of, self.ranges))  # C pass: a TP row slice has ~10k ranges

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def ideal_bytes(self) -> int:
        rows = self.shape[0] - self.pad_rows if self.shape else 1
        return rows * math.prod(self.shape[1:]) * self.itemsize

    @property
    def direct(self) -> bool:
        """True when the ranges land straight in the output (no temporary buffer)."""
        return not self.gather


#: a ReadItem from its ten fields as one tuple (no per-field ``__init__`` call)
make_item = partial(tuple.__new__, ReadItem)

_ranges_of, _gather_of = attrgetter("ranges"), attrgetter("gather")
_first_of, _length_of = itemgetter(0), itemgetter(1)  # of an (offset, length) range
_ideal_key = attrgetter("shape", "dtype", "pad_rows")  # what ``ideal_bytes`` depends on


def total_read_bytes(items: Iterable[ReadItem]) -> int:
    """``sum(i.read_bytes for i in items)`` in one C pass over every item's ranges (a TP8
    rank's plan has ~90 k items, and ``pploader plan`` sums them per rank and method)."""
    return sum(map(itemgetter(1), chain.from_iterable(map(_ranges_of, items))))


def total_ideal_bytes(items: Sequence[ReadItem]) -> int:
    """``sum(i.ideal_bytes for i in items)``, one ``ideal_bytes`` per distinct (shape,
    dtype, pad rows): the experts of a layer share a handful."""
    keys = list(map(_ideal_key, items))
    one_of = dict(zip(keys, items))
    return sum(count * one_of[key].ideal_bytes for key, count in Counter(keys).items())


def read_method_items(items: Sequence[ReadItem]) -> dict[str, list[ReadItem]]:
    """``items`` by read method: ``whole`` (one range), ``rows`` (byte runs, one per row) and
    ``box`` (covering box + gather), in C passes."""
    box = list(map(bool, map(_gather_of, items)))
    rest = list(compress(items, map(not_, box)))
    multi = list(map(lt, repeat(1), map(len, map(_ranges_of, rest))))
    return {"whole": list(compress(rest, map(not_, multi))), "rows": list(compress(rest, multi)),
            "box": list(compress(items, box))}


def read_item(entry: TensorEntry, target: str, selection: Selection,
              range_cost: int = DEFAULT_RANGE_COST_BYTES) -> ReadItem:
    """The ReadItem of ``selection`` of ``entry``: direct byte runs (concatenated in C order),
    or one covering box + gather when ``n_runs x range_cost`` makes run-by-run dearer."""
    shape, itemsize = entry.shape, entry.itemsize
    out_shape = selection.shape(shape)
    if not selection.dims:
        ranges = ((entry.start, entry.nbytes),) if entry.nbytes else ()
        return ReadItem(entry.name, target, entry.file, entry.dtype, out_shape, shape, ranges,
                        shape, pad_rows=selection.pad_rows)
    sel = dict(selection.dims)
    k, j = max(sel), min(sel)
    n_runs = len(sel[k]) * math.prod(sum(n for _, n in sel[d]) if d in sel else shape[d]
                                     for d in range(k))
    needed = (math.prod(out_shape) - (selection.pad_rows * math.prod(shape[1:]))) * itemsize
    row_bytes = math.prod(shape[1:]) * itemsize
    lo = min((a for a, _ in sel[0]), default=0) if j == 0 else 0  # none: an empty piece
    hi = max((a + n for a, n in sel[0]), default=0) if j == 0 else shape[0]
    box_bytes = (hi - lo) * row_bytes
    if n_runs <= 1 or needed + n_runs * range_cost <= box_bytes:
        runs = byte_runs(shape, itemsize, entry.start, Selection(selection.dims))
        return ReadItem(entry.name, target, entry.file, entry.dtype, out_shape, shape,
                        tuple(runs), _unpadded(out_shape, selection.pad_rows),
                        pad_rows=selection.pad_rows)
    gather = tuple((d, tuple((a - lo, n) for a, n in iv) if d == 0 else iv)
                   for d, iv in selection.dims)
    box_shape = (hi - lo,) + shape[1:]
    return ReadItem(entry.name, target, entry.file, entry.dtype, out_shape, shape,
                    ((entry.start + lo * row_bytes, box_bytes),), box_shape, gather,
                    selection.pad_rows)


@lru_cache(maxsize=4096)
def relative_item(dtype: str, shape: tuple[int, ...], selection: Selection,
                  range_cost: int = DEFAULT_RANGE_COST_BYTES) -> ReadItem:
    """The ReadItem of ``selection`` of a ``dtype`` tensor of ``shape`` stored at offset 0,
    unnamed: planned once per process for every tensor alike (every layer's projection, every
    load of a reader made per load), then moved by :func:`placed_item`."""
    nbytes = math.prod(shape) * ITEMSIZE[dtype]
    return read_item(TensorEntry("", "", dtype, shape, 0, nbytes), "", selection, range_cost)


def shift_ranges(ranges: tuple[tuple[int, int], ...], delta: int
                 ) -> tuple[tuple[int, int], ...]:
    """``ranges`` moved by ``delta`` bytes (C passes: a TP row slice has ~10k ranges)."""
    return tuple(zip(map(add, map(_first_of, ranges), repeat(delta)), map(_length_of, ranges)))


def placed_item(relative: ReadItem, entry: TensorEntry, target: str) -> ReadItem:
    """A :func:`relative_item` moved to ``entry``'s name, file and offset, read as ``target``."""
    return relative._replace(name=entry.name, target=target, file=entry.file,
                             ranges=shift_ranges(relative.ranges, entry.start))


def _unpadded(shape: tuple[int, ...], pad_rows: int) -> tuple[int, ...]:
    return (shape[0] - pad_rows,) + shape[1:] if pad_rows else shape


def _logical_selection(spec: ModelSpec, role: TensorRole, name: str, shape: tuple[int, ...],
                       topo: Topology, experts: Optional[tuple[int, int]]) -> Selection:
    """TP rule + local experts on a (logical) shape."""
    rule = spec.family.shard_rule(role.component)
    sel = tp_selection(rule, shape, spec, topo.tp_rank, topo.tp_size, name)
    if role.fused_experts and experts is not None:
        # dim 0 = the experts, or the experts flattened (E x rows each: DBRX's [E x I, H]),
        # or (>= 3-d) the routed experts then rows no compute uses, which no EP rank reads
        # (LongCat-Flash's gate_up_proj [E + zero experts, 2I, H])
        extra = len(shape) >= 3 and spec.num_experts and shape[0] > spec.num_experts
        if not shape or not spec.num_experts or shape[0] % spec.num_experts and not extra:
            raise PlanError(f"fused expert tensor has shape {list(shape)}, expected dim 0 = "
                            f"num_experts {spec.num_experts}", tensor=name)
        rows = 1 if extra else shape[0] // spec.num_experts
        if experts != (0, spec.num_experts):
            sel = _expert_block(sel, experts[0] * rows, experts[1] * rows)
    return sel


def _expert_block(sel: Selection, lo: int, hi: int) -> Selection:
    """``sel`` cut to dim-0 rows ``[lo, hi)`` (the rank's experts). A TP split on dim 0 too
    (DBRX's ``[E x I, H]``: rows of every expert) keeps its intervals inside the block."""
    dims = dict(sel.dims)
    if 0 not in dims:
        return Selection(((0, ((lo, hi - lo),)),)).merged(sel)
    dims[0] = tuple((max(a, lo), min(a + n, hi) - max(a, lo)) for a, n in dims[0]
                    if a < hi and a + n > lo)
    return Selection(tuple(sorted(dims.items())), sel.pad_rows)


def tensor_selection(spec: ModelSpec, role: TensorRole, entry: TensorEntry, topo: Topology,
               experts: Optional[tuple[int, int]], index: CheckpointIndex,
               scheme: Optional[QuantScheme]) -> Selection:
    """The rank's selection of ``entry``; quantized weights and their companions are sliced
    from the weight's logical selection (planning/quant.py)."""
    link = scheme.weight_of(entry.name, index.weight_map.__contains__) \
        if scheme is not None else None
    if scheme is not None and link is not None and link[0] in index.weight_map:
        weight = index.entry(link[0])
        own = scheme.resolve(weight.name)  # config groups: the weight's module's scheme
        found = own.weight_of(entry.name) if own is not None else None
        if own is None or found is None or not own.is_quantized(weight.name, weight.dtype,
                                                                len(weight.shape)):
            why = f"{own.name} weights are {own.weight_dtype}, >= 2-d" if own is not None \
                else f"module {weight.name.rsplit('.', 1)[0]} is not quantized by the config"
            if own is not None and found is None:
                why = f"{own.name} has no {link[1].suffix}"
            raise PlanError(f"{link[1].suffix} of a weight stored as {weight.dtype} "
                            f"{list(weight.shape)} ({why})",
                            file=entry.file, tensor=entry.name, rank=topo.rank)
        comp = found[1]
        logical = own.logical_shape(weight.shape)
        from .quant import same_shape
        if not same_shape(comp.shape(logical), entry.shape):
            raise PlanError(f"{own.name} {comp.suffix} has shape {list(entry.shape)}, expected "
                            f"{list(comp.shape(logical))} for weight {list(weight.shape)}",
                            file=entry.file, tensor=entry.name, rank=topo.rank)
        wcomp = own.weight_of(role.component)  # the family's naming, not string cutting
        wrole = role._replace(component=own.naming.logical_of(wcomp[0]) if wcomp is not None
                              else role.component)  # the TP rules are the logical weight's
        wsel = _logical_selection(spec, wrole, weight.name, logical, topo, experts)
        return own.companion_selection(comp, wsel, logical, weight.name, topo.tp_size)
    if scheme is not None and entry.dtype in scheme.weight_dtypes \
            and scheme.is_quantized(entry.name, entry.dtype, len(entry.shape)):
        own = scheme.resolve(entry.name)
        assert own is not None  # is_quantized: its module's scheme, stored as it stores
        logical = own.logical_shape(entry.shape)
        wrole = role._replace(component=own.naming.logical_of(role.component))
        wsel = _logical_selection(spec, wrole, entry.name, logical, topo, experts)
        return own.weight_selection(wsel, logical, entry.name, topo.tp_size)
    return _logical_selection(spec, role, entry.name, entry.shape, topo, experts)


def peer_selection(spec: ModelSpec, role: TensorRole, entry: TensorEntry,
                    experts: Optional[tuple[int, int]], index: CheckpointIndex,
                    scheme: Optional[QuantScheme], peer: Topology) -> Selection:
    """A TP peer's selection of ``entry`` (the exchange planner needs the whole group's)."""
    return tensor_selection(spec, role, entry, peer, experts, index, scheme)


