"""AWQ, GPTQ (desc_act off / on), compressed-tensors W4A16 (sym; asym with actorder), W8A8
int8 and NVFP4 checkpoints at PP, PP x TP and PP x EP x TP.

Tiny llama / qwen3_moe checkpoints are written in each library's real tensor layout
(tests/quant_int4.py, independent of pploader); every rank's plan is read on the CPU and
each tensor must equal, bitwise, the engine's slice of the checkpoint tensor
(``quant_int4.engine_slices``, spelled from vLLM's parameter attributes), every checkpoint
tensor read by the stages owning it, each expert by its EP rank only. Dequantizing a
rank's shard (weight, scales, zeros, group indices) gives the slice of the dequantized full
weight: the scales follow the weights, act-order scales included.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import reference_tensors
from pploader import ConfigError, PlanError
from pploader.io.read import Reader
from pploader.planning.checkpoint import open_checkpoint
from pploader.planning.plan import plan_all
from pploader.planning.quant import scheme_from_config
from pploader.planning.spec import load_spec
from quant_int4 import (AWQ_ORDER, CONFIGS, GROUP, engine_slices, unpack_int32, write_int4)

METHODS = list(CONFIGS)


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _expert(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[parts.index("experts") + 1]) if "experts" in parts else None


def _layer(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[2]) if name.startswith("model.layers.") else None


def _check_layout(model: Path, cfg: dict, method: str, pp: int, tp: int, ep: int) -> None:
    """Every rank's tensors are the engine's slices, bitwise; every tensor is read by the
    ranks that own it (its stage, its experts' EP rank) and no other."""
    ref = reference_tensors(model)
    plans = plan_all(load_spec(model), open_checkpoint(model), pp=pp, tp=tp, ep=ep)
    experts = cfg.get("num_local_experts", 0)
    for plan in plans:
        w, topo = plan.window, plan.topology
        got = dict(Reader(plan))
        owned = set()
        for name in ref:
            layer, expert = _layer(name), _expert(name)
            if layer is None:
                mine = w.has_head if "lm_head" in name or name == "model.norm.weight" \
                    else w.has_embed
            else:
                mine = w.start_layer <= layer < w.end_layer
            if mine and expert is not None and ep > 1:
                per = experts // ep
                mine = topo.ep_rank * per <= expert < (topo.ep_rank + 1) * per
            if mine:
                owned.add(name)
        assert set(got) == owned, (method, topo.describe(), sorted(set(got) ^ owned)[:5])
        for name, tensor in got.items():
            full = ref[name]
            slices, pad = engine_slices(name, tuple(full.shape), cfg, method, tp, topo.tp_rank)
            want = full[slices]
            if pad:
                want = torch.cat([want, torch.zeros((pad,) + tuple(want.shape[1:]),
                                                    dtype=want.dtype)])
            assert tensor.dtype == full.dtype and tensor.shape == want.shape, \
                (method, name, topo.describe(), tuple(tensor.shape), tuple(want.shape))
            assert _bytes(tensor) == _bytes(want), (method, name, topo.describe())


@pytest.fixture(scope="module", params=METHODS)
def llama_int4(request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, str]:
    model, cfg = write_int4(tmp_path_factory.mktemp(request.param), request.param)
    return model, cfg, request.param


@pytest.mark.parametrize("pp, tp", [(1, 1), (2, 1), (2, 2), (1, 4)])
def test_dense_ranks_hold_the_engine_slices(llama_int4: tuple[Path, dict, str], pp: int,
                                            tp: int) -> None:
    model, cfg, method = llama_int4
    _check_layout(model, cfg, method, pp, tp, 1)


@pytest.mark.parametrize("method", ["awq", "gptq-desc-act", "w4a16-asym-actorder", "w8a8"])
@pytest.mark.parametrize("pp, tp, ep", [(2, 1, 2), (2, 2, 2), (1, 2, 1)])
def test_moe_ranks_hold_the_engine_slices(tmp_path: Path, method: str, pp: int, tp: int,
                                          ep: int) -> None:
    """qwen3_moe: per-expert quantized experts, the router kept in bf16 (not quantized)."""
    model, cfg = write_int4(tmp_path / method, method, "tiny-qwen3_moe")
    _check_layout(model, cfg, method, pp, tp, ep)


# ---- the scales follow the weights -----------------------------------------------------------
def _dequant(method: str, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """[N, K] float weight of one linear's stored tensors (a full one or a rank's shard)."""
    if method == "awq":
        q = unpack_int32(t["qweight"], 1, AWQ_ORDER).T.float()
        z = unpack_int32(t["qzeros"], 1, AWQ_ORDER).T.float().repeat_interleave(GROUP, 1)
        return (q - z) * t["scales"].T.float().repeat_interleave(GROUP, 1)
    if method.startswith("gptq"):
        q = unpack_int32(t["qweight"], 0).T.float()                 # [N, K]
        z = unpack_int32(t["qzeros"], 1).T.float()                  # [N, groups]
        k = q.shape[1]
        # desc_act: the group of input k is g_idx[k] (scales whole); else k // g locally
        g = t["g_idx"].long() if method == "gptq-desc-act" else torch.arange(k) // GROUP
        return (q - z[:, g]) * t["scales"].T.float()[:, g]
    if method.startswith("w4a16"):
        q = unpack_int32(t["weight_packed"], 1).float()             # [N, K]
        z = unpack_int32(t["weight_zero_point"], 0).float()        # [N, groups]
        g = t["weight_g_idx"].long()
        return (q - z[:, g]) * t["weight_scale"].float()[:, g]
    raise ValueError(method)


@pytest.mark.parametrize("method", ["awq", "gptq", "gptq-desc-act", "w4a16-asym-actorder"])
def test_rank_shards_dequantize_to_slices_of_the_weight(tmp_path: Path, method: str) -> None:
    model, cfg = write_int4(tmp_path / method, method)
    ref = reference_tensors(model)
    tp = 2
    shards = [dict(Reader(p)) for p in plan_all(load_spec(model), open_checkpoint(model), pp=1,
                                                  tp=tp)]
    for module in ("model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.o_proj",
                   "model.layers.2.mlp.down_proj", "model.layers.3.mlp.up_proj"):
        parts = {k[len(module) + 1:]: v for k, v in ref.items() if k.startswith(module + ".")}
        whole = _dequant(method, parts)
        row = module.endswith(("o_proj", "down_proj"))
        pieces = whole.tensor_split(tp, 1 if row else 0)
        for r, shard in enumerate(shards):
            mine = {k[len(module) + 1:]: v for k, v in shard.items()
                    if k.startswith(module + ".")}
            assert set(mine) == set(parts), (module, sorted(mine))
            assert torch.equal(_dequant(method, mine), pieces[r]), (method, module, r)


# ---- refusals --------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["awq", "gptq", "w4a16"])
def test_tp_cutting_a_group_is_refused_naming_the_tensor(tmp_path: Path, method: str) -> None:
    """qwen3_moe experts' down_proj has 32 inputs: at tp=4 a rank's 8 cut a 16-input group
    (vLLM: "the input size is not aligned with the quantized weight shape")."""
    model, _ = write_int4(tmp_path / method, method, "tiny-qwen3_moe")
    spec, index = load_spec(model), open_checkpoint(model)
    plan_all(spec, index, pp=1, tp=2)
    with pytest.raises(PlanError) as err:
        plan_all(spec, index, pp=1, tp=4)
    msg = str(err.value)
    assert "mlp.experts." in msg and "down_proj" in msg and "block 16" in msg and "tp=4" in msg


def test_missing_companion_is_named(tmp_path: Path) -> None:
    model, _ = write_int4(tmp_path / "gptq", "gptq")
    (tmp_path / "gptq-missing").mkdir()
    ref = reference_tensors(model)
    del ref["model.layers.1.mlp.down_proj.qzeros"]
    from pploader.tiny import write_checkpoint
    import json
    write_checkpoint(tmp_path / "gptq-missing", ref,
                     json.loads((model / "config.json").read_text()))
    with pytest.raises(PlanError, match=r"model\.layers\.1\.mlp\.down_proj\.qzeros"):
        plan_all(load_spec(tmp_path / "gptq-missing"), open_checkpoint(tmp_path / "gptq-missing"),
                 pp=1)


@pytest.mark.parametrize("qc, match", [
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "lm_head": True}, "lm_head"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
     "checkpoint_format 'marlin'"),
    ({"quant_method": "awq", "bits": 4, "group_size": -1}, "awq group_size"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "a": {"weights": {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 8,
                          "actorder": "dynamic"}}}}, "actorder .dynamic."),
    ({"quant_method": "compressed-tensors", "format": "mixed-precision", "config_groups": {
        "a": {**CONFIGS["w4a16"]["config_groups"]["group_0"], "format": "pack-quantized"},
        "b": {**CONFIGS["w8a8"]["config_groups"]["group_0"], "format": "int-quantized",
              "targets": ["Qwen3MoeSparseMoeBlock"]}}},
     "config group b: class target 'Qwen3MoeSparseMoeBlock' is not supported"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "a": {"weights": {"type": "int", "num_bits": 4, "strategy": "tensor"}}}},
     "strategy 'tensor'"),
])
def test_unsupported_variants_are_config_errors(qc: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        scheme_from_config({"quantization_config": qc})


def test_public_load_keeps_float16_scales_of_a_bfloat16_model(tmp_path: Path) -> None:
    """GPTQ / AWQ store ``scales`` as float16 whatever the model dtype (the tiny configs are
    bfloat16): kept as stored through plan_stage / load_stage, packed int32 too."""
    from pploader import Topology, load_stage, plan_stage
    model, _ = write_int4(tmp_path / "gptq", "gptq")
    ref = reference_tensors(model)
    result = load_stage(plan_stage(model, Topology(2, 2, rank=3)))
    for target, tensor in result.state_dict.items():
        assert tensor.dtype == ref[target].dtype, target
    assert any(t.endswith(".scales") for t in result.state_dict)


# ---- stored layouts of any orientation, stacked experts too: property-tested -----------------
@st.composite
def layout_cases(draw: st.DrawFn) -> dict:
    """A logical [E?, N, K] weight, a TP rule on N or K, and a stored tensor whose dims follow
    N and K in either order with a block (a pack, a group) or one entry, maybe held whole."""
    from pploader.planning.quant_layout import Axis
    tp = draw(st.sampled_from([1, 2, 4]))
    experts = draw(st.sampled_from([0, 3]))
    n = draw(st.integers(1, 4)) * 8
    k = draw(st.integers(1, 4)) * 8
    axes = [Axis(of, draw(st.sampled_from([1, 2, 4, 8, None])), draw(st.booleans()))
            for of in (0, 1)]
    if draw(st.booleans()):
        axes.reverse()  # transposed (AWQ / GPTQ store [K, N])
    if draw(st.booleans()):
        axes = axes[:1]  # one dim only (g_idx [K])
    return dict(tp=tp, experts=experts, logical=((experts,) if experts else ()) + (n, k),
                axes=tuple(axes), dim=draw(st.sampled_from([0, 1])),
                units=draw(st.sampled_from([None, 1, 2, 4])),
                first_expert=draw(st.integers(0, 2)))


@settings(max_examples=150, deadline=None)
@given(layout_cases())
def test_stored_slices_cover_exactly_the_ranks_blocks(case: dict) -> None:
    """Each stored entry stands for the block of logical indices it covers; a rank's stored
    selection must be exactly the entries whose blocks meet its logical slice, in order
    (whole along an unsplit or one-entry dim), experts passing through."""
    from pploader.families.base import ShardRule
    from pploader.planning.quant_layout import PLAIN, Companion, QuantScheme
    from pploader.planning.shard import Selection, tp_selection
    logical, tp, axes = case["logical"], case["tp"], case["axes"]
    lead = len(logical) - 2
    part = Companion("t", "I32", axes)
    scheme = QuantScheme("test", Companion("weight", "I32", PLAIN), (part,))
    stored = torch.arange(math.prod(part.shape(logical))).reshape(part.shape(logical))
    units = case["units"]
    rule = ShardRule("w", lead + case["dim"], units=(lambda s, u=units: u) if units else None)
    for r in range(tp):
        try:
            sel = tp_selection(rule, logical, None, r, tp, "w")  # type: ignore[arg-type]
        except PlanError:
            return  # indivisible shapes: tests/planning/test_tp.py
        if case["experts"]:
            e0 = min(case["first_expert"], case["experts"] - 1)
            sel = Selection(((0, ((e0, case["experts"] - e0),)),)).merged(sel)
        picked = dict(sel.dims)
        want = stored
        for d in range(lead):
            if d in picked:
                want = want.index_select(d, torch.cat([torch.arange(a, a + m)
                                                       for a, m in picked[d]]))
        cut = False
        for at, a in enumerate(axes):
            d = lead + a.of
            idx = torch.cat([torch.arange(s, s + m) for s, m in picked[d]]) if d in picked \
                else torch.arange(logical[d])
            if a.block is None:
                continue
            blocks = list(dict.fromkeys((idx // a.block).tolist()))
            whole_blocks = all(
                s % a.block == 0 and (m % a.block == 0 or s + m == logical[d])
                for s, m in picked.get(d, ()))
            cut |= not whole_blocks
            if a.split:
                want = want.index_select(lead + at, torch.tensor(blocks, dtype=torch.long))
        if cut:
            with pytest.raises(PlanError, match="cuts"):
                scheme.companion_selection(part, sel, logical, "w", tp)
            return
        got = scheme.companion_selection(part, sel, logical, "w", tp)
        assert torch.equal(_take(stored, got), want), (case, r, got)


def _take(t: torch.Tensor, sel) -> torch.Tensor:  # type: ignore[no-untyped-def]
    for d, intervals in sel.dims:
        t = torch.cat([t.narrow(d, a, n) for a, n in intervals], d)
    return t


def test_expected_tensors_match_what_each_layout_holds(llama_int4: tuple[Path, dict, str]
                                                       ) -> None:
    """``quant.expected_tensors`` (the family template with the scheme applied, no headers)
    names every stored tensor with its shape: qweight / weight_packed, zeros, scales, g_idx,
    weight_shape, global scales."""
    from pploader.planning.quant import expected_tensors
    model, _, method = llama_int4
    held = {k: tuple(v.shape) for k, v in reference_tensors(model).items()}
    expected = expected_tensors(load_spec(model))
    assert set(expected) == set(held), (method, sorted(set(expected) ^ set(held))[:6])
    for name, shape in expected.items():
        assert shape == held[name] or (shape == () and math.prod(held[name]) == 1), \
            (method, name, shape, held[name])
