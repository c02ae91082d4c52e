"""Binding a stage into modules: fused qkv / gate_up, stacked experts, strict accounting,
and the plain-iterator integration a serving stack's load_weights consumes unchanged."""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

import pytest
import torch
from torch import nn

import pploader
from pploader import NameMap, PlanError, Topology, load_stage_into, plan_stage
from pploader.families.fused import FusedTarget, match_fused

from bind_models import one_thread  # noqa: F401 - autouse fixture
from bind_models import (MOE_CONFIG, MoEStage, TinyLM, make_moe, plan_moe, tp_cols, tp_rows)
from helpers import reference_tensors, tiny_config

CFG = tiny_config()


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_moe(tmp_path_factory.mktemp("moe"))


def test_fused_target_templates() -> None:
    qkv = pploader.families.fused.QKV
    m = match_fused((qkv,), "self_attn.k_proj.bias")
    assert m is not None and m.part == 1 and m.target == "self_attn.qkv_proj.bias"
    w13, w2 = pploader.families.fused.expert_fusions()
    m = match_fused((w13, w2), "mlp.experts.12.up_proj.weight")
    assert m is not None and m.fusion is w13 and m.part == 1 and m.expert == 12
    assert w13.stacked and not qkv.stacked
    assert match_fused((qkv, w13, w2), "mlp.experts.1.up_proj.weight_scale") is None
    with pytest.raises(ValueError):
        FusedTarget("x.{a}", ("y.{b}",))


@pytest.mark.parametrize("pp,tp", [(2, 2), (1, 1)])
def test_dense_stage_fused_qkv_gate_up(tiny_llama: Path, pp: int, tp: int) -> None:
    ref = reference_tensors(tiny_llama)
    nh, nkv = CFG["num_attention_heads"], CFG["num_key_value_heads"]
    for topo in Topology(pp, tp).all_ranks():
        staged = plan_stage(tiny_llama, topo)
        window = staged.plan.window
        with torch.device("meta"):
            module = TinyLM(CFG, window, tp=tp, device="meta", all_layers=True)
        result = load_stage_into(module, staged, device="cpu", process=False)
        assert result.missing == () and result.unexpected == ()
        r = topo.tp_rank
        for i in range(CFG["num_hidden_layers"]):
            layer = module.model.layers[str(i)]
            qkv = layer.self_attn.qkv_proj.weight
            if not window.owns(i):  # only the stage's layers are materialised
                assert qkv.is_meta and layer.mlp.down_proj.weight.is_meta
                continue
            p = f"model.layers.{i}."
            want_qkv = torch.cat([tp_rows(ref[p + "self_attn.q_proj.weight"], r, tp, nh),
                                  tp_rows(ref[p + "self_attn.k_proj.weight"], r, tp, nkv),
                                  tp_rows(ref[p + "self_attn.v_proj.weight"], r, tp, nkv)])
            assert torch.equal(qkv, want_qkv)
            want_gu = torch.cat([tp_rows(ref[p + "mlp.gate_proj.weight"], r, tp),
                                 tp_rows(ref[p + "mlp.up_proj.weight"], r, tp)])
            assert torch.equal(layer.mlp.gate_up_proj.weight, want_gu)
            assert torch.equal(layer.mlp.down_proj.weight,
                               tp_cols(ref[p + "mlp.down_proj.weight"], r, tp))
            assert torch.equal(layer.input_layernorm.weight, ref[p + "input_layernorm.weight"])
        if window.has_embed:
            assert torch.equal(module.model.embed_tokens.weight,
                               tp_rows(ref["model.embed_tokens.weight"], r, tp))
        if window.has_head:
            assert torch.equal(module.lm_head.weight, tp_rows(ref["lm_head.weight"], r, tp))


