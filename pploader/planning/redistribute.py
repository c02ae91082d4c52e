"""Read-and-redistribute: TP slices whose bytes are scattered, read as row shares + exchange.

A row-parallel weight (o_proj, down_proj: split along dim 1) gives every TP rank a column
slice, i.e. one short byte run per row. Reading it directly costs either one positional read
per row or the whole covering box (TP x the needed bytes). Instead every rank of the TP group
reads one contiguous share of the box's *rows* (1/TP of its bytes, one large sequential
request) and the group swaps the pieces with an all-to-all, so each rank ends with its slice:
bytes read per rank = ideal (+- one row), bytes exchanged per rank <= ideal.

Why it is exact: a selection whose dim-0 intervals are ascending is separable along dim 0, so
rank q's slice is the concatenation, in source-rank order, of q's selection applied to every
rank's row share. Received pieces therefore land back to back in q's output, in C order.

Pure planning (frozen data, no I/O, no torch.distributed): :class:`Exchanger` makes the
per-tensor choice in ``plan.plan_rank``; ``io/transfer/exchange.py`` executes it through ``distributed/comm.py``.
Every rank of a TP group computes the same choices and batches from the same headers.
"""
from __future__ import annotations

import math
from collections import Counter
from itertools import compress, repeat
from operator import is_not, itemgetter
from dataclasses import dataclass
from functools import cached_property, partial
from typing import TYPE_CHECKING, Callable, NamedTuple, Optional, Sequence

from .checkpoint import TensorEntry
from .items import ReadItem, make_item, read_method_items, total_read_bytes
from .shard import Interval, Selection

if TYPE_CHECKING:  # pragma: no cover
    from .rank_plan import RankPlan  # which imports this module lazily (``summary``)
    from .topology import Topology

__all__ = ["ExchangeItem", "Redistribute", "Exchanger",
           "DEFAULT_EXCHANGE_BATCH_BYTES", "read_methods", "methods_table", "rows_in", "piece_selection"]

#: Box bytes of the tensors (or row chunks of one large tensor) exchanged in one all-to-all.
#: Host memory per batch is about 3 x this / TP (row share, send and receive buffers).
DEFAULT_EXCHANGE_BATCH_BYTES = 64 << 20


class ExchangeItem(NamedTuple):
    """One tensor (or one row chunk of it) read as row shares and exchanged (an immutable
    named tuple, built without a per-field ``__init__``: a TP8 rank has ~30 k).

    ``rows[p]``: the (first row, count) that TP rank ``p`` reads; together they tile the chunk
    in order. ``selections[p]``: rank ``p``'s slice of the whole tensor. ``share``: this rank's
    rows as a direct ReadItem. ``first`` / ``last``: the chunk opens / completes the target.
    """

    target: str
    name: str
    file: str
    dtype: str
    source_shape: tuple[int, ...]
    rows: tuple[Interval, ...]
    selections: tuple[Selection, ...]
    share: ReadItem
    batch: int
    first: bool = True
    last: bool = True

    @property
    def row_bytes(self) -> int:
        return math.prod(self.source_shape[1:]) * self.share.itemsize

    def out_shape(self, rank: int) -> tuple[int, ...]:
        return self.selections[rank].shape(self.source_shape)

    def piece_bytes(self, src: int, dst: int) -> int:
        """Bytes of ``dst``'s slice held in ``src``'s row share."""
        a, n = self.rows[src]
        return rows_in(self.selections[dst], a, a + n) * _inner_bytes(
            self.selections[dst], self.source_shape, self.share.itemsize)

    def out_offset(self, dst: int) -> int:
        """Where this chunk's part of ``dst``'s slice starts in its output (bytes)."""
        return rows_in(self.selections[dst], 0, self.rows[0][0]) * _inner_bytes(
            self.selections[dst], self.source_shape, self.share.itemsize)


#: an ExchangeItem from its eleven fields as one tuple (no per-field ``__init__`` call)
_make_exchange_item = partial(tuple.__new__, ExchangeItem)
_rows_of, _selections_of, _share_of = itemgetter(5), itemgetter(6), itemgetter(7)


