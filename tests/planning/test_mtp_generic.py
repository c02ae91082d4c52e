"""MTP layers through the generic family (families/generic_mtp.py): a GLM-4.5-style checkpoint.

``Glm4MoeForCausalLM`` (no hand-written family) with ``num_nextn_predict_layers = 1`` stores its
MTP layer as ``model.layers.{num_hidden_layers}.*``: the last decoder layer (attention + MoE)
plus ``embed_tokens``, ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.{norm,head}``. A draft
plan reads exactly those, renamed to layer 0; EP splits its experts; main stages never read it;
a checkpoint whose MTP layer lacks a tensor is refused naming it.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from helpers import make_model, reference_tensors
from pploader import PlanError, Topology, iter_mtp_weights
from pploader.planning.checkpoint import open_checkpoint
from pploader.planning.plan import plan_all, plan_mtp
from pploader.planning.spec import load_spec
from pploader.tiny import write_checkpoint

pytest.importorskip("transformers")

#: 3 decoder layers (one dense, two MoE) + 1 MTP layer (model.layers.3)
GLM_MTP = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_size": 64,
           "intermediate_size": 128, "moe_intermediate_size": 32, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "n_routed_experts": 4,
           "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
           "num_hidden_layers": 3, "num_nextn_predict_layers": 1, "vocab_size": 128,
           "n_group": 1, "topk_group": 1, "attention_bias": True, "torch_dtype": "float32",
           "tie_word_embeddings": False}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def _layer(name: str) -> int:
    m = _LAYER.match(name)
    return int(m.group(1)) if m else -1


@pytest.fixture(scope="module")
def glm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("glm-mtp"), GLM_MTP, shard_bytes=40_000)


def test_draft_reads_the_mtp_layer_renamed_to_layer0(glm: Path) -> None:
    spec, index = load_spec(glm), open_checkpoint(glm)
    assert spec.family.name == "generic:glm4_moe"
    assert (spec.num_layers, spec.num_mtp_layers) == (3, 1)
    mtp = {n for n in index.weight_map if _layer(n) == 3}
    assert {"model.layers.3.eh_proj.weight", "model.layers.3.shared_head.head.weight",
            "model.layers.3.mlp.experts.3.down_proj.weight",
            "model.layers.3.mlp.gate.e_score_correction_bias"} <= mtp
    plan = plan_mtp(spec, index, 0)
    assert set(plan.tensors) == mtp and len(plan.items) == len(mtp)
    assert all(i.target == i.name.replace("model.layers.3.", "model.layers.0.", 1)
               for i in plan.items)
    ref = reference_tensors(glm)
    got = dict(iter_mtp_weights(glm, 0))
    assert set(got) == {i.target for i in plan.items}
    for item in plan.items:
        assert torch.equal(got[item.target], ref[item.name]), item.name
    with pytest.raises(PlanError, match="MTP layer 1 requested"):
        plan_mtp(spec, index, 1)


def test_draft_under_ep_and_tp(glm: Path) -> None:
    spec, index = load_spec(glm), open_checkpoint(glm)
    mtp = {n: index.entry(n).nbytes for n in index.weight_map if _layer(n) == 3}
    for rank in range(2):
        plan = plan_mtp(spec, index, 0, Topology(1, 1, 2, rank))
        ids = {int(m.group(1)) for n in plan.tensors if (m := _EXPERT.search(n))}
        assert ids == ({0, 1} if rank == 0 else {2, 3})
        assert {n for n in mtp if not _EXPERT.search(n)} <= set(plan.tensors)
    read: dict[str, int] = {}
    for rank in range(2):  # TP=2: split tensors add up, replicated ones (norms, router) whole
        for item in plan_mtp(spec, index, 0, Topology(1, 2, 1, rank)).items:
            read[item.name] = read.get(item.name, 0) + item.nbytes
    for name, whole in mtp.items():
        assert read[name] in (whole, 2 * whole), name
    assert read["model.layers.3.eh_proj.weight"] == 2 * mtp["model.layers.3.eh_proj.weight"]
    assert read["model.layers.3.shared_head.head.weight"] == \
        mtp["model.layers.3.shared_head.head.weight"]  # vocab rows split like the embedding


def test_main_stages_never_read_the_mtp_layer(glm: Path) -> None:
    spec, index = load_spec(glm), open_checkpoint(glm)
    for pp in (1, 2, 3):
        for plan in plan_all(spec, index, pp, 1, 1):
            assert not [n for n in plan.tensors if _layer(n) == 3], pp


def test_mtp_layer_missing_a_tensor_is_refused(glm: Path, tmp_path: Path) -> None:
    """A checkpoint whose MTP layer shares the target's head (no ``shared_head.head``): the
    draft is refused naming the tensor, never planned without it."""
    ref = reference_tensors(glm)
    ref.pop("model.layers.3.shared_head.head.weight")
    out = tmp_path / "no-head"
    write_checkpoint(out, ref, json.loads((glm / "config.json").read_text()))
    spec, index = load_spec(out), open_checkpoint(out)
    with pytest.raises(PlanError, match=r"missing from the checkpoint: "
                       r"model\.layers\.3\.shared_head\.head\.weight"):
        plan_mtp(spec, index, 0)
    assert plan_all(spec, index, 2, 1, 1)  # main stages are unaffected
