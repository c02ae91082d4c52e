"""Cache geometry per layer kind: what one decoder layer keeps per token (KV) and per request
(Mamba / linear-attention state) on one TP rank. Pure arithmetic on the ModelSpec.

Layouts (what :class:`pploader.cache.pools.CachePools` allocates, per layer):

- ``full_attention`` (GQA): K and V pages, each ``[num_pages, page_size, kv_heads_local, head_dim]``;
  ``kv_heads_local = kv_heads / tp``, or 1 when ``kv_heads < tp`` (heads replicated).
- ``mla``: one latent page tensor ``[num_pages, page_size, 1, kv_lora_rank + qk_rope_head_dim]``,
  the same on every TP rank (the latent is not split by TP).
- ``mamba2``: conv ``[conv_dim_local, K-1]`` with ``conv_dim = d_inner + 2 * n_groups * d_state``
  and ssm ``[heads_local, head_dim, d_state]``; groups are replicated when ``n_groups < tp``
  (Zamba's multi-head Mamba: ``n_groups = 0``, conv over d_inner only).
- ``mamba1`` (Jamba): conv ``[d_inner_local, K-1]``, ssm ``[d_inner_local, d_state]``.
- ``gdn`` (gated delta net): conv ``[conv_dim_local, K-1]`` with
  ``conv_dim = 2 * Hk * dk + Hv * dv`` and temporal ``[Hv_local, dv, dk]``.
- ``short_conv`` (LFM2): conv ``[channels_local, L_cache-1]`` (the depthwise conv's channels,
  hidden, split by TP).
- ``lightning_attention`` (MiniMax's decayed linear attention): temporal ``[heads_local,
  head_dim, head_dim]``.
- ``rg_lru`` (RecurrentGemma's recurrent block): conv ``[width_local, K-1]`` and recurrent
  ``[width_local]`` (``lru_width`` split by TP).
- ``rwkv`` (RWKV v4): shift ``[2, hidden]`` (model dtype: the previous token of the time and
  channel mixing) and wkv ``[3, attention_hidden]`` (numerator, denominator, max); tp=1 only.
- ``hybrid_attention_mamba2`` (Falcon-H1, Zamba): both the GQA pages and the mamba2 state.
- ``cca_attention`` (ZAYA1, as SGLang sizes it): the GQA pages, conv
  ``[(q_heads + k_heads) * head_dim / tp, padding]`` (``padding = cca_time0 + cca_time1 - 2``)
  and prev_hidden ``[hidden, 1]`` (the delayed value's input, whole on every rank).
- ``sliding_attention``: GQA pages holding at most ``window`` tokens per sequence (sliding-window
  or chunked attention); a GQA layer the family gives a window (``CacheDims.windows``: Mistral,
  Qwen2 with ``use_sliding_window``...) is one too. Without a window it is pooled full-length.

State tensors get a leading request-slot dim in the pool: ``[max_requests, *shape]``.
Default dtypes: KV and conv in the model dtype, ssm / temporal in float32 (or the dtype the
config asks for, e.g. ``mamba_ssm_cache_dtype``); every one can be overridden with
:class:`CacheDtypes`.

The sizes of each mixer (heads, groups, state, kernel...) come from the model's family
(``Family.cache_dims``, pploader/families/cache_dims.py): this module reads no config key.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping, Optional, Union

from ..errors import ConfigError, PlanError
from ..families.heads import UnitSplitError, unit_share
from ..planning.dtype_table import NAME_ITEMSIZE, itemsize_of
from ..planning.dtype_table import dtype_name as _name
from ..planning.partition import StageWindow

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from ..planning.spec import ModelSpec

__all__ = ["KIND_CACHES", "CacheDtypes", "KVLayout", "StateTensor", "LayerCache",
           "layer_cache", "model_cache", "local_units", "parse_dtype", "dtype_name",
           "StageCacheGeometry", "stage_geometry", "layer_cache_bytes", "WINDOWED_KINDS"]

#: Which caches each layer kind (families.base.LAYER_KINDS) carries, in order. ``mlp`` blocks
#: (NemotronH's MLP / MoE layers) have no sequence mixer, hence no cache. A kind missing here
#: is an error, never a guess.
KIND_CACHES: Mapping[str, tuple[str, ...]] = {
    "full_attention": ("gqa",), "mla": ("mla",), "mamba1": ("mamba1",), "mamba2": ("mamba2",),
    "gdn": ("gdn",), "hybrid_attention_mamba2": ("gqa", "mamba2"), "mlp": (),
    "sliding_attention": ("gqa",),  # window-sized pages (LayerCache.window)
    "short_conv": ("short_conv",),  # LFM2's gated short convolution: its last L-1 inputs
    "lightning_attention": ("lightning",),  # MiniMax: [heads, head_dim, head_dim] per request
    "rg_lru": ("rg_lru",),  # RecurrentGemma's recurrent block: conv + one value per channel
    "rwkv": ("rwkv",),  # RWKV v4: token shifts [2, hidden] + WKV state [3, attention_hidden]
    "cca_attention": ("gqa", "cca"),  # ZAYA1: K / V pages + the q / k conv and previous hidden
}


def parse_dtype(value: "Union[str, torch.dtype]") -> str:
    """``torch.bfloat16`` / ``"bfloat16"`` / ``"torch.float32"`` -> ``"bfloat16"`` ...: the
    torch dtype name the geometry keeps (no torch import for the table's dtypes; a name
    outside it is checked against torch)."""
    name = _name(value)
    if name not in NAME_ITEMSIZE:
        try:
            itemsize_of(name)
        except ValueError:
            raise ConfigError(f"unknown cache dtype {value!r}: use a torch dtype name such as "
                              "bfloat16, float16, float32 or float8_e4m3fn") from None
    return name


def dtype_name(dtype: "Union[str, torch.dtype]") -> str:
    """``torch.bfloat16`` or ``"bfloat16"`` -> ``"bfloat16"``."""
    return _name(dtype)


@dataclass(frozen=True)
class CacheDtypes:
    """Caller's dtype choices; None = default (model dtype; float32 for ssm/temporal).

    Each is a torch dtype or its name, kept as the name (planning never imports torch)."""

    kv: "Union[str, torch.dtype, None]" = None
    conv: "Union[str, torch.dtype, None]" = None
    ssm: "Union[str, torch.dtype, None]" = None

    def __post_init__(self) -> None:
        for field in ("kv", "conv", "ssm"):
            value = getattr(self, field)
            if value is not None:
                object.__setattr__(self, field, parse_dtype(value))

    @classmethod
    def of(cls, *, kv: Optional[str] = None, conv: Optional[str] = None,
           ssm: Optional[str] = None) -> "CacheDtypes":
        """From dtype names (``"bfloat16"``; None = default), as the CLI's options give them."""
        return cls(*(parse_dtype(n) if n else None for n in (kv, conv, ssm)))

    def resolve(self, spec: "ModelSpec") -> tuple[str, str, str]:
        """(kv, conv, ssm) dtype names for ``spec``."""
        ssm = self.ssm
        if ssm is None:
            ssm = parse_dtype(spec.family.cache_dims.ssm_dtype(spec) or "float32")
        return (_name(self.kv or spec.dtype_name), _name(self.conv or spec.dtype_name),
                _name(ssm))


