"""TP rules of sequence mixers without attention heads (SSM, short convolution, delta-rule
attention), Zamba2's shared block and the expert layouts ``tp_experts3d`` knows, for the
generic family, as the serving engine splits them.
:func:`layout_tp_rules` is the generic family's one hook for rules an engine defines per
architecture (gpt-oss's MXFP4 experts, families/mxfp4.py, included).

- Mamba / FalconMamba (vLLM ``MambaMixer``): ``in_proj`` ``[2I, H]`` = [x, z] halves, each
  split (``MergedColumnParallelLinear``); ``conv1d`` ``[I, 1, K]``, ``dt_proj`` ``[I, R]``,
  ``A_log`` ``[I, N]``, ``D`` ``[I]`` split on dim 0; ``x_proj`` ``[R + 2N, I]`` and
  ``out_proj`` ``[H, I]`` row-parallel (dim 1), their biases whole; the dt/B/C RMS norms
  whole.
- Mamba2 (vLLM ``MambaMixer2``): ``in_proj`` = [z, x, B, C, dt], z / x / dt by heads, B / C
  by groups (one group: whole on every rank, as ``mamba_v2_sharded_weight_loader``
  duplicates it); ``conv1d`` over [x, B, C] the same; ``A_log`` / ``D`` / ``dt_bias`` by
  heads; the gated norm and ``out_proj`` (dim 1) by heads. Sizes from the layer's own
  parameters and the config's group count (``cache_dims.param_mamba2_dims``), the same the
  cache geometry reads.
- Zamba2 (vLLM ``zamba2.py``), Kimi-Linear (SGLang ``KimiDeltaAttention``), OLMo-hybrid
  (vLLM ``OlmoHybridGatedDeltaNetAttention``): see their functions below.
- LFM2 / LFM2-MoE (vLLM ``ShortConv`` and ``Lfm2MLP``): ``conv.in_proj`` ``[3D, H]`` = [B,
  C, x] thirds, each split; ``conv.conv`` ``[D, 1, L]`` on dim 0; ``conv.out_proj``
  row-parallel; the dense ``feed_forward.w1`` / ``w3`` column-, ``w2`` row-parallel.

Every rule is gated by architecture (the engines' model files), never inferred for an
architecture no engine names; a TP size that does not divide is refused by the planner,
naming the tensor.
"""
from __future__ import annotations

import re
from functools import partial
from typing import Callable, Mapping

from ..errors import PlanError
from .blocks import Mamba2Dims
from .cache_dims import param_mamba2_dims
from .hf_meta import MetaModel, Naming
from .mxfp4 import engine_tp_rules
from .spec_view import ShardRule, SpecView
from .tp_experts3d import EXPERT3D_ARCHITECTURES, expert3d_tp_rules
from .tp_experts3d import plain_rule as _rule

__all__ = ["layout_tp_rules", "layer_components", "MIXER_ARCHITECTURES"]

Factory = Callable[[str], ShardRule]

_MAMBA1 = frozenset({"MambaForCausalLM", "FalconMambaForCausalLM"})
_MAMBA2 = frozenset({"Mamba2ForCausalLM"})
_SHORT_CONV = frozenset({"Lfm2ForCausalLM", "Lfm2MoeForCausalLM"})
_KDA = frozenset({"KimiLinearForCausalLM"})
_ZAMBA2 = frozenset({"Zamba2ForCausalLM"})
_OLMO_GDN = frozenset({"OlmoHybridForCausalLM"})

#: architectures whose mixers this module splits (the engines' model files above)
MIXER_ARCHITECTURES = _MAMBA1 | _MAMBA2 | _SHORT_CONV | _KDA | _ZAMBA2 | _OLMO_GDN


