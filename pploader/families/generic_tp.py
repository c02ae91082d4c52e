"""The generic family's TP rules (``generic.shard_rules``): one rule per distinct layer
component, derived only where a tensor's role is unambiguous (q/k/v/o, gate/up/down by name,
head counts from the config dividing the shape, norms of width hidden or head_dim, routers,
vocab, MLA, fused gate/up halves; a vision-language model's encoders replicated), the
engines' own splits of fused / per-model layouts first (fused_qkv.py, tp_mixers.py,
hf_tp_plan.py); any other tensor gets a rule that refuses TP > 1 naming the tensor."""
from __future__ import annotations

import math
import re
from functools import partial
from typing import Any, Callable, Mapping, Optional

from ..errors import PlanError
from .base import ShardRule, SpecView
from .fused_qkv import engine_rules
from .generic_mtp import mtp_rule
from .hf_meta import MetaModel, Naming
from .hf_tp_plan import TRANSFORMERS_BACKEND, with_plan
from .tp_gemma import gemma_tp_rules
from .tp_hyper import hyper_tp_rules
from .tp_mixers import layout_tp_rules

__all__ = ["shard_rules"]


def _refuse(component: str, reason: str) -> Callable[[SpecView], tuple[int, ...]]:
    def refuse(spec: SpecView) -> tuple[int, ...]:
        raise PlanError(f"tensor parallelism refused for {spec.architecture} (generic family): "
                        f"no unambiguous split for {component}: {reason}; run with tp=1 or add "
                        "a hand-written family (docs/families.md)")  # plan_rank names the tensor
    return refuse


def _heads(spec: SpecView) -> int:
    return spec.num_heads


def _kv_heads(spec: SpecView) -> int:
    return spec.num_kv_heads


def shard_rules(naming: Naming, meta: MetaModel,
                mtp_only: frozenset[str] = frozenset()) -> tuple[ShardRule, ...]:
    """One rule per distinct layer component (expert ids generalised) and per global
    (``mtp_only``: components only MTP layers have, ruled by ``generic_mtp.mtp_rule``)."""
    text = meta.text_config
    comps: dict[str, tuple[int, ...]] = {}
    rx = re.compile(naming.layer_prefix)
    expert_rx = re.compile(naming.expert_pattern) if naming.expert_pattern else None
    prefix = None  # the literal before the layer id: string tests, not a regex per name
    seen: set[str] = set()
    for name, shape in naming.template.items():
        if prefix is None or not name.startswith(prefix):
            m = rx.match(name)
            if m is None:
                comps[name] = shape
                continue
            prefix = name[:m.start(1)]
        idx, dot, comp = name[len(prefix):].partition(".")
        if not (dot and idx.isdecimal()):  # what ``(\d+)\.`` does not match (\d: Nd)
            comps[name] = shape
            continue
        if comp in seen:  # every layer of a kind repeats its representative's components
            continue
        seen.add(comp)
        em = expert_rx.fullmatch(comp) if expert_rx is not None else None
        if em is not None:
            comp = comp[:em.start(1)] + "#" + comp[em.end(1):]
        comps.setdefault(comp, shape)
    # the engines' splits of fused / per-model layouts (fused_qkv.py), mixers and 3-D experts
    # (tp_mixers.py); an architecture vLLM serves through its transformers backend takes
    # the model's own tp plan (hf_tp_plan.py), which the backend follows, except CodeGen:
    # its forward views qkv rows as 4 fixed blocks, so fused_qkv refuses a TP that cuts one
    fused = {**engine_rules(meta, naming), **hyper_tp_rules(meta, naming)} \
        if meta.architecture not in TRANSFORMERS_BACKEND or meta.model_type == "codegen" else {}
    engine = {**fused, **layout_tp_rules(meta, naming), **gemma_tp_rules(meta, naming)}
    rules, encoders = [], frozenset(naming.encoder)
    for comp, shape in comps.items():
        pattern = re.escape(comp).replace("\\#", r"\d+").replace("#", r"\d+")
        rule = mtp_rule(pattern, comp, shape, text) if comp in mtp_only else None
        rules.append(rule or (engine[comp](pattern) if comp in engine else
                              _halved_rule(pattern, comp, comps, meta.halved) or
                              _rule(pattern, comp, shape, naming, text, meta.num_experts,
                                    encoders, meta.architecture)))
    return with_plan(rules, comps, meta.tp_plan)  # vLLM's transformers backend (hf_tp_plan)


