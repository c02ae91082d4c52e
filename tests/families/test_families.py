"""Model families on checkpoints written by transformers' own ``save_pretrained``.

For every family (and both expert namings: per-expert, the default, and fused 3-D experts,
``save_original_format=False``): the family template equals the checkpoint's names and
shapes; for PP 1-4 x EP 1-2 every tensor is planned by exactly one stage, no rank plans a byte
of another stage's layer or of a non-local expert, and a real load through ``Reader`` is
bitwise equal to ``safe_open``. The expectations below come from the names themselves (layer
and expert ids parsed by the test) and from the family table (tests/family_table.py), not from
the family code under test.
"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch
from safetensors.torch import save_file

from family_expect import halves, segments
from family_table import IDS, ROWS, TINY_ROWS, VARIANTS, HfCheckpoints, Row
from helpers import CONFIGS, make_model, tiny_config
from pploader import ConfigError, PlanError
from pploader.io.read import Reader
from pploader.planning.checkpoint import CheckpointIndex, open_checkpoint
from pploader.planning.plan import RankPlan, plan_all
from pploader.planning.spec import load_spec, spec_from_config
from pploader.families import FAMILIES, supported_architectures
from pploader.families.base import CheckpointFormat


# ---- what a name is, parsed by the test -------------------------------------------------------

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")
_FUSED = re.compile(r"(\.experts\.(gate_up_proj|up_proj|down_proj)|"
                    r"block_sparse_moe\.(input|output)_linear\.weight)$")
_FIRST = re.compile(r"(embed_tokens|embeddings)\.weight$|\.visual\.")


def _layer(name: str) -> Optional[int]:
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def _is_embed(name: str) -> bool:
    return _layer(name) is None and bool(re.search(r"(embed_tokens|embeddings)\.weight$", name))


def _stage_of(name: str, windows: list[tuple[int, int]]) -> int:
    layer = _layer(name)
    if layer is None:
        return 0 if _FIRST.search(name) else len(windows) - 1
    return next(s for s, (a, b) in enumerate(windows) if a <= layer < b)


def _local(expert: int, num_experts: int, ep: int, ep_rank: int) -> bool:
    return ep_rank * num_experts // ep <= expert < (ep_rank + 1) * num_experts // ep


def _allowed_range(plan: RankPlan, index: CheckpointIndex, name: str,
                   num_experts: int) -> tuple[int, int]:
    """Bytes a rank may read for ``name``: the tensor, or its local experts' slab if fused."""
    entry = index.entry(name)
    if _FUSED.search(name) and plan.topology.ep_size > 1:
        a = plan.topology.ep_rank * num_experts // plan.topology.ep_size
        b = (plan.topology.ep_rank + 1) * num_experts // plan.topology.ep_size
        slab = entry.nbytes // num_experts
        return entry.start + a * slab, entry.start + b * slab
    return entry.start, entry.end


def _layouts(num_layers: int, moe: bool) -> list[tuple[int, int]]:
    return [(pp, ep) for pp in range(1, min(4, num_layers) + 1) for ep in ((1, 2) if moe else (1,))]


# ---- tests ------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("case,fmt", VARIANTS, ids=IDS)
def test_template_equals_checkpoint(hf_checkpoints: HfCheckpoints, case: str, fmt: str) -> None:
    path = hf_checkpoints(case, fmt)
    spec, index = load_spec(path), open_checkpoint(path)
    resolved = spec.for_checkpoint(index.weight_map)
    assert resolved.family.format == ("transformers" if fmt == "fused" else "original")
    template = resolved.family.template(resolved)
    have = {n: index.entry(n).shape for n in index.weight_map}
    assert sorted(set(template) - set(have)) == []
    assert sorted(set(have) - set(template)) == []
    assert {n: tuple(s) for n, s in template.items()} == have
    if fmt == "fused":  # the fused naming really stacks experts
        assert any(_FUSED.search(n) for n in have) and not any(_EXPERT.search(n) for n in have)
    elif spec.num_experts and case != "granitemoehybrid_tied":  # granite: 3-D on disk
        assert any(_EXPERT.search(n) for n in have)


