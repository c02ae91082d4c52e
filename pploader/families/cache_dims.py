"""What the cache geometry needs from a family: the sizes of each sequence mixer, from config.json.

``pploader.cache.geometry`` turns sizes into cache shapes (KV pages, conv / ssm / temporal
state) without knowing a config key; each family says where its sizes come from through a
:class:`CacheDims` (``Family.cache_dims``). Hand-written families pass the same readers their
templates and shard rules use (``bamba_mamba2_dims``, ``mamba1_dims``, ``gdn_dims``...), so a
mixer's weights and its cache can never disagree. Any other family (the generic one, a toy
family in a test) gets :data:`CONFIG_CACHE_DIMS`, which reads the key aliases of the
transformers 5.24 config classes listed in :data:`CONFIG_KEYS`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, TypeVar

from ..errors import ConfigError
from .spec_view import SpecView
from .blocks import GdnDims, Mamba1Dims, Mamba2Dims
from .windows import Windows, spec_layout_windows

__all__ = ["MlaDims", "GqaDims", "CcaDims", "ShortConvDims", "LightningDims", "RgLruDims", "RwkvDims", "CacheDims", "CONFIG_KEYS",
           "CONFIG_CACHE_DIMS", "mla_dims", "config_mamba2_dims", "ssm_cache_dtype",
           "param_cache_dims", "KEY_PROJECTIONS"]

T = TypeVar("T")


@dataclass(frozen=True)
class MlaDims:
    """Multi-head latent attention's cached latent: compressed kv + the rope key."""

    kv_lora_rank: int
    rope_head_dim: int


@dataclass(frozen=True)
class GqaDims:
    """What one attention layer keeps per token: K and V of ``kv_heads`` x ``head_dim``."""

    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class LightningDims:
    """Lightning (decayed linear) attention's state: one ``[head_dim, head_dim]`` KV sum per
    head (MiniMax)."""

    heads: int
    head_dim: int


@dataclass(frozen=True)
class RgLruDims:
    """RecurrentGemma's recurrent block: a depthwise conv of ``kernel`` over ``width`` channels,
    then a diagonal linear recurrence with one state value per channel."""

    width: int
    kernel: int


@dataclass(frozen=True)
class RwkvDims:
    """RWKV (v4): the previous token of the time and channel mixing (``hidden`` each) and the
    WKV numerator, denominator and running max (``attention_hidden`` each, float32)."""

    hidden: int
    attention_hidden: int


@dataclass(frozen=True)
class CcaDims:
    """ZAYA1's CCA state (SGLang's ``mamba2_cache_params``): the conv over the q / k latents
    (``(q_heads + k_heads) * head_dim`` channels, split by heads over TP) keeps ``padding``
    inputs; the delayed value keeps the previous token's ``hidden`` state (whole on every rank)."""

    q_heads: int
    k_heads: int
    head_dim: int
    hidden: int
    padding: int


@dataclass(frozen=True)
class ShortConvDims:
    """A short (LFM2-style) convolution's state: the last ``kernel - 1`` inputs of its
    ``channels`` depthwise channels."""

    channels: int
    kernel: int


def mla_dims(spec: SpecView) -> MlaDims:
    return MlaDims(spec.int("kv_lora_rank"), spec.int("qk_rope_head_dim"))