def layout_tp_rules(meta: MetaModel, naming: Naming) -> dict[str, Factory]:
    """``{component: pattern -> ShardRule}`` of every component of ``naming`` whose split
    an engine defines for ``meta.architecture`` beyond the generic rules: gpt-oss's experts
    (families/mxfp4.py), the stacked expert layouts of families/tp_experts3d.py and the
    mixers above. Empty for any other architecture."""
    arch = meta.architecture
    out = dict(engine_tp_rules(arch, naming))
    if arch not in MIXER_ARCHITECTURES and arch not in EXPERT3D_ARCHITECTURES:
        return out
    comps = layer_components(naming)
    out.update(expert3d_tp_rules(arch, comps, meta.num_experts))
    if arch in _MAMBA1:
        out.update(_mamba1(comps))
    elif arch in _MAMBA2:
        out.update(_mamba2(comps))
    elif arch in _ZAMBA2:
        out.update(_mamba2(comps))
        out.update(_zamba2_shared(comps))
    elif arch in _SHORT_CONV:
        out.update(_short_conv(comps))
    elif arch in _KDA:
        out.update(_kda(comps))
    elif arch in _OLMO_GDN:
        out.update(_olmo_gdn(comps, meta.text_config))
    return out


def layer_components(naming: Naming) -> dict[str, tuple[int, ...]]:
    """Every layer component of ``naming`` (the name after the layer prefix) -> its shape in
    the first layer that has it."""
    rx = re.compile(naming.layer_prefix)
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in naming.template.items():
        m = rx.match(name)
        if m is not None:
            out.setdefault(name[m.end():], tuple(shape))
    return out


def _mixer_prefixes(comps: Mapping[str, tuple[int, ...]], ndim: int, *needs: str) -> list[str]:
    """Prefixes ``p`` with ``p + "A_log"`` of ``ndim`` dims and every ``p + need``."""
    return [c[:-len("A_log")] for c, s in comps.items() if c.endswith("A_log") and
            len(s) == ndim and all(c[:-len("A_log")] + n in comps for n in needs)]


def _mamba1(comps: Mapping[str, tuple[int, ...]]) -> dict[str, Factory]:
    out: dict[str, Factory] = {}
    for p in _mixer_prefixes(comps, 2, "in_proj.weight", "conv1d.weight", "x_proj.weight",
                             "dt_proj.weight", "out_proj.weight"):
        inner = comps[p + "A_log"][0]
        if comps[p + "in_proj.weight"][0] != 2 * inner:
            continue  # not [x, z] of d_inner each: the generic rule refuses it
        for c in ("in_proj.weight", "in_proj.bias"):
            out[p + c] = partial(_rule, dim=0, segments=(inner, inner))
        for c in ("conv1d.weight", "conv1d.bias", "dt_proj.weight", "dt_proj.bias", "A_log",
                  "D"):
            out[p + c] = partial(_rule, dim=0)
        for c in ("x_proj.weight", "out_proj.weight"):
            out[p + c] = partial(_rule, dim=1)
        for c in ("x_proj.bias", "out_proj.bias", "dt_layernorm.weight", "b_layernorm.weight",
                  "c_layernorm.weight"):
            out[p + c] = partial(_rule, dim=None)
    return {c: f for c, f in out.items() if c in comps}


def _mamba2(comps: Mapping[str, tuple[int, ...]]) -> dict[str, Factory]:
    out: dict[str, Factory] = {}
    for p in _mixer_prefixes(comps, 1, "in_proj.weight", "conv1d.weight", "out_proj.weight"):
        dims = param_mamba2_dims({c: s for c, s in comps.items() if c.startswith(p)})
        for c in ("in_proj.weight", "in_proj.bias"):
            out[p + c] = partial(_mamba2_rule, dims=dims, part="in_proj")
        for c in ("conv1d.weight", "conv1d.bias"):
            out[p + c] = partial(_mamba2_rule, dims=dims, part="conv")
        for c in ("A_log", "D", "dt_bias"):
            out[p + c] = partial(_rule, dim=0)
        out[p + "norm.weight"] = partial(_mamba2_rule, dims=dims, part="norm")
        out[p + "out_proj.weight"] = partial(_mamba2_rule, dims=dims, part="out")
        out[p + "out_proj.bias"] = partial(_rule, dim=None)
    return {c: f for c, f in out.items() if c in comps}