@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 2)])
def test_moe_stage_stacked_experts(moe_dir: Path, tp: int, ep: int) -> None:
    ref = reference_tensors(moe_dir)
    nh, nkv = MOE_CONFIG["num_attention_heads"], MOE_CONFIG["num_key_value_heads"]
    for topo in Topology(2, tp, ep).all_ranks():
        staged = plan_moe(moe_dir, topo)
        module = MoEStage(MOE_CONFIG, staged.plan.window, tp=tp, ep=ep)
        result = load_stage_into(module, staged)
        assert result.missing == () and result.unexpected == ()
        first, last = staged.plan.experts or (0, MOE_CONFIG["num_experts"])
        r = topo.tp_rank
        for i, layer in module.model.layers.items():
            p = f"model.layers.{i}."
            w13, w2 = layer.mlp.experts.w13_weight, layer.mlp.experts.w2_weight
            assert w13.shape[0] == last - first
            for e in range(first, last):
                q = f"{p}mlp.experts.{e}."
                assert torch.equal(w13[e - first], torch.cat(
                    [tp_rows(ref[q + "gate_proj.weight"], r, tp),
                     tp_rows(ref[q + "up_proj.weight"], r, tp)]))
                assert torch.equal(w2[e - first], tp_cols(ref[q + "down_proj.weight"], r, tp))
            assert torch.equal(layer.mlp.gate.weight, ref[p + "mlp.gate.weight"])
            assert torch.equal(layer.self_attn.qkv_proj.weight, torch.cat(
                [tp_rows(ref[p + f"self_attn.{n}_proj.weight"], r, tp, h)
                 for n, h in (("q", nh), ("k", nkv), ("v", nkv))]))


def test_missing_module_tensor_is_named(tiny_llama: Path) -> None:
    staged = plan_stage(tiny_llama, Topology(2))
    module = TinyLM(CFG, staged.plan.window, device="meta")
    module.model.layers["1"].mlp.extra = nn.Parameter(torch.empty(3, device="meta"))
    with pytest.raises(PlanError, match=r"model\.layers\.1\.mlp\.extra") as err:
        load_stage_into(module, staged)
    assert err.value.tensor == "model.layers.1.mlp.extra"
    assert module.model.layers["0"].mlp.down_proj.weight.is_meta  # nothing was materialised
    ok = load_stage_into(module, staged, strict=False)
    assert ok.missing == ("model.layers.1.mlp.extra",) and ok.unexpected == ()
    assert module.model.layers["1"].mlp.extra.is_meta


def test_missing_checkpoint_part_of_fused_tensor(tmp_path: Path, tiny_llama: Path) -> None:
    tensors = reference_tensors(tiny_llama)
    del tensors["model.layers.2.self_attn.k_proj.weight"]
    from pploader.tiny import write_checkpoint
    write_checkpoint(tmp_path, tensors, CFG, shard_bytes=120_000)
    # the planner's template check names it first ...
    with pytest.raises(PlanError, match=r"model\.layers\.2\.self_attn\.k_proj\.weight"):
        load_stage_into(TinyLM(CFG, plan_stage(tiny_llama, Topology(1)).plan.window,
                               device="meta"), tmp_path, Topology(1))
    # ... and binding does too, with the planner's check off: the fused tensor is incomplete
    staged = plan_stage(tmp_path, Topology(1), strict=False)
    module = TinyLM(CFG, staged.plan.window, device="meta")
    with pytest.raises(PlanError) as err:
        load_stage_into(module, staged)
    msg = str(err.value)
    assert "model.layers.2.self_attn.qkv_proj.weight" in msg
    assert "model.layers.2.self_attn.k_proj.weight" in msg and "absent" in msg


def test_unexpected_checkpoint_tensor(tiny_llama: Path) -> None:
    staged = plan_stage(tiny_llama, Topology(2, rank=1))
    module = TinyLM(CFG, staged.plan.window, device="meta")
    del module.lm_head
    with pytest.raises(PlanError, match=r"1 checkpoint tensor\(s\) with no module tensor: "
                                         r"lm_head\.weight"):
        load_stage_into(module, staged)
    result = load_stage_into(module, staged, strict=False, process=False)
    assert result.unexpected == ("lm_head.weight",) and result.missing == ()
    head_bytes = staged.index.entry("lm_head.weight").nbytes
    assert result.stats.read_bytes == staged.plan.read_bytes - head_bytes  # never read


def test_dtype_mismatch_and_allow_cast(tiny_llama: Path) -> None:
    staged = plan_stage(tiny_llama, Topology(2))
    module = TinyLM(CFG, staged.plan.window, dtype=torch.float32, device="meta")
    with pytest.raises(PlanError, match="allow_cast"):
        load_stage_into(module, staged)
    load_stage_into(module, staged, allow_cast=True, process=False)
    ref = reference_tensors(tiny_llama)
    assert module.model.layers["0"].mlp.down_proj.weight.dtype == torch.float32
    assert torch.equal(module.model.layers["0"].mlp.down_proj.weight,
                       ref["model.layers.0.mlp.down_proj.weight"].float())


