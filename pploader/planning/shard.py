"""Slices: which part of a tensor a rank holds (TP rule, local experts) and its byte ranges.

Pure arithmetic on shapes; no I/O. A ``Selection`` lists, per partially-selected dim, the
intervals whose concatenation (in order) forms the rank's piece along that dim.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from ..errors import PlanError

if TYPE_CHECKING:  # pragma: no cover
    from ..families.base import ShardRule
    from .spec import ModelSpec

__all__ = ["Interval", "Selection", "tp_selection", "local_experts", "byte_runs",
           "DEFAULT_RANGE_COST_BYTES"]

Interval = tuple[int, int]   # (start, length) along one dim

#: Cost of one extra positional read, expressed in bytes of sequential transfer. Strided
#: (dim >= 1) slices are read row by row when that costs less than reading the covering box.
DEFAULT_RANGE_COST_BYTES = 64 * 1024


@dataclass(frozen=True)
class Selection:
    """Per-dim intervals (dims absent are taken whole) + zero rows padded after dim 0."""

    dims: tuple[tuple[int, tuple[Interval, ...]], ...] = ()
    pad_rows: int = 0

    def shape(self, source_shape: tuple[int, ...]) -> tuple[int, ...]:
        out = list(source_shape)
        for dim, intervals in self.dims:
            out[dim] = sum(n for _, n in intervals)
        if out and self.pad_rows:
            out[0] += self.pad_rows
        return tuple(out)

    def merged(self, other: "Selection") -> "Selection":
        mine = dict(self.dims)
        for dim, intervals in other.dims:
            if dim in mine:
                raise PlanError(f"two selections on dim {dim}")
            mine[dim] = intervals
        return Selection(tuple(sorted(mine.items())), self.pad_rows + other.pad_rows)


def local_experts(num_experts: int, ep_size: int, ep_rank: int) -> tuple[int, int]:
    """Contiguous block ``[first, last)`` of experts owned by ``ep_rank``: vLLM's ``linear``
    placement (``determine_expert_map``: ``start = r * base + min(r, remainder)``), so when
    the count does not divide, the *first* ``num_experts % ep_size`` ranks hold one more
    (8 experts over 3 ranks: 0-2 / 3-5 / 6-7). Where it divides this is also SGLang's split
    (SGLang refuses a count that does not divide)."""
    if num_experts < ep_size:
        raise PlanError(f"{num_experts} experts cannot be split over ep {ep_size} ranks")
    base, extra = divmod(num_experts, ep_size)
    first = ep_rank * base + min(ep_rank, extra)
    return (first, first + base + (1 if ep_rank < extra else 0))


def tp_selection(rule: Optional[ShardRule], shape: tuple[int, ...], spec: "ModelSpec",
                 tp_rank: int, tp_size: int, name: str) -> Selection:
    """The TP rank's piece of a tensor under ``rule`` (None or dim None = replicated).

    A selection that covers its whole dim is returned as replicated (``Selection()``), so
    ranks holding identical bytes have identical items (see ``plan.share_reads``).
    """
    if rule is None or rule.dim is None or tp_size == 1:
        return Selection()
    if not -len(shape) <= rule.dim < len(shape):
        raise PlanError(f"shard rule splits dim {rule.dim} of a {len(shape)}-d tensor "
                        f"{list(shape)} (tp={tp_size})", tensor=name)
    dim = rule.dim % len(shape)
    size = shape[dim]
    where = f"dim {dim} of shape {list(shape)} over tp={tp_size}"
    if rule.pad:
        if dim != 0:
            raise PlanError(f"padded (vocab) split must be on dim 0, not {where}", tensor=name)
        per = -(-size // tp_size)
        start = min(tp_rank * per, size)
        length = min(per, size - start)
        return Selection(((0, ((start, length),)),), pad_rows=per - length)
    segments = tuple(rule.segments(spec)) if rule.segments else (size,)
    if sum(segments) != size or any(s < 0 for s in segments):
        raise PlanError(f"segments {list(segments)} do not sum to {size}: cannot split {where}",
                        tensor=name)
    units = rule.units(spec) if rule.units else None
    per_segment = units if isinstance(units, tuple) else (units,) * len(segments)
    if len(per_segment) != len(segments):
        raise PlanError(f"{len(per_segment)} unit counts for {len(segments)} segments: cannot "
                        f"split {where}", tensor=name)
    intervals, offset = [], 0
    for seg, seg_units in zip(segments, per_segment):
        if seg and seg_units is not None and seg_units < tp_size and not rule.replicate:
            raise PlanError(f"{seg_units} units of {seg // max(seg_units, 1)} are fewer than "
                            f"the {tp_size} TP ranks and the engine does not replicate them: "
                            f"cannot split {where}", tensor=name)
        intervals.append(_segment_piece(seg, seg_units, offset, tp_rank, tp_size, where, name,
                                        rule.ceil))
        offset += seg
    merged = tuple(_merge(intervals))
    if merged == ((0, size),):
        return Selection()
    return Selection(((dim, merged),))


def _segment_piece(seg: int, seg_units: Optional[int], offset: int, tp_rank: int, tp_size: int,
                   where: str, name: str, ceil: bool = False) -> Interval:
    """The rank's interval of one segment: an even share of its units, or (declared units
    fewer than tp, e.g. kv heads) one replicated unit; with ``ceil`` the engine's uneven
    share (``ceil_share``: the last ranks fewer units, possibly none)."""
    if seg == 0:
        return (offset, 0)
    if seg_units is None and ceil:
        seg_units = seg  # every row its own unit, split unevenly
    if seg_units is None:  # every row is its own unit: must split evenly, never replicate
        if seg % tp_size:
            raise PlanError(f"segment of {seg} does not divide: cannot split {where}", tensor=name)
        per = seg // tp_size
        return (offset + tp_rank * per, per)
    if seg_units <= 0 or seg % seg_units:
        raise PlanError(f"segment of {seg} is not a multiple of {seg_units} units: cannot split "
                        f"{where}", tensor=name)
    unit = seg // seg_units
    # the families package is imported only by planning that splits heads (not by a reader
    # of explicit boxes such as the DCP reader, whose first load pays every import)
    from ..families.heads import UnitSplitError, ceil_share, unit_share
    share = ceil_share if ceil else unit_share
    try:
        first, count = share(seg_units, tp_size, tp_rank)
    except UnitSplitError as exc:
        raise PlanError(f"{seg_units} units of {unit} {exc.reason}: cannot split {where}",
                        tensor=name) from None
    return (offset + first * unit, count * unit)


def _merge(intervals: list[Interval]) -> list[Interval]:
    out: list[Interval] = []
    for start, n in intervals:
        if out and out[-1][0] + out[-1][1] == start:
            out[-1] = (out[-1][0], out[-1][1] + n)
        elif n:
            out.append((start, n))
    return out


def byte_runs(shape: tuple[int, ...], itemsize: int, base: int,
              selection: Selection) -> list[tuple[int, int]]:
    """Absolute ``(offset, length)`` runs whose concatenation is the selection in C order."""
    if not selection.dims:
        return [(base, math.prod(shape) * itemsize)] if math.prod(shape) else []
    sel = dict(selection.dims)
    k = max(sel)
    inner = math.prod(shape[k + 1:]) * itemsize
    if len(sel) == 1 and len(sel[k]) == 1 and 0 < sel[k][0][1] < shape[k]:
        # one interval of one dim (a TP shard of dim >= 1): evenly spaced runs, built in C
        # (a dim-1 shard of a 14336-row matrix is 14336 runs)
        start, n = sel[k][0]
        stride = shape[k] * inner
        first = base + start * inner
        rows = math.prod(shape[:k])
        return list(zip(range(first, first + rows * stride, stride),
                        itertools.repeat(n * inner, rows)))
    outer_axes = [[i for a, n in sel[d] for i in range(a, a + n)] if d in sel else range(shape[d])
                  for d in range(k)]
    runs: list[tuple[int, int]] = []
    for prefix in itertools.product(*outer_axes):
        linear = 0
        for d, idx in enumerate(prefix):
            linear = linear * shape[d] + idx
        for start, n in sel[k]:
            runs.append((base + (linear * shape[k] + start) * inner, n * inner))
    return _merge(runs)