#: Config keys of each cache quantity; the first key present wins. Checked against the
#: transformers 5.24 config classes (and the mixers' own attributes, see tests/cache/test_pools.py):
#: NemotronHConfig (mamba_num_heads, mamba_head_dim, ssm_state_size, n_groups, conv_kernel),
#: BambaConfig / GraniteMoeHybridConfig (mamba_n_heads, mamba_d_head, mamba_d_state,
#: mamba_n_groups, mamba_d_conv, mamba_expand), FalconH1Config (the same + mamba_d_ssm),
#: JambaConfig (mamba_d_state, mamba_d_conv, mamba_expand), Qwen3Next / Qwen3_5(Moe)TextConfig
#: (linear_*), DeepseekV3Config (kv_lora_rank, qk_rope_head_dim).
CONFIG_KEYS: Mapping[str, tuple[str, ...]] = {
    "mamba2.num_heads": ("mamba_num_heads", "mamba_n_heads"),
    "mamba2.head_dim": ("mamba_head_dim", "mamba_d_head"),     # may be "auto"
    "mamba2.d_state": ("ssm_state_size", "mamba_d_state"),
    "mamba2.n_groups": ("n_groups", "mamba_n_groups"),
    "mamba2.conv_kernel": ("conv_kernel", "mamba_d_conv"),
    "mamba2.d_inner": ("mamba_d_ssm",),                       # falcon_h1; else expand * hidden
    "mamba2.expand": ("mamba_expand", "expand"),
    "mamba1.d_state": ("mamba_d_state",),
    "mamba1.conv_kernel": ("mamba_d_conv",),
    "mamba1.expand": ("mamba_expand",),
    "gdn.num_key_heads": ("linear_num_key_heads",),
    "gdn.key_head_dim": ("linear_key_head_dim",),
    "gdn.num_value_heads": ("linear_num_value_heads",),
    "gdn.value_head_dim": ("linear_value_head_dim",),
    "gdn.conv_kernel": ("linear_conv_kernel_dim",),
    "mla.kv_lora_rank": ("kv_lora_rank",),
    "mla.rope_head_dim": ("qk_rope_head_dim",),
    "ssm_cache_dtype": ("mamba_ssm_cache_dtype",),
}


def _opt(config: Mapping, quantity: str) -> object:
    for key in CONFIG_KEYS[quantity]:
        if config.get(key) is not None:
            return config[key]
    return None


def _int(config: Mapping, quantity: str) -> int:
    value = _opt(config, quantity)
    if value is None:
        kind = quantity.split(".")[0]
        raise ConfigError(f"{kind} cache geometry needs {quantity}: config.json lacks "
                          + " / ".join(CONFIG_KEYS[quantity]), file="config.json")
    return int(value)  # type: ignore[call-overload]


def config_mamba2_dims(spec: SpecView) -> Mamba2Dims:
    c = spec.config
    heads = _int(c, "mamba2.num_heads")
    head_dim_raw = _opt(c, "mamba2.head_dim")
    if head_dim_raw is None or head_dim_raw == "auto":
        d_inner = _opt(c, "mamba2.d_inner")
        if d_inner is None:
            d_inner = _int(c, "mamba2.expand") * spec.hidden_size
        head_dim = int(d_inner) // heads  # type: ignore[call-overload]
    else:
        head_dim = int(head_dim_raw)  # type: ignore[call-overload]
    d_state = _int(c, "mamba2.d_state")
    groups = _int(c, "mamba2.n_groups")
    return Mamba2Dims(heads * head_dim, heads, head_dim, groups, d_state,
                      _int(c, "mamba2.conv_kernel"))


def _config_mamba1_dims(spec: SpecView) -> Mamba1Dims:
    c = spec.config
    return Mamba1Dims(_int(c, "mamba1.expand") * spec.hidden_size, _int(c, "mamba1.d_state"),
                      0, _int(c, "mamba1.conv_kernel"))


def _config_gdn_dims(spec: SpecView) -> GdnDims:
    c = spec.config
    return GdnDims(_int(c, "gdn.num_key_heads"), _int(c, "gdn.num_value_heads"),
                   _int(c, "gdn.key_head_dim"), _int(c, "gdn.value_head_dim"),
                   _int(c, "gdn.conv_kernel"))


def _config_mla_dims(spec: SpecView) -> MlaDims:
    return MlaDims(_int(spec.config, "mla.kv_lora_rank"), _int(spec.config, "mla.rope_head_dim"))


def ssm_cache_dtype(spec: SpecView) -> Optional[str]:
    """The ssm / temporal state dtype the config asks for (None: the default, float32)."""
    value = _opt(spec.config, "ssm_cache_dtype")
    return None if value is None else str(value)


