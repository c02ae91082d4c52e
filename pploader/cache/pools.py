"""Hybrid KV + Mamba cache pools for one pipeline stage, sized by the stage's own layers.

Three steps, each usable alone (all names are importable from here):

1. :func:`stage_geometry` (cache/geometry.py, pure): which of the stage's layers need KV pages
   (``attention_layers``) and which need per-request state (``state_layers``), and the
   bytes per token / per request summed over *this stage's* layers only.
2. :func:`size_pools` / :func:`size_for_target` (cache/sizing.py, pure): from a byte budget for the
   stage (:func:`budget_from_memory`: device memory x fraction - the stage's weight bytes), how
   many pages / tokens and request slots this stage holds. ``mamba_ratio`` is the share of the
   budget given to the state pool when the stage has both kinds of layers.
   :func:`pipeline_capacity` takes the minimum across stages.
3. :class:`CachePools` (here, per rank): allocates the tensors on the caller's device, maps a
   global layer id to its pool and local index, and hands out pages and request slots.

docs/pools.md shows the layouts and worked numbers.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

import torch

from ..errors import PlanError, PPLoaderError
from ..planning.dtype_table import torch_dtype
from .geometry import (CacheDtypes, LayerCache, StageCacheGeometry, dtype_name,
                       layer_cache_bytes, stage_geometry)
from .sizing import (DEFAULT_MAMBA_RATIO, DEFAULT_PAGE_SIZE, PoolCapacity, PoolOptions,
                     budget_from_memory, cache_costs, format_pools,
                     pipeline_capacity, plan_pools, rank_pools, size_for_target, size_pools,
                     stage_balance, stage_capacity)

if TYPE_CHECKING:  # pragma: no cover
    from ..planning.partition import StageWindow
    from ..planning.plan import RankPlan
    from ..planning.spec import ModelSpec

__all__ = ["PoolError", "SlotAllocator", "PageAllocator", "CachePools", "build_rank_pools",
           "pool_device", "device_memory",
           # re-exported from cache/geometry.py / cache/sizing.py: one import surface for pools
           "CacheDtypes", "StageCacheGeometry", "stage_geometry", "layer_cache_bytes",
           "PoolCapacity", "PoolOptions", "size_pools", "size_for_target", "budget_from_memory",
           "pipeline_capacity", "stage_capacity", "rank_pools", "cache_costs",
           "stage_balance", "plan_pools", "format_pools", "DEFAULT_PAGE_SIZE",
           "DEFAULT_MAMBA_RATIO"]


class PoolError(PPLoaderError):
    """A pool request cannot be served: layer not owned, pool exhausted, double free."""


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
    only; global layer ids outside ``[start_layer, end_layer)`` are refused by name. Layers
    with an attention window (sliding / chunked) get their own, window-sized page space per
    window size (``window_pages``); the full-length layers share ``pages``.
    """

    def __init__(self, geometry: StageCacheGeometry, capacity: PoolCapacity, *,
                 device: Union[str, torch.device] = "cpu") -> None:
        self.geometry, self.capacity, self.device = geometry, capacity, torch.device(device)
        self.kv: dict[int, tuple[torch.Tensor, ...]] = {}
        self.states: dict[int, dict[str, torch.Tensor]] = {}
        for c in geometry.layers:
            if c.kv is not None:
                shape = c.kv.page_shape(capacity.pages_of(c.window), capacity.page_size)
                self.kv[c.layer] = tuple(torch.empty(shape, dtype=torch_dtype(c.kv.dtype),
                                                     device=self.device)
                                         for _ in c.kv.parts)
            if c.states:
                n = capacity.max_requests or 0
                self.states[c.layer] = {s.name: torch.zeros((n, *s.shape),
                                                            dtype=torch_dtype(s.dtype),
                                                            device=self.device)
                                        for s in c.states}
        self._kv_index = {layer: i for i, layer in enumerate(geometry.attention_layers)}
        self._state_index = {layer: i for i, layer in enumerate(geometry.state_layers)}
        self.pages = PageAllocator(capacity.num_pages, capacity.page_size)
        #: window -> the allocator of that window's page space (its layers share it)
        self.window_pages = {w: PageAllocator(n, capacity.page_size)
                             for w, n in capacity.window_pages}
        self.slots = SlotAllocator(capacity.max_requests or 0)

    @property
    def start_layer(self) -> int:
        return self.geometry.start_layer

    @property
    def end_layer(self) -> int:
        return self.geometry.end_layer

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return self.geometry.attention_layers

    @property
    def state_layers(self) -> tuple[int, ...]:
        return self.geometry.state_layers

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

    def page_allocator(self, layer: int) -> PageAllocator:
        """The allocator of the pages ``layer``'s KV tensors are indexed by: ``pages`` for
        full-length layers, ``window_pages[window]`` for windowed ones."""
        c = self._check(layer)
        if c.kv is None:
            raise PoolError(f"layer {layer} ({c.kind}) has no KV cache ({self._where()})")
        return self.pages if c.window is None else self.window_pages[c.window]

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

    def allocated_bytes_by_kind(self) -> dict[str, int]:
        """Measured bytes (``tensor.nbytes``) of the pools per layer kind."""
        out: dict[str, int] = {}
        for c in self.geometry.layers:
            n = sum(t.nbytes for t in self.kv.get(c.layer, ())) + \
                sum(t.nbytes for t in self.states.get(c.layer, {}).values())
            if n or c.kv is not None:
                out[c.kind] = out.get(c.kind, 0) + n
        return out

    def report(self) -> dict[str, Any]:
        """Geometry, capacity and measured allocation (JSON-able; goes into the load report)."""
        return {**self.geometry.to_json(), "capacity": self.capacity.to_json(),
                "device": str(self.device),
                "kv_allocated_bytes": self.kv_allocated_bytes,
                "state_allocated_bytes": self.state_allocated_bytes,
                "allocated_bytes_by_kind": self.allocated_bytes_by_kind(),
                "dtypes": sorted({dtype_name(t.dtype) for ts in self.kv.values() for t in ts}
                                 | {dtype_name(t.dtype) for ts in self.states.values()
                                    for t in ts.values()})}