@dataclass(frozen=True)
class KVLayout:
    """Per-token cache of one layer on one rank: ``parts`` tensors of ``[heads, head_dim]``."""

    parts: tuple[str, ...]          # ("k", "v") for GQA, ("latent",) for MLA
    heads: int
    head_dim: int
    dtype: str                      # torch dtype name

    @property
    def bytes_per_token(self) -> int:
        return len(self.parts) * self.heads * self.head_dim * itemsize_of(self.dtype)

    def page_shape(self, num_pages: int, page_size: int) -> tuple[int, int, int, int]:
        """Shape of each part's paged tensor: ``[num_pages, page_size, heads, head_dim]``."""
        return (num_pages, page_size, self.heads, self.head_dim)

    def to_json(self) -> dict:
        return {"parts": list(self.parts), "heads": self.heads, "head_dim": self.head_dim,
                "dtype": dtype_name(self.dtype), "bytes_per_token": self.bytes_per_token}


@dataclass(frozen=True)
class StateTensor:
    """One per-request state tensor of a layer (``conv``, ``ssm`` or ``temporal``)."""

    name: str
    shape: tuple[int, ...]
    dtype: str                      # torch dtype name

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize_of(self.dtype)

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "dtype": dtype_name(self.dtype), "bytes": self.nbytes}


@dataclass(frozen=True)
class LayerCache:
    """The cache one decoder layer needs on one TP rank. ``window``: the tokens of KV it keeps
    per sequence (sliding / chunked attention), None = the whole context."""

    layer: int
    kind: str
    kv: Optional[KVLayout]
    states: tuple[StateTensor, ...]
    window: Optional[int] = None

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv.bytes_per_token if self.kv else 0

    @property
    def state_bytes_per_request(self) -> int:
        return sum(s.nbytes for s in self.states)

    def bytes_at(self, tokens: int, requests: int) -> int:
        """Cache bytes of this layer holding ``tokens`` tokens and ``requests`` requests (a
        windowed layer: at most ``window`` tokens of each request)."""
        held = tokens if self.window is None else min(tokens, requests * self.window)
        return self.kv_bytes_per_token * held + self.state_bytes_per_request * requests

    def to_json(self) -> dict:
        out = {"layer": self.layer, "kind": self.kind,
               "kv": self.kv.to_json() if self.kv else None,
               "states": {s.name: s.to_json() for s in self.states}}
        if self.window is not None:
            out["window"] = self.window
        return out


