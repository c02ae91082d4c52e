"""Pool sizing: from a byte budget (or device memory x fraction - the stage's weight bytes) to
pages / tokens and request slots for one stage's own layers; pipeline-wide limits (minimum
over stages); the per-rank pool summary of ``pploader plan``. Pure; no allocation.

Windowed layers (sliding / chunked attention, ``LayerCache.window``) get their own page space
per window size: ``min(num_pages, requests x ceil(min(window, max_context) / page_size))``
pages, where ``num_pages`` is the full-length layers' page count (it bounds every request's
pages, so a window pool is never larger than a full-length one)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

from ..errors import PlanError
from .geometry import CacheDtypes, StageCacheGeometry, layer_cache_bytes, stage_geometry
from ..planning.partition import StageWindow

if TYPE_CHECKING:  # pragma: no cover
    from ..planning.checkpoint import CheckpointIndex
    from ..planning.plan import RankPlan
    from ..planning.spec import ModelSpec

__all__ = ["PoolCapacity", "PoolOptions", "size_pools", "size_for_target", "budget_from_memory",
           "pipeline_capacity", "stage_capacity", "rank_pools", "cache_costs",
           "stage_balance", "plan_pools", "format_pools", "DEFAULT_PAGE_SIZE",
           "DEFAULT_MAMBA_RATIO", "DEFAULT_TOKENS", "DEFAULT_REQUESTS"]

DEFAULT_PAGE_SIZE = 16
DEFAULT_MAMBA_RATIO = 0.5
DEFAULT_TOKENS = 4096
DEFAULT_REQUESTS = 16


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
    #: ``(window, pages)`` of each windowed page space (``num_pages`` is the full-length one's)
    window_pages: tuple[tuple[int, int], ...] = ()
    #: KV bytes per token of the windowed layers (part of ``kv_bytes_per_token``)
    window_kv_bytes_per_token: int = 0
    #: pool bytes per layer kind (``full_attention``, ``sliding_attention``, ``mamba2``...)
    kind_bytes: tuple[tuple[str, int], ...] = ()
    #: what the KV pool would take with every layer full-length at ``num_pages`` (the rule
    #: before window-sized pools): ``full_length_kv_bytes - kv_pool_bytes`` is the saving
    full_length_kv_bytes: int = 0
    max_context: Optional[int] = None

    @property
    def max_tokens(self) -> Optional[int]:
        if not self.kv_bytes_per_token or (
                self.num_pages == 0 and self.window_kv_bytes_per_token == self.kv_bytes_per_token
                and self.window_pages):  # windowed layers only: sized per request, no token cap
            return None
        return self.num_pages * self.page_size

    @property
    def pool_bytes(self) -> int:
        return self.kv_pool_bytes + self.state_pool_bytes

    def pages_of(self, window: Optional[int]) -> int:
        """Pages of the page space of layers with ``window`` (None: full-length)."""
        if window is None:
            return self.num_pages
        found = dict(self.window_pages).get(window)
        if found is None:
            raise PlanError(f"no page space for window {window}: windows "
                            f"{[w for w, _ in self.window_pages]}")
        return found

    def to_json(self) -> dict:
        out = {"budget_bytes": self.budget_bytes, "page_size": self.page_size,
               "num_pages": self.num_pages, "max_tokens": self.max_tokens,
               "max_requests": self.max_requests, "kv_pool_bytes": self.kv_pool_bytes,
               "state_pool_bytes": self.state_pool_bytes, "pool_bytes": self.pool_bytes,
               "kind_bytes": dict(self.kind_bytes)}
        if self.window_pages:
            out.update(window_pages={str(w): p for w, p in self.window_pages},
                       full_length_kv_bytes=self.full_length_kv_bytes,
                       window_saved_bytes=self.full_length_kv_bytes - self.kv_pool_bytes,
                       max_context=self.max_context)
        return out


def _capacity(geom: StageCacheGeometry, budget: int, page_size: int, num_pages: int,
              requests: Optional[int], window_pages: tuple[tuple[int, int], ...] = (),
              max_context: Optional[int] = None) -> PoolCapacity:
    kv, st = geom.kv_bytes_per_token, geom.state_bytes_per_request
    pages = dict(window_pages)
    kinds: dict[str, int] = {}
    kv_pool = 0
    for c in geom.layers:
        layer_kv = (num_pages if c.window is None else pages[c.window]) * page_size \
            * c.kv_bytes_per_token
        kv_pool += layer_kv
        kinds[c.kind] = kinds.get(c.kind, 0) + layer_kv \
            + (requests or 0) * c.state_bytes_per_request
    return PoolCapacity(budget, page_size, num_pages,
                        requests if st or window_pages else None,
                        kv_pool, (requests or 0) * st if st else 0, kv, st, window_pages,
                        kv - geom.full_kv_bytes_per_token,
                        tuple((k, b) for k, b in kinds.items() if b or k in _KV_KINDS),
                        num_pages * page_size * kv if num_pages else kv_pool, max_context)


#: kinds listed in ``kind_bytes`` even at 0 bytes (a stage of attention layers shows its KV)
_KV_KINDS = ("full_attention", "sliding_attention", "mla", "hybrid_attention_mamba2",
             "cca_attention")


def _per_request_pages(geom: StageCacheGeometry, page_size: int,
                       max_context: Optional[int]) -> tuple[tuple[int, int, int], ...]:
    """``(window, pages per request, KV bytes per token)`` of each window size: a request
    keeps ``min(window, max_context)`` tokens, rounded up to pages."""
    if max_context is not None and max_context < 1:
        raise PlanError(f"max context must be >= 1 token, got {max_context}")
    return tuple((w, -(-min(w, max_context or w) // page_size), b) for w, b in geom.windows)


def _window_pages(groups: tuple[tuple[int, int, int], ...], num_pages: Optional[int],
                  requests: int) -> tuple[tuple[int, int], ...]:
    """Pages of each window space for ``requests`` requests, capped by ``num_pages`` (the
    full-length space bounds every request's pages; None = no full-length space)."""
    return tuple((w, requests * per if num_pages is None else min(num_pages, requests * per))
                 for w, per, _ in groups)


def _max_full_pages(full: int, groups: tuple[tuple[int, int, int], ...], requests: int,
                    page_size: int, budget: int) -> int:
    """The most full-length pages ``n`` with ``n x page_size x full`` plus the window spaces
    (``min(n, requests x per)`` pages each) within ``budget`` (the cost grows with ``n``)."""
    def cost(n: int) -> int:
        return page_size * (n * full + sum(min(n, requests * per) * b for _, per, b in groups))
    lo, hi = 0, budget // (page_size * full)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if cost(mid) <= budget else (lo, mid - 1)
    return lo


def size_pools(geom: StageCacheGeometry, budget_bytes: int, *,
               mamba_ratio: float = DEFAULT_MAMBA_RATIO,
               page_size: int = DEFAULT_PAGE_SIZE, requests: Optional[int] = None,
               max_context: Optional[int] = None) -> PoolCapacity:
    """Pages and request slots that fit ``budget_bytes`` for this stage's own layers.

    A stage with only state layers gives the whole budget to request slots, one with only
    attention layers gives it all to KV pages; a mixed stage gives ``mamba_ratio`` of it to
    the state pool and the rest to pages. Windowed layers hold ``requests`` requests (default
    16), or the state pool's; a stage whose KV is all windowed sizes everything per request
    (the whole budget over state + window pages of one request).
    """
    if budget_bytes < 0:
        raise PlanError(f"stage {geom.window.pp_rank}: negative cache budget {budget_bytes} B "
                        "(the weights alone exceed the memory given)")
    if not 0.0 <= mamba_ratio <= 1.0:
        raise PlanError(f"mamba ratio must be within [0, 1], got {mamba_ratio}")
    if page_size < 1:
        raise PlanError(f"page size must be >= 1, got {page_size}")
    kv, st = geom.kv_bytes_per_token, geom.state_bytes_per_request
    groups = _per_request_pages(geom, page_size, max_context)
    if not groups:  # no windowed layer: every KV layer shares the full-length pages
        state_budget = budget_bytes if not kv else int(budget_bytes * mamba_ratio) if st else 0
        slots = state_budget // st if st else None
        num_pages = (budget_bytes - state_budget) // (kv * page_size) if kv else 0
        return _capacity(geom, budget_bytes, page_size, num_pages, slots)
    full = geom.full_kv_bytes_per_token
    if not full:
        slots = budget_bytes // (st + page_size * sum(per * b for _, per, b in groups))
        return _capacity(geom, budget_bytes, page_size, 0, slots,
                         _window_pages(groups, None, slots), max_context)
    state_budget = int(budget_bytes * mamba_ratio) if st else 0
    slots = state_budget // st if st else DEFAULT_REQUESTS if requests is None else requests
    num_pages = _max_full_pages(full, groups, slots, page_size, budget_bytes - state_budget)
    return _capacity(geom, budget_bytes, page_size, num_pages, slots,
                     _window_pages(groups, num_pages, slots), max_context)


def size_for_target(geom: StageCacheGeometry, tokens: int, requests: int, *,
                    page_size: int = DEFAULT_PAGE_SIZE,
                    max_context: Optional[int] = None) -> PoolCapacity:
    """Pools holding exactly ``tokens`` tokens (rounded up to pages) and ``requests`` slots;
    windowed layers ``min(pages of tokens, requests x pages of min(window, max_context))``."""
    if tokens < 0 or requests < 0:
        raise PlanError(f"negative target: {tokens} tokens, {requests} requests")
    num_pages = -(-tokens // page_size) if geom.kv_bytes_per_token else 0
    windows = _window_pages(_per_request_pages(geom, page_size, max_context), num_pages,
                            requests)
    cap = _capacity(geom, 0, page_size, num_pages, requests, windows,
                    max_context if windows else None)
    return dataclasses.replace(cap, budget_bytes=cap.pool_bytes)


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


@dataclass(frozen=True)
class PoolOptions:
    """How to size a stage's pools. First match wins: ``budget_bytes`` (per rank), else
    ``device_bytes * memory_fraction - the rank's weight bytes``, else exactly ``tokens`` and
    ``requests`` (defaults 4096 and 16). ``tokens``/``requests`` are also the target load a
    cache-aware ``balanced`` partition weighs (:func:`cache_costs`)."""

    tokens: Optional[int] = None
    requests: Optional[int] = None
    budget_bytes: Optional[int] = None
    device_bytes: Optional[int] = None
    memory_fraction: float = 0.9
    mamba_ratio: float = DEFAULT_MAMBA_RATIO
    page_size: int = DEFAULT_PAGE_SIZE
    dtypes: CacheDtypes = CacheDtypes()
    #: tokens one request may reach (bounds windowed layers' pages: ``min(window, this)``)
    max_context: Optional[int] = None

    def __post_init__(self) -> None:
        """The CLI's ranges (arguments.py): an ArgumentError naming the field."""
        from ..arguments import check
        check(tokens=self.tokens, requests=self.requests, budget_bytes=self.budget_bytes,
              device_bytes=self.device_bytes, memory_fraction=self.memory_fraction,
              mamba_ratio=self.mamba_ratio, page_size=self.page_size,
              max_context=self.max_context)


def stage_capacity(geom: StageCacheGeometry, opts: PoolOptions, weight_bytes: int) -> PoolCapacity:
    """Capacity of one rank's pools under ``opts`` (``weight_bytes``: the rank's plan bytes)."""
    if opts.budget_bytes is not None or opts.device_bytes is not None:
        budget = opts.budget_bytes if opts.budget_bytes is not None else budget_from_memory(
            opts.device_bytes, opts.memory_fraction, weight_bytes)  # type: ignore[arg-type]
        return size_pools(geom, budget, mamba_ratio=opts.mamba_ratio, page_size=opts.page_size,
                          requests=opts.requests, max_context=opts.max_context)
    return size_for_target(geom, DEFAULT_TOKENS if opts.tokens is None else opts.tokens,
                           DEFAULT_REQUESTS if opts.requests is None else opts.requests,
                           page_size=opts.page_size, max_context=opts.max_context)


def rank_pools(spec: "ModelSpec", plan: "RankPlan", opts: PoolOptions
               ) -> tuple[StageCacheGeometry, PoolCapacity]:
    """Geometry and capacity of the rank planned by ``plan`` (pure; no allocation)."""
    geom = stage_geometry(spec, plan.window, plan.topology.tp_size, opts.dtypes)
    return geom, stage_capacity(geom, opts, plan.ideal_bytes)


def cache_costs(spec: "ModelSpec", tp_size: int, opts: PoolOptions) -> Optional[list[int]]:
    """Per-layer cache bytes at the target load for ``plan.make_windows(cache_bytes=...)``;
    None when no target (``tokens`` / ``requests``) was given."""
    if opts.tokens is None and opts.requests is None:
        return None
    return layer_cache_bytes(spec, opts.tokens or 0, opts.requests or 0, tp_size, opts.dtypes)


def stage_balance(spec: "ModelSpec", index: "CheckpointIndex", windows: Sequence[StageWindow],
                  tp_size: int, opts: PoolOptions) -> dict:
    """Bytes per stage (weights from the headers + cache at the target load, whole TP group)
    for ``windows`` and for the even split, with ``max / mean`` of each (lower = better
    balanced). Reads every header."""
    from ..planning.partition import even_windows, stage_costs
    from ..planning.plan import layer_bytes
    tokens = DEFAULT_TOKENS if opts.tokens is None else opts.tokens
    requests = DEFAULT_REQUESTS if opts.requests is None else opts.requests
    per_layer, first, last = layer_bytes(spec, index)
    cache = layer_cache_bytes(spec, tokens, requests, tp_size, opts.dtypes)
    costs = [w + c for w, c in zip(per_layer, cache)]
    out: dict[str, Any] = {"target_tokens": tokens, "target_requests": requests}
    for key, ws in (("chosen", windows), ("even", even_windows(spec.num_layers, len(windows)))):
        stage = stage_costs(ws, costs, first_extra=first, last_extra=last)
        out[key] = {"layers": [w.num_layers for w in ws], "stage_bytes": [int(x) for x in stage],
                    "max_over_mean": round(max(stage) / (sum(stage) / len(stage)), 4)}
    return out


def plan_pools(spec: "ModelSpec", index: "CheckpointIndex", plans: Sequence["RankPlan"],
               opts: PoolOptions, *, balance: bool = True) -> tuple[list[dict], dict]:
    """Per-rank ``pools`` objects (geometry + capacity) for ``pploader plan`` and the
    pipeline-wide summary (limits; the stage balance unless ``balance`` is False: it reads
    every stage's headers). Pure; reads headers only."""
    rows = []
    for plan in plans:
        geom, cap = rank_pools(spec, plan, opts)
        rows.append({**geom.to_json(), "capacity": cap.to_json()})
    stages = [r for r, p in zip(rows, plans) if p.topology.tp_rank == 0 and
              p.topology.ep_rank == 0]
    windows = [p.window for p in plans if p.topology.tp_rank == 0 and p.topology.ep_rank == 0]
    tp = plans[0].topology.tp_size if plans else 1
    out = {**pipeline_capacity([r["capacity"] for r in rows]),
           "stage_pool_bytes": [r["capacity"]["pool_bytes"] for r in stages]}
    if balance:
        out["balance"] = stage_balance(spec, index, windows, tp, opts)
    return rows, out


def format_pools(entries: Sequence[dict]) -> str:
    """A readable per-rank pool table from ``{"rank", "pp_rank", "tp_rank", "pools"}`` rows
    (``pools`` = :meth:`StageCacheGeometry.to_json` plus ``capacity``)."""
    from ..report import format_bytes
    head = ["rank", "pp/tp", "layers", "attn layers", "state layers", "KV B/token",
            "state B/req", "pages", "max tokens", "max reqs", "pool bytes"]
    rows = []
    for e in entries:
        p, c = e["pools"], e["pools"]["capacity"]
        rows.append([str(e["rank"]), f"{e['pp_rank']}/{e['tp_rank']}",
                     f"{p['start_layer']}-{p['end_layer'] - 1}", _ids(p["attention_layers"]),
                     _ids(p["state_layers"]), str(p["kv_bytes_per_token"]),
                     str(p["state_bytes_per_request"]), str(c["num_pages"]),
                     _dash(c["max_tokens"]), _dash(c["max_requests"]),
                     format_bytes(c["pool_bytes"])])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    line = "  ".join(h.rjust(w) for h, w in zip(head, widths))
    lim = pipeline_capacity([e["pools"]["capacity"] for e in entries])
    shapes = sorted({f"{layer['kind']}: " + ", ".join(
        f"{n} {v['shape']} {v['dtype']}" for n, v in layer["states"].items())
        for e in entries for layer in e["pools"]["layers"] if layer["states"]})
    return "\n".join([line, "-" * len(line)]
                     + ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
                     + [f"pipeline: max tokens {_dash(lim['max_tokens'])}, max requests "
                        f"{_dash(lim['max_requests'])} (minimum over stages; '-' = no limit)"]
                     + [f"state per request ({s})" for s in shapes] + _window_lines(entries))


def _window_lines(entries: Sequence[dict]) -> list[str]:
    """Per stage (its first TP / EP rank) with windowed layers: pool bytes by layer kind and
    the window pools' saving."""
    from ..report import format_bytes
    out = []
    for e in entries:
        c = e["pools"]["capacity"]
        if not c.get("window_pages") or e.get("tp_rank", 0) or e.get("ep_rank", 0):
            continue
        kinds = ", ".join(f"{k} {format_bytes(b)}" for k, b in c.get("kind_bytes", {}).items())
        spaces = ", ".join(f"window {w}: {p} pages" for w, p in c["window_pages"].items())
        out.append(f"rank {e['rank']} pool by kind: {kinds}; {spaces} (full-length "
                   f"{c['num_pages']}); window-sized pools save "
                   f"{format_bytes(c['window_saved_bytes'])}")
    return out


def _dash(value: Optional[int]) -> str:
    return "-" if value is None else str(value)


def _ids(layers: Sequence[int]) -> str:
    """Compact layer-id list: 0-3,6,9-10."""
    if not layers:
        return "-"
    out, start, prev = [], layers[0], layers[0]
    for x in list(layers[1:]) + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ",".join(out)
