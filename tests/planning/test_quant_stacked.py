"""Quantized stacked (3-D) MoE experts: planned where a real writer produces them and an engine
loads them, refused (naming the tensor) elsewhere.

Planned: transformers' fine-grained FP8 experts (``FP8Experts``) as
``save_pretrained(save_original_format=False)`` writes them, made here by transformers'
own quantizer (``FineGrainedFP8Config``, run on CPU: its GPU check is bypassed, the
quantization itself is transformers' code) on tiny Qwen3-MoE, Qwen3.5-MoE (gated delta-net
layers, shared expert) and, through the generic family, OLMoE and Qwen2-MoE. Every rank's
expert tensors at PP=2, PP=2 x EP=2 and PP=2 x TP=2, loaded on CPU, equal bitwise the slices
of tests/stacked_fp8_ref.py (vLLM's ``RoutedExperts.load_weights`` rule).

Also planned for Qwen3-MoE and Qwen3.5-MoE: transformers' default save of the same model
(per-expert fp8 weights, the scales stacked), checked bitwise the same way.

Refused: a TP size whose slices cut a scale block (vLLM refuses it too: ``fp8.py``,
"intermediate_size_per_partition ... block_n"); the default save in a family without that
format (Mixtral); stacked FP8 in families pploader does not name them for (Mixtral,
generic types whose vLLM loader was not checked); stacked experts in integer (AWQ /
compressed-tensors) storage, which no writer produces and no engine loads.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from helpers import reference_tensors
from pploader import PlanError, Topology, load_stage, plan_stage
from pploader.planning.checkpoint import open_checkpoint
from pploader.planning.plan import plan_all
from pploader.planning.spec import load_spec
from stacked_fp8_ref import expert_id, expert_slice, per_expert_slice

transformers = pytest.importorskip("transformers")

EXPERTS = 4


def _config(kind: str, inter: int):  # type: ignore[no-untyped-def]
    from transformers import AutoConfig
    if kind.startswith("qwen3_5_moe"):  # gated-delta-net + attention layers, shared expert
        text = dict(
            vocab_size=128, hidden_size=64, num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention"] * 2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4,
            linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, num_experts=EXPERTS, num_experts_per_tok=2,
            moe_intermediate_size=inter, shared_expert_intermediate_size=32)
        if kind.endswith("_vl"):  # the released form: LM under model.language_model.
            cfg = AutoConfig.for_model("qwen3_5_moe", text_config=text, vision_config=dict(
                depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8,
                out_hidden_size=64))
            cfg.architectures = ["Qwen3_5MoeForConditionalGeneration"]
            return cfg
        cfg = AutoConfig.for_model("qwen3_5_moe_text", **text)
        cfg.architectures = ["Qwen3_5MoeForCausalLM"]
        return cfg
    cfg = AutoConfig.for_model(
        kind, vocab_size=128, hidden_size=64, intermediate_size=inter, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=32, num_experts=EXPERTS,
        num_local_experts=EXPERTS, num_experts_per_tok=2, moe_intermediate_size=inter)
    cfg.architectures = {"qwen3_moe": ["Qwen3MoeForCausalLM"], "olmoe": ["OlmoeForCausalLM"],
                         "qwen2_moe": ["Qwen2MoeForCausalLM"], "phimoe": ["PhimoeForCausalLM"],
                         "mixtral": ["MixtralForCausalLM"]}[kind]
    return cfg


def _fp8_moe(root: Path, monkeypatch: pytest.MonkeyPatch, inter: int, block: int,
             original_format: bool = False, kind: str = "qwen3_moe") -> Path:
    """A tiny MoE quantized by transformers' fine-grained FP8 quantizer and saved by
    ``save_pretrained`` (transformers-5 fused naming unless ``original_format``)."""
    from transformers import (AutoModelForCausalLM, AutoModelForImageTextToText,
                              FineGrainedFP8Config)
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer
    monkeypatch.setattr(FineGrainedFP8HfQuantizer, "validate_environment",
                        lambda self, *a, **k: None)  # CPU: no GPU check; same quantizer code
    auto = AutoModelForImageTextToText if kind.endswith("_vl") else AutoModelForCausalLM
    torch.manual_seed(0)
    auto.from_config(_config(kind, inter), dtype=torch.bfloat16).save_pretrained(root / "bf16")
    q = auto.from_pretrained(
        root / "bf16", dtype=torch.bfloat16, quantization_config=FineGrainedFP8Config(
            weight_block_size=(block, block),
            # Qwen3.5's 4-row GDN a/b projections and 1-row shared-expert gate stay 16-bit
            modules_to_not_convert=["in_proj_a", "in_proj_b", "shared_expert_gate", "lm_head",
                                    "visual"]))
    out = root / "fp8"
    q.save_pretrained(out, save_original_format=original_format)
    return out


def _layer(name: str) -> int:
    return int(re.search(r"\.layers\.(\d+)\.", name).group(1))  # type: ignore[union-attr]


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_5_moe", "qwen3_5_moe_vl", "olmoe",
                                        "qwen2_moe"])
def fused(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    mp = pytest.MonkeyPatch()
    try:
        return _fp8_moe(tmp_path_factory.mktemp("stacked-fp8"), mp, inter=64, block=16,
                        kind=request.param)
    finally:
        mp.undo()


def test_writer_layout_is_stacked_fp8_with_block_scales(fused: Path) -> None:
    """The checkpoint holds what the docstring says (the layout the reference assumes)."""
    ref = reference_tensors(fused)
    lm = "model.language_model." if "model.language_model.layers.0.input_layernorm.weight" \
        in ref else "model."
    gu, gs = ref[lm + "layers.0.mlp.experts.gate_up_proj"], \
        ref[lm + "layers.0.mlp.experts.gate_up_proj_scale_inv"]
    dn, ds = ref[lm + "layers.1.mlp.experts.down_proj"], \
        ref[lm + "layers.1.mlp.experts.down_proj_scale_inv"]  # [E, H, I]: H = I = 64 here
    assert gu.dtype == dn.dtype == torch.float8_e4m3fn
    assert (tuple(gu.shape), tuple(gs.shape)) == ((EXPERTS, 128, 64), (EXPERTS, 8, 4))
    assert (tuple(dn.shape), tuple(ds.shape)) == ((EXPERTS, 64, 64), (EXPERTS, 4, 4))
    assert gs.dtype == torch.float32 and not any(".experts.0." in n for n in ref)


@pytest.mark.parametrize("pp, tp, ep", [(2, 1, 1), (2, 1, 2), (2, 2, 1)])
def test_stacked_fp8_experts_load_as_the_engine_slices_them(fused: Path, pp: int, tp: int,
                                                            ep: int) -> None:
    ref = reference_tensors(fused)
    config = json.loads((fused / "config.json").read_text())
    per_stage = config.get("text_config", config)["num_hidden_layers"] // pp
    for rank in range(pp * tp * ep):
        staged = plan_stage(fused, Topology(pp, tp, ep, rank=rank))
        result = load_stage(staged)
        pp_rank, inner = divmod(rank, tp * ep)
        ep_rank, tp_rank = divmod(inner, tp)  # dense ranks: tp fastest, then ep
        w = staged.plan.window
        assert (w.start_layer, w.end_layer) == (pp_rank * per_stage, (pp_rank + 1) * per_stage)
        assert (staged.plan.topology.tp_rank, staged.plan.topology.ep_rank) == (tp_rank, ep_rank)
        want = {n for n in ref if ".mlp.experts." in n
                and _layer(n) in range(w.start_layer, w.end_layer)}
        got = {n for n in result.state_dict if ".mlp.experts." in n}
        assert got == want, (rank, sorted(got ^ want))
        assert len(want) == 4 * per_stage
        for name in sorted(want):
            piece = expert_slice(name, ref[name], tp, tp_rank, ep, ep_rank)
            t = result.state_dict[name]
            assert t.dtype == piece.dtype and t.shape == piece.shape, (rank, name, t.shape)
            assert torch.equal(t.view(torch.uint8), piece.contiguous().view(torch.uint8)), \
                (rank, name)
        for name, t in result.state_dict.items():  # the rest keeps its stored dtypes
            assert t.dtype == ref[name].dtype, name


def test_tp_cutting_an_expert_scale_block_is_refused(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """moe_intermediate_size 48 in 16-blocks: TP=2 gives a rank 24 rows of each half, which
    cuts a block (vLLM: 24 % block_n != 0 is refused); TP=1 plans."""
    model = _fp8_moe(tmp_path, monkeypatch, inter=48, block=16)
    spec, index = load_spec(model), open_checkpoint(model)
    plan_all(spec, index, pp=2)
    plan_all(spec, index, pp=2, ep=2)
    with pytest.raises(PlanError) as err:
        plan_all(spec, index, pp=2, tp=2)
    msg = str(err.value)
    assert "cuts" in msg and "block 16" in msg and "tp=2" in msg, msg
    assert err.value.tensor is not None and ".mlp.experts." in err.value.tensor, msg
    assert err.value.tensor.endswith(("gate_up_proj", "down_proj")), msg


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_5_moe", "qwen3_5_moe_vl"])
def default_save(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                 ) -> Path:
    """transformers' default save of the quantized model: per-expert fp8 weights, the scales
    stacked (``experts.gate_up_proj_scale_inv`` next to ``experts.N.gate_proj``)."""
    mp = pytest.MonkeyPatch()
    try:
        return _fp8_moe(tmp_path_factory.mktemp("default-save"), mp, inter=64, block=16,
                        original_format=True, kind=request.param)
    finally:
        mp.undo()


@pytest.mark.parametrize("pp, tp, ep", [(2, 1, 1), (2, 1, 2), (2, 2, 1)])
def test_default_save_loads_as_the_engine_slices_it(default_save: Path, pp: int, tp: int,
                                                    ep: int) -> None:
    ref = reference_tensors(default_save)
    assert any(n.endswith("layers.0.mlp.experts.0.gate_proj.weight") for n in ref)
    assert any(n.endswith("layers.0.mlp.experts.gate_up_proj_scale_inv") for n in ref)
    assert not any(n.endswith("experts.0.gate_proj.weight_scale_inv") for n in ref)
    per_ep = EXPERTS // ep
    for rank in range(pp * tp * ep):
        staged = plan_stage(default_save, Topology(pp, tp, ep, rank=rank))
        result = load_stage(staged)
        t = staged.plan.topology
        w = staged.plan.window
        layers = range(w.start_layer, w.end_layer)
        mine = range(t.ep_rank * per_ep, (t.ep_rank + 1) * per_ep)
        want = {n for n in ref if ".mlp.experts." in n and _layer(n) in layers
                and (n.endswith("_scale_inv") or expert_id(n) in mine)}
        got = {n for n in result.state_dict if ".mlp.experts." in n}
        assert got == want, (rank, sorted(got ^ want))
        for name in sorted(want):
            piece = expert_slice(name, ref[name], tp, t.tp_rank, ep, t.ep_rank) \
                if name.endswith("_scale_inv") else per_expert_slice(name, ref[name], tp,
                                                                      t.tp_rank)
            got_t = result.state_dict[name]
            assert got_t.dtype == piece.dtype and got_t.shape == piece.shape, (rank, name)
            assert torch.equal(got_t.view(torch.uint8), piece.contiguous().view(torch.uint8)), \
                (rank, name)


def test_default_save_cutting_a_block_is_refused(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The default save with moe_intermediate_size 48 in 16-blocks: TP=2 cuts a block of
    each expert's weight (its scales are stacked, the block is the scheme's): refused."""
    model = _fp8_moe(tmp_path, monkeypatch, inter=48, block=16, original_format=True)
    spec, index = load_spec(model), open_checkpoint(model)
    plan_all(spec, index, pp=2, ep=2)
    with pytest.raises(PlanError) as err:
        plan_all(spec, index, pp=2, tp=2)
    msg = str(err.value)
    assert "cuts" in msg and "block 16" in msg, msg
    assert err.value.tensor is not None and ".mlp.experts." in err.value.tensor, msg


