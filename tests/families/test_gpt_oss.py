"""gpt-oss through the generic family: MXFP4 experts, attention sinks, biases, no dtype.

A tiny gpt-oss checkpoint in the published MXFP4 layout (stacked experts stored as
``<w>_blocks`` uint8 ``[E, N, K/32, 16]`` + ``<w>_scales`` uint8 ``[E, N, K/32]``, everything
else bfloat16, ``quantization_config.quant_method: mxfp4``, no ``torch_dtype``): plans and
loads exactly at PP=2 and PP=2 x EP=2 (bytes equal to safe_open, experts sliced on dim 0 the
same way for blocks, scales and biases); sinks split with the heads; its PP=2 logits, the
experts decoded by transformers' own MXFP4 decoder, equal transformers' ``from_pretrained``
bitwise (the bf16 gpt-oss PP=2 forward is the sweep's, tests/families/test_generic_sweep.py).
TP: tests/families/test_gpt_oss_tp.py. The real-scale layout is in
tests/planning/test_real_scale_generic.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import generic_sweep
from helpers import reference_tensors
from pploader.planning.checkpoint import open_checkpoint
from pploader.planning.plan import plan_all
from pploader.planning.spec import load_spec

QUANT = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def _mxfp4_checkpoint(out: Path, **overrides: int) -> Path:
    """The tiny bf16 gpt-oss of the sweep (``overrides`` on its config), its stacked expert
    weights re-stored as MXFP4 (random blocks and scales: the planner moves bytes, it never
    decodes them)."""
    import transformers
    transformers.logging.set_verbosity_error()
    tiny = generic_sweep.tiny_config("gpt_oss")
    for key, value in overrides.items():
        setattr(tiny, key, value)
    config = generic_sweep.model_config(tiny, transformers.GptOssForCausalLM)
    config.architectures = ["GptOssForCausalLM"]
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM._from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out, max_shard_size="40KB")
    gen = torch.Generator().manual_seed(1)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(str(out / shard))
        for name in [n for n in tensors if n.endswith(("experts.gate_up_proj",
                                                         "experts.down_proj"))]:
            e, k, n = tensors.pop(name).shape
            tensors[name + "_blocks"] = torch.randint(0, 256, (e, n, k // 32, 16),
                                                      dtype=torch.uint8, generator=gen)
            tensors[name + "_scales"] = torch.randint(118, 130, (e, n, k // 32),
                                                      dtype=torch.uint8, generator=gen)
            del index["weight_map"][name]
            index["weight_map"].update({name + "_blocks": shard, name + "_scales": shard})
        save_file(tensors, str(out / shard), metadata={"format": "pt"})
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("dtype", None)
    cfg.pop("torch_dtype", None)
    (out / "config.json").write_text(json.dumps({**cfg, "quantization_config": QUANT}))
    return out


def test_gpt_oss_mxfp4_plans_and_loads_exactly(tmp_path: Path) -> None:
    path = _mxfp4_checkpoint(tmp_path / "oss")
    spec, index = load_spec(path), open_checkpoint(path)
    assert spec.family.name == "generic:gpt_oss" and spec.dtype == torch.bfloat16
    assert spec.num_experts == 4 and any(n.endswith("gate_up_proj_blocks")
                                         for n in index.weight_map)
    ref = reference_tensors(path)
    assert generic_sweep._load_check(spec, index, ref, 2, 1) == len(ref)
    generic_sweep._load_check(spec, index, ref, 2, 2)  # blocks / scales / biases by expert
    plans = plan_all(spec, index, 2, 1, 2)
    for plan in plans:
        e0, e1 = plan.experts  # type: ignore[misc]
        for item in plan.items:
            if ".experts." in item.name:
                assert item.shape[0] == e1 - e0 == 2, item


def test_sinks_split_with_the_heads() -> None:
    from pploader.families import generic
    config = json.loads(json.dumps(generic_sweep.tiny_config("gpt_oss").to_dict()))
    config["architectures"] = ["GptOssForCausalLM"]
    fam = generic.family_for(config)
    rule = fam.shard_rule("self_attn.sinks")
    assert rule is not None and rule.dim == 0 and rule.units is not None
    assert fam.shard_rule("mlp.router.bias").dim is None  # type: ignore[union-attr]


def _dequantized_stage(path: Path, rank: int) -> object:
    """PP rank ``rank`` of 2 as the transformers integration builds it, from pploader's read of
    the MXFP4 checkpoint, each expert weight decoded by transformers' own MXFP4 decoder (what
    its ``Mxfp4Dequantize`` runs) into the skeleton's dtype."""
    from transformers import AutoConfig
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    from pploader.integrations.hf import HFStage, load_stage_weights, stage_skeleton
    from pploader.io.read import Reader
    from pploader.planning.plan import plan_rank
    from pploader.planning.stage import stage_window
    from pploader.planning.topology import Topology
    spec, index = load_spec(path), open_checkpoint(path)
    topo = Topology(2, rank=rank)
    window = stage_window(spec, index, topo, "even")
    plan = plan_rank(spec, index, topo, window)
    reader = Reader(plan)
    tensors = dict(reader)
    for name in [n for n in tensors if n.endswith("_blocks")]:
        weight = name[:-len("_blocks")]
        tensors[weight] = convert_moe_packed_tensors(tensors.pop(name),
                                                     tensors.pop(weight + "_scales"),
                                                     dtype=spec.dtype)
    model, anatomy = stage_skeleton(AutoConfig.from_pretrained(str(path)), window,
                                    dtype=spec.dtype, num_layers=spec.num_layers)
    load_stage_weights(model, tensors, window=window, strict=True, rank=rank)
    return HFStage(model, window, topo, spec, plan, reader.stats,
                   model.get_submodule(anatomy.layers), spec.hidden_size)


def test_gpt_oss_mxfp4_pp2_forward_equals_transformers(tmp_path: Path) -> None:
    """PP=2 logits of the MXFP4 checkpoint from pploader's stage reads equal transformers'
    ``from_pretrained`` (dequantizing on CPU) of the same checkpoint, bitwise (bfloat16)."""
    import transformers
    path = _mxfp4_checkpoint(tmp_path / "oss")
    ids = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(0))
    ref = transformers.GptOssForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16,
        quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    with torch.no_grad():
        want = ref(input_ids=ids, use_cache=False).logits
    first, last = (_dequantized_stage(path, r) for r in range(2))
    with torch.no_grad():
        got = last.forward(ids, first.forward(ids))  # type: ignore[attr-defined]
    assert got.dtype == want.dtype == torch.bfloat16 and want.abs().max() > 0
    assert torch.equal(got, want)
