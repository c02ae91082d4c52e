"""LongCat-Flash's experts through the generic family: EP over the routed experts.

Its ``gate_up_proj`` stacks the ``E`` routed experts and the ``Z`` zero-compute (identity)
experts (``[E + Z, 2I, H]``), ``down_proj`` only the routed ones (``[E, H, I]``); transformers
saves the zero experts' gate/up rows too (``experts.{E..E+Z-1}.gate_proj/up_proj``), which no
compute uses. Engines split the ``E`` routed experts (vLLM's expert mapping covers
``n_routed_experts``), so: ``num_experts`` is ``E``; EP rank ``r`` reads the routed experts of
vLLM's linear placement, checked here against that formula written independently; the zero
experts' tensors are layer tensors every EP rank reads. Bytes equal safe_open's
(``generic_sweep._load_check``); the PP=2 forward equals transformers (``generic_sweep.check``).
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import generic_sweep
from helpers import reference_tensors
from pploader.families.hf_experts import ids_below
from pploader.io.read import Reader
from pploader.planning.checkpoint import open_checkpoint
from pploader.planning.plan import plan_all
from pploader.planning.spec import load_spec

_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")


@pytest.fixture(scope="module")
def quiet() -> None:
    import transformers
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def _linear(num_experts: int, ep: int, rank: int) -> range:
    """vLLM's linear expert placement (``determine_expert_map``), written out here."""
    base, extra = divmod(num_experts, ep)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def test_ids_below_matches_exactly_the_smaller_ids() -> None:
    for n in (1, 4, 9, 10, 11, 99, 100, 101, 256, 512, 1000):
        rx = re.compile(f"(?:{ids_below(n)})")
        assert {i for i in range(1200) if rx.fullmatch(str(i))} == set(range(n)), n
        assert not rx.fullmatch("01") and not rx.fullmatch("")


@pytest.mark.parametrize("ep", [2, 3])
def test_longcat_flash_ep_over_the_routed_experts(tmp_path: Path, quiet: None, ep: int) -> None:
    model = generic_sweep._checkpoint("longcat_flash", "LongcatFlashForCausalLM", tmp_path)
    routed, zero = model.config.n_routed_experts, model.config.zero_expert_num
    assert routed and zero
    spec, index = load_spec(tmp_path), open_checkpoint(tmp_path)
    assert spec.num_experts == routed
    stored = {int(m.group(1)) for n in index.weight_map if (m := _EXPERT.search(n))}
    assert stored == set(range(routed + zero))  # transformers saved the zero experts' rows
    ref = reference_tensors(tmp_path)
    assert generic_sweep._load_check(spec, index, ref, 2, ep) == sum(
        len(p.items) for p in plan_all(spec, index, 2, 1, ep))
    for plan in plan_all(spec, index, 2, 1, ep):
        mine = _linear(routed, ep, plan.topology.ep_rank)
        assert plan.experts == (mine.start, mine.stop)
        layers = range(plan.window.start_layer, plan.window.end_layer)
        want = {n for n in index.weight_map for i in layers if f"layers.{i}." in n and (
            (m := _EXPERT.search(n)) is None or int(m.group(1)) in mine
            or int(m.group(1)) >= routed)}
        got = {i.name for i in plan.items if any(f"layers.{j}." in i.name for j in layers)}
        assert got == want, (plan.topology.rank, sorted(got ^ want)[:4])


def test_longcat_flash_transformers_naming_under_ep(tmp_path: Path, quiet: None) -> None:
    """``save_original_format=False``: ``down_proj`` ``[E, ...]`` and ``gate_up_proj``
    ``[E + Z, ...]`` are both split by EP, each rank its routed block (vLLM's linear
    placement); the zero experts' rows past ``E`` are read by no rank (no compute uses them)."""
    model = generic_sweep._checkpoint("longcat_flash", "LongcatFlashForCausalLM",
                                      tmp_path / "orig")
    model.save_pretrained(tmp_path / "tf", save_original_format=False, max_shard_size="40KB")
    spec, index = load_spec(tmp_path / "tf"), open_checkpoint(tmp_path / "tf")
    routed = model.config.n_routed_experts
    assert spec.num_experts == routed
    ref = reference_tensors(tmp_path / "tf")
    generic_sweep._load_check(spec, index, ref, 2, 2)
    stacked = [n for n in ref if n.endswith(("experts.down_proj", "experts.gate_up_proj"))]
    assert any(ref[n].shape[0] > routed for n in stacked)  # the zero experts' rows are stored
    for plan in plan_all(spec, index, 2, 1, 2):
        got = dict(Reader(plan))
        mine = _linear(routed, 2, plan.topology.ep_rank)
        for item in plan.items:
            if item.name in stacked:
                want = ref[item.name][mine.start:mine.stop]
                assert torch.equal(got[item.target], want), (item.name, plan.topology.rank)


@pytest.mark.parametrize("model_type", [
    "longcat_flash", pytest.param("jetmoe", marks=pytest.mark.slow),
    pytest.param("dbrx", marks=pytest.mark.slow)])
def test_sweep_ep_for_unusual_experts(model_type: str, tmp_path: Path, quiet: None) -> None:
    """The sweep's row (exact, PP=2 x EP=2 bitwise, PP=2 forward equal to transformers) for
    the three MoE types issue 31 named (DBRX and JetMoE: declared expert counts)."""
    arch = generic_sweep.causal_lm_types()[model_type]
    row = generic_sweep.check(model_type, arch, tmp_path)
    assert row["result"] == "exact" and row["experts"], row
    assert "PP=2xEP=2" in row["loads"], row
    assert row["forward"] == "bit-identical" or row["forward"].startswith("close"), row
