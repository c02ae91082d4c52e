"""integrations/engine_plan.py: an engine's view of a stage (expert parallelism riding on TP,
local experts whole; the tied head under the engine's names), without an engine."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import make_model, reference_tensors, tiny_config
from pploader import Topology, plan_stage
from pploader.integrations.engine_plan import (engine_names, engine_stage, expert_of,
                                               linear_experts, round_robin_experts)
from pploader.integrations.placed import stage_weights

MOE = dict(tiny_config("tiny-qwen3_moe"), num_experts=7)


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("moe"), MOE)


def test_placements() -> None:
    assert [sorted(linear_experts(7, 2, r)) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6]]
    assert [sorted(round_robin_experts(7, 2, r)) for r in range(2)] == [[0, 2, 4, 6], [1, 3, 5]]
    for n in range(1, 20):
        for ep in range(1, n + 1):
            for place in (linear_experts, round_robin_experts):
                parts = [place(n, ep, r) for r in range(ep)]
                assert sorted(e for p in parts for e in p) == list(range(n))


@pytest.mark.parametrize("placement", [linear_experts, round_robin_experts])
@pytest.mark.parametrize("pp_rank", [0, 1])
def test_ep_reads_local_experts_whole_and_the_rest_by_tp(moe: Path, placement, pp_rank: int
                                                         ) -> None:
    """TP=2 with the engine's EP over the same 2 ranks: each rank reads exactly its local
    experts' whole tensors and its TP slice of everything else; the two ranks' experts are
    disjoint and cover all experts."""
    ref = reference_tensors(moe)
    n = MOE["num_experts"]
    seen: dict[int, set[int]] = {}
    for tp_rank in range(2):
        topo = Topology(2, 2, 1, pp_rank * 2 + tp_rank)
        local = placement(n, 2, tp_rank)
        staged = engine_stage(str(moe), topo, (3, 3), local_experts=local)
        tp_plan = plan_stage(moe, topo, partition=[3, 3], range_cost_bytes=0)
        experts = set()
        for item in staged.plan.items:
            expert, fused = expert_of(staged, item)
            assert not fused
            if expert is None:   # non-expert tensors: the TP plan's items, unchanged
                assert item in tp_plan.plan.items, item.name
                continue
            experts.add(expert)
            assert item.shape == tuple(ref[item.name].shape)   # whole, not TP-split
        assert experts == set(local)
        seen[tp_rank] = experts
        reader, stream = stage_weights(staged, "placed", "threaded")
        got = dict(stream)
        for item in staged.plan.items:
            if expert_of(staged, item)[0] is not None:
                assert torch.equal(got[item.name], ref[item.name])
        # bytes read: the non-expert TP slices plus the local experts whole, nothing else
        assert reader.stats.read_bytes == staged.plan.ideal_bytes
    assert seen[0] | seen[1] == set(range(n)) and not seen[0] & seen[1]


def test_ep_refuses_experts_the_checkpoint_lacks(moe: Path) -> None:
    from pploader.errors import PlanError
    with pytest.raises(PlanError, match=r"experts \[9\]"):
        engine_stage(str(moe), Topology(1, 2, 1, 0), (6,), local_experts=frozenset({0, 9}))


def test_tied_last_stage_names_and_a_stored_head(tmp_path: Path) -> None:
    """Tied config: the last stage hands the embedding as model.embed_tokens.weight and
    lm_head.weight; a checkpoint that also stores an lm_head (ignored by a tied model) has
    the embedding read for the engine's tied head instead of the stored head."""
    cfg = tiny_config(num_hidden_layers=4, tie_word_embeddings=True)
    model = make_model(tmp_path / "tied", cfg)
    staged = engine_stage(str(model), Topology(2, 1, 1, 1), (2, 2))
    tied = [i for i in staged.plan.items if i.target != i.name]
    assert [engine_names(staged, i) for i in tied] == \
        [("model.embed_tokens.weight", "lm_head.weight")]
    # the same checkpoint with a stored head (different bytes from the embedding)
    import json

    from safetensors.torch import load_file, save_file
    index = json.loads((model / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["model.norm.weight"]
    tensors = load_file(str(model / shard))
    tensors["lm_head.weight"] = torch.zeros(cfg["vocab_size"], cfg["hidden_size"],
                                            dtype=tensors["model.norm.weight"].dtype)
    save_file(tensors, str(model / shard), metadata={"format": "pt"})
    index["weight_map"]["lm_head.weight"] = shard
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    plain = plan_stage(model, Topology(2, 1, 1, 1), partition=[2, 2])
    assert "lm_head.weight" in {i.name for i in plain.plan.items}   # pploader reads it
    staged = engine_stage(str(model), Topology(2, 1, 1, 1), (2, 2))
    names = [n for i in staged.plan.items for n in engine_names(staged, i)]
    assert "model.embed_tokens.weight" in names and names.count("lm_head.weight") == 1
    reader, stream = stage_weights(staged, "placed", "threaded")
    got = dict(stream)
    ref = reference_tensors(model)
    assert torch.equal(got["model.embed_tokens.weight"], ref["model.embed_tokens.weight"])


#: GLM-4.5-style (the generic family's DeepSeek-style MTP layers): 3 layers + MTP layer 3
GLM_MTP = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
           "dtype": "bfloat16", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
           "moe_intermediate_size": 32, "num_hidden_layers": 3, "first_k_dense_replace": 1,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "partial_rotary_factor": 0.5, "attention_bias": True, "use_qk_norm": False,
           "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
           "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
           "norm_topk_prob": True, "num_nextn_predict_layers": 1, "hidden_act": "silu",
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 64,
           "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}


def test_engine_draft_is_the_mtp_layer_under_checkpoint_names(tmp_path: Path) -> None:
    """A draft's plan on the generic family: exactly checkpoint layer 3's tensors, handed
    whole under their checkpoint names, with the shared components left out; the bytes
    streamed equal the checkpoint's; a layer of nothing but shared components is refused."""
    from pploader import PlanError
    from pploader.families.generic_mtp import TARGET_SHARED
    from pploader.integrations.engine_plan import engine_draft
    model_dir = make_model(tmp_path / "glm", GLM_MTP, shard_bytes=40_000)
    ref = reference_tensors(model_dir)
    mtp = {n for n in ref if n.startswith("model.layers.3.")}
    staged = engine_draft(str(model_dir), 0, shared=TARGET_SHARED)
    kept = mtp - {"model.layers.3.embed_tokens.weight", "model.layers.3.shared_head.head.weight"}
    assert set(staged.plan.tensors) == kept
    assert all(i.target == i.name for i in staged.plan.items)
    _, stream = stage_weights(staged, "full")
    got = dict(stream)
    assert set(got) == kept and all(torch.equal(got[n], ref[n]) for n in kept)
    assert set(engine_draft(str(model_dir), 0).plan.tensors) == mtp
    everything = {n.removeprefix("model.layers.3.") for n in mtp}
    with pytest.raises(PlanError, match="only components the engine shares"):
        engine_draft(str(model_dir), 0, shared=frozenset(everything))
    with pytest.raises(PlanError, match="MTP layer 1 requested"):
        engine_draft(str(model_dir), 1)
