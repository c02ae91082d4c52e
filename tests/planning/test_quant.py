"""Quantized checkpoints: FP8 block-scaled, FP8 per-channel / per-tensor and NVFP4 (ModelOpt).

The tests quantize a tiny llama themselves (numerics written here, independent of pploader),
write it as safetensors (F8_E4M3 / U8 weights, F32 / F8 scales), then load every TP rank's
shard and check that the scales are consistent with their weights: dequantize(shard, scale
shard) equals the reference slicing of dequantize(full weight, full scale), bitwise, and the
scale shards reassemble the full scale.
"""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Callable

import pytest
import torch

from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import reference_tensors
from pploader import ConfigError, PlanError, Topology, load_stage, plan_stage
from pploader.io.read import Reader
from pploader.planning.checkpoint import open_checkpoint
from pploader.planning.plan import plan_all
from pploader.planning.spec import load_spec
from pploader.planning.quant import expected_tensors, scheme_from_config
from pploader.tiny import write_checkpoint
from quant_checkpoints import SCHEMES, _quantized_weights, fp8_block, nvfp4, write_quantized
from test_tp import _bytes, llama_rule, ref_reassemble, ref_shard


def _parts(ref: dict[str, torch.Tensor], weight: str) -> dict[str, torch.Tensor]:
    stem = weight[:-len("weight")]
    return {k[len(stem):]: v for k, v in ref.items() if k.startswith(stem)
            and k[len(stem):] in ("weight", "weight_scale_inv", "weight_scale",
                                  "weight_scale_2", "input_scale")}


# ---- scales follow weights at TP 1 / 2 / 4 ---------------------------------------------------
@pytest.fixture(scope="module", params=list(SCHEMES))
def quantized_model(request: pytest.FixtureRequest,
                    tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, str]:
    model, cfg = write_quantized(tmp_path_factory.mktemp(request.param), request.param)
    return model, cfg, request.param


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_scales_consistent_with_weights(quantized_model: tuple[Path, dict, str], tp: int) -> None:
    model, cfg, scheme = quantized_model
    dequant = SCHEMES[scheme][2]
    ref = reference_tensors(model)
    weights = _quantized_weights(None, ref)
    spec, index = load_spec(model), open_checkpoint(model)
    plans = plan_all(spec, index, pp=1, tp=tp)   # strict: every companion accounted for
    shards: list[dict[str, torch.Tensor]] = [dict(Reader(p)) for p in plans]
    assert all(set(s) == set(ref) for s in shards)
    for w in weights:
        full = _parts(ref, w)
        dim, units, _ = llama_rule(w, cfg)
        whole = dequant(full)
        pieces = []
        for r, shard in enumerate(shards):
            mine = _parts(shard, w)
            assert set(mine) == set(full)
            got = dequant(mine)
            want = whole if tp == 1 else ref_shard(whole, dim, (whole.shape[dim],), units, tp,
                                                   r, False)
            assert torch.equal(got, want), (scheme, w, tp, r)
            pieces.append(mine)
        if tp > 1:  # every part reassembles: weights and per-block / per-row scales
            for part, t in full.items():
                if t.dim() < 2 or t.shape[dim] == 1:   # scalars, [N, 1] under a dim-1 split
                    assert all(_bytes(p[part]) == _bytes(t) for p in pieces), (w, part)
                    continue
                back = ref_reassemble([p[part] for p in pieces], dim, (t.shape[dim],), units,
                                      tp, t.shape[dim], False)
                assert _bytes(back) == _bytes(t), (scheme, w, part, tp)


def test_public_load_path_keeps_quantized_dtypes(quantized_model: tuple[Path, dict, str]) -> None:
    model, _, scheme = quantized_model
    staged = plan_stage(model, Topology(1, 2, rank=1))
    result = load_stage(staged)
    ref = reference_tensors(model)
    for target, t in result.state_dict.items():
        assert t.dtype == ref[target].dtype, target   # fp8 / packed uint8 / f32 scales kept
    assert result.stats.read_bytes == staged.plan.read_bytes