def test_name_map_prefix(tiny_llama: Path) -> None:
    staged = plan_stage(tiny_llama, Topology(2))
    module = TinyLM(CFG, staged.plan.window, device="meta").model  # bare: no "model." prefix
    result = load_stage_into(module, staged, names=NameMap("model.", ""), process=False)
    assert result.missing == () and result.unexpected == ()
    ref = reference_tensors(tiny_llama)
    assert torch.equal(module.layers["3"].mlp.down_proj.weight,
                       ref["model.layers.3.mlp.down_proj.weight"])


@pytest.mark.slow
def test_transformers_module_unfused_names(tiny_llama: Path) -> None:
    """A real transformers LlamaForCausalLM (separate q/k/v) binds by plain names."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(**{k: v for k, v in CFG.items() if k != "architectures"})
    torch.manual_seed(0)
    ours = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    theirs = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    result = load_stage_into(ours, tiny_llama, Topology(1))
    assert result.missing == () and result.unexpected == ()
    theirs.load_state_dict(reference_tensors(tiny_llama), strict=True)
    ids = torch.arange(12).view(1, 12)
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, theirs(ids).logits)


# ---- the integration guide's worked example (docs/integration.md) -------------------------

class ServingStage(TinyLM):
    """A serving stack's own ``load_weights``, vLLM style: a stacked_params_mapping for the
    fused projections, every other name copied into the parameter of the same name."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        q = CFG["num_attention_heads"] * CFG["head_dim"]
        kv = CFG["num_key_value_heads"] * CFG["head_dim"]
        inter = CFG["intermediate_size"]
        stacked_params_mapping = [  # (fused param, checkpoint piece, rows in the fused param)
            ("qkv_proj", "q_proj", (0, q)), ("qkv_proj", "k_proj", (q, kv)),
            ("qkv_proj", "v_proj", (q + kv, kv)),
            ("gate_up_proj", "gate_proj", (0, inter)), ("gate_up_proj", "up_proj", (inter, inter))]
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            for fused, piece, (start, rows) in stacked_params_mapping:
                if f".{piece}." in name:
                    params[name.replace(piece, fused)].data[start:start + rows].copy_(tensor)
                    break
            else:
                params[name].data.copy_(tensor)
            loaded.add(name)
        return loaded


@pytest.mark.parametrize("mode", ["owned", "borrowed"])
def test_iter_stage_weights_feeds_load_weights(tiny_llama: Path, mode: str) -> None:
    topo = Topology(2, rank=1)
    window = plan_stage(tiny_llama, topo).plan.window
    theirs = ServingStage(CFG, window)
    loaded = theirs.load_weights(pploader.iter_stage_weights(tiny_llama, topo, mode=mode))
    assert len(loaded) == len(plan_stage(tiny_llama, topo).plan.items)
    ours = TinyLM(CFG, window, device="meta")
    load_stage_into(ours, tiny_llama, topo, process=False)
    for (n, a), (m, b) in zip(theirs.state_dict().items(), ours.state_dict().items()):
        assert n == m and torch.equal(a, b), n



def test_fused_shape_misfit_is_an_error_even_when_not_strict(tiny_llama: Path,
                                                             moe_dir: Path) -> None:
    staged = plan_stage(tiny_llama, Topology(2))
    module = TinyLM(CFG, staged.plan.window, device="meta")
    module.model.layers["1"].self_attn.qkv_proj.weight = nn.Parameter(
        torch.empty(64, 64, dtype=torch.bfloat16, device="meta"))  # sized for tp=2
    with pytest.raises(PlanError, match=r"qkv_proj\.weight is \[64, 64\] but its parts .* do "
                                        r"not concatenate to it along dim 0"):
        load_stage_into(module, staged, strict=False)
    assert module.model.layers["0"].self_attn.qkv_proj.weight.is_meta  # nothing written
    moe = MoEStage(MOE_CONFIG, plan_moe(moe_dir, Topology(2)).plan.window, ep=2)  # 2 rows
    with pytest.raises(PlanError, match=r"expert 2 goes to row 2 of .*w13_weight"):
        load_stage_into(moe, plan_moe(moe_dir, Topology(2)))
