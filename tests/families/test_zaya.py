"""ZAYA1 in its release naming (what SGLang's ``zaya`` loads): PP, PP x TP and PP x EP.

A tiny release checkpoint is written with ``safetensors.torch.save_file`` from a small config
(tests/zaya_release.py: names and shapes from SGLang's module definitions). Every rank's plan holds exactly the
tensors tests/zaya_ref.py says its stage / EP rank loads (SGLang's PP split, not pploader's
even one: 7 layers over 2 stages are 3 + 4), and each item, read on the CPU, equals the
reference piece bitwise. TP sizes SGLang refuses are refused naming a tensor; a transformers
``save_pretrained`` ZAYA still goes to the generic family.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import zaya_ref
from zaya_release import CONFIG, D, E, FFN, H, LAYERS, NK, NQ, VARIANT, X, write_release
from helpers import reference_tensors
from pploader import ConfigError, PlanError
from pploader.families import find_family
from pploader.io.read import Reader
from pploader.planning.checkpoint import open_checkpoint
from pploader.planning.plan import plan_all
from pploader.planning.spec import load_spec, spec_from_config

@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_release(tmp_path_factory.mktemp("zaya") / "release", CONFIG)


@pytest.fixture(scope="module")
def variant(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_release(tmp_path_factory.mktemp("zaya") / "variant", VARIANT)


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_release_config_goes_to_the_zaya_family() -> None:
    family, arch = find_family(CONFIG)
    assert (family.name, arch) == ("zaya", "ZayaForCausalLM")
    spec = spec_from_config(CONFIG)
    assert spec.num_layers == len(LAYERS)  # zaya_layers, not num_hidden_layers
    assert spec.moe_layers == frozenset({1, 3, 5}) and spec.num_experts == E
    from pploader.families.zaya import is_release_config
    assert find_family({**CONFIG, "rms_norm_eps": 1e-5})[0].name == "zaya"
    for key, value in (("layer_types", ["hybrid"] * 7), ("moe_intermediate_size", 16),
                       ("router_hidden_size", X)):  # transformers' fields: its naming
        assert not is_release_config({**CONFIG, key: value})
    assert not is_release_config({"architectures": ["ZayaForCausalLM"], "model_type": "zaya",
                                  "hidden_size": H, "num_attention_heads": NQ})


@pytest.mark.parametrize("pp,tp,ep", [(2, 1, 1), (2, 2, 1), (2, 1, 2), (1, 2, 2)])
def test_every_rank_equals_sglangs_pieces(release: Path, pp: int, tp: int, ep: int) -> None:
    """Item by item: the rank's tensors are its SGLang stage's (and EP rank's), each read on
    the CPU equals the reference piece, bitwise; all ranks together read every tensor."""
    spec, index = load_spec(release), open_checkpoint(release)
    ref = reference_tensors(release)
    plans = plan_all(spec, index, pp, tp, ep, partition="sglang")
    assert len(plans) == pp * tp * ep
    seen: set[str] = set()
    for plan in plans:
        t = plan.topology
        want_names = {n for n in ref if zaya_ref.owns(n, CONFIG, pp, t.pp_rank, ep, t.ep_rank)}
        assert {i.name for i in plan.items} == want_names, t.describe()
        assert (plan.window.start_layer, plan.window.end_layer) == \
            zaya_ref.sglang_window(len(LAYERS), pp, t.pp_rank)
        got = dict(Reader(plan))
        for item in plan.items:
            want = zaya_ref.piece(item.name, ref[item.name], CONFIG, tp, t.tp_rank)
            have = got[item.target]
            assert tuple(have.shape) == tuple(want.shape), (t.describe(), item.name)
            assert have.dtype == want.dtype and _bytes(have) == _bytes(want), \
                (t.describe(), item.name)
        seen |= want_names
    assert seen == set(ref)


@pytest.mark.parametrize("tp", [1, 2])
def test_the_other_options_plan_as_sglang_builds_them(variant: Path, tp: int) -> None:
    """LayerNorm, attention biases (q / k by heads, val_proj and o_proj's whole), no residual
    scaling, no MOD / EDA, a tied head (the last stage reads the embedding as its head): the
    strict plan accepts exactly SGLang's tensors, each rank's pieces bitwise."""
    spec, index = load_spec(variant), open_checkpoint(variant)
    ref = reference_tensors(variant)
    for plan in plan_all(spec, index, 2, tp, partition="sglang"):
        t = plan.topology
        want = {n for n in ref if zaya_ref.owns(n, VARIANT, 2, t.pp_rank, 1, 0)}
        if t.pp_rank == 1:  # the tied head: the embedding, read as lm_head
            want.add("model.embed_tokens.weight")
            assert {i.target for i in plan.items if i.name == "model.embed_tokens.weight"} \
                == {"lm_head.weight"}
        assert {i.name for i in plan.items} == want, t.describe()
        got = dict(Reader(plan))
        for item in plan.items:
            piece = zaya_ref.piece(item.target, ref[item.name], VARIANT, tp, t.tp_rank)
            assert _bytes(got[item.target]) == _bytes(piece), (t.describe(), item.name)


def test_sglang_split_is_not_the_even_one(release: Path) -> None:
    """7 layers over 2 stages: SGLang gives the extra layer to the last stage (3 + 4)."""
    spec, index = load_spec(release), open_checkpoint(release)
    windows = [(p.window.start_layer, p.window.end_layer)
               for p in plan_all(spec, index, 2, partition="sglang")]
    assert windows == [(0, 3), (3, 7)]


@pytest.mark.parametrize("tp,ep,tensor,why", [
    (4, 1, "model.layers.0.self_attn.qkv.linear_k.weight", "key heads"),
    (3, 1, "model.layers.0.self_attn.qkv.linear_q.weight", "query heads"),
    (1, 3, "model.layers.1.zaya_block.experts.local_experts.0.linear_fc1.weight", "experts")])
def test_sizes_sglang_refuses(release: Path, tp: int, ep: int, tensor: str, why: str) -> None:
    spec, index = load_spec(release), open_checkpoint(release)
    with pytest.raises(PlanError, match=why) as err:
        plan_all(spec, index, 1, tp, ep)
    assert err.value.tensor == tensor


def test_more_ranks_than_experts_or_an_uneven_intermediate_is_refused() -> None:
    """SGLang's ZayaBlock refuses TP above the expert count; FusedMoE an intermediate size
    (ffn_hidden_size / 2) TP does not divide."""
    fam = find_family(CONFIG)[0]
    assert fam.check_parallel is not None
    fc1 = "model.layers.1.zaya_block.experts.local_experts.0."
    one = spec_from_config({**CONFIG, "num_experts": 1})
    with pytest.raises(PlanError, match="greater than the 1 experts") as err:
        fam.check_parallel(one, 2, 1)
    assert err.value.tensor == fc1 + "linear_fc1.weight"
    odd = spec_from_config({**CONFIG, "ffn_hidden_size": 30, "ffn_hidden_size_list": None})
    with pytest.raises(PlanError, match="intermediate size 15") as err:
        fam.check_parallel(odd, 2, 1)
    assert err.value.tensor == fc1 + "linear_fc2.weight"
    fam.check_parallel(spec_from_config(CONFIG), 2, 2)  # what SGLang accepts passes
    # SGLang pads 250 rows to 256 (128 a rank at TP=2); ceil(250 / 2) = 125 would differ
    with pytest.raises(PlanError, match="pads the vocabulary of 250 to 256") as err:
        fam.check_parallel(spec_from_config({**CONFIG, "vocab_size": 250}), 2, 1)
    assert err.value.tensor == "model.embed_tokens.weight"
    fam.check_parallel(spec_from_config({**CONFIG, "vocab_size": 262272}), 2, 1)  # ZAYA1's


def test_configs_sglang_refuses() -> None:
    """Attention off the even ids SGLang builds it at; num_query_groups != num_key_value_heads
    (ZayaConfig asserts them equal); query heads not a multiple of the key heads (CCA asserts
    it); an odd ffn_hidden_size (no gate / up halves)."""
    with pytest.raises(ConfigError, match="layer 0 is 4"):
        spec_from_config({**CONFIG, "zaya_layers": [E, "a", E, "a"]})
    with pytest.raises(ConfigError, match="num_query_groups 2 != num_key_value_heads 4"):
        spec_from_config({**CONFIG, "num_key_value_heads": 4})
    with pytest.raises(ConfigError, match="not a multiple of the 2 key heads"):
        spec_from_config({**CONFIG, "num_attention_heads": 3, "cca_num_q_heads": None})
    with pytest.raises(ConfigError, match="not even"):
        spec_from_config({**CONFIG, "ffn_hidden_size": 31, "ffn_hidden_size_list": None})


@pytest.mark.parametrize("tp", [1, 2])
def test_cache_geometry_is_sglangs(release: Path, tp: int) -> None:
    """By hand from SGLang's sizing (bf16): an attention layer keeps K and V of NK / tp key
    heads per token; per request the conv over (NQ + NK) * D / tp channels x (2 - 1) + (2 - 1)
    inputs and the previous hidden state [H, 1]; an MoE layer keeps nothing."""
    from pploader.cache.geometry import layer_cache
    spec = load_spec(release)
    att, moe = layer_cache(spec, 0, tp), layer_cache(spec, 1, tp)
    assert att.kind == "cca_attention" and att.kv is not None
    assert (att.kv.heads, att.kv.head_dim, att.kv_bytes_per_token) == \
        (NK // tp, D, 2 * (NK // tp) * D * 2)
    assert {s.name: s.shape for s in att.states} == \
        {"conv": ((NQ + NK) * D // tp, 2), "prev_hidden": (H, 1)}
    assert att.state_bytes_per_request == ((NQ + NK) * D // tp * 2 + H) * 2
    assert moe.kv is None and not moe.states


def test_transformers_naming_goes_to_the_generic_family(tmp_path: Path) -> None:
    """transformers' own ZAYA (save_pretrained: hybrid layers, fused experts) keeps the generic
    family, and plans at PP=2 (strict: every tensor known)."""
    import transformers
    import generic_sweep
    transformers.logging.set_verbosity_error()
    tiny = generic_sweep.tiny_config("zaya")
    config = generic_sweep.model_config(tiny, transformers.ZayaForCausalLM)
    config.architectures = ["ZayaForCausalLM"]
    torch.manual_seed(0)
    transformers.ZayaForCausalLM._from_config(config, dtype=torch.float32).save_pretrained(
        tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert find_family(raw)[0].name != "zaya"
    spec, index = load_spec(tmp_path), open_checkpoint(tmp_path)
    assert spec.family.name != "zaya"
    plans = plan_all(spec, index, 2)
    assert {i.name for p in plans for i in p.items} == set(index.weight_map)


# ---- a real gloo job: PP=2 x TP=2 (SGLang's split), plain, exchanged and read once ----------
def _gloo_rank(rank: int, world: int, model: str) -> dict:
    from pploader import Topology, load_stage, plan_stage
    from pploader.distributed.comm import Comm
    topo = Topology.for_world(world, rank, pp=2, tp=2)
    comm = Comm(topo, timeout_s=60)
    plain = load_stage(plan_stage(model, topo, partition="sglang", exchange_cost=None))
    exchanged = load_stage(plan_stage(model, topo, partition="sglang", exchange_cost=0.0),
                           comm=comm)
    once = load_stage(plan_stage(model, topo, partition="sglang", read_once=True,
                                 exchange_cost=None), comm=comm)
    comm.agree(None)
    comm.close()
    return {"tp_rank": topo.tp_rank, "pp_rank": topo.pp_rank,
            **{kind: {k: _bytes(v) for k, v in load.state_dict.items()}
               for kind, load in (("plain", plain), ("exchanged", exchanged), ("once", once))}}


@pytest.mark.slow
def test_gloo_loads_sglangs_pieces(release: Path) -> None:
    from helpers import run_ranks
    ref = reference_tensors(release)
    seen: set[str] = set()
    for res in run_ranks(_gloo_rank, 4, str(release)):
        assert res["plain"] == res["exchanged"] == res["once"]
        assert set(res["plain"]) == {n for n in ref if zaya_ref.owns(n, CONFIG, 2, res["pp_rank"],
                                                                     1, 0)}
        for name, raw in res["plain"].items():
            assert raw == _bytes(zaya_ref.piece(name, ref[name], CONFIG, 2, res["tp_rank"])), name
        seen |= set(res["plain"])
    assert seen == set(ref)


@pytest.mark.parametrize("tp,ep", [(2, 1), (1, 2)])
def test_experts_bind_into_sglangs_stacked_parameters(release: Path, tp: int, ep: int) -> None:
    """``load_stage_into`` writes each local expert's pieces into SGLang's ``FusedMoE``
    parameters: ``w13_weight`` [E_local, 2 I / tp, H] (its gate rows then its up rows, as the
    loader's ``w1`` / ``w3`` shards), ``w2_weight`` [E_local, H, I / tp]; everything else under
    its own name."""
    from torch import nn
    from pploader import Topology, load_stage_into, plan_stage
    from pploader.planning.checkpoint import DTYPES
    ref = reference_tensors(release)
    per = E // ep
    for rank in range(2 * tp * ep):
        topo = Topology.for_world(2 * tp * ep, rank, pp=2, tp=tp, ep=ep)
        staged = plan_stage(release, topo, partition="sglang")
        items = {i.target: (tuple(i.shape), DTYPES[i.dtype][0]) for i in staged.plan.items}
        moe = sorted({t.split(".zaya_block.")[0] for t in items if ".local_experts." in t})
        root = nn.Module()

        def add(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
            *path, leaf = name.split(".")
            mod = root
            for part in path:
                if not hasattr(mod, part):
                    mod.add_module(part, nn.Module())
                mod = getattr(mod, part)
            mod.register_parameter(leaf, nn.Parameter(torch.empty(shape, dtype=dtype),
                                                      requires_grad=False))
        for name, (shape, dtype) in items.items():
            if ".local_experts." not in name:
                add(name, shape, dtype)
        for layer in moe:
            add(layer + ".zaya_block.experts.w13_weight", (per, FFN // tp, H), torch.bfloat16)
            add(layer + ".zaya_block.experts.w2_weight", (per, H, FFN // 2 // tp), torch.bfloat16)
        result = load_stage_into(root, staged, process=False)
        assert result.missing == () and result.unexpected == (), (topo.describe(), result)
        params = dict(root.named_parameters())
        first = topo.ep_rank * per
        for layer in moe:
            x = f"{layer}.zaya_block.experts."
            for j in range(per):
                e = f"{x}local_experts.{first + j}."
                for fused, piece in (("w13_weight", "linear_fc1.weight"),
                                     ("w2_weight", "linear_fc2.weight")):
                    want = zaya_ref.piece(e + piece, ref[e + piece], CONFIG, tp, topo.tp_rank)
                    assert torch.equal(params[x + fused][j], want), (topo.describe(), e, fused)
        assert not any(".local_experts." in n for n in params)