@dataclass(frozen=True)
class Redistribute:
    """The exchanged part of one rank's plan. ``group``: global ranks of the TP group in
    tp_rank order; ``items`` in exchange order, ``batch`` ascending (one all-to-all each).
    The plan's ``items`` still hold a direct read of every target (used without a Comm)."""

    group: tuple[int, ...]
    tp_rank: int
    items: tuple[ExchangeItem, ...]
    exchange_cost: float
    batch_bytes: int

    @property
    def targets(self) -> frozenset[str]:
        return frozenset(i.target for i in self.items)

    @property
    def read_bytes(self) -> int:
        return total_read_bytes(map(_share_of, self.items))

    @property
    def sent_bytes(self) -> int:
        """Bytes this rank sends to the other ranks of the group."""
        return self._exchanged_bytes[0]

    @property
    def received_bytes(self) -> int:
        """Bytes this rank receives from the other ranks of the group."""
        return self._exchanged_bytes[1]

    @cached_property
    def _exchanged_bytes(self) -> tuple[int, int]:
        """(sent, received), worked out once per distinct (rows, selections) pair:
        a DeepSeek-V3 TP8 rank's ~30 k items have a few hundred, and ``pploader plan`` spent
        ~11 s on them item by item (eight ranks)."""
        me, peers = self.tp_rank, range(len(self.group))
        # items of one shape, dtype and choice share their ``rows`` and ``selections`` tuples
        # (``Exchanger.finish``): keyed by identity, as hashing ~30 k nested tuples costs more
        # than it saves; items that do not share them are only counted apart
        keys = list(zip(map(id, map(_rows_of, self.items)),
                        map(id, map(_selections_of, self.items))))
        one_of = dict(zip(keys, self.items))
        sent = received = 0
        for key, count in Counter(keys).items():
            item = one_of[key]
            sent += count * sum(item.piece_bytes(me, q) for q in peers if q != me)
            received += count * sum(item.piece_bytes(p, me) for p in peers if p != me)
        return sent, received

    @property
    def num_batches(self) -> int:
        return len({i.batch for i in self.items})

    def batches(self) -> list[list[ExchangeItem]]:
        out: list[list[ExchangeItem]] = []
        for item in self.items:
            if not out or out[-1][0].batch != item.batch:
                out.append([])
            out[-1].append(item)
        return out


def rows_in(sel: Selection, start: int, stop: int) -> int:
    """How many of ``sel``'s dim-0 rows lie in ``[start, stop)`` (all rows if dim 0 is whole)."""
    intervals = dict(sel.dims).get(0)
    if intervals is None:
        return max(0, stop - start)
    return sum(max(0, min(a + n, stop) - max(a, start)) for a, n in intervals)


def piece_selection(sel: Selection, start: int, stop: int) -> Selection:
    """``sel`` restricted to rows ``[start, stop)``, in coordinates of that row block."""
    dims = dict(sel.dims)
    if 0 in dims:
        dims[0] = tuple((max(a, start) - start, min(a + n, stop) - max(a, start))
                        for a, n in dims[0] if min(a + n, stop) > max(a, start))
    else:
        dims[0] = ((0, stop - start),)
    return Selection(tuple(sorted(dims.items())))


def _inner_bytes(sel: Selection, shape: tuple[int, ...], itemsize: int) -> int:
    out = sel.shape(shape)
    return math.prod(out[1:]) * itemsize if out else itemsize


def _ascending(sel: Selection) -> bool:
    for _, intervals in sel.dims:
        ends = [a + n for a, n in intervals]
        if any(intervals[i + 1][0] < ends[i] for i in range(len(intervals) - 1)):
            return False
    return True


def _direct_cost(shape: tuple[int, ...], itemsize: int, sel: Selection,
                 range_cost: int) -> int:
    """What ``plan.read_item`` pays for ``sel``: min(row runs, covering box), in bytes."""
    dims = dict(sel.dims)
    k = max(dims)
    n_runs = len(dims[k]) * math.prod(sum(n for _, n in dims[d]) if d in dims else shape[d]
                                      for d in range(k))
    needed = math.prod(sel.shape(shape)) * itemsize
    row_bytes = math.prod(shape[1:]) * itemsize
    rows = (max(a + n for a, n in dims[0]) - min(a for a, _ in dims[0])) if 0 in dims \
        else shape[0]
    return min(needed + n_runs * range_cost, rows * row_bytes + range_cost)


@dataclass(frozen=True)
class _Choice:
    """The group-wide decision for one (shape, dtype, selections): row shares or None."""

    selections: tuple[Selection, ...]
    box: Optional[Interval]          # rows exchanged; None = read directly


_NOT_EXCHANGED = _Choice((), None)