def test_default_save_in_a_family_without_that_format_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same layout for Mixtral (vLLM's Mixtral maps no stacked scale): refused, naming a
    tensor, the per-expert scales it lacks and the stacked ones it has."""
    model = _fp8_moe(tmp_path, monkeypatch, inter=64, block=16, original_format=True,
                     kind="mixtral")
    assert "model.layers.0.block_sparse_moe.experts.gate_up_proj_scale_inv" in \
        reference_tensors(model)
    with pytest.raises(PlanError) as err:
        plan_all(load_spec(model), open_checkpoint(model), pp=2)
    msg = str(err.value)
    assert "missing" in msg and "experts.0.w1.weight_scale_inv" in msg, msg
    assert "not expected" in msg and "experts.gate_up_proj_scale_inv" in msg, msg
    assert err.value.tensor is not None and ".experts." in err.value.tensor, msg


@pytest.mark.parametrize("kind, family", [("mixtral", "mixtral"), ("phimoe", "generic:phimoe")])
def test_stacked_fp8_in_a_family_without_engine_loader_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, family: str) -> None:
    """FP8 stacked experts in transformers' fused naming that pploader does not plan, written
    by transformers: Mixtral (vLLM's Mixtral has ``block_sparse_moe`` experts named w1 / w3 /
    w2, so nothing maps ``mlp.experts.gate_up_proj_scale_inv``) and a generic-family type
    outside ``hf_experts.STACKED_FP8_TYPES`` (PhiMoE): refused, naming the scale."""
    model = _fp8_moe(tmp_path, monkeypatch, inter=64, block=16, kind=kind)
    assert "model.layers.0.mlp.experts.gate_up_proj_scale_inv" in reference_tensors(model)
    with pytest.raises(PlanError, match="stacked .3-D. experts in fp8-block storage, not "
                                        f"planned for {family}") as err:
        plan_all(load_spec(model), open_checkpoint(model), pp=2)
    assert err.value.tensor is not None and err.value.tensor.endswith("_scale_inv")


def _int_stacked(root: Path, qc: dict, suffixes: dict[str, tuple[torch.dtype, tuple]]
                 ) -> Path:
    """A Qwen3-MoE in transformers-5 fused naming whose stacked experts are stored in an
    integer scheme's tensors (``safetensors`` directly: no writer makes this)."""
    h, inter, e = 64, 64, EXPERTS
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
           "vocab_size": 128, "hidden_size": h, "intermediate_size": 128,
           "moe_intermediate_size": inter, "num_hidden_layers": 1, "num_attention_heads": 2,
           "num_key_value_heads": 2, "head_dim": 32, "num_experts": e,
           "num_experts_per_tok": 2, "torch_dtype": "bfloat16", "quantization_config": qc}
    bf = torch.bfloat16
    t = {"model.embed_tokens.weight": torch.zeros(128, h, dtype=bf),
         "model.norm.weight": torch.zeros(h, dtype=bf), "lm_head.weight": torch.zeros(128, h, dtype=bf),
         "model.layers.0.input_layernorm.weight": torch.zeros(h, dtype=bf),
         "model.layers.0.post_attention_layernorm.weight": torch.zeros(h, dtype=bf),
         "model.layers.0.self_attn.q_norm.weight": torch.zeros(32, dtype=bf),
         "model.layers.0.self_attn.k_norm.weight": torch.zeros(32, dtype=bf),
         "model.layers.0.mlp.gate.weight": torch.zeros(e, h, dtype=bf)}
    for p, shape in (("q", (64, h)), ("k", (64, h)), ("v", (64, h)), ("o", (h, 64))):
        t[f"model.layers.0.self_attn.{p}_proj.weight"] = torch.zeros(shape, dtype=bf)
    for leaf in ("gate_up_proj", "down_proj"):
        for suffix, (dtype, shape) in suffixes.items():
            t[f"model.layers.0.mlp.experts.{leaf}{suffix}"] = torch.zeros(shape, dtype=dtype)
    root.mkdir(parents=True)
    save_file(t, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps(cfg))
    return root


@pytest.mark.parametrize("qc, suffixes", [
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm", "zero_point": True},
     {"": (torch.int32, (EXPERTS, 64, 16)), "_scales": (torch.float16, (EXPERTS, 2, 128))}),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
          "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
          "group_size": 32}}}},
     {".weight_packed": (torch.int32, (EXPERTS, 128, 8)),
      ".weight_scale": (torch.bfloat16, (EXPERTS, 128, 2)),
      ".weight_shape": (torch.int64, (2,))}),
])
def test_integer_stacked_experts_are_refused(tmp_path: Path, qc: dict, suffixes: dict) -> None:
    model = _int_stacked(tmp_path / "m", qc, suffixes)
    with pytest.raises(PlanError, match="stacked .3-D. experts in .* storage, not planned "
                                        "for qwen3_moe") as err:
        plan_all(load_spec(model), open_checkpoint(model), pp=1)
    assert err.value.tensor is not None and ".mlp.experts." in err.value.tensor, str(err.value)
