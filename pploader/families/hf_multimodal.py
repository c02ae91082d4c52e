"""Multimodal (vision-language) knowledge for the generic family, read from the meta model.

A ``*ForConditionalGeneration`` model holds a language model (the decoder layers, their
embedding, final norm and head) beside encoders: a vision / audio tower and a projector
(``model.vision_tower``, ``model.multi_modal_projector``). ``hf_meta._derive`` places them
(forward order: the encoders run before the layers, so they go to the first stage); this
module says which tensors are encoders and which extra on-disk naming their checkpoints use.

- ``encoder_keys``: first-stage state-dict keys outside the language model (or inside a
  nested model built from another config: GIT's ``image_encoder``). The generic TP rules
  replicate them: vision towers are small next to the language model (SigLIP's 0.4 B of
  Gemma-3-27B), their head counts come from a config the text rules do not read, and
  engines run them data-parallel beside a TP language model (SGLang's
  ``--mm-enable-dp-encoder``, vLLM's ``mm_encoder_tp_mode="data"``).
- ``prefixed_conversions``: the naming of checkpoints published before transformers 5
  (``vision_tower.vision_model.*`` for CLIP / SigLIP towers). transformers' loader strips such
  prefixes (``PrefixChange`` in its conversion mapping) and its ``save_pretrained`` of a model
  built from a config leaves them out, so both spellings exist on the Hub; with the prefix
  changes put back, ``revert_weight_conversion`` spells the older one.

transformers is imported only when a generic family is built.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Mapping

__all__ = ["PREFIXED", "encoder_keys", "prefixed_conversions", "text_model_path",
           "tower_paths"]

#: the name of the naming with the prefixes transformers strips on load put back
PREFIXED = "prefixed"


def tower_paths(model: Any) -> list[str]:
    """Paths of nested transformers models built from a config other than the text config
    (GIT's ``image_encoder``, a VL model's vision tower): never the decoder stack."""
    from transformers import PreTrainedModel
    text = model.config.get_text_config()
    return [path for path, module in model.named_modules()
            if path and isinstance(module, PreTrainedModel) and module.config is not text
            and module.config is not model.config]


def text_model_path(model: Any, layers_path: str) -> str:
    """The nearest transformers model holding the decoder layers (a VL model's
    ``model.language_model``; ``""`` when that is the whole model)."""
    from transformers import PreTrainedModel
    parts = layers_path.split(".")[:-1]
    for depth in range(len(parts), 0, -1):
        path = ".".join(parts[:depth])
        if isinstance(model.get_submodule(path), PreTrainedModel):
            return path
    return ""


def encoder_keys(model: Any, layers_path: str, stage_of: Mapping[str, str]) -> set[str]:
    """First-stage keys of ``stage_of`` (state-dict key -> "first" / "last") that belong to
    an encoder: outside the language model, or inside a tower."""
    text = text_model_path(model, layers_path)
    towers = [p + "." for p in tower_paths(model)]
    return {k for k, side in stage_of.items() if side == "first" and (
        (text and not k.startswith(text + ".")) or any(k.startswith(t) for t in towers))}


@contextmanager
def prefixed_conversions(model: Any) -> Iterator[bool]:
    """While open, ``revert_weight_conversion(model, ...)`` also reverts the ``PrefixChange``
    renamings of the model's conversion mapping (the naming older checkpoints use); yields
    False, changing nothing, when the mapping has none."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange
    conversions = get_model_conversion_mapping(model, add_legacy=False)
    if not any(isinstance(c, PrefixChange) for c in conversions):
        yield False
        return
    before = getattr(model, "_weight_conversions", None)
    model._weight_conversions = conversions  # what a model loaded from such a checkpoint has
    try:
        yield True
    finally:
        if before is None:
            del model._weight_conversions
        else:
            model._weight_conversions = before
