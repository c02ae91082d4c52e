"""DBRX, Laguna, dots3 Note and LongCat-Flash under TP through the generic family (families/fused_qkv.py): tiny
transformers checkpoints loaded at PP=2 x TP=k on the CPU, every tensor of every rank bitwise
equal to tests/attn_tp_ref.py's slice. Before, all were refused at TP=2 (DBRX's ``Wqkv``,
Laguna's and dots3's ``g_proj``: "not a known projection"; Laguna's per-layer query heads did
not match ``num_attention_heads``; dots3's ``k_rope_only_layernorm``: "norm of width"; LongCat's ``input_layernorm.0``: "role
'0'").
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from tp_check import build_tiny, check_ranks
from attn_tp_ref import dbrx_slice, dots3_slice, laguna_slice, longcat_slice
from helpers import reference_tensors
from pploader.errors import PlanError
from pploader.io.read import Reader
from pploader.planning.checkpoint import open_checkpoint
from pploader.planning.plan import plan_all
from pploader.planning.spec import load_spec
from sweep_shrink import tiny_config

transformers = pytest.importorskip("transformers")
REF: dict[str, Callable[..., torch.Tensor]] = {
    "dbrx": dbrx_slice, "laguna": laguna_slice, "dots3_note": dots3_slice,
    "dots3_note_text": dots3_slice, "longcat_flash": longcat_slice}


def _build(model_type: str, out: Path, **overrides: Any) -> dict[str, Any]:
    return build_tiny(model_type, out, **overrides)


def _check(model_type: str, path: Path, config: dict[str, Any], tp: int) -> set[str]:
    """Every rank's bytes against the reference; the modules some rank holds a part of."""
    return check_ranks(path, tp, lambda name, full, rank:
                       REF[model_type](name, full, config, tp, rank))[1]


@pytest.mark.parametrize("tp", [2, 4])
def test_dbrx_pp2_tp_bytes(tp: int, tmp_path: Path) -> None:
    """The tiny one has 4 heads and one KV head: k / v copied on every rank."""
    config = _build("dbrx", tmp_path)
    assert config["attn_config"]["kv_n_heads"] < tp
    split = _check("dbrx", tmp_path, config, tp)
    assert {"Wqkv", "out_proj", "mlp", "wte", "lm_head"} <= split, split


def test_dbrx_pp2_ep2_tp2_bytes(tmp_path: Path) -> None:
    """EP=2 x TP=2: a rank's 2 of the 4 experts, each expert's rows its TP share; the
    attention by TP rank as without EP."""
    config = _build("dbrx", tmp_path)
    spec, index = load_spec(tmp_path), open_checkpoint(tmp_path)
    ref = reference_tensors(tmp_path)
    seen: set[str] = set()
    for plan in plan_all(spec, index, 2, 2, 2):
        got = dict(Reader(plan))
        topo = plan.topology
        for item in plan.items:
            want = dbrx_slice(item.name, ref[item.name], config, 2, topo.tp_rank, 2,
                              topo.ep_rank)
            assert torch.equal(got[item.target], want), (topo.rank, item.name)
            seen.add(item.name)
    assert seen == set(index.weight_map)


def test_dbrx_kv_heads_split_tp2(tmp_path: Path) -> None:
    """Two KV heads at TP=2: one each, none copied."""
    attn = {**tiny_config("dbrx").to_dict()["attn_config"], "kv_n_heads": 2}
    config = _build("dbrx", tmp_path, attn_config=attn)
    assert config["attn_config"]["kv_n_heads"] == 2
    assert "Wqkv" in _check("dbrx", tmp_path, config, 2)


@pytest.mark.parametrize("tp", [2, 4])
def test_laguna_pp2_tp_bytes(tp: int, tmp_path: Path) -> None:
    """The tiny one's layers have 48 query heads (``num_attention_heads`` says 4)."""
    config = _build("laguna", tmp_path)
    assert set(config["num_attention_heads_per_layer"]) != {config["num_attention_heads"]}
    split = _check("laguna", tmp_path, config, tp)
    assert {"q_proj", "o_proj", "g_proj", "k_proj", "gate_proj", "down_proj"} <= split, split


def test_laguna_heads_not_dividing_refused(tmp_path: Path) -> None:
    """A layer of 6 query heads cannot split over 4 ranks (vLLM asserts): refused, naming a
    tensor of that projection."""
    _build("laguna", tmp_path, num_attention_heads_per_layer=[8, 6, 8, 8])
    spec, index = load_spec(tmp_path), open_checkpoint(tmp_path)
    with pytest.raises(PlanError) as err:
        plan_all(spec, index, 2, 4, 1)
    assert re.search(r"self_attn\.(q|o|g)_proj", str(err.value.tensor)), err.value


@pytest.mark.parametrize("model_type", ["dots3_note", "dots3_note_text"])
def test_dots3_headwise_gate_pp2_tp2_bytes(model_type: str, tmp_path: Path) -> None:
    """transformers' dots3 gate is headwise ([heads, hidden]): whole on every rank, as vLLM's
    ReplicatedLinear holds it; the MLA projections split by heads."""
    config = _build(model_type, tmp_path)
    split = _check(model_type, tmp_path, config, 2)
    assert {"q_b_proj", "kv_b_proj", "o_proj", "down_proj"} <= split, split
    assert not split & {"g_proj", "k_rope_only_layernorm", "wk", "weights_proj"}, split



@pytest.mark.parametrize("tp", [2, 4])
def test_longcat_flash_pp2_tp_bytes(tp: int, tmp_path: Path) -> None:
    """Two MLA sub-blocks and two dense MLPs a layer, split by heads / rows; the numbered
    norms and the router (4 routed + 4 zero experts) whole."""
    config = _build("longcat_flash", tmp_path)
    split = _check("longcat_flash", tmp_path, config, tp)
    assert {"q_b_proj", "kv_b_proj", "o_proj", "gate_proj", "down_proj"} <= split, split
    assert not split & {"0", "1", "classifier", "router"}, split