def build_rank_pools(spec: "ModelSpec", plan: Optional["RankPlan"] = None,
                     opts: Optional[PoolOptions] = None, *,
                     device: Union[str, torch.device] = "cpu", mesh: Any = None,
                     window: Optional[StageWindow] = None,
                     weight_bytes: Optional[int] = None) -> CachePools:
    """Allocate the pools of this rank's stage on ``device`` (after its weights).

    The stage: the rank planned by ``plan``; or, without a plan, a ``DeviceMesh`` (``mesh``,
    dims named pp / tp [/ ep]: its TP size and pipeline rank) and the stage's ``window``
    (``pipeline_window(stage, layers)``; default: pploader's even split), as
    ``planning.mesh.resolve_stage`` reads them. With a plan, a ``mesh`` / ``window``
    given too must be the plan's (TopologyError otherwise). ``weight_bytes``: the rank's
    weight bytes when the budget is ``device_bytes`` and there is no plan."""
    from ..planning.mesh import check_stage, resolve_stage
    opts = opts if opts is not None else PoolOptions()
    if plan is not None:
        if mesh is not None or window is not None:
            check_stage(plan.topology, plan.window, mesh=mesh, stage_window=window)
        geom, cap = rank_pools(spec, plan, opts)
        return CachePools(geom, cap, device=device)
    topo, win = resolve_stage(spec.num_layers, mesh=mesh, window=window)
    if opts.budget_bytes is None and opts.device_bytes is not None and weight_bytes is None:
        raise PlanError("pools sized from device_bytes need the rank's weight bytes: pass "
                        "weight_bytes= (e.g. the local shards' bytes of the stage's state "
                        "dict) or a plan, or give budget_bytes", rank=topo.rank)
    geom = stage_geometry(spec, win, topo.tp_size, opts.dtypes)
    return CachePools(geom, stage_capacity(geom, opts, weight_bytes or 0), device=device)


def pool_device(name: Optional[str] = None, *, local_rank: int = 0) -> torch.device:
    """``name``, else ``cuda:<local_rank>`` when this process has a GPU, else cpu (``cuda``
    without an index also means this rank's local GPU). ``local_rank``: this rank's index on
    its node, from the caller (the CLI takes it from the launcher; library code reads no
    environment). A device this process does not have is a PlanError naming it."""
    try:
        dev = torch.device(name) if name else None
    except (RuntimeError, ValueError):
        raise PlanError(f"unknown device {name!r}: use cpu, cuda or cuda:N") from None
    if dev is not None and dev.type not in ("cpu", "cuda"):
        raise PlanError(f"device {name!r} is not supported: use cpu, cuda or cuda:N")
    if dev is not None and dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise PlanError(f"device {name!r} asked for but this process sees no GPU "
                            "(torch.cuda.is_available() is False): use --device cpu")
        if dev.index is not None and dev.index >= count:
            raise PlanError(f"device {name!r} asked for but this process sees {count} GPU(s): "
                            f"use cuda:0..cuda:{count - 1}, or cuda for this rank's own GPU")
    if dev is not None and not (dev.type == "cuda" and dev.index is None):
        return dev
    if dev is not None or torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def device_memory(device: Optional[Union[str, torch.device]]) -> int:
    """Total memory of a CUDA ``device`` (for ``--device-memory auto``)."""
    dev = torch.device(device) if device is not None else None
    if dev is None or dev.type != "cuda":
        raise PlanError(f"--device-memory auto needs pools on a GPU (pool device: {dev}); "
                        "give the bytes instead, e.g. --device-memory 80G")
    return int(torch.cuda.get_device_properties(dev).total_memory)
