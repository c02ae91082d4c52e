"""pploader.integrations.vllm without an engine: windows from vLLM's own split, the strict
check (placed tensors: tests/integrations/test_placed.py). Marked ``vllm`` (needs vllm importable; see .ci/vllm-suite.sh)."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

# tests/ is on sys.path (conftest), so this directory is a namespace package "vllm": only
# a real installed vllm (a regular package, with an __init__ file) counts
_SPEC = importlib.util.find_spec("vllm")
HAVE_VLLM = _SPEC is not None and _SPEC.origin is not None

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not HAVE_VLLM,
                                 reason="vllm is not installed here: run .ci/vllm-suite.sh")]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from helpers import make_model, tiny_config
    cfg = tiny_config(num_hidden_layers=5, head_dim=32, hidden_size=128, vocab_size=200)
    return make_model(tmp_path_factory.mktemp("llama"), cfg, shard_bytes=80_000)


def test_engine_partition_is_get_pp_indices_and_reads_the_env(monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    from vllm.distributed.utils import get_pp_indices

    from pploader.integrations.vllm import engine_partition
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    for layers in range(4, 40):
        for pp in range(1, 5):
            sizes = engine_partition(layers, pp)
            starts = [sum(sizes[:r]) for r in range(pp)]
            assert [(s, s + n) for s, n in zip(starts, sizes)] == \
                [get_pp_indices(layers, r, pp) for r in range(pp)]
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "1,4")
    assert engine_partition(5, 2) == (1, 4)


def test_plan_window_checked_against_the_engine(llama: Path) -> None:
    from pploader import PlanError, Topology
    from pploader.integrations.vllm import plan_engine_stage
    topo = Topology(2, 1, 1, 1)
    staged = plan_engine_stage(str(llama), topo, (1, 4), "placed",
                               SimpleNamespace(model=SimpleNamespace(start_layer=1, end_layer=5)))
    assert (staged.plan.window.start_layer, staged.plan.window.end_layer) == (1, 5)
    assert staged.plan.window.has_head and not staged.plan.window.has_embed
    with pytest.raises(PlanError, match=r"vLLM's model holds layers \(2, 5\)"):
        plan_engine_stage(str(llama), topo, (1, 4), "placed",
                          SimpleNamespace(model=SimpleNamespace(start_layer=2, end_layer=5)))


def test_strict_check_lists_missing_and_zeroes_other_stages_params(llama: Path) -> None:
    from pploader import PlanError, Topology, plan_stage
    from pploader.integrations.vllm import check_all_loaded
    staged = plan_stage(llama, Topology(2, 1, 1, 0))   # first stage: no norm, no head

    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm_head = nn.Linear(4, 4, bias=False)          # built here, owned by stage 1
            self.model = nn.Module()
            self.model.embed_tokens = nn.Embedding(4, 4)
    stage = Stage()
    assert check_all_loaded(stage, {"model.embed_tokens.weight"}, staged) == ("lm_head.weight",)
    assert torch.count_nonzero(stage.lm_head.weight) == 0
    with pytest.raises(PlanError, match="1 parameter.*model.embed_tokens.weight"):
        check_all_loaded(stage, {"lm_head.weight"}, staged)