@dataclass(frozen=True)
class CacheDims:
    """Where one family's mixer sizes come from (None: the family has no such mixer).
    ``pploader.cache.geometry`` calls these; it never reads a config key itself."""

    mla: Optional[Callable[[SpecView], MlaDims]] = None
    mamba1: Optional[Callable[[SpecView], Mamba1Dims]] = None
    mamba2: Optional[Callable[[SpecView], Mamba2Dims]] = None
    gdn: Optional[Callable[[SpecView], GdnDims]] = None
    #: K / V heads and head dim (None: the spec's ``num_kv_heads`` and ``head_dim``)
    gqa: Optional[Callable[[SpecView], GqaDims]] = None
    short_conv: Optional[Callable[[SpecView], ShortConvDims]] = None
    lightning: Optional[Callable[[SpecView], LightningDims]] = None
    rg_lru: Optional[Callable[[SpecView], RgLruDims]] = None
    rwkv: Optional[Callable[[SpecView], RwkvDims]] = None
    cca: Optional[Callable[[SpecView], CcaDims]] = None
    ssm_dtype: Callable[[SpecView], Optional[str]] = ssm_cache_dtype
    #: tokens of KV each layer keeps per sequence (sliding / chunked attention; None = the
    #: whole context); None here = no layer of the family is windowed (families/windows.py)
    windows: Optional[Callable[[SpecView], Windows]] = None

    def windows_of(self, spec: SpecView) -> Windows:
        """One window per decoder layer (None = full length)."""
        if self.windows is None:
            return (None,) * spec.num_layers
        out = tuple(self.windows(spec))
        if len(out) != spec.num_layers:
            raise ConfigError(f"{spec.architecture}: {len(out)} attention windows for "
                              f"{spec.num_layers} layers", file="config.json")
        return out

    def of_mla(self, spec: SpecView) -> MlaDims:
        return _read(self.mla, "mla", spec)

    def of_mamba1(self, spec: SpecView) -> Mamba1Dims:
        return _read(self.mamba1, "mamba1", spec)

    def of_mamba2(self, spec: SpecView) -> Mamba2Dims:
        return _read(self.mamba2, "mamba2", spec)

    def of_gdn(self, spec: SpecView) -> GdnDims:
        return _read(self.gdn, "gdn", spec)

    def of_gqa(self, spec: SpecView) -> GqaDims:
        if self.gqa is None:
            return GqaDims(spec.num_kv_heads, spec.head_dim)
        return self.gqa(spec)

    def of_short_conv(self, spec: SpecView) -> ShortConvDims:
        return _read(self.short_conv, "short_conv", spec)

    def of_lightning(self, spec: SpecView) -> LightningDims:
        return _read(self.lightning, "lightning", spec)

    def of_rg_lru(self, spec: SpecView) -> RgLruDims:
        return _read(self.rg_lru, "rg_lru", spec)

    def of_rwkv(self, spec: SpecView) -> RwkvDims:
        return _read(self.rwkv, "rwkv", spec)

    def of_cca(self, spec: SpecView) -> CcaDims:
        return _read(self.cca, "cca", spec)


def _read(reader: Optional[Callable[[SpecView], T]], mixer: str, spec: SpecView) -> T:
    if reader is None:
        raise ConfigError(f"{spec.architecture}: its family declares no {mixer} sizes for the "
                          f"cache geometry (Family.cache_dims.{mixer})", file="config.json")
    return reader(spec)


#: The default: every mixer's sizes by the known config-key aliases (CONFIG_KEYS).
CONFIG_CACHE_DIMS = CacheDims(mla=_config_mla_dims, mamba1=_config_mamba1_dims,
                              mamba2=config_mamba2_dims, gdn=_config_gdn_dims,
                              windows=spec_layout_windows)


# ---- sizes from a layer's own parameter shapes (the generic family) ---------------------------

#: config names of the Mamba2 group count (the only size the parameter shapes leave open:
#: they give groups x d_state)
_GROUP_KEYS = ("n_groups", "mamba_n_groups", "mamba_ngroups", "mamba_num_groups", "ngroups")


def _mixer(params: Mapping[str, tuple[int, ...]], what: str
           ) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """(prefix, A_log shape, conv1d weight shape) of the one SSM mixer in ``params``."""
    found = [(n[:-len("A_log")], s) for n, s in params.items() if n.endswith("A_log")]
    if len(found) != 1:
        raise ConfigError(f"{what} cache geometry from the layer's parameters: {len(found)} "
                          "A_log parameters, expected one", file="config.json")
    prefix, a_log = found[0]
    conv = params.get(prefix + "conv1d.weight")
    if conv is None or len(conv) != 3:
        raise ConfigError(f"{what} cache geometry from the layer's parameters: no "
                          f"{prefix}conv1d.weight [channels, 1, kernel]", file="config.json")
    return prefix, a_log, conv