def test_expected_tensors_match_what_a_quantized_checkpoint_holds(
        quantized_model: tuple[Path, dict, str]) -> None:
    model, _, scheme = quantized_model
    spec, ref = load_spec(model), reference_tensors(model)
    held = {k: tuple(v.shape) for k, v in ref.items()}
    expected = expected_tensors(spec)
    assert set(expected) == set(held)
    for name, shape in expected.items():
        assert shape == held[name] or (shape == () and math.prod(held[name]) == 1), name


# ---- errors ----------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme, qc, quantize, ok_tp, tensor, dim", [
    # k/v: 2 heads x 16 rows; at tp=2 each rank's 16 rows cut a 32-row block
    ("fp8-block", {"quant_method": "fp8", "weight_block_size": [32, 32]},
     lambda w: fp8_block(w, 32, 32), 1, r"self_attn\.[qkv]_proj\.weight", 0),
    # o_proj: 64 inputs; at tp=4 each rank's 16 columns cut a 32-wide scale group
    ("nvfp4", {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32},
     lambda w: nvfp4(w, 32), 2, r"self_attn\.o_proj\.weight", 1),
])
def test_split_cutting_a_block_is_a_clear_error(tmp_path: Path, scheme: str, qc: dict,
                                                quantize: Callable, ok_tp: int, tensor: str,
                                                dim: int) -> None:
    model, _ = write_quantized(tmp_path / scheme, scheme, quant_config=qc, quantize=quantize)
    spec, index = load_spec(model), open_checkpoint(model)
    plan_all(spec, index, pp=1, tp=ok_tp)  # blocks divide these slices: fine
    with pytest.raises(PlanError) as err:
        plan_all(spec, index, pp=1, tp=ok_tp * 2)
    msg = str(err.value)
    assert "cuts" in msg and f"tp={ok_tp * 2}" in msg and f"dim {dim}" in msg, msg
    assert "block 32" in msg and re.search(r"tensor model\.layers\.\d+\." + tensor, msg), msg
    assert "shape [" in msg


@pytest.mark.parametrize("scheme, drop", [("fp8-block", "weight_scale_inv"),
                                          ("nvfp4", "weight_scale_2"),
                                          ("nvfp4", "input_scale")])
def test_missing_scale_is_an_error(tmp_path: Path, scheme: str, drop: str) -> None:
    name = "model.layers.3.mlp.down_proj." + drop
    model, _ = write_quantized(tmp_path / "m", scheme, drop=name)
    spec, index = load_spec(model), open_checkpoint(model)
    with pytest.raises(PlanError, match="missing") as err:
        plan_all(spec, index, pp=2, tp=2)
    assert err.value.tensor == name
    plan_all(spec, index, pp=2, tp=2, strict=False)  # non-strict: loads what is there


def test_scale_of_an_unquantized_weight_or_wrong_shape_is_an_error(tmp_path: Path) -> None:
    model, cfg = write_quantized(tmp_path / "m", "fp8-block")
    ref = reference_tensors(model)
    bad = dict(ref)
    bad["model.layers.0.input_layernorm.weight_scale_inv"] = torch.ones(1, 1)
    write_checkpoint(tmp_path / "extra", bad, cfg)
    with pytest.raises(PlanError, match="not expected"):
        plan_all(load_spec(tmp_path / "extra"), open_checkpoint(tmp_path / "extra"), pp=1)
    bad = dict(ref)
    bad["model.layers.0.mlp.up_proj.weight_scale_inv"] = torch.ones(7, 4)
    write_checkpoint(tmp_path / "shape", bad, cfg)
    with pytest.raises(PlanError, match=r"shape \[7, 4\]"):
        plan_all(load_spec(tmp_path / "shape"), open_checkpoint(tmp_path / "shape"), pp=1)
    with pytest.raises(PlanError, match=r"expected \[8, 4\]"):
        plan_all(load_spec(tmp_path / "shape"), open_checkpoint(tmp_path / "shape"), pp=1,
                 tp=2, strict=False)


