"""Pipeline forward over gloo reproduces single-process transformers logits.

Each tiny model is built by transformers, written with ``save_pretrained`` (the real on-disk
layout: per-expert tensors, Nemotron-H's ``backbone.`` prefix, ...), loaded per stage through
pploader and run stage to stage over gloo; the last stage's logits must match the reference
model loaded by ``from_pretrained`` from the same directory (fp32, max abs diff <= 1e-5).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import reference_tensors, run_ranks
from pploader import Topology
from pploader.distributed.comm import Comm
from pploader.errors import PlanError
from pploader.planning.partition import even_windows

transformers = pytest.importorskip("transformers")  # the `hf` extra; installed in CI

from pploader.integrations.hf import (HFStage, PassThrough, build_stage,  # noqa: E402
                                      load_stage_weights, pipeline_forward, stage_skeleton)

TOL = 1e-5
BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
GDN = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
           linear_value_head_dim=8, linear_conv_kernel_dim=4,
           layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])
MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8,
              mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8)

#: family -> (config class, model class, config kwargs): tiny, fp32, 4 layers.
MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(BASE)),
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", dict(BASE, tie_word_embeddings=True)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(BASE, **MOE, decoder_sparse_step=1, mlp_only_layers=[0])),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict({k: v for k, v in BASE.items() if k != "head_dim"},
                         num_key_value_heads=4, moe_intermediate_size=16, n_routed_experts=4,
                         n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                         first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=8,
                         qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8)),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(BASE, **MOE, **GDN, shared_expert_intermediate_size=16)),
    "jamba": ("JambaConfig", "JambaForCausalLM",
              dict(BASE, num_experts=4, num_experts_per_tok=2, attn_layer_period=2,
                   attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                   mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4)),
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM",
                  dict(BASE, **MAMBA2, mamba_d_ssm=64, embedding_multiplier=2.5,
                       lm_head_multiplier=0.7)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(BASE, num_local_experts=4, num_experts_per_tok=2)),
    "bamba": ("BambaConfig", "BambaForCausalLM", dict(BASE, **MAMBA2, attn_layer_indices=[1, 3])),
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM",
                   dict({k: v for k, v in BASE.items() if k != "num_hidden_layers"},
                        hybrid_override_pattern="M*M-", mamba_num_heads=4, mamba_head_dim=16,
                        n_groups=1, ssm_state_size=8, conv_kernel=4, expand=2, chunk_size=8)),
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",
                         dict(BASE, **MAMBA2, num_local_experts=4, num_experts_per_tok=2,
                              shared_intermediate_size=16,
                              layer_types=["mamba", "attention", "mamba", "attention"],
                              embedding_multiplier=3.0, logits_scaling=2.0,
                              residual_multiplier=0.5, attention_multiplier=0.3)),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(BASE, **GDN)),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
                    dict(BASE, **MOE, **GDN, shared_expert_intermediate_size=16)),
    "qwen3_5_moe_vl": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration",
                       dict(text_config=dict(BASE, **MOE, **GDN,
                                             shared_expert_intermediate_size=16),
                            vision_config=dict(depth=1, hidden_size=16, intermediate_size=32,
                                               num_heads=2, out_hidden_size=32, patch_size=4,
                                               num_position_embeddings=16))),
}
#: models also written with fused 3-D expert tensors (``save_original_format=False``)
FUSED = ("qwen3_moe", "deepseek_v3")


def _make(root: Path, name: str, *, fused: bool = False) -> Path:
    cfg_cls, model_cls, kwargs = MODELS[name]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**kwargs))
    out = root / (name + "_fused" if fused else name)
    model.float().save_pretrained(out, **({"save_original_format": False} if fused else {}))
    return out


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf-models")
    models = {name: _make(root, name) for name in MODELS}
    models.update({name + "_fused": _make(root, name, fused=True) for name in FUSED})
    return models


def _inputs() -> dict[str, torch.Tensor]:
    """Two sequences of 11 tokens (more than one Mamba2 chunk), the second left-padded."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, BASE["vocab_size"], (2, 11), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _reference(path: Path) -> torch.Tensor:
    """Logits of the whole model loaded by transformers itself from the same directory."""
    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, arch).from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(**_inputs(), use_cache=False).logits


def _pipeline_rank(rank: int, world: int, models: dict[str, str]) -> dict[str, dict]:
    """One gloo rank: build its stage of every model and run the pipeline forward."""
    topo = Topology.for_world(world, rank)
    comm = Comm(topo, timeout_s=60)
    out = {}
    inputs = _inputs()
    for name, path in models.items():
        stage = build_stage(path, topo)
        ids = inputs["input_ids"]
        logits = pipeline_forward(stage, ids, comm, attention_mask=inputs["attention_mask"])
        out[name] = {"logits": logits, "tensors": list(stage.plan.tensors),
                     "window": (stage.window.start_layer, stage.window.end_layer),
                     "layer_params": _layer_params(stage)}
    comm.close()
    return out