class Exchanger:
    """Collects the exchange choices of one rank's plan (used by ``plan.plan_rank``).

    ``consider`` is given each strided item with a callable returning any TP peer's selection;
    a tensor is exchanged when the slowest rank of the group pays less with row shares
    (``share + range_cost + exchange_cost x max(sent, received)``) than with direct reads
    (``min(runs x range_cost + needed, box + range_cost)``).
    """

    def __init__(self, topology: "Topology", *, range_cost_bytes: int, exchange_cost: float,
                 batch_bytes: int = DEFAULT_EXCHANGE_BATCH_BYTES) -> None:
        if exchange_cost < 0 or batch_bytes <= 0:
            raise ValueError(f"exchange_cost must be >= 0 and batch_bytes > 0, got "
                             f"{exchange_cost}, {batch_bytes}")
        self.topology, self.range_cost = topology, range_cost_bytes
        self.cost, self.batch_bytes = exchange_cost, batch_bytes
        self._memo: dict[tuple, _Choice] = {}
        self._seen: dict[tuple, tuple[Selection, _Choice]] = {}   # key -> (selection, choice)
        self._chosen: list[tuple[TensorEntry, str, _Choice]] = []

    def consider(self, entry: TensorEntry, target: str, selection: Selection, key: tuple,
                 peer_selection: Callable[["Topology"], Selection]) -> bool:
        """Decide for one item; ``key`` identifies (rule, shape, dtype) for reuse. True when
        the tensor will be exchanged."""
        return self.take(entry, target, self.choice(entry, selection, key, peer_selection))

    def take(self, entry: TensorEntry, target: str, choice: _Choice) -> bool:
        """Record ``choice`` (from :meth:`choice`) for one item; True when it is exchanged.
        A planner may reuse one choice for tensors with the same key, shape, dtype and
        selection (what ``choice`` would return for them)."""
        if choice.box is None:
            return False
        self._chosen.append((entry, target, choice))
        return True

    def take_many(self, entries: Sequence[TensorEntry], targets: Sequence[str],
                  choices: Sequence[Optional[_Choice]]) -> None:
        """:meth:`take` for a whole stage in one C pass (``None``: read directly)."""
        keep = list(map(is_not, choices, repeat(None)))
        self._chosen.extend(zip(compress(entries, keep), compress(targets, keep),
                                compress(choices, keep)))  # type: ignore[arg-type]

    def choice(self, entry: TensorEntry, selection: Selection, key: tuple,
               peer_selection: Callable[["Topology"], Selection]) -> _Choice:
        """The group's decision for ``entry`` sliced as ``selection`` (not yet recorded)."""
        full_key = (key, entry.shape, entry.dtype)
        seen = self._seen.get(full_key)
        if seen is not None and seen[0] is selection:  # the same decision, already made
            choice = seen[1]
        else:
            choice = self._choose(entry, selection, key, full_key, peer_selection)
            if seen is None:
                self._seen[full_key] = (selection, choice)
        return choice

    def _choose(self, entry: TensorEntry, selection: Selection, key: tuple, full_key: tuple,
                peer_selection: Callable[["Topology"], Selection]) -> _Choice:
        """The group's choice for this tensor (``_NOT_EXCHANGED``: not a candidate)."""
        t = self.topology
        if t.tp_size == 1 or not any(d >= 1 for d, _ in selection.dims) or selection.pad_rows:
            return _NOT_EXCHANGED
        choice = self._memo.get(full_key)
        if choice is None:
            sels = tuple(selection if r == t.rank else peer_selection(t.with_rank(r))
                         for r in t.tp_group())
            choice = self._memo[full_key] = _Choice(sels, self._decide(entry, sels))
        elif choice.selections[t.tp_rank] != selection:  # memo key too coarse: decide afresh
            return self._choose(entry, selection, key + (selection,),
                                (key + (selection,), entry.shape, entry.dtype), peer_selection)
        return choice

    def _decide(self, entry: TensorEntry, sels: tuple[Selection, ...]) -> Optional[Interval]:
        shape, itemsize, tp = entry.shape, entry.itemsize, len(sels)
        if not shape or any(s.pad_rows or not _ascending(s) for s in sels):
            return None
        starts = [dict(s.dims).get(0) for s in sels]
        picked = [iv for iv in starts if iv is not None]
        if len(picked) < len(starts):  # some rank takes every row
            lo, hi = 0, shape[0]
        elif any(picked):
            lo = min(a for iv in picked for a, _ in iv)
            hi = max(a + n for iv in picked for a, n in iv)
        else:
            return None
        rows = _shares(lo, hi, tp)
        row_bytes = math.prod(shape[1:]) * itemsize
        direct = redist = 0.0
        for q, sel in enumerate(sels):
            if any(d >= 1 for d, _ in sel.dims):
                direct = max(direct, _direct_cost(shape, itemsize, sel, self.range_cost))
            else:  # a contiguous slice on this rank: one range
                direct = max(direct, math.prod(sel.shape(shape)) * itemsize + self.range_cost)
            inner = _inner_bytes(sel, shape, itemsize)
            sent = sum(rows_in(sels[d], *_span(rows[q])) * _inner_bytes(sels[d], shape, itemsize)
                       for d in range(tp) if d != q)
            received = sum(rows_in(sel, *_span(rows[p])) * inner for p in range(tp) if p != q)
            redist = max(redist, rows[q][1] * row_bytes + self.range_cost
                         + self.cost * max(sent, received))
        return (lo, hi - lo) if redist < direct else None

    def finish(self, file_order: dict[str, int]) -> Optional[Redistribute]:
        """The Redistribute of the chosen tensors, in checkpoint order, batched and chunked
        (a tensor larger than a batch is split into row chunks)."""
        if not self._chosen:
            return None
        t = self.topology
        tp_rank = t.tp_rank
        keys = [(file_order[e.file], e.start, target) for e, target, _ in self._chosen]
        chosen = list(map(self._chosen.__getitem__, sorted(range(len(keys)),
                                                           key=keys.__getitem__)))
        items: list[ExchangeItem] = []
        batch, used = 0, 0
        #: (shape, dtype, box) -> per chunk: (rows, every rank's share, this rank's share
        #: shape, its byte offset from the tensor's start, its bytes, first row)
        chunks_of: dict[tuple, list[tuple]] = {}
        make_share, make_exchange, batch_bytes = make_item, _make_exchange_item, self.batch_bytes
        for entry, target, choice in chosen:
            name, file, dtype, shape, start, _ = entry
            shape_key = (shape, dtype, choice.box)
            chunks = chunks_of.get(shape_key)
            if chunks is None:  # worked out once per shape, dtype and exchanged rows
                lo, count = choice.box  # type: ignore[misc]
                row_bytes = math.prod(shape[1:]) * entry.itemsize
                per_chunk = max(1, batch_bytes // max(row_bytes, 1))
                starts = list(range(lo, lo + count, per_chunk)) or [lo]
                chunks = chunks_of[shape_key] = []
                for chunk_start in starts:
                    n = min(per_chunk, lo + count - chunk_start)
                    rows = _shares(chunk_start, chunk_start + n, t.tp_size)
                    a, k = rows[tp_rank]
                    chunks.append((n * row_bytes, rows, (k,) + shape[1:], a * row_bytes,
                                   k * row_bytes, a))
            last = len(chunks) - 1
            for i, (chunk_bytes, rows, share_shape, offset, share_bytes, first_row) in \
                    enumerate(chunks):
                if used and used + chunk_bytes > batch_bytes:
                    batch, used = batch + 1, 0
                # rows [first_row, first_row + k) as one direct read (its target
                # ``name@first_row`` is unique per chunk)
                share = make_share((name, f"{target}@{first_row}", file, dtype, share_shape,
                                    shape, ((start + offset, share_bytes),) if share_bytes
                                    else (), share_shape, (), 0))
                items.append(make_exchange((target, name, file, dtype, shape, rows,
                                            choice.selections, share, batch, i == 0, i == last)))
                used += chunk_bytes
        return Redistribute(t.tp_group(), t.tp_rank, tuple(items), self.cost, self.batch_bytes)


def _shares(lo: int, hi: int, tp: int) -> tuple[Interval, ...]:
    """Rows ``[lo, hi)`` in ``tp`` contiguous, near-equal shares."""
    n = hi - lo
    return tuple((lo + n * p // tp, n * (p + 1) // tp - n * p // tp) for p in range(tp))


def _span(interval: Interval) -> tuple[int, int]:
    return interval[0], interval[0] + interval[1]


def read_methods(plan: RankPlan) -> dict[str, dict[str, int]]:
    """Per read method, how many tensors and bytes this rank's plan reads (``pploader plan``):
    ``whole`` (one range, the whole tensor or a contiguous slice), ``rows`` (byte runs, one per
    row), ``box`` (covering box + gather), ``redistribute`` (row share + exchange; with the
    bytes sent and received)."""
    out: dict[str, dict[str, int]] = {
        method: {"tensors": len(items), "read_bytes": total_read_bytes(items)}
        for method, items in read_method_items(plan.direct_items).items()}
    ex = plan.redistribute
    out["redistribute"] = {"tensors": len(ex.targets) if ex else 0,
                           "read_bytes": ex.read_bytes if ex else 0,
                           "sent_bytes": ex.sent_bytes if ex else 0,
                           "received_bytes": ex.received_bytes if ex else 0,
                           "batches": ex.num_batches if ex else 0}
    return out


def methods_table(summaries: Sequence[dict]) -> str:
    """Per rank, tensors and bytes read by each method (``RankPlan.summary()["methods"]``)."""
    from ..report import format_bytes
    names = ("whole", "rows", "box", "redistribute")
    head = ["rank", *names, "exchanged (sent/recv)", "batches"]
    rows = []
    for s in summaries:
        m = s["methods"]
        ex = m["redistribute"]
        rows.append([str(s["rank"]), *(f"{m[k]['tensors']} / {format_bytes(m[k]['read_bytes'])}"
                                       for k in names),
                     f"{format_bytes(ex['sent_bytes'])} / {format_bytes(ex['received_bytes'])}",
                     str(ex["batches"])])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    line = "  ".join(h.rjust(w) for h, w in zip(head, widths))
    return "\n".join([line, "-" * len(line),
                      *("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)])