def _halved_rule(pattern: str, comp: str, comps: Mapping[str, tuple[int, ...]],
                 halved: frozenset[str]) -> Optional[ShardRule]:
    """The TP rule of a stacked experts' ``gate_up_proj`` / ``down_proj`` whose module splits
    the fused gate/up output in halves, gate first (``MetaModel.halved``): each half's
    intermediate rows split evenly, ``down_proj`` on its intermediate dim, as vLLM shards
    w13 / w2 (intermediate / tp a rank). Both orientations: transformers' ``[E, 2I, H]`` /
    ``[E, H, I]`` and Llama-4's ``[E, H, 2I]`` / ``[E, I, H]``, told apart by the pair's
    shapes. None: not such a tensor (the generic rule decides)."""
    if comp not in halved:
        return None
    if comp.endswith((".weight", ".bias")):  # a linear MLP's: [2I, H] (bias [2I]), [H, I]
        stem = comp.rsplit(".", 2)[0]
        gate_up = comps.get(stem + ".gate_up_proj.weight")
        down = comps.get(stem + ".down_proj.weight")
        if gate_up is None or down is None or len(gate_up) != 2 or len(down) != 2 or \
                gate_up[0] != 2 * down[1] or gate_up[1] != down[0]:
            return None
        if ".down_proj." in comp:
            return ShardRule(pattern, 1)
        return ShardRule(pattern, 0, segments=partial(_halves, down[1]))
    stem, _, kind = comp.rpartition(".")
    gate_up, down = comps.get(stem + ".gate_up_proj"), comps.get(stem + ".down_proj")
    if gate_up is None or down is None or len(gate_up) != 3 or len(down) != 3:
        return None
    if gate_up[1] == 2 * down[2] and gate_up[2] == down[1]:
        dims, inter = (1, 2), down[2]            # [E, 2I, H], [E, H, I]
    elif gate_up[2] == 2 * down[1] and gate_up[1] == down[2]:
        dims, inter = (2, 1), down[1]            # [E, H, 2I], [E, I, H]
    else:
        return None
    if kind == "gate_up_proj":
        return ShardRule(pattern, dims[0], segments=partial(_halves, inter))
    return ShardRule(pattern, dims[1])


def _halves(inter: int, _spec: SpecView) -> tuple[int, ...]:
    return (inter, inter)


#: how vLLM holds a QK norm spanning the whole projection (width heads x head_dim) under TP:
#: "heads" = split with the heads (MiniMax-M2's ``MiniMaxText01RMSNormTP``: q by heads, k by kv
#: heads, a replicated kv head's slice on its replicas); "replicated" = whole on every rank
#: (OLMoE's ``_apply_qk_norm`` gathers q / k first; Olmo2 / Olmo3 run on vLLM's transformers
#: backend, whose tp_plan gathers the projections' outputs: ``colwise_gather_output``)
PROJECTION_NORMS = {"MiniMaxM2ForCausalLM": "heads", "OlmoeForCausalLM": "replicated",
                    "Olmo2ForCausalLM": "replicated", "Olmo3ForCausalLM": "replicated"}
_Q_NORMS = ("q_norm", "query_layernorm", "q_layernorm")
_K_NORMS = ("k_norm", "key_layernorm", "k_layernorm")


def _projection_norm(pattern: str, role: str, width: int, heads: int, kv: int, head_dim: int,
                     architecture: str
                     ) -> Optional[ShardRule]:
    """The rule of a per-projection (QK) norm of ``width``: per head (replicated), or the
    whole projection as the engine holds it (PROJECTION_NORMS); None when neither applies
    (refused)."""
    if width == head_dim:
        return ShardRule(pattern, None)
    how = PROJECTION_NORMS.get(architecture)
    units = _heads if role in _Q_NORMS and width == heads * head_dim else \
        _kv_heads if role in _K_NORMS and width == kv * head_dim else None
    if how is None or units is None:
        return None
    return ShardRule(pattern, None) if how == "replicated" else ShardRule(pattern, 0, units=units)


