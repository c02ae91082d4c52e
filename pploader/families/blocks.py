"""Reusable layer blocks as data: expert sets, Mamba1 / Mamba2 mixers, gated delta nets.

Each block gives the tensors it adds to one layer (component -> shape, as transformers 5.x
``save_pretrained`` names them) and the TP shard rules of those components. Families compose
blocks; nothing here knows a family.

TP conventions (vLLM's): column-parallel (dim 0) for projections into a block, row-parallel
(dim 1) for projections out of it, per-head / per-group units so a split never cuts a head,
and segmented dim-0 splits for tensors that pack several parts (each part split on its own).
Experts are split by TP inside each expert (EP chooses which experts a rank holds).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional

from ..errors import ConfigError
from .spec_view import ShardRule, SpecView, cfg_opt


__all__ = ["Shapes", "expert_tensors", "expert_rules", "Mamba2Dims", "mamba2_tensors",
           "mamba2_rules", "Mamba1Dims", "mamba1_dims", "mamba1_tensors", "mamba1_rules",
           "GdnDims", "gdn_dims", "gdn_tensors", "gdn_rules", "prefixed", "assemble", "mlp_biased",
           "kinds_from_names", "num_experts_of", "int_opt"]

Shapes = dict[str, tuple[int, ...]]


def prefixed(prefix: str, tensors: Mapping[str, tuple[int, ...]]) -> Shapes:
    return {prefix + k: tuple(v) for k, v in tensors.items()}


def assemble(spec: SpecView, globals_: Shapes, layer: Callable[[int], Shapes],
             prefix: str = "model.layers.", layers: Optional[range] = None) -> Shapes:
    """A whole checkpoint template: globals + ``{prefix}{i}.{component}`` of every layer."""
    out = dict(globals_)
    for i in (layers if layers is not None else range(spec.num_layers)):
        out.update(prefixed(f"{prefix}{i}.", layer(i)))
    return out


def kinds_from_names(names: object, mapping: Mapping[str, str], key: str) -> tuple[str, ...]:
    """Layer kinds from a config list of block names (``layer_types``...), via ``mapping``."""
    if not isinstance(names, (list, tuple)) or not names:
        raise ConfigError(f"`{key}` must be a non-empty list, got {names!r}")
    unknown = sorted({str(n) for n in names} - set(mapping))
    if unknown:
        raise ConfigError(f"`{key}` has unknown block types {unknown}; known: {sorted(mapping)}")
    return tuple(mapping[n] for n in names)


def int_opt(config: Mapping, key: str, default: int) -> int:
    """An optional integer config value (``default`` when absent or null)."""
    return int(cfg_opt(config, key, default))  # type: ignore[arg-type]


def num_experts_of(config: Mapping, *keys: str) -> int:
    """Routed experts per MoE layer (0 when the config names none)."""
    for key in keys:
        if config.get(key) is not None:
            return int(config[key])  # type: ignore[arg-type]
    return 0


def mlp_biased(hidden: int, inter: int, prefix: str, *, bias: bool = False,
               names: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")) -> Shapes:
    """A (gated or, with two names, plain up/down) MLP, optionally with biases."""
    out: Shapes = {}
    for name in names[:-1]:
        out[f"{prefix}{name}.weight"] = (inter, hidden)
        if bias:
            out[f"{prefix}{name}.bias"] = (inter,)
    out[f"{prefix}{names[-1]}.weight"] = (hidden, inter)
    if bias:
        out[f"{prefix}{names[-1]}.bias"] = (hidden,)
    return out


# ---- experts ----------------------------------------------------------------------------------

def expert_tensors(prefix: str, num_experts: int, hidden: int, inter: int, *, fused: bool,
                   gated: bool = True, names: tuple[str, str, str] = ("gate_proj", "up_proj",
                                                                    "down_proj"),
                   fused_names: tuple[str, str] = ("gate_up_proj", "down_proj")) -> Shapes:
    """Routed experts: per expert (``{prefix}{e}.{name}.weight``) or fused 3-D tensors
    (``{prefix}gate_up_proj`` [E, 2I, H] = [gate; up] on dim 1, ``{prefix}down_proj`` [E, H, I]);
    ungated experts (NemotronH) have only up [E, I, H] and down."""
    if fused:
        up, down = fused_names
        return {prefix + up: (num_experts, (2 if gated else 1) * inter, hidden),
                prefix + down: (num_experts, hidden, inter)}
    g, u, d = names
    out: Shapes = {}
    for e in range(num_experts):
        if gated:
            out[f"{prefix}{e}.{g}.weight"] = (inter, hidden)
        out[f"{prefix}{e}.{u}.weight"] = (inter, hidden)
        out[f"{prefix}{e}.{d}.weight"] = (hidden, inter)
    return out


def expert_rules(prefix: str, inter: Callable[[SpecView], int], *, gated: bool = True,
                 col: str = "gate_proj|up_proj", row: str = "down_proj",
                 fused_col: str = "gate_up_proj", fused_row: str = "down_proj"
                 ) -> tuple[ShardRule, ...]:
    """TP inside each expert: per-expert col (dim 0) / row (dim 1); fused 3-D col on dim 1
    ([gate; up] segments when gated), row on dim 2. ``prefix`` is a regex."""
    segs = (lambda s: (inter(s), inter(s))) if gated else None
    return (ShardRule(prefix + rf"\d+\.({col})\.weight", 0),
            ShardRule(prefix + rf"\d+\.({row})\.weight", 1),
            ShardRule(prefix + rf"({fused_col})(\.weight)?", 1, segments=segs),
            ShardRule(prefix + rf"({fused_row})(\.weight)?", 2))


# ---- Mamba2 (Bamba, FalconH1, GraniteMoeHybrid, NemotronH) -----------------------------------

@dataclass(frozen=True)
class Mamba2Dims:
    """Sizes of one Mamba2 mixer; in_proj = [z, x, B, C, dt], conv over [x, B, C]."""

    d_inner: int
    n_heads: int
    head_dim: int
    n_groups: int
    d_state: int
    conv_kernel: int

    def __post_init__(self) -> None:
        if self.n_heads * self.head_dim != self.d_inner:
            raise ConfigError(f"mamba heads {self.n_heads} x head dim {self.head_dim} != "
                              f"intermediate size {self.d_inner}")

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.n_groups * self.d_state

    @property
    def in_proj_segments(self) -> tuple[int, ...]:
        gs = self.n_groups * self.d_state
        return (self.d_inner, self.d_inner, gs, gs, self.n_heads)

    @property
    def in_proj_units(self) -> tuple[int, ...]:
        return (self.n_heads, self.n_heads, self.n_groups, self.n_groups, self.n_heads)

    @property
    def conv_segments(self) -> tuple[int, ...]:
        gs = self.n_groups * self.d_state
        return (self.d_inner, gs, gs)

    @property
    def conv_units(self) -> tuple[int, ...]:
        return (self.n_heads, self.n_groups, self.n_groups)


def mamba2_tensors(d: Mamba2Dims, hidden: int, *, conv_bias: bool, in_bias: bool,
                   out_bias: bool, norm: bool, prefix: str = "mamba.") -> Shapes:
    out: Shapes = {"in_proj.weight": (sum(d.in_proj_segments), hidden),
                   "conv1d.weight": (d.conv_dim, 1, d.conv_kernel),
                   "A_log": (d.n_heads,), "D": (d.n_heads,), "dt_bias": (d.n_heads,),
                   "out_proj.weight": (hidden, d.d_inner)}
    if in_bias:
        out["in_proj.bias"] = (sum(d.in_proj_segments),)
    if conv_bias:
        out["conv1d.bias"] = (d.conv_dim,)
    if out_bias:
        out["out_proj.bias"] = (hidden,)
    if norm:
        out["norm.weight"] = (d.d_inner,)
    return prefixed(prefix, out)


def mamba2_rules(prefix: str, dims: Callable[[SpecView], Mamba2Dims]) -> tuple[ShardRule, ...]:
    """in_proj by heads (z, x, dt) and groups (B, C; replicated when groups < tp), conv the same
    over [x, B, C], per-head params and the gated norm by heads, out_proj row-parallel."""
    return (
        ShardRule(prefix + r"in_proj\.(weight|bias)", 0,
                  segments=lambda s: dims(s).in_proj_segments,
                  units=lambda s: dims(s).in_proj_units),
        ShardRule(prefix + r"conv1d\.(weight|bias)", 0, segments=lambda s: dims(s).conv_segments,
                  units=lambda s: dims(s).conv_units),
        ShardRule(prefix + r"(A_log|D|dt_bias)", 0),
        ShardRule(prefix + r"norm\.weight", 0, units=lambda s: dims(s).n_heads),
        ShardRule(prefix + r"out_proj\.weight", 1, units=lambda s: dims(s).n_heads))


# ---- Mamba1 (Jamba) ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Mamba1Dims:
    d_inner: int
    d_state: int
    dt_rank: int
    conv_kernel: int


def mamba1_dims(spec: SpecView) -> Mamba1Dims:
    hidden = spec.hidden_size
    rank = spec.config.get("mamba_dt_rank", "auto")
    dt_rank = -(-hidden // 16) if rank in (None, "auto") else int(rank)  # type: ignore[call-overload]
    return Mamba1Dims(int_opt(spec.config, "mamba_expand", 2) * hidden,
                      spec.int("mamba_d_state"), dt_rank, spec.int("mamba_d_conv"))


def mamba1_tensors(spec: SpecView, prefix: str = "mamba.") -> Shapes:
    d, h = mamba1_dims(spec), spec.hidden_size
    out: Shapes = {"in_proj.weight": (2 * d.d_inner, h),
                   "conv1d.weight": (d.d_inner, 1, d.conv_kernel),
                   "x_proj.weight": (d.dt_rank + 2 * d.d_state, d.d_inner),
                   "dt_proj.weight": (d.d_inner, d.dt_rank), "dt_proj.bias": (d.d_inner,),
                   "A_log": (d.d_inner, d.d_state), "D": (d.d_inner,),
                   "out_proj.weight": (h, d.d_inner),
                   "dt_layernorm.weight": (d.dt_rank,), "b_layernorm.weight": (d.d_state,),
                   "c_layernorm.weight": (d.d_state,)}
    if cfg_opt(spec.config, "mamba_conv_bias", True):
        out["conv1d.bias"] = (d.d_inner,)
    if cfg_opt(spec.config, "mamba_proj_bias", False):
        out["in_proj.bias"] = (2 * d.d_inner,)
        out["out_proj.bias"] = (h,)
    return prefixed(prefix, out)


def mamba1_rules(prefix: str) -> tuple[ShardRule, ...]:
    """in_proj = [x, z] split per part; channels of conv / dt / A / D split; x_proj and out_proj
    row-parallel; the dt/B/C layernorms replicated."""
    def halves(s: SpecView) -> tuple[int, int]:
        return (mamba1_dims(s).d_inner,) * 2
    return (ShardRule(prefix + r"in_proj\.(weight|bias)", 0, segments=halves),
            ShardRule(prefix + r"(conv1d\.(weight|bias)|dt_proj\.(weight|bias)|A_log|D)", 0),
            ShardRule(prefix + r"(x_proj|out_proj)\.weight", 1))


# ---- gated delta net (Qwen3-Next, Qwen3.5) ---------------------------------------------------

@dataclass(frozen=True)
class GdnDims:
    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_segments(self) -> tuple[int, int, int]:
        return (self.key_dim, self.key_dim, self.value_dim)

    @property
    def conv_units(self) -> tuple[int, int, int]:
        return (self.num_k_heads, self.num_k_heads, self.num_v_heads)


def gdn_dims(spec: SpecView) -> GdnDims:
    return GdnDims(spec.int("linear_num_key_heads"), spec.int("linear_num_value_heads"),
                   spec.int("linear_key_head_dim"), spec.int("linear_value_head_dim"),
                   spec.int("linear_conv_kernel_dim"))


def gdn_tensors(spec: SpecView, *, split_proj: bool, prefix: str = "linear_attn.") -> Shapes:
    """Qwen3-Next packs [q, k, v, z] per key-head group in ``in_proj_qkvz`` and [b, a] in
    ``in_proj_ba``; Qwen3.5 stores ``in_proj_qkv`` ([q; k; v] blocks), ``in_proj_z/b/a``."""
    d, h = gdn_dims(spec), spec.hidden_size
    out: Shapes = {"conv1d.weight": (2 * d.key_dim + d.value_dim, 1, d.conv_kernel),
                   "A_log": (d.num_v_heads,), "dt_bias": (d.num_v_heads,),
                   "norm.weight": (d.v_head_dim,), "out_proj.weight": (h, d.value_dim)}
    if split_proj:
        out.update({"in_proj_qkv.weight": (2 * d.key_dim + d.value_dim, h),
                    "in_proj_z.weight": (d.value_dim, h), "in_proj_b.weight": (d.num_v_heads, h),
                    "in_proj_a.weight": (d.num_v_heads, h)})
    else:
        out.update({"in_proj_qkvz.weight": (2 * d.key_dim + 2 * d.value_dim, h),
                    "in_proj_ba.weight": (2 * d.num_v_heads, h)})
    return prefixed(prefix, out)


def gdn_rules(prefix: str) -> tuple[ShardRule, ...]:
    """Key-head groups (qkvz / ba, interleaved per group) or [q; k; v] blocks split per part;
    value heads for z / b / a / A_log / dt_bias; out_proj row-parallel; the norm replicated."""
    return (
        ShardRule(prefix + r"in_proj_(qkvz|ba)\.weight", 0,
                  units=lambda s: gdn_dims(s).num_k_heads),
        ShardRule(prefix + r"(in_proj_qkv\.weight|conv1d\.weight)", 0,
                  segments=lambda s: gdn_dims(s).conv_segments,
                  units=lambda s: gdn_dims(s).conv_units),
        ShardRule(prefix + r"(in_proj_[zba]\.weight|A_log|dt_bias)", 0,
                  units=lambda s: gdn_dims(s).num_v_heads),
        ShardRule(prefix + r"out_proj\.weight", 1, units=lambda s: gdn_dims(s).num_v_heads))
