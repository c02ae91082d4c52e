"""Engines as they are: their exact layer splits (vLLM, SGLang, their partition variables),
placeholder layers, multi-rule name maps, iter_stage_weights(StagePlan), and the worked
SGLang / hand-written engine integrations of docs/integration.md."""
from __future__ import annotations

import re

import json
import os
from pathlib import Path
import pytest
import torch

import pploader
from pploader import (EngineSplit, LoadRecord, MissingLayer, NameMap, NameRule, PlanError,
                      Topology, check_engine_window, get_pp_indices, iter_stage_weights,
                      load_stage_into, make_stage_layers, plan_stage, reload_from_disk)
from pploader.planning.partition import engine_layer_counts, engine_windows, even_windows
from pploader.cli import main as cli_main
from pploader.planning.plan import make_windows
from pploader.planning.spec import spec_from_config

from engine_models import (HAND_NAMES, HandStage, SGLangStyleLlama, run_pipeline)
from helpers import make_model, reference_tensors, run, tiny_config, torchrun_cmd

CFG = tiny_config()
PAIRS = [(layers, pp) for layers in range(1, 129) for pp in range(1, 17)]


# ---- the engines' published formulas, written out here independently ----------------------

def vllm_reference(layers: int, rank: int, pp: int) -> tuple[int, int]:
    """vLLM's get_pp_indices as its docstring and body read: every stage gets layers // pp;
    the remainder is spread one layer each over the stages before the last, starting from the
    second-to-last and moving towards the first."""
    sizes = [layers // pp] * pp
    remaining = layers % pp
    stage = pp - 2
    while remaining:
        sizes[stage] += 1
        stage -= 1
        remaining -= 1
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


def sglang_reference(layers: int, rank: int, pp: int) -> tuple[int, int]:
    """SGLang's get_pp_indices as it reads: base = layers // pp, remainder r; a rank among the
    last r has base + 1 layers starting at rank * (base + 1) - (pp - r), any other rank has
    base layers starting at rank * base."""
    base, r = divmod(layers, pp)
    if rank >= pp - r:
        start = rank * (base + 1) - (pp - r)
        return start, start + base + 1
    return rank * base, rank * base + base


def test_published_examples() -> None:
    assert [w.num_layers for w in engine_windows("sglang", 61, 4)] == [15, 15, 15, 16]
    assert [w.num_layers for w in engine_windows("vllm", 61, 4)] == [15, 15, 16, 15]
    assert [w.num_layers for w in engine_windows("vllm", 61, 2)] == [31, 30]
    assert get_pp_indices(61, 3, 4, style="sglang") == (45, 61)
    assert get_pp_indices(61, 2, 4) == (30, 46)
    # vLLM's own test values for VLLM_PP_LAYER_PARTITION
    assert [get_pp_indices(20, r, 4, partition="4,6,6,4") for r in range(4)] == \
        [(0, 4), (4, 10), (10, 16), (16, 20)]


@pytest.mark.parametrize("style, reference", [("vllm", vllm_reference),
                                              ("sglang", sglang_reference)])
def test_every_split_equals_the_engine_formula(style: str, reference) -> None:
    """Every (layers <= 128, pp <= 16), every rank; fewer layers than stages (a stage with
    no layer: the engine formula gives an empty window) is refused, as the docs say."""
    for layers, pp in PAIRS:
        if layers < pp:
            with pytest.raises(PlanError, match="no layer"):
                get_pp_indices(layers, 0, pp, style=style)
            continue
        ours = [get_pp_indices(layers, r, pp, style=style) for r in range(pp)]
        assert ours == [reference(layers, r, pp) for r in range(pp)], (style, layers, pp)


def test_even_split_is_vllms_and_not_sglangs() -> None:
    differ = 0
    for layers, pp in PAIRS:
        if pp > layers:
            continue
        even = [(w.start_layer, w.end_layer) for w in even_windows(layers, pp)]
        assert even == [vllm_reference(layers, r, pp) for r in range(pp)], (layers, pp)
        differ += even != [sglang_reference(layers, r, pp) for r in range(pp)]
    assert differ == 1501  # of the 1,928 pairs with layers >= pp: why --partition sglang exists


def test_planning_with_engine_splits_for_every_layout() -> None:
    """What `pploader plan` / plan_stage place for every (layers <= 128, pp <= 16)."""
    for layers in range(1, 129):
        spec = spec_from_config(tiny_config(num_hidden_layers=layers))
        for pp in range(1, min(layers, 16) + 1):
            for style, reference in (("vllm", vllm_reference), ("sglang", sglang_reference)):
                ref = [reference(layers, r, pp) for r in range(pp)]
                got = make_windows(spec, None, pp, style)  # type: ignore[arg-type]
                assert [(w.start_layer, w.end_layer) for w in got] == ref, (style, layers, pp)
                assert got[0].has_embed and got[-1].has_head


def test_partition_variable_text() -> None:
    split = EngineSplit("sglang", "16,15,15,15")
    spec = spec_from_config(tiny_config(num_hidden_layers=61))
    assert [w.num_layers for w in make_windows(spec, None, 4, split)] == [16, 15, 15, 15]  # type: ignore[arg-type]
    assert str(split) == "sglang (SGLANG_PP_LAYER_PARTITION=16,15,15,15)"
    with pytest.raises(PlanError, match=r"VLLM_PP_LAYER_PARTITION='4,4' has 2 stages but pp is 3"):
        engine_layer_counts("vllm", 8, 3, "4,4")
    with pytest.raises(PlanError, match=r"sums to 9 but the model has 8 layers"):
        engine_layer_counts("sglang", 8, 3, "3,3,3")
    with pytest.raises(PlanError, match="comma-separated"):
        engine_layer_counts("sglang", 8, 2, "4;4")
    with pytest.raises(PlanError, match="unknown engine 'trt'"):
        EngineSplit("trt")
    with pytest.raises(PlanError, match=r"gives stage 0 no layer"):
        make_windows(spec, None, 2, EngineSplit("vllm", "0,61"))  # type: ignore[arg-type]
    assert engine_layer_counts("vllm", 3, 4) == [1, 1, 1, 0]   # as vLLM splits it
    assert engine_layer_counts("sglang", 3, 4) == [0, 1, 1, 1]
    with pytest.raises(PlanError, match="pp_rank 4 is not in"):
        get_pp_indices(8, 4, 4)


@pytest.mark.parametrize("args,kwargs,error", [
    ((3, 3, 4), {}, "gives stage 3 no layer"),                 # issue 44: was (3, 3)
    ((3, 0, 4), {"style": "sglang"}, "gives stage 0 no layer"),
    ((8, 0, 2), {"partition": "8,0"}, "gives stage 1 no layer"),
    ((8, 0, 2), {"partition": [8, 0]}, "gives stage 1 no layer"),
    (("8", 0, 2), {}, "num_layers='8' is not an integer"),
    ((8.5, 0, 2), {}, "num_layers=8.5 is not an integer"),
    ((8, 0.5, 2), {}, "pp_rank=0.5 is not an integer"),
    ((8, None, 2), {}, "pp_rank=None"),
    ((8, 0, 0), {}, "pp_size=0 is below 1"),
    ((8, 0, 2), {"style": "trt"}, "style='trt' is not one of"),
    ((8, 0, 2), {"partition": 8}, "partition=8: give layer counts"),
])
def test_get_pp_indices_refuses_empty_stages_and_bad_arguments(args: tuple, kwargs: dict,
                                                               error: str) -> None:
    from pploader.errors import PPLoaderError
    with pytest.raises(PPLoaderError, match=re.escape(error)):
        get_pp_indices(*args, **kwargs)


# ---- the CLI -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def deep_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """61 layers (DeepSeek-V3's count), tiny tensors."""
    cfg = tiny_config(num_hidden_layers=61, hidden_size=16, intermediate_size=32,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8, vocab_size=64)
    return make_model(tmp_path_factory.mktemp("deep"), cfg, shard_bytes=40_000)


def _cli_windows(capsys: pytest.CaptureFixture, model: Path, pp: int, partition: str
                 ) -> tuple[str, list[tuple[int, int]]]:
    assert cli_main(["plan", "--model", str(model), "--pp", str(pp), "--partition", partition,
                     "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    return doc["partition"], [(r["start_layer"], r["end_layer"]) for r in doc["ranks"]]


def test_cli_plan_partition_sglang_and_vllm(deep_model: Path, capsys: pytest.CaptureFixture,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SGLANG_PP_LAYER_PARTITION", raising=False)
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    for pp in range(1, 17):
        label, got = _cli_windows(capsys, deep_model, pp, "sglang")
        assert label == "sglang" and got == [sglang_reference(61, r, pp) for r in range(pp)]
        _, got = _cli_windows(capsys, deep_model, pp, "vllm")
        assert got == [vllm_reference(61, r, pp) for r in range(pp)]
    monkeypatch.setenv("SGLANG_PP_LAYER_PARTITION", "20,20,11,10")
    label, got = _cli_windows(capsys, deep_model, 4, "sglang")
    assert label == "sglang (SGLANG_PP_LAYER_PARTITION=20,20,11,10)"
    assert got == [(0, 20), (20, 40), (40, 51), (51, 61)]
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "30,31")
    assert _cli_windows(capsys, deep_model, 2, "vllm")[1] == [(0, 30), (30, 61)]
    assert _cli_windows(capsys, deep_model, 2, "even")[1] == [(0, 31), (31, 61)]  # not read
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "30,30")
    assert cli_main(["plan", "--model", str(deep_model), "--pp", "2", "--partition",
                     "vllm"]) == 2
    assert "VLLM_PP_LAYER_PARTITION='30,30' sums to 60" in capsys.readouterr().err


def test_cli_load_resolves_the_engine_split(tiny_llama: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from pploader.cli import _engine_partition, build_parser
    args = build_parser().parse_args(["load", "--model", str(tiny_llama), "--partition",
                                      "sglang"])
    monkeypatch.delenv("SGLANG_PP_LAYER_PARTITION", raising=False)
    assert _engine_partition(args.partition) == EngineSplit("sglang")
    monkeypatch.setenv("SGLANG_PP_LAYER_PARTITION", "1,1,6")
    assert _engine_partition(args.partition) == EngineSplit("sglang", "1,1,6")


@pytest.mark.slow
def test_torchrun_load_partition_sglang(tiny_llama: Path) -> None:
    """`pploader load --partition sglang` on 3 ranks: each rank loads SGLang's window."""
    out = run(torchrun_cmd(3, "load", "--model", str(tiny_llama), "--pp", "3", "--partition",
                           "sglang", "--json", "--no-pools"), timeout=300,
              env={"SGLANG_PP_LAYER_PARTITION": "1,3,4"})
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout[out.stdout.index("{"):])
    assert [(r["start_layer"], r["end_layer"]) for r in doc["ranks"]] == [(0, 1), (1, 4), (4, 8)]
    assert all(r["read_bytes"] == r["ideal_bytes"] for r in doc["ranks"])


def test_plan_stage_partition_sglang(deep_model: Path) -> None:
    got = [plan_stage(deep_model, Topology(4, rank=r), partition="sglang").plan.window
           for r in range(4)]
    assert [(w.start_layer, w.end_layer) for w in got] == [(0, 15), (15, 30), (30, 45), (45, 61)]


# ---- placeholders ---------------------------------------------------------------------------

def test_missing_layer() -> None:
    layer = MissingLayer(5)
    assert list(layer.parameters()) == [] and list(layer.buffers()) == []
    with pytest.raises(RuntimeError, match="layer 5 is a MissingLayer placeholder"):
        layer(torch.ones(2))
    x = torch.ones(3)
    assert MissingLayer(passthrough=True)(x, torch.zeros(1)) is x
    layers = make_stage_layers(6, (2, 4), lambda i: torch.nn.Linear(2, 2))
    assert [type(m).__name__ for m in layers] == ["MissingLayer"] * 2 + ["Linear"] * 2 + \
        ["MissingLayer"] * 2
    assert [n for n, _ in layers.named_parameters()] == ["2.weight", "2.bias", "3.weight",
                                                          "3.bias"]
    with pytest.raises(ValueError, match="not inside the model's 6 layers"):
        make_stage_layers(6, (4, 7), lambda i: torch.nn.Linear(2, 2))


def test_placeholder_at_an_owned_layer_is_refused(tiny_llama: Path) -> None:
    """A module built for another window: its placeholder stands where this stage owns a
    layer. An error even when not strict, before anything is written."""
    built_for = even_windows(8, 2)[0]                     # layers 0-3
    staged = plan_stage(tiny_llama, Topology(2, rank=0), partition=[5, 3])  # layers 0-4
    stage = HandStage(CFG, built_for)
    with pytest.raises(PlanError, match=r"blocks\.4 is a placeholder \(MissingLayer\) but stage "
                                        r"0 owns layer 4 \(layers 0-4\)"):
        load_stage_into(stage, staged, names=HAND_NAMES, strict=False)
    assert stage.blocks[0].attn.qkv.w.is_meta

    class PPMissingLayer(torch.nn.Identity):  # an engine's own placeholder, by class name
        pass
    stage.blocks[4] = PPMissingLayer()
    with pytest.raises(PlanError, match=r"blocks\.4 is a placeholder \(PPMissingLayer\)"):
        load_stage_into(stage, staged, names=HAND_NAMES)


# ---- names ----------------------------------------------------------------------------------

def test_name_map_prefix_is_backwards_compatible() -> None:
    names = NameMap("model.", "")
    assert names.to_module("model.layers.0.mlp.down_proj.weight") == "layers.0.mlp.down_proj.weight"
    assert names.to_module("lm_head.weight") is None
    assert names.to_checkpoint("layers.0.mlp.down_proj.weight") == \
        "model.layers.0.mlp.down_proj.weight"
    assert NameMap().to_module("x.y") == "x.y" == NameMap().to_checkpoint("x.y")


def test_name_map_rules() -> None:
    ck = "model.layers.3.self_attn.qkv_proj.weight"
    assert HAND_NAMES.to_module(ck) == "blocks.3.attn.qkv.w"
    assert HAND_NAMES.to_checkpoint("blocks.3.attn.qkv.w") == ck
    assert HAND_NAMES.to_module("lm_head.weight") == "head.w"
    assert HAND_NAMES.to_checkpoint("head.w") == "lm_head.weight"
    assert HAND_NAMES.to_checkpoint("blocks.3.self_attn.qkv_proj.w") == \
        "model.layers.3.self_self_attn.qkv_proj_proj.weight"  # exact, if odd
    assert NameMap.of(prefix={"model.": "m."}).to_checkpoint("model.x") is None  # no preimage
    assert HAND_NAMES.to_checkpoint("blocks.3.rotary.inv_freq") == \
        "model.layers.3.rotary.inv_freq"
    # rules apply in order, each once; substrings before prefixes before suffixes (of())
    names = NameMap.of(substr={"a.": "b."}, prefix={"b.": "c."}, suffix={".w": ".weight"})
    assert names.to_module("a.x.w") == "c.x.weight"
    assert names.to_module("a.a.w") == "c.a.weight"   # the substring rule fires once
    # not injective (norm_f and ln_f both give ln_f): a preimage, checked by the round trip
    names = NameMap.of(substr={"norm": "ln"})
    assert names.to_module("ln_f.weight") == names.to_module("norm_f.weight") == "ln_f.weight"
    assert names.to_checkpoint("ln_f.weight") in ("ln_f.weight", "norm_f.weight")
    assert NameMap.of(substr={"x": "y"}).to_checkpoint("xy") is None  # nothing maps to it
    # dropping
    names = NameMap("model.", "", rules=(NameRule("suffix", ".inv_freq", None),))
    assert names.to_module("model.rotary.inv_freq") is None and names.drops("model.rotary.inv_freq")
    assert not names.drops("lm_head.weight")
    assert list(names.apply([("model.a", 1), ("model.r.inv_freq", 2), ("lm_head.weight", 3)])) \
        == [("a", 1)]
    with pytest.raises(ValueError, match="kind 'infix'"):
        NameRule("infix", "a", "b")


def test_dropped_names_are_not_unexpected_and_not_read(tiny_llama: Path) -> None:
    staged = plan_stage(tiny_llama, Topology(2, rank=1))
    stage = HandStage(CFG, staged.plan.window)
    with pytest.raises(PlanError, match=r"with no module tensor: lm_head\.weight"):
        load_stage_into(stage, staged, names=NameMap(rules=tuple(
            r for r in HAND_NAMES.rules if r.old != "lm_head.")))
    drop_head = HAND_NAMES.rules + (NameRule("prefix", "head.", None),)
    stage = HandStage(CFG, staged.plan.window)
    result = load_stage_into(stage, staged, names=NameMap(rules=drop_head), strict=False)
    assert result.unexpected == () and result.missing == ("head.w",)
    head_bytes = staged.index.entry("lm_head.weight").nbytes
    assert result.stats.read_bytes == staged.plan.read_bytes - head_bytes


# ---- iter_stage_weights(StagePlan) ----------------------------------------------------------

def test_iter_stage_weights_takes_the_plan(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:
    topo = Topology(3, rank=1)
    staged = plan_stage(tiny_llama, topo, partition="sglang")
    by_dir = dict(iter_stage_weights(tiny_llama, topo, partition="sglang"))

    def no_second_plan(*args: object, **kwargs: object) -> None:
        raise AssertionError("planned twice")
    monkeypatch.setattr(pploader.stage, "plan_stage", no_second_plan)
    by_plan = dict(iter_stage_weights(staged))
    assert by_plan.keys() == by_dir.keys() == {i.target for i in staged.plan.items}
    assert all(torch.equal(by_plan[k], by_dir[k]) for k in by_plan)
    assert {k.split(".")[2] for k in by_plan if k.startswith("model.layers.")} == {"2", "3", "4"}
    with pytest.raises(ValueError, match="differs from the StagePlan's"):
        next(iter_stage_weights(staged, Topology(3, rank=0)))
    with pytest.raises(ValueError, match="topology missing"):
        next(iter_stage_weights(tiny_llama))


# ---- docs/integration.md: SGLang ----------------------------------------------------------

# docs/integration.md's SGLang integration, verbatim (type hints aside): plan with SGLang's
# split (its partition variable included), check the window against the model SGLang built,
# stream the stage into the model's own load_weights.
def load_stage(model: SGLangStyleLlama, model_dir: Path, pp_rank: int, pp_size: int) -> None:
    """model: the stage SGLang built (make_layers gave it start_layer / end_layer)."""
    split = pploader.EngineSplit("sglang", os.environ.get("SGLANG_PP_LAYER_PARTITION"))
    staged = pploader.plan_stage(model_dir, pploader.Topology(pp_size, rank=pp_rank),
                                 partition=split)
    pploader.check_engine_window(staged.plan.window, model.model.start_layer,
                                 model.model.end_layer, engine="sglang")
    model.load_weights(pploader.iter_stage_weights(staged))   # planned once, streamed


def sglang_stage(model_dir: Path, pp_rank: int, pp_size: int) -> SGLangStyleLlama:
    model = SGLangStyleLlama(CFG, pp_rank, pp_size)  # what SGLang builds (make_layers)
    load_stage(model, model_dir, pp_rank, pp_size)
    return model


def test_sglang_worked_integration(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SGLANG_PP_LAYER_PARTITION", raising=False)
    ids = torch.arange(10)
    single = sglang_stage(tiny_llama, 0, 1)
    ref = reference_tensors(tiny_llama)
    assert torch.equal(single.model.layers[7].mlp.down_proj.weight,
                       ref["model.layers.7.mlp.down_proj.weight"])
    want = run_pipeline([single], ids)
    for pp in (1, 2, 3, 4):
        stages = [sglang_stage(tiny_llama, r, pp) for r in range(pp)]
        for r, stage in enumerate(stages):  # every parameter loaded, with its checkpoint value
            assert stage.loaded == {n for n, _ in stage.named_parameters()}, (pp, r)
        assert torch.equal(run_pipeline(stages, ids), want), pp
    monkeypatch.setenv("SGLANG_PP_LAYER_PARTITION", "1,7")   # SGLang's variable, honoured
    stages = [sglang_stage(tiny_llama, r, 2) for r in range(2)]
    assert (stages[1].model.start_layer, stages[1].model.end_layer) == (1, 8)
    assert torch.equal(run_pipeline(stages, ids), want)


def test_sglang_window_disagreement_is_an_error(tiny_llama: Path) -> None:
    """8 layers over 3 stages: pploader's even split 3,3,2, SGLang's 2,3,3. Fed the even
    plan, SGLang's load_weights drops what it does not own and never sees layer 5: silently
    unloaded. The window check turns that into an error."""
    model = SGLangStyleLlama(CFG, 0, 3)                      # layers 0-1
    staged = plan_stage(tiny_llama, Topology(3, rank=0))     # even: layers 0-2
    with pytest.raises(PlanError, match=r"sglang built layers \[0, 2\) but pploader planned "
                                        r"\[0, 3\)"):
        check_engine_window(staged.plan.window, model.model.start_layer,
                            model.model.end_layer, engine="sglang")
    model = SGLangStyleLlama(CFG, 2, 3)                      # layers 5-7
    model.load_weights(iter_stage_weights(plan_stage(tiny_llama, Topology(3, rank=2))))
    assert "model.layers.5.self_attn.qkv_proj.weight" not in model.loaded  # the hazard


# ---- docs/integration.md: a hand-written engine --------------------------------------------

def hand_stage_loaded(model_dir: Path, pp_rank: int, pp_size: int
                      ) -> tuple[HandStage, LoadRecord]:
    """A hand-written stage loaded from ``model_dir``, and its record (for reloads)."""
    staged = plan_stage(model_dir, Topology(pp_size, rank=pp_rank), partition="sglang")
    stage = HandStage(CFG, staged.plan.window)          # placeholders outside the window
    result = load_stage_into(stage, staged, names=HAND_NAMES)  # strict: all or an error
    assert result.missing == () and result.unexpected == ()
    return stage, result.record


def hand_stage(model_dir: Path, pp_rank: int, pp_size: int) -> HandStage:
    return hand_stage_loaded(model_dir, pp_rank, pp_size)[0]


def test_hand_written_engine(tiny_llama: Path, tmp_path: Path) -> None:
    ids = torch.arange(10)
    want = run_pipeline([hand_stage(tiny_llama, 0, 1)], ids)
    stages, records = zip(*(hand_stage_loaded(tiny_llama, r, 3) for r in range(3)))
    assert [(s.window.start_layer, s.window.end_layer) for s in stages] == \
        [(0, 2), (2, 5), (5, 8)]
    assert torch.equal(run_pipeline(stages, ids), want)
    assert stages[1].blocks[0].__class__ is MissingLayer
    with pytest.raises(RuntimeError, match="layer 0 is a MissingLayer placeholder"):
        stages[1].blocks[0](torch.ones(2, CFG["hidden_size"]))
    # reload keeps the names (and the window): a second checkpoint, written in place
    second = make_model(tmp_path / "second", seed=1)
    ptr = stages[1].blocks[3].attn.qkv.w.data_ptr()
    for stage, record in zip(stages, records):
        reload_from_disk(stage, second, record=record)
    assert stages[1].blocks[3].attn.qkv.w.data_ptr() == ptr
    assert torch.equal(run_pipeline(stages, ids),
                       run_pipeline([hand_stage(second, 0, 1)], ids))


def test_hand_written_engine_layerwise(tiny_llama: Path, tmp_path: Path) -> None:
    """load_layerwise through the same name rules: a stream of the second checkpoint."""
    second = make_model(tmp_path / "second", seed=2)
    stage, record = hand_stage_loaded(tiny_llama, 1, 3)
    staged = plan_stage(second, Topology(3, rank=1), partition="sglang")
    report = pploader.load_layerwise(stage, iter_stage_weights(staged), record=record)
    assert report.peak_buffered_layers <= 1
    ref = reference_tensors(second)
    assert torch.equal(stage.blocks[2].ffn.down.w, ref["model.layers.2.mlp.down_proj.weight"])
    q = ref["model.layers.4.self_attn.q_proj.weight"]
    assert torch.equal(stage.blocks[4].attn.qkv.w[: q.shape[0]], q)


def test_hand_written_engine_own_loader(tiny_llama: Path) -> None:
    """An engine with its own loader: the stage's stream renamed with the same NameMap."""
    staged = plan_stage(tiny_llama, Topology(2, rank=1), partition="vllm")
    renamed = dict(HAND_NAMES.apply(iter_stage_weights(staged)))
    ref = reference_tensors(tiny_llama)
    assert torch.equal(renamed["blocks.4.self_attn.q_proj.w"],
                       ref["model.layers.4.self_attn.q_proj.weight"])
    assert torch.equal(renamed["head.w"], ref["lm_head.weight"])
    assert not any(k.startswith(("blocks.0.", "blocks.3.", "tok.")) for k in renamed)