@pytest.mark.slow
@pytest.mark.parametrize("case,fmt", VARIANTS, ids=IDS)
def test_stages_partition_checkpoint_and_load_bitwise(hf_checkpoints: HfCheckpoints,
                                                      references: Any, case: str,
                                                      fmt: str) -> None:
    path = hf_checkpoints(case, fmt)
    spec, index = load_spec(path), open_checkpoint(path)
    ref = references(path)
    n, e = spec.num_layers, spec.num_experts
    mtp = {name for name in index.weight_map if (_layer(name) or 0) >= n}
    assert bool(mtp) == (case == "deepseek_v3") == bool(spec.num_mtp_layers)
    for pp, ep in _layouts(n, bool(e)):
        plans = plan_all(spec, index, pp, 1, ep)
        windows = [(p.window.start_layer, p.window.end_layer) for p in plans[::ep]]
        where = f"pp={pp} ep={ep}"
        # every tensor by exactly one stage (the tied embedding also by the last); union = all
        stage_sets: list[set[str]] = [set() for _ in range(pp)]
        for plan in plans:
            stage_sets[plan.topology.pp_rank] |= set(plan.tensors)
        union = set().union(*stage_sets)
        assert union == set(index.weight_map) - mtp, where
        for name in union:
            holders = [s for s in range(pp) if name in stage_sets[s]]
            expect = {_stage_of(name, windows)}
            if spec.tie_word_embeddings and _is_embed(name):
                expect.add(pp - 1)
            assert set(holders) == expect, (where, name, holders)
        for plan in plans:
            t = plan.topology
            for name in plan.tensors:  # EP: per-expert tensors only on their EP rank
                m = _EXPERT.search(name)
                if m is not None:
                    assert _local(int(m.group(1)), e, ep, t.ep_rank), (where, t.rank, name)
            if ep > 1:  # every local per-expert tensor of the stage's layers is there
                for name in index.weight_map:
                    m = _EXPERT.search(name)
                    if (m and name not in mtp and _stage_of(name, windows) == t.pp_rank
                            and _local(int(m.group(1)), e, ep, t.ep_rank)):
                        assert name in plan.tensors, (where, t.rank, name)
            # no byte outside the tensor (or, fused, outside the local experts' slab)
            for item in plan.items:
                lo, hi = _allowed_range(plan, index, item.name, e)
                for off, length in item.ranges:
                    assert lo <= off and off + length <= hi, (where, t.rank, item.name)
            # a real load equals safe_open (fused experts: the local slice)
            reader = Reader(plan)
            got = dict(reader)
            assert reader.stats.read_bytes == plan.read_bytes == plan.ideal_bytes, where
            assert len(got) == len(plan.items)
            for item in plan.items:
                want = ref[item.name]
                if _FUSED.search(item.name) and ep > 1:
                    want = want[t.ep_rank * e // ep:(t.ep_rank + 1) * e // ep]
                assert got[item.target].dtype == want.dtype
                assert torch.equal(got[item.target].view(torch.uint8),
                                   want.contiguous().view(torch.uint8)), (where, item.name)
            if spec.tie_word_embeddings and plan.window.has_head:  # PP=1: one read, tied
                assert any(_is_embed(i.name) and i.target != i.name
                           for i in plan.items) != plan.window.has_embed


@pytest.mark.slow
@pytest.mark.parametrize("case,fmt", VARIANTS, ids=IDS)
def test_tp2_plans_build(hf_checkpoints: HfCheckpoints, case: str, fmt: str) -> None:
    """TP=2 (x EP=2 for MoE) plans every family without error; split tensors halve."""
    path = hf_checkpoints(case, fmt)
    spec, index = load_spec(path), open_checkpoint(path)
    ep = 2 if spec.num_experts else 1
    plans = plan_all(spec, index, 2, 2, ep)
    assert len(plans) == 4 * ep
    for plan in plans:
        split = [i for i in plan.items if i.shape != index.entry(i.name).shape]
        assert split, plan.topology.describe()
        assert plan.ideal_bytes < sum(index.entry(i.name).nbytes for i in plan.items)


def test_unknown_architecture_lists_supported() -> None:
    with pytest.raises(ConfigError) as err:
        spec_from_config({"architectures": ["NoSuchForCausalLM"], "dtype": "float32"})
    text = str(err.value)
    assert "NoSuchForCausalLM" in text and "docs/families.md" in text
    for arch in ("DeepseekV3ForCausalLM", "Qwen3_5MoeForConditionalGeneration",
                 "NemotronHForCausalLM", "JambaForCausalLM", "GraniteMoeHybridForCausalLM"):
        assert arch in text and arch in supported_architectures()


def _layout_of(config: dict) -> tuple[tuple[str, ...], frozenset[int], int, int]:
    spec = spec_from_config(dict(config, dtype="float32"))
    return spec.layer_kinds, spec.moe_layers, spec.num_experts, spec.num_mtp_layers


def test_layouts_from_config_fields() -> None:
    """Layer kinds and MoE placement come from each family's own config fields."""
    jamba = _layout_of({"architectures": ["JambaForCausalLM"], "num_hidden_layers": 8,
                        "attn_layer_period": 4, "attn_layer_offset": 2, "expert_layer_period": 2,
                        "expert_layer_offset": 1, "num_experts": 16})
    assert jamba[0] == ("mamba1",) * 2 + ("full_attention",) + ("mamba1",) * 3 + (
        "full_attention",) + ("mamba1",)
    assert jamba[1] == {1, 3, 5, 7} and jamba[2] == 16
    nemo = _layout_of({"architectures": ["NemotronHForCausalLM"],
                       "hybrid_override_pattern": "M-M*E", "n_routed_experts": 8})
    assert nemo[0] == ("mamba2", "mlp", "mamba2", "full_attention", "mlp")
    assert nemo[1] == {4} and nemo[2] == 8
    qnext = _layout_of({"architectures": ["Qwen3NextForCausalLM"], "num_hidden_layers": 8,
                        "num_experts": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert qnext[0] == ("gdn", "gdn", "gdn", "full_attention") * 2
    assert qnext[1] == {1, 5, 7}
    ds = _layout_of({"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 5,
                     "first_k_dense_replace": 3, "n_routed_experts": 8,
                     "num_nextn_predict_layers": 1})
    assert ds == (("mla",) * 5, frozenset({3, 4}), 8, 1)
    bamba = _layout_of({"architectures": ["BambaForCausalLM"], "num_hidden_layers": 4,
                        "attn_layer_indices": [2]})
    assert bamba[0] == ("mamba2", "mamba2", "full_attention", "mamba2") and not bamba[1]
    falcon = _layout_of({"architectures": ["FalconH1ForCausalLM"], "num_hidden_layers": 2})
    assert falcon[0] == ("hybrid_attention_mamba2",) * 2
    granite = _layout_of({"architectures": ["GraniteMoeHybridForCausalLM"], "num_hidden_layers": 2,
                          "layer_types": ["mamba", "attention"], "num_local_experts": 0})
    assert granite == (("mamba2", "full_attention"), frozenset(), 0, 0)
    vl = spec_from_config({"architectures": ["Qwen3_5MoeForConditionalGeneration"],
                           "dtype": "bfloat16", "text_config": {
                               "num_hidden_layers": 2, "num_experts": 4,
                               "layer_types": ["linear_attention", "full_attention"]}})
    assert vl.layer_kinds == ("gdn", "full_attention") and vl.moe_layers == {0, 1}
    with pytest.raises(ConfigError, match="unknown block types"):
        _layout_of({"architectures": ["Qwen3_5ForCausalLM"], "num_hidden_layers": 1,
                    "layer_types": ["sliding_attention"]})


@pytest.mark.slow
def test_mixed_namings_fail_strictly(hf_checkpoints: HfCheckpoints, tmp_path: Path) -> None:
    """A fused checkpoint with one stray per-expert tensor is not silently accepted."""
    src = hf_checkpoints("qwen3_moe", "fused")
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    save_file({"model.layers.0.mlp.experts.0.up_proj.weight": torch.zeros(16, 32)},
              str(tmp_path / "extra.safetensors"))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.mlp.experts.0.up_proj.weight"] = "extra.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(PlanError, match="not expected"):
        plan_all(load_spec(tmp_path), open_checkpoint(tmp_path), 1)


def test_family_table_covers_every_family() -> None:
    """One row per registered family and per bundled tiny config: a family added without its
    row (or a tiny config without a family row) fails here."""
    assert sorted(r.family for r in ROWS) == sorted(f.name for f in FAMILIES)
    bundled = sorted(p.stem for p in CONFIGS.glob("tiny-*.json"))
    assert sorted(r.tiny for r in TINY_ROWS) == bundled  # type: ignore[type-var]


@pytest.mark.parametrize("row", TINY_ROWS, ids=[r.family for r in TINY_ROWS])
def test_tiny_config_layout_equals_table(row: Row) -> None:
    """The family reads the tiny config's layer kinds and experts as the table states them."""
    spec = spec_from_config(tiny_config(row.tiny))  # type: ignore[arg-type]
    assert spec.family.name == row.family
    assert spec.layer_kinds == row.kinds and spec.num_experts == row.experts


@pytest.mark.parametrize("row", TINY_ROWS, ids=[r.family for r in TINY_ROWS])
def test_layer_template_assembles_to_the_template(row: Row) -> None:
    """A family's ``layer_template`` (the template by layer, which planning builds only for a
    stage's layers) is its ``template``, in every checkpoint format: names, shapes and order.
    A format that replaces ``template`` alone drops the by-layer one."""
    spec = spec_from_config(tiny_config(row.tiny))  # type: ignore[arg-type]
    base = spec.family
    formats = [base.for_checkpoint([])] + [
        base.for_checkpoint([f"model.layers.0.{m}" for m in ("mlp.experts.gate_up_proj",
                                                             "mixer.experts.up_proj")])]
    for fam in formats:
        if fam.layer_template is None:
            continue
        globals_, layer, ids = fam.layer_template(spec)
        assembled = dict(globals_)
        for i in ids:  # layer i's components, named by the family's layer prefix
            names = {fam.layer_name(i, c): tuple(s) for c, s in layer(i).items()}
            assert set(names).isdisjoint(assembled)  # each name in one layer only
            assembled.update(names)
        assert list(assembled.items()) == list(fam.template(spec).items())  # type: ignore[misc]
    if base.layer_template is not None:  # a format replacing ``template`` alone drops it
        fmt = CheckpointFormat("other", "^only_in_this_format$", (("template", base.template),))
        other = dataclasses.replace(base, formats=(fmt,)).for_checkpoint(["only_in_this_format"])
        assert other.format == "other" and other.layer_template is None


@pytest.mark.slow
@pytest.mark.parametrize("row", TINY_ROWS, ids=[r.family for r in TINY_ROWS])
def test_bundled_tiny_config_matches_transformers(row: Row, tmp_path: Path) -> None:
    """Each bundled tiny config's template (what ``make-tiny`` writes) has the exact names and
    shapes transformers writes for that config (DeepSeek: plus the MTP layers it drops)."""
    import transformers
    transformers.logging.set_verbosity_error()
    raw = tiny_config(row.tiny)  # type: ignore[arg-type]
    spec = spec_from_config(raw)
    kwargs = {k: v for k, v in raw.items() if k not in ("architectures", "model_type")}
    config = transformers.AutoConfig.for_model(raw["model_type"], **kwargs)
    getattr(transformers, raw["architectures"][0])(config).save_pretrained(tmp_path)
    index = open_checkpoint(tmp_path)
    have = {n: index.entry(n).shape for n in index.weight_map}
    template = {n: tuple(s) for n, s in spec.family.template(spec).items()
                if (_layer(n) or 0) < spec.num_layers}
    assert template == have
    mtp = {n for n in spec.family.template(spec) if (_layer(n) or 0) >= spec.num_layers}
    assert bool(mtp) == bool(spec.num_mtp_layers)


def test_bundled_demo_plans_pp4_ep2(tiny_checkpoints: Callable[[str], Path]) -> None:
    """The demo model (tiny-qwen3_5_moe: GDN + full attention, routed + shared experts) plans
    at PP=4 x EP=2 with every rank reading only its own layers and experts."""
    path = tiny_checkpoints("tiny-qwen3_5_moe")
    spec, index = load_spec(path), open_checkpoint(path)
    assert set(spec.layer_kinds) == {"gdn", "full_attention"} and spec.num_experts >= 4
    assert spec.num_layers == 8 and len(spec.moe_layers) == 8
    for plan in plan_all(spec, index, 4, 1, 2):
        experts = {int(m.group(1)) for n in plan.tensors if (m := _EXPERT.search(n))}
        assert experts == set(range(*plan.experts))
        layers = {_layer(n) for n in plan.tensors} - {None}
        assert layers == set(range(plan.window.start_layer, plan.window.end_layer))
        assert any("shared_expert." in n for n in plan.tensors)


# ---- TP shard rules against the table's reference slices ------------------------------------

TP_ROWS = [r for r in TINY_ROWS if r.tp_slices]


@pytest.mark.parametrize("row", TP_ROWS, ids=[r.family for r in TP_ROWS])
def test_tp2_shards_equal_reference_slices(row: Row, tiny_checkpoints: Callable[[str], Path],
                                           references: Callable[[Path], dict]) -> None:
    """PP=2 x TP=2: every rank's load (``Reader``) of each listed component is bitwise the
    table's slice of the ``safe_open`` tensor."""
    path = tiny_checkpoints(row.tiny)  # type: ignore[arg-type]
    spec, index, ref = load_spec(path), open_checkpoint(path), references(path)
    checked: set[str] = set()
    for plan in plan_all(spec, index, 2, 2, 1):
        got = dict(Reader(plan))
        for item in plan.items:
            for suffix, slicer in row.tp_slices.items():
                if item.name.endswith("." + suffix):
                    want = slicer(ref[item.name], plan.topology.tp_rank)
                    assert torch.equal(got[item.target].view(torch.uint8),
                                       want.contiguous().view(torch.uint8)), \
                        (item.name, plan.topology.rank)
                    checked.add(suffix)
    assert checked == set(row.tp_slices)


def _load_stage_rank(rank: int, world: int, models: list[str]) -> dict[str, dict]:
    """One rank of PP=2 x TP=2: its stage of each model, loaded plain and with a Comm (read
    once + TP row shares exchanged where the plan chose it); tensors as raw bytes."""
    from pploader import Topology, load_stage, plan_stage
    from pploader.distributed.comm import Comm
    topo = Topology.for_world(world, rank, pp=2, tp=2)
    comm = Comm(topo, timeout_s=60)
    out = {}
    for model in models:
        staged = plan_stage(model, topo)
        plain = load_stage(staged)
        shared = load_stage(plan_stage(model, topo, read_once=True), comm=comm)
        out[model] = {"tp_rank": topo.tp_rank,
                      "names": {i.target: i.name for i in staged.plan.items},
                      "plain": {k: v.contiguous().view(torch.uint8).numpy().tobytes()
                                for k, v in plain.state_dict.items()},
                      "shared": {k: v.contiguous().view(torch.uint8).numpy().tobytes()
                                 for k, v in shared.state_dict.items()}}
    comm.agree(None)
    comm.close()
    return out


@pytest.mark.slow
def test_pp2_tp2_distributed_loads_equal_reference_slices(
        tiny_checkpoints: Callable[[str], Path], references: Callable[[Path], dict]) -> None:
    """Four gloo ranks (PP=2 x TP=2) load every TP row's tiny checkpoint, plain and through a
    Comm (read once, row shares exchanged); both equal the table's slices of ``safe_open``."""
    from helpers import run_ranks
    paths = {r.family: tiny_checkpoints(r.tiny) for r in TP_ROWS}  # type: ignore[arg-type]
    results = run_ranks(_load_stage_rank, 4, [str(p) for p in paths.values()], timeout_s=240)
    for row in TP_ROWS:
        ref, checked = references(paths[row.family]), set()
        for res in (r[str(paths[row.family])] for r in results):
            assert res["plain"] == res["shared"], row.family
            assert set(res["plain"]) == set(res["names"])
            for target, raw in res["plain"].items():
                name = res["names"][target]
                for suffix, slicer in row.tp_slices.items():
                    if name.endswith("." + suffix):
                        want = slicer(ref[name], res["tp_rank"]).contiguous()
                        assert raw == want.view(torch.uint8).numpy().tobytes(), (row.family, name)
                        checked.add(suffix)
        assert checked == set(row.tp_slices), row.family


@pytest.mark.slow
def test_tp2_fused_gate_up_reference_slices(hf_checkpoints: HfCheckpoints,
                                            references: Any) -> None:
    """transformers' fused experts: gate_up_proj [E, 2I, H] = [gate; up] halves on dim 1,
    down_proj [E, H, I] halves on dim 2; with EP=2 on top, the rank's expert block too."""
    path = hf_checkpoints("qwen3_moe", "fused")
    spec, index, ref = load_spec(path), open_checkpoint(path), references(path)
    for plan in plan_all(spec, index, 1, 2, 2):
        got = dict(Reader(plan))
        t = plan.topology
        e0, e1 = plan.experts
        for item in plan.items:
            full = ref[item.name][e0:e1]
            if item.name.endswith("experts.gate_up_proj"):
                assert torch.equal(got[item.target], segments(full, t.tp_rank, [16, 16], dim=1))
            elif item.name.endswith("experts.down_proj"):
                assert torch.equal(got[item.target], halves(full, t.tp_rank, 2))


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["original", "fused"])
def test_deepseek_mtp_draft_with_ep(hf_checkpoints: HfCheckpoints, references: Any,
                                    fmt: str) -> None:
    """The appended MTP layers of a transformers-written DeepSeek-V3 (both namings): plan_mtp
    with EP=2 streams layer k renamed to layer 0, only the rank's experts (fused: its slab)."""
    from pploader import Topology
    from pploader.planning.plan import plan_mtp
    path = hf_checkpoints("deepseek_v3", fmt)
    spec, index, ref = load_spec(path), open_checkpoint(path), references(path)
    n, e = spec.num_layers, spec.num_experts
    for k in range(spec.num_mtp_layers):
        union: set[str] = set()
        for rank in range(2):
            plan = plan_mtp(spec, index, k, Topology(1, 1, 2, rank))
            got = dict(Reader(plan))
            for item in plan.items:
                assert _layer(item.name) == n + k
                assert item.target == item.name.replace(f"layers.{n + k}.", "layers.0.")
                m = _EXPERT.search(item.name)
                assert m is None or _local(int(m.group(1)), e, 2, rank)
                want = ref[item.name]
                if _FUSED.search(item.name):
                    want = want[rank * e // 2:(rank + 1) * e // 2]
                assert torch.equal(got[item.target], want), item.name
            union |= set(plan.tensors)
        assert union == {name for name in index.weight_map if _layer(name) == n + k}


# ---- names and sizes the families own (the planner and the cache only ask) -----------------

def test_families_name_their_head_and_quant_companions() -> None:
    from pploader.families.base import GlobalRule, QuantNaming
    for fam in FAMILIES:  # every head rule is one exact name, the one its pattern matches
        head = fam.head_name()
        rule = next(r for r in fam.globals if r.role == "head")
        assert head is not None and re.fullmatch(rule.pattern, head), fam.name
    assert GlobalRule(r"lm_head\.weight", "last", "head").name == "lm_head.weight"
    assert GlobalRule(r"model\.visual\..+", "first").name is None  # a pattern, not a name
    naming = QuantNaming()
    assert naming.companion("m.q_proj.weight", "weight_scale_inv") == "m.q_proj.weight_scale_inv"
    assert naming.weight_of("m.o.weight_scale_2", ["weight_scale", "weight_scale_2"]) == \
        ("m.o.weight", "weight_scale_2")
    assert naming.weight_of("m.o.bias", ["weight_scale"]) is None
    assert naming.module_of("m.o.weight") == "m.o" and not naming.is_weight("m.o.bias")


def test_registry_finds_family_modules() -> None:
    """Every family module's ``FAMILIES`` is registered (no list to edit); model types route."""
    from pploader.families import MODEL_TYPES, find_family, phi3
    assert phi3.PHI3 in FAMILIES and MODEL_TYPES["phi3"] == {"phi3"}
    assert find_family({"architectures": ["Phi3ForCausalLM"], "model_type": "phi3"})[0].name \
        == "phi3"
    assert find_family({"architectures": ["LlamaForCausalLM"], "model_type": "mistral"})[0] \
        .name == "llama"


def test_dispatch_by_architecture_when_model_type_unknown(tmp_path: Path) -> None:
    """A hand-written architecture under a ``model_type`` the installed transformers does not
    know (a fork, a newer release) is planned by that family, as engines dispatch on
    ``architectures``; a known other model_type (exaone saves through LlamaForCausalLM under
    its own names) still goes to the generic family; an unknown architecture is refused."""
    from pploader.errors import ConfigError
    from pploader.families import find_family
    from pploader.planning.checkpoint import open_checkpoint
    from pploader.planning.plan import plan_all
    from pploader.planning.spec import load_spec
    assert find_family({"architectures": ["LlamaForCausalLM"],
                        "model_type": "llama_fork_unknown"})[0].name == "llama"
    assert find_family({"architectures": ["LlamaForCausalLM"], "model_type": "exaone",
                        "hidden_size": 64, "num_attention_heads": 4, "num_layers": 2,
                        "vocab_size": 128, "intermediate_size": 128})[0].name \
        .startswith("generic")
    with pytest.raises(ConfigError, match="unsupported architecture 'NoSuchForCausalLM'"):
        find_family({"architectures": ["NoSuchForCausalLM"], "model_type": "no_such"})
    path = make_model(tmp_path, tiny_config("tiny-llama"))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "llama_fork_unknown"}))
    spec = load_spec(path)
    assert spec.family.name == "llama"
    assert len(plan_all(spec, open_checkpoint(path), 2)) == 2