def _rule(pattern: str, comp: str, shape: tuple[int, ...], naming: Naming,
          text: Mapping[str, Any], num_experts: int,
          encoders: frozenset[str] = frozenset(), architecture: str = "") -> ShardRule:
    """The TP rule of one component (see the module docstring); ``encoders``: the names of
    vision / audio encoders and projectors (``Naming.encoder``), replicated."""
    hidden = _int(text, "hidden_size")
    heads = _int(text, "num_attention_heads")
    kv = _int(text, "num_key_value_heads") or heads or 0
    head_dim = _int(text, "head_dim") or (hidden // heads if hidden and heads else None)
    vocab = _int(text, "vocab_size")
    tokens = comp.split(".")
    kind = tokens[-1]
    role = tokens[-2] if len(tokens) >= 2 else ""
    refuse = lambda why: ShardRule(pattern, 0, segments=_refuse(comp, why))  # noqa: E731
    if comp in (naming.embed, naming.head) or naming.head and kind == "bias" and \
            comp == naming.head[:-len("weight")] + "bias":  # (Phi's head bias: vLLM's
        #                                                    ParallelLMHead splits it too)
        return ShardRule(pattern, 0, pad=True) if shape and shape[0] == vocab else \
            refuse(f"vocabulary dim {shape[:1]} != vocab_size {vocab}")
    if comp in encoders:
        return ShardRule(pattern, None)  # a vision / audio encoder or projector: replicated
    if kind in _SINKS and heads and shape == (heads,):
        return ShardRule(pattern, 0, units=_heads)  # one attention sink per head
    if _router(tokens, shape, num_experts):
        return ShardRule(pattern, None)  # router weight / bias / score correction: replicated
    if len(shape) == 0 or math.prod(shape) == 1:
        return ShardRule(pattern, None)  # a scalar: nothing to split
    if "indexer" in tokens[:-1] and _int(text, "index_head_dim"):
        return ShardRule(pattern, None)  # DeepSeek sparse attention's indexer (V3.2, GLM-5):
        # vLLM's ``Indexer`` is replicated ("no tensor parallel"), its k_norm included
    mla = _mla_rule(pattern, role, kind, shape, text, heads or 0)
    if mla is not None:
        return mla
    if role in _POSITIONS and kind == "weight" and len(shape) == 2 and shape[1] == hidden:
        return ShardRule(pattern, None)  # learned absolute positions: vLLM's OPT / GPT-2
        #                                  hold them whole (``nn.Embedding``)
    if len(shape) == 2 and shape[0] == 1 and role.endswith("gate"):
        return ShardRule(pattern, None)  # a one-output gate (``shared_expert_gate``)
    if kind not in ("weight", "bias"):
        return refuse(f"{list(shape)} is not a weight or bias of a known projection")
    if len(shape) == 1 and re.search(r"norm|^ln(_\w+)?$", role, re.IGNORECASE):
        if role in _Q_NORMS + _K_NORMS:
            return _projection_norm(pattern, role, shape[0], heads or 0, kv, head_dim or 0,
                                    architecture) or \
                refuse(f"per-projection norm of width {shape[0]} (head_dim {head_dim}): "
                       "no engine rule for this architecture")
        return ShardRule(pattern, None) if shape[0] == hidden else \
            refuse(f"norm of width {shape[0]} (hidden_size {hidden})")
    if kind.endswith(("_blocks", "_scales")) and len(shape) > 2:
        return refuse(f"MXFP4 expert {kind.rsplit('_', 1)[1]} {list(shape)}: the split of the "
                      "gate/up rows (interleaved or stacked) is the model's, not derivable; "
                      "use --ep for the experts")
    if len(shape) > 2:
        return refuse(f"{len(shape)}-d tensor {list(shape)}: the expert dim is known, the "
                      "layout of the others (gate/up order, transposition) is not")
    if not heads or not head_dim:
        return refuse("the config has no attention head counts")
    if role == "q_proj":
        return ShardRule(pattern, 0, units=_heads) if shape[0] == heads * head_dim else \
            refuse(f"rows {shape[0]} != heads {heads} x head_dim {head_dim}")
    if role in ("k_proj", "v_proj"):
        return ShardRule(pattern, 0, units=_kv_heads) if shape[0] == kv * head_dim else \
            refuse(f"rows {shape[0]} != kv heads {kv} x head_dim {head_dim}")
    if role == "o_proj" or role in ("out_proj", "dense") and len(tokens) >= 3 and \
            re.search(r"attn|attention", tokens[-3]):  # OPT / GPT-J's out_proj, Phi's dense
        if kind == "bias":
            return ShardRule(pattern, None)
        return ShardRule(pattern, 1, units=_heads) if shape[1] == heads * head_dim else \
            refuse(f"columns {shape[1]} != heads {heads} x head_dim {head_dim}")
    if role in ("gate_proj", "up_proj", "w1", "w3") and len(tokens) >= 3 and (
            role.startswith(("gate", "up")) or "experts" in tokens):
        return ShardRule(pattern, 0)
    if role in _FC_PAIRS and "experts" not in tokens and len(shape) <= 2:
        return _fc_rule(pattern, role, kind, shape, comps_of_fc(naming, comp, role)) or \
            refuse(f"{role} {list(shape)} does not pair with {_FC_PAIRS[role]}")
    if role in ("down_proj", "w2") and (role == "down_proj" or "experts" in tokens):
        return ShardRule(pattern, None) if kind == "bias" else ShardRule(pattern, 1)
    return refuse(f"role {role!r} {list(shape)} is not a known projection")


#: MLA's low-rank inputs and their norms: component role -> the config sizes of its width
_MLA_INPUTS = {"q_a_proj": ("q_lora_rank",), "q_a_layernorm": ("q_lora_rank",),
               "kv_a_proj_with_mqa": ("kv_lora_rank", "qk_rope_head_dim"),
               "kv_a_layernorm": ("kv_lora_rank",)}


def _mla_rule(pattern: str, role: str, kind: str, shape: tuple[int, ...],
              text: Mapping[str, Any], heads: int) -> Optional[ShardRule]:
    """The TP rule of a multi-head latent attention tensor (DeepSeek-V2 / V3 / V3.2, GLM-5,
    ``kv_lora_rank`` in the config), as vLLM's ``DeepseekV2MLAAttention`` and SGLang's
    ``DeepseekV2AttentionMLA`` hold it: the low-rank inputs ``q_a_proj`` /
    ``kv_a_proj_with_mqa`` and their norms replicated (vLLM: ``ReplicatedLinear`` /
    ``disable_tp``), ``q_b_proj`` / ``q_proj`` / ``kv_b_proj`` column-parallel by heads,
    ``o_proj`` row-parallel by heads (its bias whole). None: not an MLA tensor of these
    widths (the generic rules decide)."""
    kv_rank, rope = _int(text, "kv_lora_rank"), _int(text, "qk_rope_head_dim")
    nope, v = _int(text, "qk_nope_head_dim"), _int(text, "v_head_dim")
    if not (kv_rank and rope and nope is not None and v and heads) or not shape:
        return None
    sizes = _MLA_INPUTS.get(role)
    if sizes is not None:
        width = [_int(text, k) for k in sizes]
        return ShardRule(pattern, None) if None not in width and shape[0] == sum(
            w for w in width if w is not None) else None
    if kind == "bias":
        return ShardRule(pattern, None) if role == "o_proj" and shape == (
            _int(text, "hidden_size"),) else None
    if kind != "weight" or len(shape) != 2:
        return None
    if role in ("q_b_proj", "q_proj") and shape[0] == heads * (nope + rope) or \
            role == "kv_b_proj" and shape[0] == heads * (nope + v):
        return ShardRule(pattern, 0, units=_heads)
    if role == "o_proj" and shape[1] == heads * v:
        return ShardRule(pattern, 1, units=_heads)
    return None


#: module names of learned absolute position embeddings (replicated under TP)
_POSITIONS = {"embed_positions", "wpe", "position_embeddings", "positions_embed"}


#: the two linear layers of a plain MLP under other names: input -> output layer, both ways
_FC_INPUTS = {"fc1": "fc2", "fc_in": "fc_out", "dense_h_to_4h": "dense_4h_to_h"}
_FC_PAIRS = {**_FC_INPUTS, **{v: k for k, v in _FC_INPUTS.items()}}


def comps_of_fc(naming: Naming, comp: str, role: str
                ) -> tuple[Optional[tuple[int, ...]], Optional[tuple[int, ...]], bool]:
    """The weight shapes of the (input, output) MLP pair ``comp`` belongs to (same parent),
    from any layer of the template, and whether ``role`` is the input one."""
    first = role in _FC_INPUTS
    pair = (role, _FC_PAIRS[role]) if first else (_FC_PAIRS[role], role)
    stem = comp.rsplit(".", 2)[0] + "." if comp.count(".") >= 2 else ""
    found: dict[str, tuple[int, ...]] = {}
    for name, shape in naming.template.items():
        for r in pair:
            if r not in found and (name == stem + r + ".weight" or
                                   name.endswith("." + stem + r + ".weight")):
                found[r] = tuple(shape)
        if len(found) == 2:
            break
    return found.get(pair[0]), found.get(pair[1]), first


def _fc_rule(pattern: str, role: str, kind: str, shape: tuple[int, ...],
             pair: tuple[Optional[tuple[int, ...]], Optional[tuple[int, ...]], bool]
             ) -> Optional[ShardRule]:
    """An MLP of two linear layers, input [I, H] / output [H, I] (``fc1`` / ``fc2``: OPT, Phi,
    XGLM; ``fc_in`` / ``fc_out``: GPT-J; ``dense_h_to_4h`` / ``dense_4h_to_h``: Bloom,
    Falcon, Persimmon): the input column-parallel (its bias too), the output row-parallel
    (bias whole), as vLLM's OPT / GPT-J / Bloom / Falcon and SGLang's Phi hold them. None: the
    pair's shapes do not match."""
    fc1, fc2, first = pair
    if fc1 is None or fc2 is None or len(fc1) != 2 or fc1 != (fc2[1], fc2[0]):
        return None
    if first:
        return ShardRule(pattern, 0) if shape[0] == fc1[0] else None
    return ShardRule(pattern, None) if kind == "bias" else ShardRule(pattern, 1)


#: names of per-head attention sinks (gpt-oss ``self_attn.sinks``): split with the heads
_SINKS = {"sinks", "sink", "attn_sink", "attention_sink", "attn_sinks"}

#: tensor names of MoE routing state, wherever the module (ERNIE's ``moe_statics``)
_ROUTER_TENSORS = {"e_score_correction_bias", "expert_bias", "router_bias"}

#: module names of MoE routers (the parameters under them are replicated, as engines do)
_ROUTERS = {"gate", "router", "layer", "routing", "gating", "switch", "wg", "classifier",
            "router_gate", "moe_gate", "gate_network"}


def _router(tokens: list[str], shape: tuple[int, ...], num_experts: int) -> bool:
    """A MoE router's parameter: under a router-named module (``mlp.gate.weight``,
    ``mlp.gate.e_score_correction_bias``, ``mlp.router.bias``) or named as routing state
    (``mlp.expert_bias``), at most 2-D, with the expert count as its first or last dim; never
    inside the experts or an attention module."""
    if not num_experts or len(shape) == 0 or len(shape) > 2 or len(tokens) < 2:
        return False
    if num_experts not in (shape[0], shape[-1]) or "experts" in tokens:
        return False
    if any("attn" in t or "attention" in t for t in tokens):
        return False  # per-head parameters (Beam's ``self_attn.gate_bias`` [heads]) are not
        #              routers, even where heads == experts
    if tokens[-1] in _ROUTER_TENSORS:
        return True  # routing state by name (``mlp.expert_bias``, ``e_score_correction_bias``)
    return any(t in _ROUTERS for t in tokens[-3:-1])


def _int(text: Mapping[str, Any], key: str) -> Optional[int]:
    value = text.get(key)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None