def _mamba2_rule(pattern: str, dims: Callable[[SpecView], Mamba2Dims], part: str) -> ShardRule:
    if part == "in_proj":
        return ShardRule(pattern, 0, segments=lambda s: dims(s).in_proj_segments,
                         units=lambda s: dims(s).in_proj_units)
    if part == "conv":
        return ShardRule(pattern, 0, segments=lambda s: dims(s).conv_segments,
                         units=lambda s: dims(s).conv_units)
    return ShardRule(pattern, 0 if part == "norm" else 1, units=lambda s: dims(s).n_heads)


def _short_conv(comps: Mapping[str, tuple[int, ...]]) -> dict[str, Factory]:
    out: dict[str, Factory] = {}
    conv, inp = comps.get("conv.conv.weight"), comps.get("conv.in_proj.weight")
    if conv is not None and inp is not None and len(conv) == 3 and inp[0] == 3 * conv[0]:
        for c in ("conv.in_proj.weight", "conv.in_proj.bias"):
            out[c] = partial(_rule, dim=0, segments=(conv[0],) * 3)
        for c in ("conv.conv.weight", "conv.conv.bias"):
            out[c] = partial(_rule, dim=0)
        out["conv.out_proj.weight"] = partial(_rule, dim=1)
        out["conv.out_proj.bias"] = partial(_rule, dim=None)
    w1, w2 = comps.get("feed_forward.w1.weight"), comps.get("feed_forward.w2.weight")
    if w1 is not None and w2 is not None and len(w1) == 2 and w1 == (w2[1], w2[0]) and \
            comps.get("feed_forward.w3.weight") == w1:
        out["feed_forward.w1.weight"] = out["feed_forward.w3.weight"] = partial(_rule, dim=0)
        out["feed_forward.w2.weight"] = partial(_rule, dim=1)
    return {c: f for c, f in out.items() if c in comps}


def _kda(comps: Mapping[str, tuple[int, ...]]) -> dict[str, Factory]:
    """Kimi delta attention as SGLang's ``KimiDeltaAttention`` holds it (its q / k / v and
    ``o_proj`` follow the generic attention rules)."""
    out: dict[str, Factory] = {}
    for comp, shape in comps.items():
        if not comp.endswith("A_log") or len(shape) != 4 or shape[:2] != (1, 1) or shape[3] != 1:
            continue
        p = comp[:-len("A_log")]  # the mixer, or its ``forget_gate.`` (transformers naming)
        m = p[:-len("forget_gate.")] if p.endswith("forget_gate.") else p
        out[p + "A_log"] = partial(_rule, dim=2)
        out[p + "dt_bias"] = partial(_rule, dim=0)
        for g in (p, m):
            out[g + "f_a_proj.weight"] = out[g + "g_a_proj.weight"] = partial(_rule, dim=None)
            out[g + "f_b_proj.weight"] = out[g + "g_b_proj.weight"] = partial(_rule, dim=0)
        for c in ("b_proj.weight", "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"):
            out[m + c] = partial(_rule, dim=0)
        out[m + "o_norm.weight"] = partial(_rule, dim=None)
        conv, q = comps.get(m + "conv1d.weight"), comps.get(m + "q_proj.weight")
        if conv is not None and q is not None and conv[0] == 3 * q[0]:
            out[m + "conv1d.weight"] = partial(_rule, dim=0, segments=(q[0],) * 3)
    return {c: f for c, f in out.items() if c in comps}


_ADAPTER = re.compile(r"(.+_adapter_list\.\d+\.)([01])\.weight")


