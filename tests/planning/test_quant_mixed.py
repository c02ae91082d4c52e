"""compressed-tensors checkpoints with config groups of different schemes (int8 W8A8 attention,
int4 pack-quantized MLP, one layer FP8) and an ignore list, at PP=2, PP=2 x TP=2 and
PP=2 x EP=2 (x TP=2), on a tiny llama and a tiny qwen3_moe (per-expert experts).

Each module's method is read from the config by hand (tests/quant_mixed.py); each rank's
tensors must be, bitwise, the engine's slice of that method's stored tensors
(``quant_int4.engine_slices``, from vLLM's parameter attributes), every tensor read by the
ranks owning it and by no other; also one component under two int4 schemes of equal shapes
(symmetric; asymmetric with act-order), each sliced by its own. Refusals name the tensor: a
weight stored quantized whose module no group targets, or the ignore list names, or another
group's scheme covers (one scheme too); a module two groups match where compressed-tensors
and vLLM would pick different schemes; a MoE layer whose experts mix schemes; a fused q/k/v
whose pieces do.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch

from helpers import reference_tensors
from pploader import PlanError
from pploader.io.read import Reader
from pploader.planning.checkpoint import open_checkpoint
from pploader.planning.plan import plan_all
from pploader.planning.quant import scheme_from_config
from pploader.planning.spec import load_spec
from quant_int4 import engine_slices
from quant_mixed import MIXED, mixed_method, write_mixed


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _owner(name: str, plan, ep: int, experts: int) -> bool:  # type: ignore[no-untyped-def]
    """Whether ``plan``'s rank reads ``name`` (its stage's layer or globals, its experts)."""
    w, parts = plan.window, name.split(".")
    if name.startswith("model.layers."):
        mine = w.start_layer <= int(parts[2]) < w.end_layer
    else:
        mine = w.has_head if name.startswith(("lm_head", "model.norm.")) else w.has_embed
    if mine and "experts" in parts and ep > 1:
        expert, per = int(parts[parts.index("experts") + 1]), experts // ep
        mine = plan.topology.ep_rank * per <= expert < (plan.topology.ep_rank + 1) * per
    return mine


def _check(model: Path, cfg: dict, pp: int, tp: int, ep: int,
           method_of: Callable[[str], Optional[str]] = mixed_method,
           kinds: frozenset = frozenset({None, "w8a8", "w4a16", "fp8-channel"})) -> None:
    ref = reference_tensors(model)
    plans = plan_all(load_spec(model), open_checkpoint(model), pp=pp, tp=tp, ep=ep)
    methods = {n: method_of(n.rsplit(".", 1)[0] + ".weight") for n in ref}
    assert set(methods.values()) == kinds, set(methods.values())  # the test covers all
    for plan in plans:
        got = dict(Reader(plan))
        owned = {n for n in ref if _owner(n, plan, ep, cfg.get("num_local_experts", 0))}
        where = plan.topology.describe()
        assert set(got) == owned, (where, sorted(set(got) ^ owned)[:6])
        for name, tensor in got.items():
            full = ref[name]
            slices, pad = engine_slices(name, tuple(full.shape), cfg,
                                        methods[name] or "w4a16", tp, plan.topology.tp_rank)
            want = full[slices]
            if pad:
                want = torch.cat([want, torch.zeros((pad,) + tuple(want.shape[1:]),
                                                    dtype=want.dtype)])
            assert tensor.dtype == full.dtype and tensor.shape == want.shape, \
                (name, where, tuple(tensor.shape), tuple(want.shape))
            assert _bytes(tensor) == _bytes(want), (name, where)
        items = {i.name: i.dtype for i in plan.items}  # the plan's dtype per weight
        for name in items:
            method = methods[name]
            if name.endswith((".weight", ".weight_packed")):
                want_dtype = {None: "BF16", "w8a8": "I8", "w4a16": "I32", "w4a16-asym-actorder":
                              "I32", "fp8-channel": "F8_E4M3"}[method]
                assert items[name] == want_dtype, (name, method, items[name])


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    return write_mixed(tmp_path_factory.mktemp("mixed-llama"))


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    return write_mixed(tmp_path_factory.mktemp("mixed-moe"), "tiny-qwen3_moe")


@pytest.mark.parametrize("pp, tp", [(2, 1), (2, 2)])
def test_dense_ranks_hold_each_weights_schemes_slices(llama: tuple[Path, dict], pp: int,
                                                      tp: int) -> None:
    _check(*llama, pp, tp, 1)


@pytest.mark.parametrize("pp, tp, ep", [(2, 1, 1), (2, 2, 1), (2, 1, 2), (2, 2, 2)])
def test_moe_ranks_hold_each_weights_schemes_slices(moe: tuple[Path, dict], pp: int, tp: int,
                                                    ep: int) -> None:
    _check(*moe, pp, tp, ep)


def _actorder_method(name: str) -> Optional[str]:
    if not re.fullmatch(r"model\.layers\.\d+\..*_proj\.weight", name) or "lm_head" in name:
        return None
    return "w4a16-asym-actorder" if re.match(r"model\.layers\.[4-7]\.mlp\.", name) \
        else "w4a16"


@pytest.mark.parametrize("pp, tp", [(1, 2), (2, 2)])
def test_same_shapes_under_two_schemes_are_sliced_each_by_its_own(tmp_path: Path, pp: int,
                                                                  tp: int) -> None:
    """Layers 0-3 int4 symmetric, layers 4-7's MLP int4 asymmetric with act-order: the same
    component, shape and dtype (weight_packed, weight_scale [N, K/16]), but a row-parallel
    down_proj's act-order scales are held whole while the others are split."""
    from quant_int4 import CONFIGS
    one = CONFIGS["w4a16"]["config_groups"]["group_0"]
    act = CONFIGS["w4a16-asym-actorder"]["config_groups"]["group_1"]
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized",
          "config_groups": {"sym": dict(one), "act": {
              **act, "targets": [r"re:model\.layers\.[4-7]\.mlp\."]}},
          "ignore": ["lm_head"]}
    model, cfg = write_mixed(tmp_path / "m", qc=qc, method_of=_actorder_method)
    _check(model, cfg, pp, tp, 1, _actorder_method,
           frozenset({None, "w4a16", "w4a16-asym-actorder"}))


