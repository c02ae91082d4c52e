"""SSM / short-convolution / delta-rule mixers and other stacked expert layouts under TP
through the generic family (families/tp_mixers.py, tp_experts3d.py): tiny ``save_pretrained``
checkpoints of Mamba, FalconMamba, Mamba2, Zamba2, LFM2, LFM2-MoE, Kimi-Linear and
OLMo-hybrid (both namings), GraniteMoE, GraniteMoeShared and Aria loaded at PP=2 x TP=2 and
PP=1 x TP=4 (the CPU reader), every tensor of every rank bitwise equal to the slice
tests/tp_mixers_ref.py writes from the engines' loaders; DBRX's ``[E x I, H]`` experts (its
fused ``Wqkv`` aside) read at TP=2 and at EP=2 x TP=2 (each rank: its experts, the rows of
its TP share in each); (marked slow) a real 4-rank gloo job for Mamba2 and GraniteMoE. Before,
all were refused at TP > 1 ("no unambiguous split" for ``A_log``, ``conv.conv``,
``feed_forward.w1``, ``input_linear``, ``fc1``, ``v1``).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import generic_sweep
from helpers import reference_tensors
from sweep_shrink import model_config, tiny_config
from tp_mixers_ref import engine_piece, take
from pploader.errors import PlanError
from pploader.io.read import Reader
from pploader.planning.checkpoint import FileIdentity, open_checkpoint
from pploader.planning.items import tensor_selection
from pploader.planning.partition import StageWindow
from pploader.planning.plan import RankPlan, plan_all, read_item
from pploader.planning.shard import local_experts
from pploader.planning.spec import load_spec
from pploader.planning.topology import Topology

transformers = pytest.importorskip("transformers")
TP = 2

#: model type -> (config overrides, layer components the rules must split)
CASES: dict[str, tuple[dict[str, Any], set[str]]] = {
    "mamba": ({}, {"mixer.in_proj.weight", "mixer.A_log", "mixer.x_proj.weight",
                   "mixer.conv1d.weight", "mixer.dt_proj.bias"}),
    "falcon_mamba": ({}, {"mixer.in_proj.weight", "mixer.out_proj.weight", "mixer.D"}),
    "mamba2": ({}, {"mixer.in_proj.weight", "mixer.conv1d.weight", "mixer.norm.weight",
                    "mixer.dt_bias", "mixer.out_proj.weight"}),
    "lfm2": ({"layer_types": ["conv", "full_attention", "conv", "full_attention"],
              "full_attn_idxs": [1, 3]}, {"conv.in_proj.weight", "conv.conv.weight", "conv.out_proj.weight",
                  "feed_forward.w1.weight", "feed_forward.w2.weight"}),
    "lfm2_moe": ({}, {"conv.in_proj.weight", "feed_forward.w3.weight"}),
    "granitemoe": ({}, {"block_sparse_moe.input_linear.weight",
                        "block_sparse_moe.output_linear.weight"}),
    "granitemoeshared": ({"shared_intermediate_size": 32},
                         {"block_sparse_moe.input_linear.weight",
                          "shared_mlp.input_linear.weight", "shared_mlp.output_linear.weight"}),
    "aria_text": ({}, {"mlp.experts.fc1.weight", "mlp.experts.fc2.weight"}),
    "kimi_linear": ({}, {"self_attn.A_log", "self_attn.b_proj.weight", "self_attn.f_b_proj.weight",
                         "self_attn.q_conv1d.weight", "self_attn.dt_bias",
                         "self_attn.kv_b_proj.weight"}),
    # heads x head dim = 2 x hidden, as vLLM's zamba2 requires; q / k / v LoRA adapters on
    "zamba2": ({"attention_head_dim": 32, "use_shared_attention_adapter": True},
               {"mamba.in_proj.weight", "mamba.conv1d.weight", "mamba_decoder.mamba.norm.weight",
                "shared_transformer.feed_forward.gate_up_proj.weight",
                "shared_transformer.feed_forward.gate_up_proj_adapter_list.0.1.weight",
                "shared_transformer.self_attn.linear_q_adapter_list.0.0.weight"}),
    # key heads = value heads: the original naming's three equal conv chunks are q / k / v
    "olmo_hybrid": ({"linear_num_key_heads": 4},
                    {"linear_attn.q_conv1d.weight", "linear_attn.v_conv1d.weight",
                     "linear_attn.g_proj.weight", "linear_attn.A_log", "linear_attn.o_proj.weight"}),
    "olmo_hybrid:transformers": ({}, {"linear_attn.conv1d.weight", "linear_attn.q_proj.weight",
                                      "linear_attn.v_proj.weight", "linear_attn.b_proj.weight"}),
    # transformers' own naming: the q / k / v convs stacked, A_log / dt_bias / f_* under
    # ``forget_gate``, 3-D experts
    "kimi_linear:transformers": ({}, {"self_attn.conv1d.weight", "self_attn.forget_gate.A_log",
                                      "self_attn.forget_gate.f_b_proj.weight",
                                      "mlp.experts.gate_up_proj"}),
}


def _checkpoint(model_type: str, out: Path, **overrides: Any) -> dict[str, Any]:
    model_type, _, naming = model_type.partition(":")
    arch = generic_sweep.causal_lm_types()[model_type]
    cls = getattr(transformers, arch)
    config = model_config(tiny_config(model_type), cls)
    for key, value in overrides.items():
        setattr(config, key, value)
    config.architectures = [arch]
    torch.manual_seed(0)
    cls._from_config(config, dtype=torch.float32).save_pretrained(
        out, max_shard_size="40KB", save_original_format=naming != "transformers")
    return json.loads((out / "config.json").read_text())


def _component(name: str) -> str:
    parts = name.split(".")
    i = next(i for i, p in enumerate(parts) if p.isdecimal())
    return ".".join(parts[i + 1:])


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


#: (pp, tp) layouts; TP=4 also splits 2 KV heads by replication (LFM2) and, for Mamba2, would
#: give 2 groups over 4 ranks, which vLLM refuses (see docs/families.md): not run there
LAYOUTS = [(2, 2), (1, 4)]


@pytest.mark.parametrize("pp,tp", LAYOUTS)
@pytest.mark.parametrize("model_type", sorted(CASES))
def test_every_rank_equals_the_engine_slices(model_type: str, pp: int, tp: int,
                                             tmp_path: Path) -> None:
    if tp == 4 and model_type == "mamba2":
        pytest.skip("2 Mamba2 groups over 4 ranks: vLLM refuses it, pploader replicates")
    overrides, must_split = CASES[model_type]
    config = _checkpoint(model_type, tmp_path, **overrides)
    spec, index = load_spec(tmp_path), open_checkpoint(tmp_path)
    ref = reference_tensors(tmp_path)
    seen: set[str] = set()
    split: set[str] = set()
    for plan in plan_all(spec, index, pp, tp, 1, exchange_cost=None):
        got = dict(Reader(plan))
        assert {i.target for i in plan.items} == set(got)
        for item in plan.items:
            full = ref[item.name]
            piece, pad = engine_piece(item.name, tuple(full.shape), config, tp,
                                      plan.topology.tp_rank)
            want = take(full, piece, pad)
            assert tuple(got[item.target].shape) == tuple(want.shape), (item.name, plan.topology)
            assert _bytes(got[item.target]) == _bytes(want), (plan.topology.rank, item.name)
            seen.add(item.name)
            if piece is not None and any(c.isdecimal() for c in item.name.split(".")):
                split.add(_component(item.name))
    assert seen == set(index.weight_map)
    assert must_split <= split, sorted(must_split - split)


def test_mamba2_heads_that_tp_does_not_divide_are_refused(tmp_path: Path) -> None:
    """4 heads over TP=8: vLLM's ``MambaMixer2`` asserts ``num_heads % tp == 0``; the plan is
    refused naming a per-head tensor."""
    _checkpoint("mamba2", tmp_path)
    spec, index = load_spec(tmp_path), open_checkpoint(tmp_path)
    with pytest.raises(PlanError, match=r"mixer\.(A_log|D|dt_bias|in_proj|norm|conv1d)"):
        plan_all(spec, index, 1, 8, 1)


def test_olmo_hybrid_convs_of_the_wrong_width_are_refused(tmp_path: Path) -> None:
    """2 key heads, 4 value heads: transformers' save (its reverse conversion) stores the
    fused conv as three equal chunks (43 / 43 / 42 rows), not [key, key, value] (32 / 32 / 64)
    as released and as vLLM loads them: refused at any layout, naming the conv."""
    _checkpoint("olmo_hybrid", tmp_path)
    spec, index = load_spec(tmp_path), open_checkpoint(tmp_path)
    for pp, tp in ((2, 2), (2, 1)):
        with pytest.raises(PlanError, match=r"linear_attn\.[qkv]_conv1d.*shape \[4[23], 1, 4\]"
                                            r" in the checkpoint != \[(32|64), 1, 4\]"):
            plan_all(spec, index, pp, tp, 1)


@pytest.mark.parametrize("pp,tp", LAYOUTS)
def test_olmo_hybrid_released_conv_widths_split_as_vllm(pp: int, tp: int,
                                                        tmp_path: Path) -> None:
    """2 key heads, 4 value heads (the real config's key width is half its value width) in
    the released naming, convs [key, key, value] = 32 / 32 / 64 rows: every rank equals the
    slices vLLM's ``olmo_hybrid`` loads (the sweep's checkpoint, written by transformers'
    reverse conversion as equal thirds, is refused instead: the test above)."""
    config = _checkpoint("olmo_hybrid", tmp_path)
    generic_sweep.as_released("olmo_hybrid", tmp_path, config)
    spec, index = load_spec(tmp_path), open_checkpoint(tmp_path)
    ref = reference_tensors(tmp_path)
    split: set[str] = set()
    for plan in plan_all(spec, index, pp, tp, 1, exchange_cost=None):
        got = dict(Reader(plan))
        for item in plan.items:
            full = ref[item.name]
            piece, pad = engine_piece(item.name, tuple(full.shape), config, tp,
                                      plan.topology.tp_rank)
            want = take(full, piece, pad)
            assert _bytes(got[item.target]) == _bytes(want), (plan.topology.rank, item.name)
            if piece is not None and "_conv1d" in item.name:
                split.add(_component(item.name))
    assert split == {"linear_attn.q_conv1d.weight", "linear_attn.k_conv1d.weight",
                     "linear_attn.v_conv1d.weight"}


def _one_plan(path: Path, item: object) -> RankPlan:
    return RankPlan(model=str(path.parent), topology=Topology(1),
                    window=StageWindow(0, 0, 1, True, True), experts=None,
                    items=(item,), paths={path.name: str(path)},  # type: ignore[arg-type]
                    identities={path.name: FileIdentity.of(os.stat(path))}, header_bytes=0)


@pytest.mark.parametrize("ep", [1, 2])
def test_dbrx_experts_per_expert_rows(ep: int, tmp_path: Path) -> None:
    """DBRX's ``ffn.experts.mlp.{w1,v1,w2}`` [E x I, H]: rank (ep, tp) reads rows
    ``[t I/tp, (t+1) I/tp)`` of each of its experts (vLLM reshapes to [E, I, H] and takes that
    slice of every expert), bitwise through the reader."""
    config = _checkpoint("dbrx", tmp_path)
    spec = load_spec(tmp_path)
    index = open_checkpoint(tmp_path)
    spec = spec.for_checkpoint(index.weight_map)
    ref = reference_tensors(tmp_path)
    experts = config["ffn_config"]["moe_num_experts"]
    inter = config["ffn_config"]["ffn_hidden_size"]
    names = [n for n in index.weight_map if n.endswith(("mlp.w1", "mlp.v1", "mlp.w2"))]
    assert len(names) == 3 * spec.num_layers
    for rank in range(TP * ep):
        topo = Topology(1, tp_size=TP, ep_size=ep, rank=rank)
        block = local_experts(experts, ep, topo.ep_rank)
        for name in names:
            entry = index.entry(name)
            role = spec.family.classify(name, spec.num_layers, spec.num_mtp_layers)
            assert role is not None
            sel = tensor_selection(spec, role, entry, topo, block if ep > 1 else None, index,
                                   None)
            got = dict(Reader(_one_plan(Path(index.paths[entry.file]),
                                        read_item(entry, name, sel, 64 * 1024))))[name]
            full = ref[name].reshape(experts, inter, -1)[block[0]:block[1]]
            per = inter // TP
            want = full[:, topo.tp_rank * per:(topo.tp_rank + 1) * per].reshape(-1, full.shape[2])
            assert _bytes(got) == _bytes(want), (rank, name)


# ---- a real gloo job: PP=2 x TP=2, plain and exchanged ----------------------------------------
def _gloo_rank(rank: int, world: int, model: str) -> dict:
    from pploader import Topology, load_stage, plan_stage
    from pploader.distributed.comm import Comm
    topo = Topology.for_world(world, rank, pp=2, tp=2)
    comm = Comm(topo, timeout_s=60)
    plain = load_stage(plan_stage(model, topo, exchange_cost=None))
    exchanged = load_stage(plan_stage(model, topo, exchange_cost=0.0), comm=comm)
    comm.agree(None)
    comm.close()
    return {"tp_rank": topo.tp_rank,
            **{kind: {k: _bytes(v) for k, v in load.state_dict.items()}
               for kind, load in (("plain", plain), ("exchanged", exchanged))}}


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["mamba2", "granitemoe"])
def test_gloo_job_loads_the_engine_slices(model_type: str, tmp_path: Path) -> None:
    """4 gloo ranks (PP=2 x TP=2) load a mixer and a 3-D expert model plain and exchanged
    (row shares + all-to-all over the TP group): every rank's bytes are the reference slices
    of its stage's tensors."""
    from helpers import run_ranks
    config = _checkpoint(model_type, tmp_path, **CASES[model_type][0])
    ref = reference_tensors(tmp_path)  # (both untied: every loaded name is a stored one)
    results = run_ranks(_gloo_rank, 4, str(tmp_path))
    seen: set[str] = set()
    for res in results:
        assert res["plain"] == res["exchanged"]
        for name, raw in res["plain"].items():
            piece, pad = engine_piece(name, tuple(ref[name].shape), config, 2, res["tp_rank"])
            assert raw == _bytes(take(ref[name], piece, pad)), (res["tp_rank"], name)
        seen |= set(res["plain"])
    assert seen == set(ref)


