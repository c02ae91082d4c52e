"""Architectures vLLM serves through its transformers backend, split by the model's
``base_model_tp_plan`` (pploader/families/hf_tp_plan.py): tiny transformers checkpoints
loaded on CPU at PP=2 x TP=2, every tensor of every rank bitwise equal to the slice
tests/hf_plan_ref.py computes on its own from the plans and vLLM's fusions (AXK2's MLA and
GLUs, Phi-4-multimodal's towers' q / k / v, which vLLM merges whatever the plan says); the
refusals (a style vLLM has no linear class for, a non-string style, sizes that do not divide,
a linear the backend's fusers may merge in a class whose fusion is not recorded, a model type
the transformers vLLM 0.32 accepts lacks, a model vLLM cannot build); the generic TP plans
already derived left alone.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import generic_sweep
from helpers import reference_tensors
from hf_plan_ref import PLANS, plan_slices
from pploader import PPLoaderError
from pploader.io.read import Reader
from pploader.planning.checkpoint import open_checkpoint
from pploader.planning.plan import plan_all
from pploader.planning.spec import load_spec

pytest.importorskip("transformers")


def _tiny(model_type: str, out: Path) -> None:
    generic_sweep._checkpoint(model_type, generic_sweep.causal_lm_types()[model_type], out)


@pytest.mark.parametrize("model_type", sorted(PLANS))
def test_pp2_tp2_bytes_equal_the_plan_slices(model_type: str, tmp_path: Path) -> None:
    _tiny(model_type, tmp_path)
    spec, index = load_spec(tmp_path), open_checkpoint(tmp_path)
    assert spec.family.name == f"generic:{model_type}"
    ref = reference_tensors(tmp_path)
    split: set[str] = set()
    seen: set[str] = set()
    for plan in plan_all(spec, index, 2, 2, 1):
        got = dict(Reader(plan))
        for item in plan.items:
            full = ref[item.name]
            slices, pad = plan_slices(model_type, item.name, full.shape, 2,
                                      plan.topology.tp_rank)
            want = full[slices]
            if pad:
                want = torch.cat([want, want.new_zeros((pad,) + tuple(want.shape[1:]))])
            assert torch.equal(got[item.target], want), (plan.topology.rank, item.name)
            if want.shape != full.shape:
                split.add(item.name.rsplit(".", 2)[-2])
            seen.add(item.name)
    assert seen == set(index.weight_map)
    # every plan entry present in the checkpoint is split (the reference is not all-whole)
    assert {k.rsplit(".", 1)[-1] for k in PLANS[model_type]} <= split


def _neox(out: Path, **changes: Any) -> Path:
    """A tiny GPT-NeoX checkpoint with ``changes`` in its config (before building)."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
    sizes = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=128, max_position_embeddings=64)
    config = GPTNeoXConfig(**{**sizes, **changes})
    config.architectures = ["GPTNeoXForCausalLM"]
    torch.manual_seed(0)
    GPTNeoXForCausalLM(config).save_pretrained(out)
    return out


def _refusal(path: Path, tp: int = 2) -> PPLoaderError:
    spec, index = load_spec(path), open_checkpoint(path)
    with pytest.raises(PPLoaderError) as info:
        plan_all(spec, index, 2, tp, 1)
    return info.value


def _with_plan(path: Path, plan: dict[str, Any]) -> Path:
    config = json.loads((path / "config.json").read_text())
    config["base_model_tp_plan"] = plan
    (path / "config.json").write_text(json.dumps(config))
    return path


_NEOX_PLAN = {"layers.*.attention.query_key_value": "colwise",
              "layers.*.attention.dense": "rowwise",
              "layers.*.mlp.dense_h_to_4h": "colwise",
              "layers.*.mlp.dense_4h_to_h": "rowwise"}


@pytest.mark.parametrize("style", ["packed_colwise", ["colwise"]])
def test_a_style_vllm_has_no_linear_for_is_refused(style: Any, tmp_path: Path) -> None:
    path = _with_plan(_neox(tmp_path), {**_NEOX_PLAN, "layers.*.mlp.dense_h_to_4h": style})
    exc = _refusal(path)
    assert exc.tensor is not None and "mlp.dense_h_to_4h" in exc.tensor
    assert repr(style) in str(exc) and "base_model_tp_plan" in str(exc)
    assert plan_all(load_spec(path), open_checkpoint(path), 2, 1, 1)  # TP=1 still plans


def test_sizes_that_do_not_divide_are_refused(tmp_path: Path) -> None:
    exc = _refusal(_neox(tmp_path, intermediate_size=130), tp=4)  # 130 rows over 4 ranks
    assert exc.tensor is not None and "mlp.dense_" in exc.tensor
    assert "130 does not divide" in str(exc) and "tp=4" in str(exc)


