"""MTP (multi-token-prediction) layers of the generic family, DeepSeek-V3 style.

Published checkpoints of DeepSeek-V3-style models (GLM-4.5, GLM-4.6 / 4.7, Kimi-style DeepSeek
derivatives) store ``num_nextn_predict_layers`` MTP layers after the decoder layers, under the
decoder layers' prefix (``model.layers.{num_hidden_layers + k}.*``). transformers builds no
module for them (``Glm4MoeForCausalLM`` lists them in ``_keys_to_ignore_on_load_unexpected``),
so the meta model cannot show them; each is the model's last decoder layer (attention and
MoE block, spelled as that naming spells it) plus the MTP block's own tensors
(:data:`EXTRAS`, as DeepSeek-V3 stores them and the hand-written ``deepseek`` family reads
them). Main-model stages never read them (placement ``mtp``); ``plan_mtp`` plans one for a
draft model, and its strict accounting refuses a checkpoint whose MTP layer differs (e.g. one
that shares the target's embedding and head instead of storing its own).

A separate ``mtp.*`` module (Qwen3-Next / Qwen3.5: ``mtp_num_hidden_layers``) is recognised and
skipped (``Family.mtp_pattern``), not planned.
"""
from __future__ import annotations

import re
from dataclasses import replace
from typing import Any, Mapping, Optional

from .base import ShardRule
from .hf_meta import Naming

__all__ = ["EXTRAS", "TARGET_SHARED", "num_mtp_layers", "with_mtp", "mtp_rule"]

#: the MTP block's tensors besides its decoder layer: component -> shape in units of
#: (hidden, vocab); the vocabulary ones are split like the model's embedding under TP
EXTRAS: Mapping[str, tuple[str, ...]] = {
    "embed_tokens.weight": ("vocab", "hidden"), "enorm.weight": ("hidden",),
    "hnorm.weight": ("hidden",), "eh_proj.weight": ("hidden", "2hidden"),
    "shared_head.norm.weight": ("hidden",), "shared_head.head.weight": ("vocab", "hidden")}
_VOCAB = ("embed_tokens.weight", "shared_head.head.weight")
#: the MTP block's components a NextN draft takes from the target model instead of reading its
#: own copies (SGLang's DeepSeek-V3 / GLM-4.5 NextN drafts: ``set_embed_and_head``)
TARGET_SHARED: frozenset[str] = frozenset(_VOCAB)


def num_mtp_layers(text: Mapping[str, Any]) -> int:
    """``num_nextn_predict_layers`` of the text config (0 when absent)."""
    value = text.get("num_nextn_predict_layers")
    return int(value) if isinstance(value, int) and value > 0 else 0


def with_mtp(naming: Naming, text: Mapping[str, Any], num_layers: int
             ) -> tuple[Naming, frozenset[str]]:
    """``naming`` with its MTP layers appended to the template (see the module docstring), and
    the MTP-only components it added; unchanged without MTP layers, hidden / vocab sizes or
    decoder layers."""
    count, hidden, vocab = num_mtp_layers(text), text.get("hidden_size"), text.get("vocab_size")
    if not count or not num_layers or not isinstance(hidden, int) or not isinstance(vocab, int):
        return naming, frozenset()
    found = _last_layer(naming, num_layers - 1)
    if found is None:
        return naming, frozenset()
    literal, last = found
    sizes = {"hidden": hidden, "vocab": vocab, "2hidden": 2 * hidden}
    block = {**last, **{comp: tuple(sizes[d] for d in dims) for comp, dims in EXTRAS.items()}}
    template = dict(naming.template)
    for k in range(count):
        template.update({f"{literal}{num_layers + k}.{comp}": shape
                         for comp, shape in block.items()})
    return replace(naming, template=template), frozenset(EXTRAS) - set(last)


def mtp_rule(pattern: str, comp: str, shape: tuple[int, ...],
             text: Mapping[str, Any]) -> Optional[ShardRule]:
    """The TP rule of an MTP-only component, as engines shard it: the vocabulary tensors like
    the embedding (padded rows), the norms and ``eh_proj`` replicated (DeepSeek's MTP
    ``eh_proj`` is a plain linear in vLLM and SGLang). None: not an MTP-only component."""
    if comp not in EXTRAS:
        return None
    if comp in _VOCAB:
        return ShardRule(pattern, 0, pad=True) if shape[:1] == (text.get("vocab_size"),) \
            else None
    return ShardRule(pattern, None)


def _last_layer(naming: Naming, layer: int
                ) -> Optional[tuple[str, dict[str, tuple[int, ...]]]]:
    """(the text before the layer id, component -> shape) of decoder layer ``layer``, the
    last one: the template is layer-major, so its names are at the end."""
    rx = re.compile(naming.layer_prefix)
    literal, out = "", {}  # type: str, dict[str, tuple[int, ...]]
    for name in reversed(list(naming.template)):
        m = rx.match(name)
        if m is None or int(m.group(1)) != layer:
            if out:
                break
            continue
        literal = name[:m.start(1)]
        out[name[m.end():]] = naming.template[name]
    return (literal, dict(reversed(list(out.items())))) if out else None