def _layer_params(stage: HFStage) -> list[int]:
    """Per decoder layer: its number of materialised parameters on this stage."""
    return [sum(p.numel() for p in layer.parameters() if not p.is_meta) for layer in stage.layers]


@pytest.mark.slow
@pytest.mark.parametrize("pp", [2, 3])
def test_pipeline_forward_matches_single_process(hf_models: dict[str, Path], pp: int) -> None:
    results = run_ranks(_pipeline_rank, pp, {k: str(v) for k, v in hf_models.items()},
                        timeout_s=180)
    for name, path in hf_models.items():
        want = _reference(path)
        got = results[-1][name]["logits"]
        assert all(r[name]["logits"] is None for r in results[:-1])
        assert got.shape == want.shape and got.dtype == torch.float32
        diff = (got - want).abs().max().item()
        assert diff <= TOL, f"{name} pp={pp}: max abs diff {diff}"
        # the stages split the layers and own nothing outside their window
        windows = [r[name]["window"] for r in results]
        assert windows[0][0] == 0 and windows[-1][1] == 4
        assert all(a[1] == b[0] for a, b in zip(windows, windows[1:]))
        for r in results:
            start, end = r[name]["window"]
            owned = [n > 0 for n in r[name]["layer_params"]]
            assert owned == [start <= i < end for i in range(4)], (name, owned)
        # every checkpoint tensor was read by exactly one stage (a tied head re-reads the embedding)
        read = [t for r in results for t in r[name]["tensors"]]
        assert set(read) == set(reference_tensors(path))
        twice = {t for t in read if read.count(t) > 1}
        assert twice == ({"model.embed_tokens.weight"} if name.endswith("_tied") else set())


@pytest.mark.slow
def test_stage_skeleton_materialises_nothing_and_keeps_layer_attributes() -> None:
    cfg_cls, model_cls, kwargs = MODELS["qwen3_next"]
    config = getattr(transformers, cfg_cls)(**kwargs)
    model, anatomy = stage_skeleton(config, even_windows(4, 2)[1], dtype=torch.float32,
                                    model_class=getattr(transformers, model_cls))
    assert all(p.is_meta for p in model.parameters())
    layers = model.get_submodule(anatomy.layers)
    assert [isinstance(layer, PassThrough) for layer in layers] == [True, True, False, False]
    # attributes the modeling code reads per layer fall through to the (meta) original
    assert layers[0].block_type == "linear_attention" and layers[1].block_type == "full_attention"
    assert sum(1 for _ in layers[0].parameters()) == 0
    # off the first stage the embedding, off the last the head and final norm hold nothing
    assert anatomy.embed == "model.embed_tokens" and anatomy.head == "lm_head"
    assert anatomy.last_globals == ("model.norm",)
    assert sum(p.numel() for p in model.get_input_embeddings().parameters()) == 0


@pytest.mark.slow
def test_strict_load_names_missing_and_unexpected(hf_models: dict[str, Path]) -> None:
    stage = build_stage(hf_models["llama"], Topology(2, rank=1))
    tensors = {k: v.clone() for k, v in stage.model.state_dict().items()}
    config = transformers.AutoConfig.from_pretrained(hf_models["llama"])
    missing = dict(tensors)
    dropped = "model.layers.3.mlp.down_proj.weight"
    missing.pop(dropped)
    model, _ = stage_skeleton(config, stage.window, dtype=torch.float32)
    with pytest.raises(PlanError, match=dropped.replace(".", r"\.")):
        load_stage_weights(model, missing, window=stage.window)
    extra = dict(tensors, **{"model.layers.0.mlp.down_proj.weight": tensors[dropped]})
    model, _ = stage_skeleton(config, stage.window, dtype=torch.float32)
    with pytest.raises(PlanError, match=r"does not take.*layers\.0\.mlp\.down_proj"):
        load_stage_weights(model, extra, window=stage.window)


@pytest.mark.slow
def test_chained_stages_detect_a_corrupted_weight(hf_models: dict[str, Path]) -> None:
    """The comparison is not vacuous: one perturbed weight in a middle stage shows up."""
    path = hf_models["falcon_h1"]
    want = _reference(path)
    inputs = _inputs()
    stages = [build_stage(path, Topology(3, rank=r)) for r in range(3)]
    hidden = None
    for stage in stages:
        hidden = stage.forward(inputs["input_ids"], hidden,
                               attention_mask=inputs["attention_mask"])
    assert (hidden - want).abs().max().item() <= TOL
    middle = stages[1]
    layer = middle.layers[middle.window.start_layer]
    with torch.no_grad():
        next(layer.parameters()).add_(1e-3)
    hidden = None
    for stage in stages:
        hidden = stage.forward(inputs["input_ids"], hidden,
                               attention_mask=inputs["attention_mask"])
    assert (hidden - want).abs().max().item() > 10 * TOL