def param_mamba1_dims(params: Mapping[str, tuple[int, ...]]) -> Callable[[SpecView], Mamba1Dims]:
    """Mamba1 sizes read off a layer's parameters: ``A_log`` [d_inner, d_state],
    ``conv1d.weight`` [d_inner, 1, kernel] (Mamba, FalconMamba: their configs name them
    ``intermediate_size`` / ``state_size`` / ``conv_kernel``)."""
    def read(spec: SpecView) -> Mamba1Dims:
        _, a_log, conv = _mixer(params, "mamba1")
        if len(a_log) != 2 or conv[0] != a_log[0]:
            raise ConfigError(f"mamba1 cache geometry: A_log {list(a_log)} and conv1d "
                              f"{list(conv)} do not give [d_inner, d_state]", file="config.json")
        return Mamba1Dims(a_log[0], a_log[1], 0, conv[2])
    return read


def param_mamba2_dims(params: Mapping[str, tuple[int, ...]]) -> Callable[[SpecView], Mamba2Dims]:
    """Mamba2 sizes read off a layer's parameters: heads from ``A_log`` [heads], d_inner from
    ``out_proj.weight`` [hidden, d_inner] (else ``norm.weight`` [d_inner]), the conv channels
    d_inner + 2 x groups x d_state and the kernel from ``conv1d.weight``; the group count from
    the config (``_GROUP_KEYS``), the one size the shapes leave open. Zamba's multi-head
    Mamba (``A_log`` [heads, head_dim, d_state], conv over d_inner only) has no groups."""
    def read(spec: SpecView) -> Mamba2Dims:
        prefix, a_log, conv = _mixer(params, "mamba2")
        if len(a_log) == 3:  # Zamba: ssm state [heads, head_dim, d_state], conv [d_inner, K]
            heads, head_dim, d_state = a_log
            if conv[0] != heads * head_dim:
                raise ConfigError(f"mamba2 cache geometry: conv1d channels {conv[0]} != heads "
                                  f"{heads} x head dim {head_dim} of A_log {list(a_log)}",
                                  file="config.json")
            return Mamba2Dims(conv[0], heads, head_dim, 0, d_state, conv[2])
        out, norm = params.get(prefix + "out_proj.weight"), params.get(prefix + "norm.weight")
        d_inner = out[1] if out is not None and len(out) == 2 else \
            norm[0] if norm is not None and len(norm) == 1 else None
        if len(a_log) != 1 or d_inner is None or d_inner % a_log[0]:
            raise ConfigError(f"mamba2 cache geometry from the layer's parameters: A_log "
                              f"{list(a_log)}, out_proj {out}, norm {norm} do not give heads "
                              "and d_inner", file="config.json")
        groups = next((spec.config[k] for k in _GROUP_KEYS
                       if isinstance(spec.config.get(k), int)), None)
        both = conv[0] - d_inner
        if not isinstance(groups, int) or groups <= 0 or both <= 0 or both % (2 * groups):
            raise ConfigError(f"mamba2 cache geometry: conv channels {conv[0]} - d_inner "
                              f"{d_inner} must be 2 x groups x d_state, groups from config.json "
                              f"({' / '.join(_GROUP_KEYS)}: {groups})", file="config.json")
        heads = a_log[0]
        return Mamba2Dims(d_inner, heads, d_inner // heads, groups, both // (2 * groups),
                          conv[2])
    return read


#: Key projections of attention layers, by name suffix -> how many parts its rows pack (K
#: alone, or K and V): BERT-style ``attention.self.key``, CTRL ``Wk``, CPM-Ant ``project_k``,
#: Moshi ``k_proj.linear``, JetMoE ``kv_proj`` (K and V stacked), the usual ``k_proj``.
KEY_PROJECTIONS: tuple[tuple[str, int], ...] = (
    (".self.key.weight", 1), (".Wk.weight", 1), (".project_k.weight", 1),
    (".k_proj.linear.weight", 1), ("self_attention.kv_proj.weight", 2), ("k_proj.weight", 1))

#: config names of the KV head count, then of the attention head count (MHA: one K/V head each)
_KV_HEAD_KEYS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")
_HEAD_KEYS = ("num_attention_heads", "n_head", "n_heads", "num_heads")


def key_projection(params: Mapping[str, tuple[int, ...]]) -> Optional[tuple[str, int]]:
    """(name, K/V parts) of the one key projection among a layer's parameters, or None."""
    for suffix, parts in KEY_PROJECTIONS:
        found = [n for n in params if n.endswith(suffix) and "cross" not in n]
        if len(found) == 1:
            return found[0], parts
    return None


