"""Inkling in its release naming (``model.llm.*``), planned as vLLM 0.32's ``models/inkling``
loads it: a tiny release checkpoint written with safetensors (tests/inkling_ref.py: shapes
from vLLM's modules, one local layer kind with its own head counts, a dense layer, routed +
shared experts, an MTP depth), every rank of PP=2, PP=2 x TP=2 and PP=2 x EP=2 checked item
by item against the reference slices written from vLLM's loaders, and read on the CPU bitwise
equal to them. TP and EP sizes vLLM does not load are refused naming the tensor; the
multimodal release places its towers whole on the first stage; transformers' own naming
(``inkling_text``, ``save_pretrained``) still goes to the generic family.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import inkling_ref
from gpt_oss_ref import check_item
from helpers import reference_tensors
from pploader.errors import PlanError
from pploader.io.read import Reader
from pploader.planning.checkpoint import open_checkpoint
from pploader.planning.plan import plan_all
from pploader.planning.spec import load_spec


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return inkling_ref.write(tmp_path_factory.mktemp("inkling") / "release")


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _want(full: torch.Tensor, slices: tuple[slice, ...], pad: int) -> torch.Tensor:
    piece = full[slices]
    if pad:
        piece = torch.cat([piece, piece.new_zeros((pad,) + tuple(piece.shape[1:]))])
    return piece


def _check_layout(path: Path, config: dict, pp: int, tp: int, ep: int) -> dict[str, set]:
    """Every rank: its tensors are the stage's (vLLM's layer ranges), each item delivers the
    reference slice (offsets) and reads bitwise equal to it. Returns the piece shapes seen
    per tensor."""
    spec, index = load_spec(path), open_checkpoint(path)
    ref = reference_tensors(path)
    shapes: dict[str, set] = {}
    for plan in plan_all(spec, index, pp, tp, ep):
        t = plan.topology
        assert {i.name for i in plan.items} == inkling_ref.stage_names(
            config, list(index.weight_map), pp, t.pp_rank, ep, t.ep_rank), t.describe()
        got = dict(Reader(plan))
        for item in plan.items:
            entry = index.entry(item.name)
            slices, pad = inkling_ref.engine_slices(item.name, tuple(entry.shape), config, tp,
                                                    t.tp_rank, ep, t.ep_rank)
            problem = check_item(item, entry.start, entry.shape, slices, pad)
            assert problem is None, (t.describe(), item.name, problem)
            want = _want(ref[item.name], slices, pad)
            assert got[item.target].dtype == want.dtype
            assert _bytes(got[item.target]) == _bytes(want), (t.describe(), item.name)
            shapes.setdefault(item.name, set()).add(tuple(item.shape))
    return shapes


def test_release_config_goes_to_the_inkling_family(release: Path) -> None:
    spec = load_spec(release)
    assert spec.family.name == "inkling" and spec.architecture == "InklingForCausalLM"
    assert spec.moe_layers == frozenset({1, 2, 3}) and spec.num_experts == 4


@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (1, 2)])
def test_every_rank_equals_vllms_slices(release: Path, tp: int, ep: int) -> None:
    config = json.loads((release / "config.json").read_text())
    shapes = _check_layout(release, config, 2, tp, ep)
    stored = set(open_checkpoint(release).weight_map)
    assert set(shapes) == {n for n in stored if not n.startswith("model.mtp.")}
    split = {n for n, s in shapes.items() if any(x != tuple(reference_tensors(release)[n].shape)
                                                 for x in s)}
    if tp == 1 and ep == 1:
        assert not split
    if ep == 2:  # only the routed experts, two of four a rank
        assert split and all(".mlp.experts." in n for n in split)
        assert shapes["model.llm.layers.2.mlp.experts.w2_weight"] == {(2, 64, 24)}
    if tp == 2:  # what the engine cuts, and only that
        leaves = {n.split(".", 4)[-1] if n.startswith("model.llm.layers.") else n
                  for n in split}
        assert leaves == {
            "model.llm.unembed.weight", "attn.wq_du.weight", "attn.wk_dv.weight",
            "attn.wv_dv.weight", "attn.wr_du.weight", "attn.wo_ud.weight",
            "attn.k_sconv.weight", "attn.v_sconv.weight", "attn_sconv.weight",
            "mlp_sconv.weight", "mlp.w13_dn.weight", "mlp.w2_md.weight",
            "mlp.experts.w13_weight", "mlp.experts.w2_weight",
            "mlp.shared_experts.shared_w13_weight", "mlp.shared_experts.shared_w2_weight"}
        # the local layers' own head counts: 8 query heads of 8, 4 KV heads
        assert shapes["model.llm.layers.1.attn.wq_du.weight"] == {(32, 64)}
        assert shapes["model.llm.layers.1.attn.k_sconv.weight"] == {(16, 1, 4)}
        assert shapes["model.llm.layers.0.attn.k_sconv.weight"] == {(16, 1, 4)}
        assert shapes["model.llm.layers.0.mlp.w13_dn.weight"] == {(40, 64)}
        assert shapes["model.llm.embed.weight"] == {(256, 64)}  # replicated, as vLLM


def test_vllm_partition_of_an_uneven_stack(tmp_path: Path) -> None:
    """5 layers over 3 stages with ``partition="vllm"``: each stage's tensors are those of
    ``get_pp_indices`` ([2, 2, 1], as the reference computes it), sliced as vLLM at TP=2."""
    config = dict(inkling_ref.TINY, num_hidden_layers=5)
    path = inkling_ref.write(tmp_path / "five", config)
    spec, index = load_spec(path), open_checkpoint(path)
    ref = reference_tensors(path)
    seen = set()
    for plan in plan_all(spec, index, 3, 2, 1, partition="vllm"):
        t = plan.topology
        assert {i.name for i in plan.items} == inkling_ref.stage_names(
            config, list(index.weight_map), 3, t.pp_rank)
        got = dict(Reader(plan))
        for item in plan.items:
            slices, pad = inkling_ref.engine_slices(item.name, tuple(ref[item.name].shape),
                                                    config, 2, t.tp_rank)
            assert _bytes(got[item.target]) == _bytes(_want(ref[item.name], slices, pad))
            seen.add(item.name)
    assert [len(inkling_ref.pp_layers(5, 3, r)) for r in range(3)] == [2, 2, 1]
    assert seen == {n for n in ref if not n.startswith("model.mtp.")}


def test_interleaved_pairs_stay_together(release: Path) -> None:
    """A rank's routed w13 rows de-interleave (even rows gate, odd rows up) into the full
    tensor's gate and up rows ``[r I / tp, (r + 1) I / tp)``: what vLLM's loader uploads."""
    spec, index = load_spec(release), open_checkpoint(release)
    full = reference_tensors(release)["model.llm.layers.3.mlp.experts.w13_weight"]
    for plan in plan_all(spec, index, 2, 2, 1)[2:]:
        got = dict(Reader(plan))["model.llm.layers.3.mlp.experts.w13_weight"]
        r = plan.topology.tp_rank
        assert torch.equal(got[:, 0::2], full[:, 0::2][:, 12 * r:12 * (r + 1)])
        assert torch.equal(got[:, 1::2], full[:, 1::2][:, 12 * r:12 * (r + 1)])


@pytest.mark.parametrize("pp,tp,ep,tensor,words", [
    (2, 4, 1, "model.llm.layers.0.attn.k_sconv.weight", "2 KV heads"),
    (2, 3, 1, "model.llm.layers.0.attn.wq_du.weight", "4 query heads"),
    (2, 8, 1, "model.llm.layers.0.attn.wq_du.weight", "4 query heads"),
    (2, 1, 3, "model.llm.layers.1.mlp.experts.w13_weight", "4 routed experts"),
    (2, 2, 2, "model.llm.layers.1.mlp.experts.w13_weight", "keeps every routed expert whole"),
])
def test_sizes_vllm_does_not_load_are_refused(release: Path, pp: int, tp: int, ep: int,
                                              tensor: str, words: str) -> None:
    spec, index = load_spec(release), open_checkpoint(release)
    with pytest.raises(PlanError) as err:
        plan_all(spec, index, pp, tp, ep)
    assert tensor in str(err.value) and words in str(err.value)


def test_intermediate_sizes_refused_by_pairs(tmp_path: Path) -> None:
    """TP=2 with a dense intermediate of 41 (odd: pairs cannot split) is refused naming the
    dense ``w13_dn``; with 2 routed experts over EP=2 the MoE still plans."""
    config = dict(inkling_ref.TINY, dense_intermediate_size=41)
    path = inkling_ref.write(tmp_path / "odd", config)
    spec, index = load_spec(path), open_checkpoint(path)
    with pytest.raises(PlanError, match=r"layers\.0\.mlp\.w13_dn\.weight.*41"):
        plan_all(spec, index, 2, 2, 1)
    assert len(plan_all(spec, index, 2, 1, 1)) == 2


def test_multimodal_release_places_towers_first(tmp_path: Path) -> None:
    """``inkling_mm_model``: the text config nested, the towers whole on stage 0 only, the
    text model cut as the text-only release."""
    text = {k: v for k, v in inkling_ref.TINY.items() if k not in ("architectures", "model_type")}
    config = {"architectures": ["InklingForConditionalGeneration"],
              "model_type": "inkling_mm_model", "torch_dtype": "bfloat16",
              "text_config": text, "vision_config": {}, "audio_config": {}}
    path = inkling_ref.write(tmp_path / "mm", config=None)
    from safetensors.torch import save_file
    towers = {"model.visual.layers.linear_0.weight": torch.ones(8, 12, dtype=torch.bfloat16),
              "model.audio.encoder.weight": torch.ones(16, 64, dtype=torch.bfloat16)}
    save_file(towers, str(path / "towers.safetensors"))
    idx = json.loads((path / "model.safetensors.index.json").read_text())
    idx["weight_map"].update({n: "towers.safetensors" for n in towers})
    (path / "model.safetensors.index.json").write_text(json.dumps(idx))
    (path / "config.json").write_text(json.dumps(config))
    spec, index = load_spec(path), open_checkpoint(path)
    assert spec.family.name == "inkling_mm" and spec.num_layers == 4
    for plan in plan_all(spec, index, 2, 2, 1):
        names = {i.name: i for i in plan.items}
        if plan.topology.pp_rank == 0:
            assert set(towers) <= set(names)
            assert all(tuple(names[n].shape) == tuple(t.shape) for n, t in towers.items())
        else:
            assert not set(towers) & set(names)
    _check_layout(path, text, 2, 2, 1)


def test_transformers_naming_stays_generic(tmp_path: Path) -> None:
    """A ``save_pretrained`` inkling_text (transformers' naming) is not the release family."""
    from tp_check import build_tiny
    build_tiny("inkling_text", tmp_path)
    spec = load_spec(tmp_path)
    assert spec.family.name not in ("inkling", "inkling_mm")
    assert spec.architecture == "InklingForCausalLM"
    assert any(".self_attn.q_proj." in n for n in open_checkpoint(tmp_path).weight_map)


def test_transformers_multimodal_config_is_not_the_release_family() -> None:
    """transformers' ``InklingForConditionalGeneration`` shares ``inkling_mm_model`` with the
    multimodal release; its config (``text_config.model_type`` ``inkling_text``, as
    transformers writes it) is not the release family's, the release config is."""
    from transformers import AutoConfig

    from pploader.families import FAMILIES
    mm = next(f for f in FAMILIES if f.name == "inkling_mm")
    saved = AutoConfig.for_model("inkling_mm_model").to_dict()
    assert saved["text_config"]["model_type"] == "inkling_text"
    assert not mm.matches_config(saved)
    assert mm.matches_config({"model_type": "inkling_mm_model",
                              "text_config": {"model_type": "inkling_model"}})
    assert mm.matches_config({"model_type": "inkling_mm_model", "text_config": {}})


# ---- a real gloo job: PP=2 x TP=2, plain and exchanged ------------------------------------
def _gloo_rank(rank: int, world: int, model: str) -> dict:
    from pploader import Topology, load_stage, plan_stage
    from pploader.distributed.comm import Comm
    topo = Topology.for_world(world, rank, pp=2, tp=2)
    comm = Comm(topo, timeout_s=60)
    plain = load_stage(plan_stage(model, topo, exchange_cost=None))
    exchanged_plan = plan_stage(model, topo, exchange_cost=0.0)
    exchanged = load_stage(exchanged_plan, comm=comm)
    comm.agree(None)
    comm.close()
    ex = exchanged_plan.plan.redistribute
    return {"tp_rank": topo.tp_rank, "exchanged": sorted(ex.targets) if ex is not None else [],
            **{kind: {k: _bytes(v) for k, v in load.state_dict.items()}
               for kind, load in (("plain", plain), ("exchanged", exchanged))}}


@pytest.mark.slow
def test_gloo_loads_vllms_slices(release: Path) -> None:
    """Four gloo ranks load their stage plain and exchanged (strided slices as row shares +
    an all-to-all of the TP group): both equal the reference slices bitwise."""
    from helpers import run_ranks
    config = json.loads((release / "config.json").read_text())
    ref = reference_tensors(release)
    seen: set[str] = set()
    for res in run_ranks(_gloo_rank, 4, str(release)):
        assert res["exchanged"], "no tensor was exchanged"
        assert res["plain"].keys() == res["exchanged"].keys()
        for name, got in res["plain"].items():
            slices, pad = inkling_ref.engine_slices(name, tuple(ref[name].shape), config, 2,
                                                    res["tp_rank"])
            want = _bytes(_want(ref[name], slices, pad))
            assert got == want and res["exchanged"][name] == want, name
        seen |= set(res["plain"])
    assert seen == {n for n in ref if not n.startswith("model.mtp.")}