def _zamba2_shared(comps: Mapping[str, tuple[int, ...]]) -> dict[str, Factory]:
    """Zamba2's shared transformer block as vLLM's ``zamba2.py`` holds it (its attention
    follows the generic rules): ``linear`` replicated (``ReplicatedLinear``), the block's
    input norm over the concatenated ``2 x hidden`` whole, ``feed_forward.gate_up_proj``
    ``[2I, H]`` in halves, each LoRA adapter's ``A`` (``.0``) split on its rank rows
    (``ColumnParallelLinear``, output gathered) and ``B`` (``.1``) on its output rows, a
    gate/up adapter's in halves (``MergedColumnParallelLinear``)."""
    out: dict[str, Factory] = {"linear.weight": partial(_rule, dim=None),
                               "shared_transformer.input_layernorm.weight":
                                   partial(_rule, dim=None)}
    gate_up = comps.get("shared_transformer.feed_forward.gate_up_proj.weight")
    down = comps.get("shared_transformer.feed_forward.down_proj.weight")
    inter = down[1] if down is not None and len(down) == 2 else None
    if gate_up is not None and inter is not None and gate_up[0] == 2 * inter:
        out["shared_transformer.feed_forward.gate_up_proj.weight"] = partial(
            _rule, dim=0, segments=(inter, inter))
    for comp, shape in comps.items():
        m = _ADAPTER.fullmatch(comp)
        if m is None or len(shape) != 2:
            continue
        halves = m.group(2) == "1" and "gate_up_proj_adapter" in comp and inter is not None \
            and shape[0] == 2 * inter
        out[comp] = partial(_rule, dim=0, segments=(inter, inter) if halves and inter else None)
    return {c: f for c, f in out.items() if c in comps}


def _olmo_gdn(comps: Mapping[str, tuple[int, ...]], text: Mapping[str, object]
              ) -> dict[str, Factory]:
    """OLMo-hybrid's gated delta net as vLLM's ``OlmoHybridGatedDeltaNetAttention`` loads it:
    ``in_proj_qkvg`` = [q, k, v, g] and the fused conv [q, k, v], each part's rows split
    evenly (``width // tp`` a rank, as its loaders cut them), ``a_proj`` / ``b_proj`` /
    ``A_log`` / ``dt_bias`` by value heads, the head-dim ``o_norm`` whole, ``o_proj`` columns;
    the attention layers' q / k norms whole. A conv whose rows are not its part's width
    (transformers' original naming chunks the fused conv in three equal parts) is refused."""
    sizes = [text.get(k) for k in ("linear_num_key_heads", "linear_num_value_heads",
                                   "linear_key_head_dim", "linear_value_head_dim")]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in sizes):
        return {}
    kh, vh, kd, vd = (int(v) for v in sizes)  # type: ignore[call-overload]
    key, value = kh * kd, vh * vd
    out: dict[str, Factory] = {}
    m = "linear_attn."
    for c, width in {"q_proj": key, "k_proj": key, "v_proj": value, "g_proj": value,
                     "q_conv1d": key, "k_conv1d": key, "v_conv1d": value}.items():
        shape = comps.get(m + c + ".weight")
        if shape is not None and shape[0] == width:
            out[m + c + ".weight"] = partial(_rule, dim=0)
        elif shape is not None:
            out[m + c + ".weight"] = partial(_refused, why=(
                f"{c} has {shape[0]} rows, not its part's width {width} (vLLM's "
                "olmo_hybrid loads [key, key, value] convs; transformers' original naming "
                "chunks the fused conv in three equal parts)"))
    conv = comps.get(m + "conv1d.weight")
    if conv is not None and conv[0] == 2 * key + value:
        out[m + "conv1d.weight"] = partial(_rule, dim=0, segments=(key, key, value))
    for c in ("a_proj.weight", "b_proj.weight", "A_log", "dt_bias"):
        out[m + c] = partial(_rule, dim=0)
    out[m + "o_norm.weight"] = partial(_rule, dim=None)
    out[m + "o_proj.weight"] = partial(_rule, dim=1)
    # its full-attention layers' QK norms span the projection; vLLM gathers q / k first
    # (``OlmoHybridAttention._apply_qk_norm``): whole on every rank
    out["self_attn.q_norm.weight"] = out["self_attn.k_norm.weight"] = partial(_rule, dim=None)
    return {c: f for c, f in out.items() if c in comps}


def _refused(pattern: str, why: str) -> ShardRule:
    """A rule that refuses TP > 1 saying ``why`` (the planner names the tensor)."""
    def refuse(spec: SpecView) -> tuple[int, ...]:
        raise PlanError(f"tensor parallelism refused for {spec.architecture}: {why}")
    return ShardRule(pattern, 0, segments=refuse)