def test_unsupported_quantization_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="quant_method 'bitsandbytes' is not supported"):
        scheme_from_config({"quantization_config": {"quant_method": "bitsandbytes"}})
    with pytest.raises(ConfigError, match="gptq with 3-bit"):
        scheme_from_config({"quantization_config": {"quant_method": "gptq", "bits": 3,
                                                    "group_size": 128}})
    with pytest.raises(ConfigError, match="awq version 'gemv'"):
        scheme_from_config({"quantization_config": {"quant_method": "awq", "bits": 4,
                                                    "group_size": 128, "version": "gemv"}})
    with pytest.raises(ConfigError, match="weight_block_size"):
        scheme_from_config({"quantization_config": {"quant_method": "fp8",
                                                    "weight_block_size": [128]}})
    assert scheme_from_config({"hidden_size": 8}) is None




# ---- the weight -> companion mapping, property-tested --------------------------------------
def _take(t: torch.Tensor, sel) -> torch.Tensor:  # type: ignore[no-untyped-def]
    for d, intervals in sel.dims:
        t = torch.cat([t.narrow(d, a, n) for a, n in intervals], d)
    return t


def _expand(scale: torch.Tensor, block: tuple, logical: tuple) -> torch.Tensor:
    """A scale tensor at the element resolution of its weight (None = one entry per dim)."""
    out = scale
    for axis, b in zip((-2, -1), block):
        size = logical[axis]
        idx = torch.arange(size) // b if b is not None else torch.zeros(size, dtype=torch.long)
        out = out.index_select(out.dim() + axis, idx)
    return out


@st.composite
def mapping_cases(draw: st.DrawFn) -> dict:
    tp = draw(st.sampled_from([1, 2, 4]))
    experts = draw(st.sampled_from([0, 3]))
    bn = draw(st.sampled_from([1, 2, 4]))
    bk = draw(st.sampled_from([None, 2, 4, 8]))
    n = draw(st.integers(1, 6)) * draw(st.sampled_from([1, 2, 4]))
    k = draw(st.integers(1, 4)) * 8
    dim = draw(st.sampled_from([-2, -1]))
    return dict(tp=tp, experts=experts, block=(bn, bk), dim=dim,
                logical=((experts,) if experts else ()) + (n, k),
                units=draw(st.sampled_from([None, 1, 2, 4, 8])),
                first_expert=draw(st.integers(0, 2)))


@settings(max_examples=120, deadline=None)
@given(mapping_cases())
def test_companion_slices_follow_the_weight(case: dict) -> None:
    from pploader.families.base import ShardRule
    from pploader.planning.quant import Companion, QuantScheme, blocks
    from pploader.planning.shard import Selection, tp_selection
    logical, (bn, bk), tp = case["logical"], case["block"], case["tp"]
    comp = Companion("weight_scale", "F32", blocks(bn, bk))
    scheme = QuantScheme("test", Companion("weight", "F8_E4M3", blocks(1, 1)), (comp,))
    dim = len(logical) + case["dim"]
    units = case["units"]
    rule = ShardRule("w", dim, units=(lambda s, u=units: u) if units else None)
    scale = torch.rand(comp.shape(logical))
    whole = _expand(scale, (bn, bk), logical)
    for r in range(tp):
        try:
            sel = tp_selection(rule, logical, None, r, tp, "w")  # type: ignore[arg-type]
        except PlanError:
            return  # indivisible shapes are tested elsewhere
        if case["experts"]:
            e0 = min(case["first_expert"], case["experts"] - 1)
            sel = Selection(((0, ((e0, case["experts"] - e0),)),)).merged(sel)
        blocked = {0: bn, 1: bk}
        aligned = all(a % b == 0 and (m % b == 0 or a + m == logical[d])
                      for d, iv in sel.dims if d >= len(logical) - 2
                      for b in [blocked[d - len(logical) + 2]] if b is not None
                      for a, m in iv)
        if not aligned:
            with pytest.raises(PlanError, match=rf"cuts .* tp={tp}"):
                scheme.companion_selection(comp, sel, logical, "w", tp)
            return
        csel = scheme.companion_selection(comp, sel, logical, "w", tp)
        got = _expand(_take(scale, csel), (bn, bk), _take(whole, sel).shape)
        assert torch.equal(got, _take(whole, sel))