@pytest.mark.parametrize("model_type, gate_up, down", [
    ("granitemoe", "block_sparse_moe.input_linear.weight", "block_sparse_moe.output_linear.weight"),
    ("aria_text", "mlp.experts.fc1.weight", "mlp.experts.fc2.weight"),
])
def test_expert_shards_compute_the_whole(model_type: str, gate_up: str, down: str,
                                         tmp_path: Path) -> None:
    """What the split is for, checked without the reference: transformers' own experts module
    (its ``gate_up_proj`` / ``down_proj`` are the checkpoint's ``input_linear`` /
    ``output_linear`` and ``fc1`` / ``fc2``, same layouts) run on each TP rank's shards,
    summed over the ranks, equals the module on the whole tensors."""
    from test_stacked_experts_tp import _experts, _run
    arch = generic_sweep.causal_lm_types()[model_type]
    model = generic_sweep._checkpoint(model_type, arch, tmp_path)
    spec, index = load_spec(tmp_path), open_checkpoint(tmp_path)
    ref = reference_tensors(tmp_path)
    up_name = next(n for n in ref if ".layers.0." in n and n.endswith(gate_up))
    down_name = up_name[:-len(gate_up)] + down
    _, module = _experts(model)
    shards = [dict(Reader(p)) for p in plan_all(spec, index, 1, TP, 1)]
    assert all(s[up_name].shape != ref[up_name].shape for s in shards)  # split, not whole
    experts = ref[up_name].shape[0]
    x = torch.randn(4 * experts, spec.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = _run(module, ref[up_name], ref[down_name], x, experts)
        parts = sum(_run(module, s[up_name], s[down_name], x, experts) for s in shards)
    assert torch.allclose(parts, whole, atol=1e-5, rtol=1e-4), (parts - whole).abs().max()