def local_units(units: int, tp: int, what: str) -> int:
    """Units (heads, groups) one TP rank holds: the weights' rule (families/heads.py
    ``unit_share``): ``units / tp``, or 1 when ``units < tp`` (replicated)."""
    try:
        return unit_share(units, tp)[1]
    except UnitSplitError as exc:
        verb = "split" if exc.reason == "do not divide" else "replicated"
        raise PlanError(f"{units} {what} cannot be {verb} evenly over tp={tp}") from None


def _split(size: int, tp: int, what: str) -> int:
    if size % tp:
        raise PlanError(f"{what} = {size} is not divisible by tp={tp}")
    return size // tp


Dtypes = tuple[str, str, str]


def _gqa(spec: "ModelSpec", tp: int, dt: Dtypes) -> KVLayout:
    d = spec.family.cache_dims.of_gqa(spec)
    return KVLayout(("k", "v"), local_units(d.kv_heads, tp, "kv heads"), d.head_dim, dt[0])


def _mla(spec: "ModelSpec", tp: int, dt: Dtypes) -> KVLayout:
    d = spec.family.cache_dims.of_mla(spec)
    return KVLayout(("latent",), 1, d.kv_lora_rank + d.rope_head_dim, dt[0])


def _mamba2(spec: "ModelSpec", tp: int, dt: Dtypes) -> tuple[StateTensor, ...]:
    d = spec.family.cache_dims.of_mamba2(spec)
    heads_local = _split(d.n_heads, tp, "mamba heads")
    groups = local_units(d.n_groups, tp, "mamba n_groups") if d.n_groups else 0  # 0: Zamba
    conv_dim = heads_local * d.head_dim + 2 * groups * d.d_state
    return (StateTensor("conv", (conv_dim, d.conv_kernel - 1), dt[1]),
            StateTensor("ssm", (heads_local, d.head_dim, d.d_state), dt[2]))


def _mamba1(spec: "ModelSpec", tp: int, dt: Dtypes) -> tuple[StateTensor, ...]:
    d = spec.family.cache_dims.of_mamba1(spec)
    d_inner = _split(d.d_inner, tp, "mamba d_inner")
    return (StateTensor("conv", (d_inner, d.conv_kernel - 1), dt[1]),
            StateTensor("ssm", (d_inner, d.d_state), dt[2]))


def _gdn(spec: "ModelSpec", tp: int, dt: Dtypes) -> tuple[StateTensor, ...]:
    d = spec.family.cache_dims.of_gdn(spec)
    hk = local_units(d.num_k_heads, tp, "linear key heads")
    hv = local_units(d.num_v_heads, tp, "linear value heads")
    return (StateTensor("conv", (2 * hk * d.k_head_dim + hv * d.v_head_dim,
                                 d.conv_kernel - 1), dt[1]),
            StateTensor("temporal", (hv, d.v_head_dim, d.k_head_dim), dt[2]))


def _short_conv(spec: "ModelSpec", tp: int, dt: Dtypes) -> tuple[StateTensor, ...]:
    d = spec.family.cache_dims.of_short_conv(spec)
    return (StateTensor("conv", (_split(d.channels, tp, "short conv channels"),
                                 d.kernel - 1), dt[1]),)


def _lightning(spec: "ModelSpec", tp: int, dt: Dtypes) -> tuple[StateTensor, ...]:
    d = spec.family.cache_dims.of_lightning(spec)
    return (StateTensor("temporal", (_split(d.heads, tp, "lightning attention heads"),
                                     d.head_dim, d.head_dim), dt[2]),)


def _rg_lru(spec: "ModelSpec", tp: int, dt: Dtypes) -> tuple[StateTensor, ...]:
    d = spec.family.cache_dims.of_rg_lru(spec)
    width = _split(d.width, tp, "rg_lru width")
    return (StateTensor("conv", (width, d.kernel - 1), dt[1]),
            StateTensor("recurrent", (width,), dt[2]))


def _rwkv(spec: "ModelSpec", tp: int, dt: Dtypes) -> tuple[StateTensor, ...]:
    d = spec.family.cache_dims.of_rwkv(spec)
    if tp > 1:  # no engine shards RWKV; the weights' rules refuse TP too
        raise PlanError(f"rwkv cache geometry at tp={tp}: no engine defines a TP split of "
                        "RWKV's state; use tp=1")
    return (StateTensor("shift", (2, d.hidden), dt[1]),
            StateTensor("wkv", (3, d.attention_hidden), dt[2]))


