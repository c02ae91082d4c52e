"""Hybrid KV + Mamba cache pools for one pipeline stage, sized by the stage's own layers.

Three steps, each usable alone:

1. :func:`stage_geometry` (pure, any process): which of the stage's layers need KV pages
   (``attention_layers``) and which need per-request state (``state_layers``), and the
   bytes per token / per request summed over *this stage's* layers only.
2. :func:`size_pools` / :func:`size_for_target` (pure): from a byte budget for the stage
   (:func:`budget_from_memory`: device memory x fraction - the stage's weight bytes), how many
   pages / tokens and request slots this stage can hold. ``mamba_ratio`` is the share of the
   budget given to the state pool when the stage has both kinds of layers.
   :func:`pipeline_capacity` takes the minimum across stages.
3. :class:`CachePools` (per rank): allocates the tensors on the caller's device, maps a global
   layer id to its pool and local index, and hands out pages and request slots.

docs/pools.md shows the layouts and worked numbers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

import torch

from .errors import PlanError, PPLoaderError
from .geometry import CacheDtypes, LayerCache, dtype_name, model_cache
from .partition import StageWindow

if TYPE_CHECKING:  # pragma: no cover
    from .comm import Comm
    from .spec import ModelSpec

__all__ = ["PoolError", "StageCacheGeometry", "PoolCapacity", "stage_geometry", "size_pools",
           "size_for_target", "budget_from_memory", "pipeline_capacity", "gather_capacity",
           "layer_cache_bytes", "SlotAllocator", "PageAllocator", "CachePools",
           "DEFAULT_PAGE_SIZE", "DEFAULT_MAMBA_RATIO"]

DEFAULT_PAGE_SIZE = 16
DEFAULT_MAMBA_RATIO = 0.5


class PoolError(PPLoaderError):
    """A pool request cannot be served: layer not owned, pool exhausted, double free."""


@dataclass(frozen=True)
class StageCacheGeometry:
    """The cache of one stage on one TP rank: its own layers only."""

    window: StageWindow
    tp_size: int
    layers: tuple[LayerCache, ...]          # the window's layers, in order

    @property
    def start_layer(self) -> int:
        return self.window.start_layer

    @property
    def end_layer(self) -> int:
        return self.window.end_layer

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Global ids of the stage's layers that keep KV pages."""
        return tuple(c.layer for c in self.layers if c.kv is not None)

    @property
    def state_layers(self) -> tuple[int, ...]:
        """Global ids of the stage's layers that keep per-request state."""
        return tuple(c.layer for c in self.layers if c.states)

    @property
    def kv_bytes_per_token(self) -> int:
        return sum(c.kv_bytes_per_token for c in self.layers)

    @property
    def state_bytes_per_request(self) -> int:
        return sum(c.state_bytes_per_request for c in self.layers)

    def to_json(self) -> dict:
        return {"start_layer": self.start_layer, "end_layer": self.end_layer,
                "tp_size": self.tp_size, "attention_layers": list(self.attention_layers),
                "state_layers": list(self.state_layers),
                "kv_bytes_per_token": self.kv_bytes_per_token,
                "state_bytes_per_request": self.state_bytes_per_request,
                "layers": [c.to_json() for c in self.layers if c.kv is not None or c.states]}


def stage_geometry(spec: "ModelSpec", window: StageWindow, tp_size: int = 1,
                   dtypes: CacheDtypes = CacheDtypes()) -> StageCacheGeometry:
    """Cache geometry of ``window``'s layers on one of ``tp_size`` TP ranks (pure)."""
    if not 0 <= window.start_layer < window.end_layer <= spec.num_layers:
        raise PlanError(f"stage {window.pp_rank} window [{window.start_layer}, "
                        f"{window.end_layer}) outside the model's {spec.num_layers} layers")
    every = model_cache(spec, tp_size, dtypes)
    return StageCacheGeometry(window, tp_size, every[window.start_layer:window.end_layer])


def layer_cache_bytes(spec: "ModelSpec", tokens: int, requests: int, tp_size: int = 1,
                      dtypes: CacheDtypes = CacheDtypes()) -> list[int]:
    """Cache bytes of each layer at a target load, over the whole TP group of a stage (the
    same unit as the layer's weight bytes): the cost ``balanced`` partitions add."""
    return [c.bytes_at(tokens, requests) * tp_size for c in model_cache(spec, tp_size, dtypes)]


@dataclass(frozen=True)
class PoolCapacity:
    """What one stage's pools hold. ``None`` = this stage sets no limit on that quantity."""

    budget_bytes: int
    page_size: int
    num_pages: int
    max_requests: Optional[int]
    kv_pool_bytes: int
    state_pool_bytes: int
    kv_bytes_per_token: int
    state_bytes_per_request: int

    @property
    def max_tokens(self) -> Optional[int]:
        return self.num_pages * self.page_size if self.kv_bytes_per_token else None

    @property
    def pool_bytes(self) -> int:
        return self.kv_pool_bytes + self.state_pool_bytes

    def to_json(self) -> dict:
        return {"budget_bytes": self.budget_bytes, "page_size": self.page_size,
                "num_pages": self.num_pages, "max_tokens": self.max_tokens,
                "max_requests": self.max_requests, "kv_pool_bytes": self.kv_pool_bytes,
                "state_pool_bytes": self.state_pool_bytes, "pool_bytes": self.pool_bytes}


