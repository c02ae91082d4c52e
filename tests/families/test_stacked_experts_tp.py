"""Stacked (3-D) experts under TP through the generic family (issue 41, item 2): transformers'
``[E, 2I, H]`` / ``[E, H, I]`` (``save_original_format=False``) and Llama-4's ``[E, H, 2I]`` /
``[E, I, H]`` split on the intermediate dim, each half of the fused gate/up on its own.

Checked by what the split is for, not by a second copy of the rule: the model's own experts
module run on each TP rank's shards (loaded through the plan), summed over the ranks, equals
the module run on the whole tensors (a row-parallel down projection sums partial outputs).
A split that took contiguous rows of the fused gate/up, or the wrong dim, would not.
"""
from __future__ import annotations

import copy
import inspect
from pathlib import Path

import pytest
import torch

import generic_sweep
from helpers import reference_tensors
from pploader.io.read import Reader
from pploader.planning.checkpoint import open_checkpoint
from pploader.planning.plan import plan_all
from pploader.planning.spec import load_spec


@pytest.fixture(scope="module", autouse=True)
def quiet() -> None:
    import transformers
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def _experts(model: torch.nn.Module) -> tuple[str, torch.nn.Module]:
    for path, module in model.named_modules():
        own = dict(module.named_parameters(recurse=False))
        if own.get("gate_up_proj") is not None and own["gate_up_proj"].dim() == 3:
            return path, module
    raise AssertionError("no stacked experts")


def _run(module: torch.nn.Module, gate_up: torch.Tensor, down: torch.Tensor,
         x: torch.Tensor, experts: int) -> torch.Tensor:
    m = copy.deepcopy(module)
    m.gate_up_proj = torch.nn.Parameter(gate_up.float(), requires_grad=False)
    m.down_proj = torch.nn.Parameter(down.float(), requires_grad=False)
    params = inspect.signature(type(m).forward).parameters
    if "top_k_index" in params:  # transformers' experts: every token to experts 0 and last
        tokens = x.shape[0]
        index = torch.tensor([[0, experts - 1]] * tokens)
        weights = torch.full((tokens, 2), 0.5)
        return m(x, index, weights)
    return m(x)  # Llama-4: tokens already grouped per expert


@pytest.mark.parametrize("model_type, arch, transformers_naming", [
    ("olmoe", "OlmoeForCausalLM", True),
    ("qwen2_moe", "Qwen2MoeForCausalLM", True),
    ("llama4_text", "Llama4ForCausalLM", False),
])
@pytest.mark.parametrize("tp", [2])
def test_stacked_expert_shards_compute_the_whole(tmp_path: Path, model_type: str, arch: str,
                                                 transformers_naming: bool, tp: int) -> None:
    model = generic_sweep._checkpoint(model_type, arch, tmp_path / "orig")
    path = tmp_path / "orig"
    if transformers_naming:
        path = tmp_path / "tf"
        model.save_pretrained(path, save_original_format=False, max_shard_size="40KB")
    spec, index = load_spec(path), open_checkpoint(path)
    ref = reference_tensors(path)
    where, module = _experts(model)
    tail = where.split(".layers.", 1)[1].split(".", 1)[1]  # path inside the layer
    gate_up = next(n for n in ref if ".layers.0." in n and n.endswith(f"{tail}.gate_up_proj"))
    down = gate_up[:-len("gate_up_proj")] + "down_proj"
    shards = [dict(Reader(p)) for p in plan_all(spec, index, 1, tp, 1)]
    assert all(s[gate_up].shape != ref[gate_up].shape for s in shards)  # split, not whole
    experts, hidden = ref[gate_up].shape[0], spec.hidden_size
    x = torch.randn(4 * experts, hidden, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = _run(module, ref[gate_up], ref[down], x, experts)
        parts = sum(_run(module, s[gate_up], s[down], x, experts) for s in shards)
    assert torch.allclose(parts, whole, atol=1e-5, rtol=1e-4), (parts - whole).abs().max()