def _cca(spec: "ModelSpec", tp: int, dt: Dtypes) -> tuple[StateTensor, ...]:
    d = spec.family.cache_dims.of_cca(spec)
    q = _split(d.q_heads, tp, "CCA query heads")
    k = _split(d.k_heads, tp, "CCA key heads")
    return (StateTensor("conv", ((q + k) * d.head_dim, d.padding), dt[1]),
            StateTensor("prev_hidden", (d.hidden, 1), dt[1]))


_KV_BUILDERS: Mapping[str, Callable[["ModelSpec", int, Dtypes], KVLayout]] = {
    "gqa": _gqa, "mla": _mla}
_STATE_BUILDERS: Mapping[str, Callable[["ModelSpec", int, Dtypes], tuple[StateTensor, ...]]] = {
    "mamba2": _mamba2, "mamba1": _mamba1, "gdn": _gdn, "short_conv": _short_conv,
    "lightning": _lightning, "rg_lru": _rg_lru, "rwkv": _rwkv, "cca": _cca}


#: layer kinds whose KV a window can bound (GQA attention); a window on another kind is an error
WINDOWED_KINDS = ("full_attention", "sliding_attention")


def layer_cache(spec: "ModelSpec", layer: int, tp_size: int = 1,
                dtypes: CacheDtypes = CacheDtypes(),
                windows: Optional[tuple[Optional[int], ...]] = None) -> LayerCache:
    """The cache of decoder layer ``layer`` on one of ``tp_size`` TP ranks (``windows``: the
    family's ``CacheDims.windows_of(spec)``, read here when not given)."""
    if not 0 <= layer < spec.num_layers:
        raise PlanError(f"layer {layer} outside the model's {spec.num_layers} layers")
    if windows is None:
        windows = spec.family.cache_dims.windows_of(spec)
    kind, window = spec.layer_kinds[layer], windows[layer]
    if window is not None:
        if kind not in WINDOWED_KINDS:
            raise ConfigError(f"layer {layer} ({kind}) has an attention window of {window} "
                              f"tokens: only {' / '.join(WINDOWED_KINDS)} layers can have one")
        kind = "sliding_attention"  # a windowed GQA layer, whatever the layout called it
    if kind not in KIND_CACHES:
        raise ConfigError(f"layer {layer} has kind {kind!r} with no cache geometry; known kinds: "
                          + ", ".join(KIND_CACHES)
                          + " (add it to pploader.cache.geometry.KIND_CACHES)")
    dt = dtypes.resolve(spec)
    kv, states = None, tuple[StateTensor, ...]()
    for part in KIND_CACHES[kind]:
        if part in _KV_BUILDERS:
            kv = _KV_BUILDERS[part](spec, tp_size, dt)
        else:
            states += _STATE_BUILDERS[part](spec, tp_size, dt)
    return LayerCache(layer, kind, kv, states, window)


def model_cache(spec: "ModelSpec", tp_size: int = 1,
                dtypes: CacheDtypes = CacheDtypes()) -> tuple[LayerCache, ...]:
    """The cache of every decoder layer (MTP layers excluded) on one TP rank."""
    windows = spec.family.cache_dims.windows_of(spec)
    return tuple(layer_cache(spec, i, tp_size, dtypes, windows) for i in range(spec.num_layers))


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
        """KV bytes per token over every attention layer (windowed ones too)."""
        return sum(c.kv_bytes_per_token for c in self.layers)

    @property
    def full_kv_bytes_per_token(self) -> int:
        """KV bytes per token of the layers that keep the whole context."""
        return sum(c.kv_bytes_per_token for c in self.layers if c.window is None)

    @property
    def windows(self) -> tuple[tuple[int, int], ...]:
        """``(window, KV bytes per token)`` of each window size among the stage's layers,
        smallest window first (layers of one window share one page space)."""
        out: dict[int, int] = {}
        for c in self.layers:
            if c.window is not None and c.kv is not None:
                out[c.window] = out.get(c.window, 0) + c.kv_bytes_per_token
        return tuple(sorted(out.items()))

    @property
    def state_bytes_per_request(self) -> int:
        return sum(c.state_bytes_per_request for c in self.layers)

    def to_json(self) -> dict:
        out = {"start_layer": self.start_layer, "end_layer": self.end_layer,
               "tp_size": self.tp_size, "attention_layers": list(self.attention_layers),
               "state_layers": list(self.state_layers),
               "kv_bytes_per_token": self.kv_bytes_per_token,
               "state_bytes_per_request": self.state_bytes_per_request,
               "layers": [c.to_json() for c in self.layers if c.kv is not None or c.states]}
        if self.windows:  # (only then: a model without windowed layers reports as before)
            out["full_kv_bytes_per_token"] = self.full_kv_bytes_per_token
            out["window_kv_bytes_per_token"] = {str(w): b for w, b in self.windows}
        return out


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