def _capacity(geom: StageCacheGeometry, budget: int, page_size: int, num_pages: int,
              requests: Optional[int]) -> PoolCapacity:
    kv, st = geom.kv_bytes_per_token, geom.state_bytes_per_request
    return PoolCapacity(budget, page_size, num_pages, requests if st else None,
                        num_pages * page_size * kv, (requests or 0) * st if st else 0, kv, st)


def size_pools(geom: StageCacheGeometry, budget_bytes: int, *,
               mamba_ratio: float = DEFAULT_MAMBA_RATIO,
               page_size: int = DEFAULT_PAGE_SIZE) -> PoolCapacity:
    """Pages and request slots that fit ``budget_bytes`` for this stage's own layers.

    A stage with only state layers gives the whole budget to request slots, one with only
    attention layers gives it all to KV pages; a mixed stage gives ``mamba_ratio`` of it to
    the state pool and the rest to pages.
    """
    if budget_bytes < 0:
        raise PlanError(f"stage {geom.window.pp_rank}: negative cache budget {budget_bytes} B "
                        "(the weights alone exceed the memory given)")
    if not 0.0 <= mamba_ratio <= 1.0:
        raise PlanError(f"mamba ratio must be within [0, 1], got {mamba_ratio}")
    if page_size < 1:
        raise PlanError(f"page size must be >= 1, got {page_size}")
    kv, st = geom.kv_bytes_per_token, geom.state_bytes_per_request
    state_budget = budget_bytes if not kv else int(budget_bytes * mamba_ratio) if st else 0
    requests = state_budget // st if st else None
    num_pages = (budget_bytes - state_budget) // (kv * page_size) if kv else 0
    return _capacity(geom, budget_bytes, page_size, num_pages, requests)