def test_load_stage_is_bitwise_and_keeps_each_weights_dtype(llama: tuple[Path, dict]) -> None:
    """The public load of one rank (PP=2 x TP=2, rank 1: stage 0, TP rank 1) on the CPU."""
    from pploader import Topology, load_stage, plan_stage
    model, cfg = llama
    ref = reference_tensors(model)
    result = load_stage(plan_stage(model, Topology(2, 2, rank=1)))
    assert result.state_dict
    for target, tensor in result.state_dict.items():
        slices, pad = engine_slices(target, tuple(ref[target].shape), cfg,
                                    mixed_method(target.rsplit(".", 1)[0] + ".weight")
                                    or "w4a16", 2, 1)
        assert not pad and tensor.dtype == ref[target].dtype, target
        assert _bytes(tensor) == _bytes(ref[target][slices]), target
    held = {t.rsplit(".", 1)[-1] for t in result.state_dict}
    assert {"weight_packed", "weight_shape", "input_scale"} <= held, held


def test_expected_tensors_without_headers(llama: tuple[Path, dict]) -> None:
    """``expected_tensors`` (no headers: the config alone) names each module's stored tensors
    by its group: the ignored down_proj of layer 2 stays a bf16 weight."""
    from pploader.planning.quant import expected_tensors
    model, _ = llama
    held = {k: tuple(v.shape) for k, v in reference_tensors(model).items()}
    expected = expected_tensors(load_spec(model))
    assert set(expected) == set(held), sorted(set(expected) ^ set(held))[:6]
    assert "model.layers.2.mlp.down_proj.weight" in expected


