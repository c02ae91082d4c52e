"""``RankPlan``: everything one rank reads. Its own module (light imports: no model
families), so the read backends and the DCP reader load without the planner."""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import compress
from operator import attrgetter, not_
from typing import TYPE_CHECKING, Mapping, Optional

from .header import FileIdentity
from .items import ReadItem, total_ideal_bytes, total_read_bytes
from .partition import StageWindow
from .shard import DEFAULT_RANGE_COST_BYTES
from .topology import Topology

if TYPE_CHECKING:  # pragma: no cover
    from .redistribute import Redistribute

__all__ = ["RankPlan"]

_ranges_of, _file_of, _target_of = attrgetter("ranges"), attrgetter("file"), attrgetter("target")


@dataclass(frozen=True)
class RankPlan:
    """Everything one rank will read, in the order it reads it."""

    model: str
    topology: Topology
    window: StageWindow
    experts: Optional[tuple[int, int]]
    items: tuple[ReadItem, ...]
    paths: Mapping[str, str]
    identities: Mapping[str, FileIdentity]
    header_bytes: int
    tensors: tuple[str, ...] = field(default=())
    range_cost_bytes: int = DEFAULT_RANGE_COST_BYTES   # the cost rule the items were made with
    #: tensors read as TP row shares + all-to-all when loaded with a Comm (planning/redistribute.py);
    #: ``items`` still hold their direct reads (what a load without a Comm does)
    redistribute: Optional["Redistribute"] = None

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(map(_file_of, compress(self.items,
                                                          map(_ranges_of, self.items)))))

    @property
    def ideal_bytes(self) -> int:
        return total_ideal_bytes(self.items)

    @property
    def read_bytes(self) -> int:
        return total_read_bytes(self.items)

    @property
    def direct_items(self) -> list[ReadItem]:
        """The items read directly when loaded with a Comm (all but the exchanged ones)."""
        ex = self.redistribute
        if ex is None:
            return list(self.items)
        skip = ex.targets
        return list(compress(self.items, map(not_, map(skip.__contains__,
                                                       map(_target_of, self.items)))))

    @property
    def planned_read_bytes(self) -> int:
        """Bytes read when loaded with a Comm: direct items + row shares of exchanged ones."""
        ex = self.redistribute
        if ex is None:
            return self.read_bytes
        return total_read_bytes(self.direct_items) + ex.read_bytes

    @property
    def largest_item_bytes(self) -> int:
        return max((max(i.nbytes, i.read_bytes) for i in self.items), default=0)

    def summary(self) -> dict:
        """The stable JSON form documented in docs/usage.md."""
        from .redistribute import read_methods
        t = self.topology
        return {"rank": t.rank, "pp_rank": t.pp_rank, "tp_rank": t.tp_rank, "ep_rank": t.ep_rank,
                "start_layer": self.window.start_layer, "end_layer": self.window.end_layer,
                "has_embed": self.window.has_embed, "has_head": self.window.has_head,
                "experts": list(self.experts) if self.experts else None,
                "num_tensors": len(self.items), "ideal_bytes": self.ideal_bytes,
                "planned_read_bytes": self.planned_read_bytes,
                "direct_read_bytes": self.read_bytes, "methods": read_methods(self),
                "header_bytes": self.header_bytes,
                "files": list(self.files), "tensors": list(self.tensors)}