def size_for_target(geom: StageCacheGeometry, tokens: int, requests: int, *,
                    page_size: int = DEFAULT_PAGE_SIZE) -> PoolCapacity:
    """Pools holding exactly ``tokens`` tokens (rounded up to pages) and ``requests`` slots."""
    if tokens < 0 or requests < 0:
        raise PlanError(f"negative target: {tokens} tokens, {requests} requests")
    num_pages = -(-tokens // page_size) if geom.kv_bytes_per_token else 0
    need = num_pages * page_size * geom.kv_bytes_per_token + \
        requests * geom.state_bytes_per_request
    return _capacity(geom, need, page_size, num_pages, requests)


def budget_from_memory(device_bytes: int, fraction: float, weight_bytes: int) -> int:
    """A stage's cache budget: ``device_bytes * fraction - weight_bytes`` (the rank's
    planned weight bytes, ``RankPlan.ideal_bytes``)."""
    if not 0.0 < fraction <= 1.0:
        raise PlanError(f"memory fraction must be within (0, 1], got {fraction}")
    budget = int(device_bytes * fraction) - weight_bytes
    if budget <= 0:
        raise PlanError(f"no memory left for cache: {device_bytes} B x {fraction} - "
                        f"{weight_bytes} B of weights = {budget} B")
    return budget


def _min(values: Sequence[Optional[int]]) -> Optional[int]:
    known = [v for v in values if v is not None]
    return min(known) if known else None


def pipeline_capacity(stages: Sequence[Union[PoolCapacity, dict]]) -> dict:
    """Pipeline-wide limits: the minimum over stages of max tokens and max requests (a stage
    without attention / state layers does not limit that quantity)."""
    caps = [s.to_json() if isinstance(s, PoolCapacity) else s for s in stages]
    return {"max_tokens": _min([c["max_tokens"] for c in caps]),
            "max_requests": _min([c["max_requests"] for c in caps]),
            "pool_bytes": sum(c["pool_bytes"] for c in caps)}


def gather_capacity(comm: "Comm", capacity: PoolCapacity) -> dict:
    """Called on all ranks: every rank's capacity, gathered (through ``Comm.agree``), reduced
    to the pipeline-wide limits. ``pool_bytes`` counts every rank, TP ranks included."""
    return pipeline_capacity(comm.agree(None, capacity.to_json()))


class SlotAllocator:
    """Free-list allocator of ``capacity`` integer slots (request slots, KV pages)."""

    def __init__(self, capacity: int, what: str = "request slot") -> None:
        self.capacity, self.what = capacity, what
        self._free = list(range(capacity - 1, -1, -1))  # pop() hands out 0, 1, 2 ...
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def alloc(self) -> int:
        return self.alloc_many(1)[0]

    def alloc_many(self, n: int) -> list[int]:
        """``n`` slots, all or none."""
        if n > len(self._free):
            raise PoolError(f"{self.what} pool exhausted: asked for {n}, {len(self._free)} of "
                            f"{self.capacity} free")
        out = [self._free.pop() for _ in range(n)]
        self._used.update(out)
        return out

    def free(self, slot: int) -> None:
        self.free_many([slot])

    def free_many(self, slots: Sequence[int]) -> None:
        bad = [s for s in slots if s not in self._used]
        if bad or len(set(slots)) != len(slots):
            state = "out of range" if any(not 0 <= s < self.capacity for s in bad) \
                else "not allocated (double free?)"
            raise PoolError(f"cannot free {self.what} {bad or list(slots)}: {state}")
        for s in slots:
            self._used.remove(s)
            self._free.append(s)


class PageAllocator(SlotAllocator):
    """KV page allocator; ``pages_for(tokens)`` pages hold ``tokens`` tokens."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        super().__init__(num_pages, "KV page")
        self.page_size = page_size

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def alloc_tokens(self, tokens: int) -> list[int]:
        return self.alloc_many(self.pages_for(tokens))


class CachePools:
    """The KV and state pools of one stage on one rank, on the caller's device.

    The KV pool covers the stage's attention layers only, the state pool its state layers
    only; global layer ids outside ``[start_layer, end_layer)`` are refused by name.
    """

    def __init__(self, geometry: StageCacheGeometry, capacity: PoolCapacity, *,
                 device: Union[str, torch.device] = "cpu") -> None:
        self.geometry, self.capacity, self.device = geometry, capacity, torch.device(device)
        self.kv: dict[int, tuple[torch.Tensor, ...]] = {}
        self.states: dict[int, dict[str, torch.Tensor]] = {}
        for c in geometry.layers:
            if c.kv is not None:
                shape = c.kv.page_shape(capacity.num_pages, capacity.page_size)
                self.kv[c.layer] = tuple(torch.empty(shape, dtype=c.kv.dtype, device=self.device)
                                         for _ in c.kv.parts)
            if c.states:
                n = capacity.max_requests or 0
                self.states[c.layer] = {s.name: torch.zeros((n, *s.shape), dtype=s.dtype,
                                                            device=self.device)
                                        for s in c.states}
        self._kv_index = {layer: i for i, layer in enumerate(geometry.attention_layers)}
        self._state_index = {layer: i for i, layer in enumerate(geometry.state_layers)}
        self.pages = PageAllocator(capacity.num_pages, capacity.page_size)
        self.slots = SlotAllocator(capacity.max_requests or 0)

    @property
    def start_layer(self) -> int:
        return self.geometry.start_layer

    @property
    def end_layer(self) -> int:
        return self.geometry.end_layer

    def _where(self) -> str:
        w = self.geometry.window
        return f"stage {w.pp_rank} owns layers [{w.start_layer}, {w.end_layer})"

    def _check(self, layer: int) -> LayerCache:
        if not self.start_layer <= layer < self.end_layer:
            raise PoolError(f"layer {layer} is not in this stage's window: {self._where()}")
        return self.geometry.layers[layer - self.start_layer]

    def locate(self, layer: int) -> dict[str, int]:
        """Global layer id -> ``{"kv": i}`` / ``{"state": j}`` (both for hybrid layers):
        the layer's index inside each pool it uses."""
        self._check(layer)
        out = {}
        if layer in self._kv_index:
            out["kv"] = self._kv_index[layer]
        if layer in self._state_index:
            out["state"] = self._state_index[layer]
        return out

    def kv_cache(self, layer: int) -> tuple[torch.Tensor, ...]:
        """The layer's paged tensors: ``(k, v)`` or ``(latent,)``."""
        c = self._check(layer)
        if layer not in self.kv:
            raise PoolError(f"layer {layer} ({c.kind}) has no KV cache; attention layers: "
                            f"{list(self.geometry.attention_layers)} ({self._where()})")
        return self.kv[layer]

    def state(self, layer: int) -> dict[str, torch.Tensor]:
        """The layer's state tensors by name, each ``[max_requests, *shape]``."""
        c = self._check(layer)
        if layer not in self.states:
            raise PoolError(f"layer {layer} ({c.kind}) has no state; state layers: "
                            f"{list(self.geometry.state_layers)} ({self._where()})")
        return self.states[layer]

    def alloc_request(self) -> int:
        """A free request slot, its state zeroed in every state layer."""
        slot = self.slots.alloc()
        for tensors in self.states.values():
            for t in tensors.values():
                t[slot].zero_()
        return slot

    def free_request(self, slot: int) -> None:
        self.slots.free(slot)

    @property
    def kv_allocated_bytes(self) -> int:
        return sum(t.nbytes for ts in self.kv.values() for t in ts)

    @property
    def state_allocated_bytes(self) -> int:
        return sum(t.nbytes for ts in self.states.values() for t in ts.values())

    def report(self) -> dict[str, Any]:
        """Geometry, capacity and measured allocation (JSON-able; goes into the load report)."""
        return {**self.geometry.to_json(), "capacity": self.capacity.to_json(),
                "device": str(self.device),
                "kv_allocated_bytes": self.kv_allocated_bytes,
                "state_allocated_bytes": self.state_allocated_bytes,
                "dtypes": sorted({dtype_name(t.dtype) for ts in self.kv.values() for t in ts}
                                 | {dtype_name(t.dtype) for ts in self.states.values()
                                    for t in ts.values()})}