def test_a_replicated_linear_the_fusers_may_merge_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a class whose fusion is not recorded (GPT-NeoX's attention, taken out of the table): a
    # plan naming only its fused qkv leaves the attention's dense replicated beside a
    # column-parallel sibling, which vLLM's fusers may turn row-parallel
    from pploader.families import hf_fusers
    monkeypatch.delitem(hf_fusers.FUSIONS, "GPTNeoXAttention")
    # (a config of its own: derived structures are memoized per config)
    path = _with_plan(_neox(tmp_path, intermediate_size=192), {k: v for k, v in _NEOX_PLAN.items()
                                        if "attention.dense" not in k})
    exc = _refusal(path)
    assert exc.tensor is not None and "attention.dense" in exc.tensor
    assert "fuse" in str(exc) and "GPTNeoXAttention" in str(exc)


def test_a_recorded_unfused_class_takes_the_plan(tmp_path: Path) -> None:
    # GPT-NeoX's attention is recorded as traced and left unfused by vLLM: the dense the plan
    # leaves out is a ReplicatedLinear, whole on every rank
    path = _with_plan(_neox(tmp_path), {k: v for k, v in _NEOX_PLAN.items()
                                        if "attention.dense" not in k})
    dense = "gpt_neox.layers.0.attention.dense.weight"
    ref = reference_tensors(path)
    for plan in plan_all(load_spec(path), open_checkpoint(path), 1, 2, 1):
        got = dict(Reader(plan))
        item = next(i for i in plan.items if i.name == dense)
        assert torch.equal(got[item.target], ref[dense])


@pytest.mark.parametrize("model_type", ["dory", "flint", "lfm3"])
def test_a_type_the_transformers_vllm_accepts_lacks_is_refused(model_type: str,
                                                                tmp_path: Path) -> None:
    # vLLM 0.32 requires transformers <5.20, which has no such model type
    _tiny(model_type, tmp_path)
    exc = _refusal(tmp_path)
    assert exc.tensor is not None
    assert "transformers <5.20" in str(exc) and repr(model_type) in str(exc)
    assert plan_all(load_spec(tmp_path), open_checkpoint(tmp_path), 2, 1, 1)  # TP=1 plans


@pytest.mark.parametrize(("model_type", "layer", "cls"), [
    ("diffllama", 0, "DiffLlamaAttention"), ("minimax", 1, "MiniMaxDecoderLayer")])
def test_a_model_vllm_cannot_build_is_refused(model_type: str, layer: int, cls: str,
                                              tmp_path: Path) -> None:
    # vLLM makes each layer's attention from the module that calls transformers' attention
    # interface; DiffLlama's differential attention and MiniMax's lightning layers call none,
    # so vLLM refuses to build the model (at any TP), whatever its fusers would merge
    _tiny(model_type, tmp_path)
    exc = _refusal(tmp_path)
    assert exc.tensor is not None
    assert f"layer {layer}, {cls}" in str(exc) and "attention interface" in str(exc)
    assert plan_all(load_spec(tmp_path), open_checkpoint(tmp_path), 2, 1, 1)  # TP=1 plans


def test_attention_interface_calls_are_found() -> None:
    from transformers.models.diffllama import modeling_diffllama as dl
    from transformers.models.llama import modeling_llama as ll
    from pploader.families.hf_fusers import _calls_interface
    assert _calls_interface(ll.LlamaAttention)
    assert not _calls_interface(dl.DiffLlamaAttention)
    assert not _calls_interface(ll.LlamaMLP)


def test_the_plan_is_derived_only_for_transformers_backend_architectures(
        tmp_path: Path) -> None:
    from pploader.families.hf_meta import derive
    from pploader.families.hf_tp_plan import TRANSFORMERS_BACKEND
    _neox(tmp_path)
    _tiny("llama", tmp_path / "llama")
    neox = derive(json.loads((tmp_path / "config.json").read_text()))
    llama = derive(json.loads((tmp_path / "llama" / "config.json").read_text()))
    assert neox.architecture in TRANSFORMERS_BACKEND and llama.tp_plan == {}
    assert neox.tp_plan["attention.query_key_value.weight"] == "dim0"
    assert neox.tp_plan["attention.dense.bias"] == "whole"
    assert neox.tp_plan["embed_out.weight"] == "vocab"  # as saved (model: lm_head)


def test_style_lookup_is_vllms_prefix_match() -> None:
    from pploader.families.hf_tp_plan import _style
    plan = {"embed_tokens": "embedding_rowwise", "layers.*.mlp": "rowwise",
            "layers.*.mlp.fc": "colwise"}
    assert _style(plan, "embed_tokens_extend.proj") == "embedding_rowwise"  # a prefix
    assert _style(plan, "layers.3.mlp.fc") == "rowwise"  # the first key that matches wins
    assert _style(plan, "norm") == "replicate"


def test_kv_heads_fewer_than_tp_are_replicated_as_the_fused_qkv_holds_them(
        tmp_path: Path) -> None:
    # Doge's q / k / v are column-parallel side by side: vLLM fuses them into one
    # QKVParallelLinear, which puts a whole KV head on each rank when there are fewer than TP
    from transformers import DogeConfig, DogeForCausalLM
    config = DogeConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=1, intermediate_size=128,
                        max_position_embeddings=64, is_moe=False)
    config.architectures = ["DogeForCausalLM"]
    torch.manual_seed(0)
    DogeForCausalLM(config).save_pretrained(tmp_path)
    spec, index = load_spec(tmp_path), open_checkpoint(tmp_path)
    ref = reference_tensors(tmp_path)
    got: dict[tuple[int, str], torch.Tensor] = {}
    for plan in plan_all(spec, index, 1, 2, 1):
        out = dict(Reader(plan))
        for item in plan.items:
            got[plan.topology.tp_rank, item.name] = out[item.target]
    k, q = "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.q_proj.weight"
    assert ref[k].shape == (16, 64)  # one KV head of 16
    assert torch.equal(got[0, k], ref[k]) and torch.equal(got[1, k], ref[k])
    assert torch.equal(got[1, q], ref[q][32:])  # query heads 2-3 on rank 1
