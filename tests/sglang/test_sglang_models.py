"""SGLang's own hybrid and MoE models in its CPU engine, pploader's load format against SGLang's
default loader: Qwen3.5 (gated delta net + gated attention), Qwen3.5-MoE (the same with MoE
layers and a gated shared expert) and ZAYA1 (CCA attention + MoE). Marked ``sglang`` (see
test_sglang.py); each fixture starts its engines in a subprocess of its own (``-k hybrid``,
``-k zaya``). SGLang's CPU path for the gated delta net and the shared-expert gate calls
kernels that this machine lacks: the stand-in's plain-torch ones (tests/sglang/stubs), which
transformers' own first token checks.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from engine_suite import PROMPTS, engine_marks, loads, run_engines
from sglang_checks import check_bytes, checkpoint_tensors

pytestmark = engine_marks("sglang")

HERE = Path(__file__).resolve().parent

#: Qwen3.5 (dense): gated delta net (linear attention) and gated full attention alternating,
#: so each PP=2 stage holds one of each; value heads 2 x key heads (SGLang's fused split)
QWEN3_5 = {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
           "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
           "layer_types": ["linear_attention", "full_attention"] * 2,
           "full_attention_interval": 2,   # what SGLang's config reads (it ignores layer_types)
           "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32,
           "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
           "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4, "vocab_size": 2048,
           "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
           "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                               "partial_rotary_factor": 0.25},
           "hidden_act": "silu", "tie_word_embeddings": False, "dtype": "bfloat16",
           "bos_token_id": 1, "eos_token_id": 2}

#: Qwen3.5-MoE: the same layers with MoE blocks (8 experts, 2 a token) and a gated shared
#: expert (SGLang's Qwen2-MoE block; its gate is the Triton kernel the stand-in replaces)
QWEN3_5_MOE = {**QWEN3_5, "architectures": ["Qwen3_5MoeForCausalLM"],
               "model_type": "qwen3_5_moe_text", "num_experts": 8, "num_experts_per_tok": 2,
               "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128,
               "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}


def _stage_of(name: str, split: int) -> int:
    """Which PP=2 stage holds ``name`` when the first ``split`` layers are stage 0: the
    embedding goes first; the final norm and the head last (written from SGLang's PP rule)."""
    if name.startswith("model.layers."):
        return int(name.split(".")[2]) >= split
    return 0 if name.startswith("model.embed_tokens.") else 1


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Qwen3.5 and Qwen3.5-MoE at PP=2 through both loaders, in one engine process."""
    from helpers import make_model
    root = tmp_path_factory.mktemp("sglang-hybrid-ckpts")
    models = {"hybrid": make_model(root / "qwen3_5", QWEN3_5, shard_bytes=1_500_000, seed=8),
              "hybrid-moe": make_model(root / "qwen3_5_moe", QWEN3_5_MOE,
                                       shard_bytes=1_500_000, seed=12)}
    runs = [{"name": f"{name}-pp2{suffix}", "model": str(model), "load_format": fmt, "pp": 2,
             "logprobs": True}
            for name, model in models.items()
            for suffix, fmt in (("", "pploader"), ("-default", "auto"))]
    done = run_engines(HERE / "engine.py", runs, PROMPTS,
                       tmp_path_factory.mktemp("sglang-hybrid"), "sglang")
    return {"models": models, **done}


def _first_tokens_by_transformers(model_dir: Path) -> list[int]:
    """transformers' own model (fp32, its torch gated delta rule): each prompt's argmax."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return [int(model(torch.tensor([p])).logits[0, -1].argmax()) for p in PROMPTS]


def _check_hybrid_pp2(hybrid: dict[str, Any], name: str) -> None:
    """The default loader's greedy tokens and log-probabilities, all finite, the first token
    transformers' own; each rank read exactly its stage's tensors (counted here from the
    checkpoint by the layer split), by its count and by rchar."""
    from safetensors import safe_open
    model = hybrid["models"][name]
    run, ref = hybrid[f"{name}-pp2"], hybrid[f"{name}-pp2-default"]
    assert run["tokens"] == ref["tokens"]
    assert run["logprobs"] == ref["logprobs"]
    for probs in run["logprobs"]:
        assert len(probs) == 8 and all(math.isfinite(p) and p <= 0 for p in probs), probs
    assert [t[0] for t in run["tokens"]] == _first_tokens_by_transformers(model)
    stages = loads(run)
    assert [(x["start_layer"], x["end_layer"]) for x in stages] == [(0, 2), (2, 4)]
    check_bytes(run)
    want = [[0, 0], [0, 0]]   # per stage: tensors, bytes
    for shard in sorted(model.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as fh:
            for tensor in fh.keys():
                t = fh.get_slice(tensor)
                nbytes = math.prod(t.get_shape()) * {"BF16": 2, "F32": 4}[t.get_dtype()]
                stage = _stage_of(tensor, 2)
                want[stage][0] += 1
                want[stage][1] += nbytes
    assert [[x["items"], x["read_bytes"]] for x in stages] == want
    count, total = checkpoint_tensors(model)
    assert count == want[0][0] + want[1][0] and total == want[0][1] + want[1][1]


def test_hybrid_gated_delta_net_pp2(hybrid: dict[str, Any]) -> None:
    """Qwen3.5 (gated delta net + gated attention, one of each per stage) at PP=2."""
    _check_hybrid_pp2(hybrid, "hybrid")


def test_hybrid_moe_pp2(hybrid: dict[str, Any]) -> None:
    """Qwen3.5-MoE (the same, with MoE layers and a gated shared expert) at PP=2: each stage
    reads its experts and shared expert only. (SGLang's Qwen3-Next refuses PP itself.)"""
    _check_hybrid_pp2(hybrid, "hybrid-moe")


ZAYA_PROMPTS = [[5, 17, 42, 99, 3, 8], [200, 1, 7]]   # ids below the tiny vocabulary (256)


@pytest.fixture(scope="module")
def zaya(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """ZAYA1 (CCA attention + MoE layers, SGLang's own ``zaya`` model) at PP=2 and TP=2
    through both loaders, in their own engine process (``-k zaya``)."""
    from zaya_release import CONFIG, write_release
    config = dict(CONFIG, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2)
    model = write_release(tmp_path_factory.mktemp("zaya") / "release", config,
                          model_values=True)
    runs = [{"name": f"zaya-{name}{suffix}", "model": str(model), "load_format": fmt,
             **layout, "logprobs": True}
            for name, layout in (("pp2", {"pp": 2}), ("tp2", {"tp": 2}))
            for suffix, fmt in (("", "pploader"), ("-default", "auto"))]
    done = run_engines(HERE / "engine.py", runs, ZAYA_PROMPTS,
                       tmp_path_factory.mktemp("sglang-zaya"), "sglang")
    return {"model": model, "config": config, **done}


def test_zaya_pp2_and_tp2_same_tokens_and_only_stage_bytes(zaya: dict[str, Any]) -> None:
    """ZAYA1 in SGLang's CPU engine: at PP=2 and at TP=2 the default loader's greedy tokens and
    log-probabilities; at PP=2 each rank read exactly the tensors tests/zaya_ref.py gives its
    stage (SGLang's 3 + 4 split of 7 layers). Its ``load_weights`` calls the ``FusedMoE``'s
    ``weight_loader`` itself: pploader had refused the load ("w13_weight not loaded"). Not
    run: EP, where SGLang's CPU MoE (``moe_forward_native``) fails on the -1 ids of experts
    held elsewhere with its own loader too."""
    import zaya_ref
    from pploader.planning.checkpoint import open_checkpoint
    for name in ("zaya-pp2", "zaya-tp2"):
        run, ref = zaya[name], zaya[f"{name}-default"]
        assert run["tokens"] == ref["tokens"] and run["logprobs"] == ref["logprobs"], name
        assert all(math.isfinite(p) for probs in run["logprobs"] for p in probs), name
        assert all(len(set(tokens)) > 1 for tokens in run["tokens"]), run["tokens"]
    stages = loads(zaya["zaya-pp2"])
    assert [(x["start_layer"], x["end_layer"]) for x in stages] == [(0, 3), (3, 7)]
    index = open_checkpoint(str(zaya["model"]))
    for stage, load in enumerate(stages):
        want = [n for n in index.weight_map if zaya_ref.owns(n, zaya["config"], 2, stage, 1, 0)]
        assert load["items"] == len(want)
        assert load["read_bytes"] == sum(index.entry(n).nbytes for n in want)
    check_bytes(zaya["zaya-pp2"])
    check_bytes(zaya["zaya-tp2"], tp=2)
