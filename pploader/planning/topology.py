"""Topology: who this rank is in the PP x EP x TP grid. Pure data, passed explicitly.

Rank order (documented, Megatron-style): TP innermost, then EP, then PP::

    rank = pp_rank * (ep_size * tp_size) + ep_rank * tp_size + tp_rank

so the TP ranks of one stage are neighbours (same node when possible).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import TopologyError

__all__ = ["Topology", "MAX_RANKS"]

#: the most ranks a job may have (arguments.MAX_RANKS; plan builds every rank)
MAX_RANKS = 1 << 16


def _check_count(name: str, value: object, low: int = 1) -> None:
    """An integer from ``low`` to MAX_RANKS, else a TopologyError naming ``name`` (never a
    ZeroDivisionError or TypeError later)."""
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= MAX_RANKS:
        what = "a positive integer" if low else "an integer >= 0"
        raise TopologyError(f"{name} must be {what} up to {MAX_RANKS}, got {value!r}")


@dataclass(frozen=True)
class Topology:
    """PP/EP/TP sizes and this process's rank; validated on construction."""

    pp_size: int
    tp_size: int = 1
    ep_size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        for field_name in ("pp_size", "tp_size", "ep_size"):
            _check_count(field_name, getattr(self, field_name))
        _check_count("rank", self.rank, low=0)
        if self.world_size > MAX_RANKS:
            raise TopologyError(f"pp {self.pp_size} x ep {self.ep_size} x tp {self.tp_size} = "
                                f"{self.world_size} ranks, more than {MAX_RANKS}")
        if not 0 <= self.rank < self.world_size:
            raise TopologyError(f"rank {self.rank} outside world of {self.world_size} "
                                f"(pp {self.pp_size} x ep {self.ep_size} x tp {self.tp_size})")

    @classmethod
    def for_world(cls, world_size: int, rank: int, *, pp: int | None = None, tp: int = 1,
                  ep: int = 1) -> "Topology":
        """Topology of a launched job; ``pp`` defaults to world / (tp * ep)."""
        for name, value in (("world_size", world_size), ("tp", tp), ("ep", ep)) + (
                (("pp", pp),) if pp is not None else ()):
            _check_count(name, value)
        _check_count("rank", rank, low=0)
        if pp is None:
            if world_size % (tp * ep):
                raise TopologyError(f"world size {world_size} is not divisible by tp {tp} x ep {ep}: "
                                    f"launch a multiple of {tp * ep} ranks or change --tp/--ep")
            pp = world_size // (tp * ep)
        if pp * tp * ep != world_size:
            raise TopologyError(f"pp {pp} x ep {ep} x tp {tp} = {pp * tp * ep} != world size "
                                f"{world_size}: launch {pp * tp * ep} ranks, or choose --pp/--ep/"
                                f"--tp whose product is {world_size}")
        return cls(pp, tp, ep, rank)

    @property
    def world_size(self) -> int:
        return self.pp_size * self.ep_size * self.tp_size

    @property
    def stage_size(self) -> int:
        return self.ep_size * self.tp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def ep_rank(self) -> int:
        return (self.rank // self.tp_size) % self.ep_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.stage_size

    def with_rank(self, rank: int) -> "Topology":
        return Topology(self.pp_size, self.tp_size, self.ep_size, rank)

    def all_ranks(self) -> tuple["Topology", ...]:
        return tuple(self.with_rank(r) for r in range(self.world_size))

    def rank_of(self, pp_rank: int, ep_rank: int = 0, tp_rank: int = 0) -> int:
        return pp_rank * self.stage_size + ep_rank * self.tp_size + tp_rank

    def tp_group(self) -> tuple[int, ...]:
        """Ranks sharing this rank's stage and EP rank (they split tensors by TP)."""
        return tuple(self.rank_of(self.pp_rank, self.ep_rank, t) for t in range(self.tp_size))

    def stage_group(self) -> tuple[int, ...]:
        """All ranks of this rank's pipeline stage."""
        start = self.pp_rank * self.stage_size
        return tuple(range(start, start + self.stage_size))

    def replica_group(self) -> tuple[int, ...]:
        """Ranks of the stage with the same TP rank (they hold the same non-expert slices)."""
        return tuple(self.rank_of(self.pp_rank, e, self.tp_rank) for e in range(self.ep_size))

    def describe(self) -> str:
        return f"rank {self.rank} (pp {self.pp_rank}/{self.pp_size}, ep {self.ep_rank}/" \
               f"{self.ep_size}, tp {self.tp_rank}/{self.tp_size})"