def param_gqa_dims(params: Mapping[str, tuple[int, ...]]) -> Callable[[SpecView], GqaDims]:
    """K / V geometry of an attention layer from its key projection's rows (kv_heads x
    head_dim per packed part) and the config's KV head count (else its attention head
    count): for layouts whose head dim is not hidden / heads (CPM-Ant's ``dim_head``, JetMoE's
    ``kv_channels``, Zamba's ``attention_head_dim`` over a doubled width)."""
    def read(spec: SpecView) -> GqaDims:
        found = key_projection(params)
        c = spec.config
        heads = next((int(c[k]) for k in _KV_HEAD_KEYS + _HEAD_KEYS  # type: ignore[call-overload]
                      if isinstance(c.get(k), int)), 0)
        if found is None or heads <= 0:
            raise ConfigError("attention cache geometry from the layer's parameters: no key "
                              f"projection ({' / '.join(s for s, _ in KEY_PROJECTIONS)}) or no "
                              f"head count ({' / '.join(_KV_HEAD_KEYS + _HEAD_KEYS)})",
                              file="config.json")
        name, parts = found
        rows = params[name][0]
        if len(params[name]) != 2 or rows % (parts * heads):
            raise ConfigError(f"attention cache geometry: {name} {list(params[name])} does not "
                              f"hold {parts} x {heads} KV heads", file="config.json")
        return GqaDims(heads, rows // (parts * heads))
    return read


def param_short_conv_dims(params: Mapping[str, tuple[int, ...]]
                          ) -> Callable[[SpecView], ShortConvDims]:
    """A short convolution's state from its depthwise ``conv.weight`` [channels, 1, L_cache]
    (LFM2's ``conv.conv.weight``; the config's ``conv_L_cache`` must agree)."""
    def read(spec: SpecView) -> ShortConvDims:
        found = [s for n, s in params.items() if n.endswith("conv.conv.weight")]
        if len(found) != 1 or len(found[0]) != 3 or found[0][1] != 1:
            raise ConfigError("short convolution cache geometry: expected one depthwise "
                              f"conv.conv.weight [channels, 1, L], got {found}",
                              file="config.json")
        channels, _, kernel = found[0]
        declared = spec.config.get("conv_L_cache")
        if declared is not None and declared != kernel:
            raise ConfigError(f"short convolution: conv_L_cache {declared} != the kernel "
                              f"{kernel} of conv.conv.weight", file="config.json")
        return ShortConvDims(channels, kernel)
    return read


def param_gdn_dims(params: Mapping[str, tuple[int, ...]]) -> Callable[[SpecView], GdnDims]:
    """Gated delta rule sizes: by the config's ``linear_*`` keys where it has them (OLMo-hybrid),
    else off the mixer's parameters when its K and V heads are the same ones (Kimi / Bailing
    delta attention: ``A_log`` holds one entry per head, q / k / v rows = heads x head dim, and
    the conv runs over q, k and v)."""
    def read(spec: SpecView) -> GdnDims:
        if _opt(spec.config, "gdn.num_key_heads") is not None:
            return _config_gdn_dims(spec)
        a_log = [(n[:-len("A_log")], s) for n, s in params.items() if n.endswith("A_log")]
        heads = math.prod(a_log[0][1]) if len(a_log) == 1 else 0
        prefix = a_log[0][0].removesuffix("forget_gate.") if a_log else ""
        rows = [params.get(prefix + f"{x}_proj.weight", (0,))[0] for x in "qkv"]
        conv = params.get(prefix + "conv1d.weight", ())
        if not heads or len(set(rows)) != 1 or rows[0] % heads or len(conv) != 3 \
                or conv[0] != sum(rows):
            raise ConfigError("gdn cache geometry: config.json lacks linear_num_key_heads and the "
                              f"mixer's parameters (A_log {[s for _, s in a_log]}, q/k/v rows "
                              f"{rows}, conv1d {list(conv)}) do not give equal K / V heads",
                              file="config.json")
        return GdnDims(heads, heads, rows[0] // heads, rows[0] // heads, conv[2])
    return read


def param_lightning_dims(params: Mapping[str, tuple[int, ...]]
                         ) -> Callable[[SpecView], LightningDims]:
    """Lightning attention's heads from its per-head decay ``slope_rate`` [heads, 1, 1] and the
    head dim from ``qkv_proj`` [3 x heads x head_dim, hidden]."""
    def read(spec: SpecView) -> LightningDims:
        slope = [s for n, s in params.items() if n.endswith("slope_rate")]
        qkv = [s for n, s in params.items() if n.endswith("qkv_proj.weight")]
        heads = slope[0][0] if len(slope) == 1 and slope[0] else 0
        if not heads or len(qkv) != 1 or qkv[0][0] % (3 * heads):
            raise ConfigError(f"lightning attention cache geometry: slope_rate {slope} and "
                              f"qkv_proj {qkv} do not give heads x head dim", file="config.json")
        return LightningDims(heads, qkv[0][0] // (3 * heads))
    return read


def param_rg_lru_dims(params: Mapping[str, tuple[int, ...]]) -> Callable[[SpecView], RgLruDims]:
    """The recurrent block's width from ``rg_lru.recurrent_param`` [width] and its conv kernel
    from ``conv_1d.weight`` [width, 1, kernel] (RecurrentGemma's ``lru_width`` /
    ``conv1d_width``)."""
    def read(spec: SpecView) -> RgLruDims:
        param = [s for n, s in params.items() if n.endswith("rg_lru.recurrent_param")]
        conv = [s for n, s in params.items() if n.endswith("conv_1d.weight")]
        if len(param) != 1 or len(conv) != 1 or len(conv[0]) != 3 or len(param[0]) != 1 \
                or conv[0][0] != param[0][0]:
            raise ConfigError(f"rg_lru cache geometry: recurrent_param {param} and conv_1d "
                              f"{conv} do not give [width] and [width, 1, kernel]",
                              file="config.json")
        return RgLruDims(param[0][0], conv[0][2])
    return read


def param_rwkv_dims(params: Mapping[str, tuple[int, ...]]) -> Callable[[SpecView], RwkvDims]:
    """RWKV's widths: ``attention.time_decay`` [attention_hidden] and ``attention.output``
    [hidden, attention_hidden]."""
    def read(spec: SpecView) -> RwkvDims:
        decay, out = params.get("attention.time_decay"), params.get("attention.output.weight")
        if decay is None or out is None or len(decay) != 1 or len(out) != 2 \
                or out[1] != decay[0]:
            raise ConfigError(f"rwkv cache geometry: attention.time_decay {decay} and "
                              f"attention.output {out} do not give [att] and [hidden, att]",
                              file="config.json")
        return RwkvDims(out[0], decay[0])
    return read


def param_cache_dims(kinds: tuple[str, ...],
                     layer_params: tuple[Mapping[str, tuple[int, ...]], ...],
                     gqa_from_params: bool = False) -> CacheDims:
    """CacheDims for a model whose layers' parameters are known (the generic family): SSM
    mixers and short convolutions sized from their own shapes (first layer of the kind), MLA /
    gated delta net sizes by the config-key aliases as ``CONFIG_CACHE_DIMS``; K / V from the
    first attention layer's key projection when ``gqa_from_params`` (layouts whose heads the
    spec's ``num_kv_heads`` / ``head_dim`` do not describe), else from the spec."""
    first = {k: layer_params[i] for i, k in reversed(list(enumerate(kinds)))}
    mamba2 = first.get("mamba2", first.get("hybrid_attention_mamba2"))
    attention = next((first[k] for k in ("full_attention", "sliding_attention",
                                         "hybrid_attention_mamba2") if k in first), None)
    return CacheDims(
        mla=_config_mla_dims,
        gdn=param_gdn_dims(first["gdn"]) if "gdn" in first else _config_gdn_dims,
        lightning=param_lightning_dims(first["lightning_attention"])
        if "lightning_attention" in first else None,
        rg_lru=param_rg_lru_dims(first["rg_lru"]) if "rg_lru" in first else None,
        rwkv=param_rwkv_dims(first["rwkv"]) if "rwkv" in first else None,
        mamba1=param_mamba1_dims(first["mamba1"]) if "mamba1" in first else None,
        mamba2=param_mamba2_dims(mamba2) if mamba2 is not None else None,
        gqa=param_gqa_dims(attention) if gqa_from_params and attention is not None else None,
        short_conv=param_short_conv_dims(first["short_conv"]) if "short_conv" in first
        else None)
