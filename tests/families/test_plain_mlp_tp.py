"""Plain two-linear MLPs, attention output projections named ``out_proj`` / ``dense``, learned
position embeddings and a head bias under TP through the generic family (OPT, XGLM, GPT-J,
Phi): tiny transformers checkpoints loaded at PP=2 x TP=2, every tensor of every rank bitwise
equal to the slice written here from vLLM's OPT / GPT-J and SGLang's Phi: q / k / v rows
(and biases) by heads, the output projection's columns by heads (bias whole), the MLP's input
layer (``fc1`` / ``fc_in``) rows and bias, its output layer (``fc2`` / ``fc_out``) columns
(bias whole), the vocabulary (embedding, head and its bias) in ``ceil(V / tp)`` rows, norms
and position embeddings whole. Before, these were refused (``fc1``, ``out_proj``,
``embed_positions``, ``ln_1``, ``lm_head.bias``: "not a known projection").
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import generic_sweep
from helpers import reference_tensors
from pploader.io.read import Reader
from pploader.planning.checkpoint import open_checkpoint
from pploader.planning.plan import plan_all
from pploader.planning.spec import load_spec

pytest.importorskip("transformers")
TP = 2
_ROWS = ("q_proj", "k_proj", "v_proj", "fc1", "fc_in")
_COLUMNS = ("out_proj", "dense", "fc2", "fc_out")
_VOCAB = ("embed_tokens", "wte", "lm_head")


def _want(name: str, full: torch.Tensor, rank: int) -> torch.Tensor:
    module, leaf = name.split(".")[-2:]
    if module in _ROWS:
        per = full.shape[0] // TP
        return full[rank * per:(rank + 1) * per]
    if module in _COLUMNS and leaf == "weight":
        per = full.shape[1] // TP
        return full[:, rank * per:(rank + 1) * per]
    if module in _VOCAB:
        per = -(-full.shape[0] // TP)
        part = full[rank * per:(rank + 1) * per]
        pad = per - part.shape[0]
        return torch.cat([part, part.new_zeros((pad,) + tuple(part.shape[1:]))]) if pad else part
    return full  # norms, position embeddings, output biases


@pytest.mark.parametrize("model_type", ["opt", "xglm", "gptj", "phi"])
def test_plain_mlp_pp2_tp2_bytes(model_type: str, tmp_path: Path) -> None:
    arch = generic_sweep.causal_lm_types()[model_type]
    generic_sweep._checkpoint(model_type, arch, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config.get("num_key_value_heads", config.get("num_attention_heads")) in (
        None, config.get("num_attention_heads"))  # MHA: k / v split like q
    spec, index = load_spec(tmp_path), open_checkpoint(tmp_path)
    ref = reference_tensors(tmp_path)
    seen: set[str] = set()
    split: set[str] = set()
    for plan in plan_all(spec, index, 2, TP, 1):
        got = dict(Reader(plan))
        for item in plan.items:
            want = _want(item.name, ref[item.name], plan.topology.tp_rank)
            assert torch.equal(got[item.target], want), (plan.topology.rank, item.name)
            seen.add(item.name)
            if want.shape != ref[item.name].shape:
                split.add(item.name.split(".")[-2])
    assert seen == set(index.weight_map)
    assert {"q_proj", "v_proj"} <= split and split & {"fc1", "fc_in"} and \
        split & {"fc2", "fc_out"} and split & {"out_proj", "dense"}
