"""The generic family's conversion cross-check on sampled layers (families/hf_check.py).

The check converts two layers of each kind (and every tensor outside the layers) with
transformers' own ``revert_weight_conversion``; the derivation gives every other layer its
representative's components. Here the whole model is converted, as the check did before, and
must equal the derived template on every layer; a tampered sampled name must be refused.
"""
from __future__ import annotations

from typing import Any

import pytest

from pploader.errors import ConfigError
from pploader.families.hf_check import check_conversion, pin_conversions, sampled_layers
from pploader.families.hf_meta import _derive, build_meta_model

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

#: GLM-4.5-style: one dense layer then MoE layers (stacked experts in transformers, one tensor
#: per expert on disk: a conversion on every MoE layer), 12 layers (two-digit indices)
GLM = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_size": 64,
       "intermediate_size": 128, "moe_intermediate_size": 32, "num_attention_heads": 4,
       "num_key_value_heads": 2, "head_dim": 16, "n_routed_experts": 4, "n_shared_experts": 1,
       "num_experts_per_tok": 2, "first_k_dense_replace": 1, "num_hidden_layers": 12,
       "vocab_size": 128, "n_group": 1, "topk_group": 1, "torch_dtype": "bfloat16",
       "tie_word_embeddings": False}


def _meta(n: int) -> Any:
    return torch.empty(n, device="meta")


def test_sampled_layers_are_each_kinds_first_and_last_and_any_other_dtype() -> None:
    a, b = (("w", (2,)),), (("w", (2,)), ("v", (3,)))
    signature = {0: a, 1: b, 2: a, 3: b, 4: a, 5: b}
    reps = {a: 0, b: 1}
    state = {f"L.{i}.{rel}": _meta(2) for i, sig in signature.items() for rel, _ in sig}
    assert sampled_layers(signature, reps, state, "L.") == {0, 1, 4, 5}
    state["L.2.w"] = torch.empty(2, device="meta", dtype=torch.float16)
    assert sampled_layers(signature, reps, state, "L.") == {0, 1, 2, 4, 5}


def test_derived_template_equals_the_whole_model_conversion() -> None:
    """What the sampled check stands for: every layer, converted by transformers, has the
    names and shapes the derivation gave it."""
    from transformers.core_model_loading import revert_weight_conversion
    from pploader.families.hf_meta import _saved_state
    meta = _derive(GLM)
    model = build_meta_model(GLM)
    state, _ = _saved_state(model)
    whole = {k: tuple(v.shape) for k, v in revert_weight_conversion(model, dict(state)).items()}
    assert dict(meta.namings[0].template) == whole
    assert any(".mlp.experts.3.down_proj.weight" in n for n in whole)  # a real conversion
    assert meta.num_layers == 12 and meta.moe_layers == frozenset(range(1, 12))


def test_a_wrong_name_in_a_sampled_layer_is_refused() -> None:
    from pploader.families.hf_meta import _saved_state
    model = build_meta_model(GLM)
    pin_conversions(model)
    state, _ = _saved_state(model)
    meta = _derive(GLM)
    template = dict(meta.namings[0].template)
    layer_of = {k: (int(k.split(".")[2]), k.split(".", 3)[3]) for k in state
                if k.startswith("model.layers.")}
    names = {i: {n: n.replace(f"layers.{i}.", f"layers.{min(i, 1)}.", 1)
                 for n in template if n.startswith(f"model.layers.{i}.")} for i in range(12)}
    sample = frozenset({0, 1, 11})
    dtypes = check_conversion(model, state, layer_of, sample, template, names)
    assert dtypes["model.layers.11.mlp.experts.0.up_proj.weight"] == "bfloat16"
    bad = dict(template)
    bad["model.layers.11.mlp.experts.9.up_proj.weight"] = bad.pop(
        "model.layers.11.mlp.experts.3.up_proj.weight")
    names[11] = {n: n for n in bad if n.startswith("model.layers.11.")}
    with pytest.raises(ConfigError, match="disagrees with save_pretrained"):
        check_conversion(model, state, layer_of, sample, bad, names)


def test_pinned_conversions_change_no_conversion() -> None:
    """The conversion list pinned on the meta model is the one each call would look up."""
    from transformers.core_model_loading import revert_weight_conversion
    from pploader.families.hf_meta import _saved_state
    model = build_meta_model(GLM)
    state, _ = _saved_state(model)
    before = {k: tuple(v.shape) for k, v in revert_weight_conversion(model, dict(state)).items()}
    pin_conversions(model)
    assert getattr(model, "_weight_conversions", None)
    after = {k: tuple(v.shape) for k, v in revert_weight_conversion(model, dict(state)).items()}
    assert after == before and list(after) == list(before)