# ---- which group wins ------------------------------------------------------------------------
def _mixed(groups: dict, ignore: tuple = ()):  # type: ignore[no-untyped-def]
    qc = {"quant_method": "compressed-tensors", "ignore": list(ignore), "config_groups": {
        name: {**MIXED["config_groups"][kind], "targets": targets}
        for name, (kind, targets) in groups.items()}}
    return scheme_from_config({"quantization_config": qc})


def test_precedence_as_compressed_tensors() -> None:
    """Exact name before regex before class; a target named twice belongs to the later group;
    ignore before all; a module no target matches is plain (the groups in an order where
    vLLM's first match in config order agrees)."""
    s = _mixed({"a": ("int4", ["Linear"]),
                "c": ("fp8", ["model.layers.0.self_attn.q_proj", "re:.*k_proj$"]),
                "b": ("attn", [r"re:.*\.q_proj$"]),
                "d": ("int4", [r"re:.*k_proj$"])}, ignore=["re:.*v_proj"])
    assert s.mixed
    name = {n: (s.resolve(f"model.layers.0.self_attn.{n}.weight") or s).name
            for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
    # q: exact (c) over the regex (b); k: re:.*k_proj$ now d's; v ignored; o: Linear (a)
    assert name == {"q_proj": "fp8-channel", "k_proj": "w4a16-group", "v_proj": "mixed",
                    "o_proj": "w4a16-group"}, name
    assert s.resolve("model.layers.1.self_attn.q_proj.weight").name == "int8-channel"
    plain = _mixed({"a": ("int4", [r"re:.*mlp.*"]), "b": ("attn", [r"re:.*self_attn.*"])})
    assert plain.resolve("lm_head.weight") is None


@pytest.mark.parametrize("groups, ct, vllm", [
    # two regexes: compressed-tensors takes the alphabetically first (attn's), vLLM the
    # first in config order (l0's)
    ({"l0": ("int4", [r"re:model\.layers\.0\.self_attn\..*"]),
      "attn": ("attn", [r"re:.*self_attn\.[qkvo]_proj$"])}, "attn", "l0"),
    # an exact name listed after a regex: compressed-tensors takes the exact name
    ({"attn": ("attn", [r"re:.*self_attn\.[qkvo]_proj$"]),
      "one": ("fp8", ["model.layers.0.self_attn.q_proj"])}, "one", "attn"),
])
def test_engines_disagreeing_is_refused_naming_the_tensor(groups: dict, ct: str,
                                                          vllm: str) -> None:
    s = _mixed(groups)
    assert s.resolve("model.layers.1.self_attn.q_proj.weight").name == "int8-channel"
    with pytest.raises(PlanError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight_scale"
                                        rf".*config group {ct} .* by {vllm} "):
        s.resolve("model.layers.0.self_attn.q_proj.weight_scale")


# ---- refusals naming the tensor --------------------------------------------------------------
def _with_config(model: Path, tmp: Path, qc: dict) -> Path:
    """``model``'s tensors under another quantization_config."""
    from pploader.tiny import write_checkpoint
    cfg = json.loads((model / "config.json").read_text())
    cfg["quantization_config"] = qc
    write_checkpoint(tmp, reference_tensors(model), cfg)
    return tmp


@pytest.mark.parametrize("change, match", [
    # the int4 group no longer targets every Linear: layer 0's down_proj matches no group
    (lambda qc: qc["config_groups"]["int4"].update(
        targets=[r"re:model\.layers\.[02-9]\.mlp\.(gate|up)_proj$"]),
     r"model\.layers\.\d\.mlp\.down_proj\.weight_packed.*no config group targets it"),
    # the ignore list names a module the checkpoint stores quantized
    (lambda qc: qc["ignore"].append("model.layers.3.mlp.up_proj"),
     r"model\.layers\.3\.mlp\.up_proj\.weight_packed.*ignore list names it"),
    # the fp8 group now covers layer 3's MLP, stored as int4
    (lambda qc: qc["config_groups"]["fp8"].update(targets=[r"re:model\.layers\.[13]\.mlp\."]),
     r"model\.layers\.3\.mlp\.\w+_proj\.weight_packed.*fp8-channel"),
])
@pytest.mark.parametrize("strict", [True, False])
def test_a_weight_stored_against_its_group_is_refused(llama: tuple[Path, dict], tmp_path: Path,
                                                      change: Callable, match: str,
                                                      strict: bool) -> None:
    qc = json.loads(json.dumps(MIXED))
    change(qc)
    model = _with_config(llama[0], tmp_path / "m", qc)
    with pytest.raises(PlanError, match=match):
        plan_all(load_spec(model), open_checkpoint(model), pp=1, strict=strict)


@pytest.mark.parametrize("ep_rank", [0, 1])
def test_experts_of_one_layer_mixing_schemes_are_refused(tmp_path: Path, ep_rank: int) -> None:
    """Expert 0 of layer 2 FP8, its other experts int4: vLLM builds one MoE method per layer
    (from expert 0's scheme, so the EP rank of experts 4-7 is refused too)."""
    qc = json.loads(json.dumps(MIXED))
    qc["config_groups"]["fp8"]["targets"] = [r"re:model\.layers\.2\.mlp\.experts\.0\."]

    def method(name: str) -> Optional[str]:
        if name.startswith("model.layers.2.mlp.experts.0."):
            return "fp8-channel"
        got = mixed_method(name)
        return "w4a16" if got == "fp8-channel" else got
    from pploader import Topology, plan_stage
    model, _ = write_mixed(tmp_path / "m", "tiny-qwen3_moe", qc, method)
    with pytest.raises(PlanError, match=r"experts of layer 2 mix quantization schemes.*"
                                        r"model\.layers\.2\.mlp\.experts\.\d\.\w+_proj\.weight"):
        plan_stage(model, Topology(1, ep_size=2, rank=ep_rank), strict=False)


@pytest.mark.parametrize("change, match", [
    (lambda qc: qc["ignore"].append("model.layers.1.self_attn.o_proj"),
     r"model\.layers\.1\.self_attn\.o_proj\.weight_packed.*ignore list names it"),
    (lambda qc: qc["config_groups"]["group_0"].update(targets=[r"re:.*mlp\..*"]),
     r"model\.layers\.\d\.self_attn\.\w_proj\.weight_packed.*no config group targets it"),
])
def test_one_scheme_checks_the_groups_and_ignore_list_too(tmp_path: Path, change: Callable,
                                                          match: str) -> None:
    """A config of one scheme (int4 W4A16): the same refusals, at PP=2 x TP=2."""
    from quant_int4 import CONFIGS, write_int4
    model, _ = write_int4(tmp_path / "w4a16", "w4a16")
    plan_all(load_spec(model), open_checkpoint(model), pp=2, tp=2)
    qc = json.loads(json.dumps(CONFIGS["w4a16"]))
    change(qc)
    bad = _with_config(model, tmp_path / "bad", qc)
    with pytest.raises(PlanError, match=match):
        plan_all(load_spec(bad), open_checkpoint(bad), pp=2, tp=2)


def test_fused_pieces_with_different_schemes_are_refused(tmp_path: Path) -> None:
    """q_proj of layer 0 int4 by an exact target, k / v int8: vLLM's qkv_proj is one layer of
    one scheme (the family's q/k/v fusion), so the plan is refused naming a piece."""
    qc = json.loads(json.dumps(MIXED))
    qc["config_groups"]["int4"]["targets"].append("model.layers.0.self_attn.q_proj")

    def method(name: str) -> Optional[str]:
        return "w4a16" if name.startswith("model.layers.0.self_attn.q_proj.") \
            else mixed_method(name)
    model, _ = write_mixed(tmp_path / "m", qc=qc, method_of=method)
    with pytest.raises(PlanError, match=r"model\.layers\.0\.self_attn\.[kq]_proj\.weight.*"
                                        r"fused self_attn\.qkv_proj\.weight in layer 0"):
        plan_all(load_spec(model), open_checkpoint(model), pp=2)
