"""pploader.integrations.vllm without an engine: windows from vLLM's own split, the strict
check (placed tensors: tests/integrations/test_placed.py). Marked ``vllm`` (needs vllm importable; see .ci/vllm-suite.sh)."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from engine_suite import engine_marks

pytestmark = engine_marks("vllm", slow=False)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from helpers import make_model, tiny_config
    cfg = tiny_config(num_hidden_layers=5, head_dim=32, hidden_size=128, vocab_size=200)
    return make_model(tmp_path_factory.mktemp("llama"), cfg, shard_bytes=80_000)


def test_engine_partition_is_get_pp_indices_and_reads_the_env(monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    from vllm.distributed.utils import get_pp_indices

    from engine_suite import check_partition
    from pploader.integrations.vllm import engine_partition
    check_partition(engine_partition, get_pp_indices, "VLLM_PP_LAYER_PARTITION", monkeypatch)


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


def test_strict_check_passes_attention_scales_the_engine_defaults(llama: Path) -> None:
    """vLLM builds ``attn.k_scale`` / ``q_scale`` / zero points for quantized models
    (compressed-tensors) and defaults them after loading when the checkpoint has none: not
    "missing" then; missing when the checkpoint stores such scales and they were not loaded."""
    from dataclasses import replace
    from pploader import PlanError, Topology, plan_stage
    from pploader.integrations.vllm import check_all_loaded
    staged = plan_stage(llama, Topology(1))

    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.k_scale = nn.Parameter(torch.tensor(-1.0), requires_grad=False)
            self.k_zero_point = nn.Parameter(torch.tensor(0.0), requires_grad=False)
    stage = nn.Module()
    stage.attn = Attn()
    assert check_all_loaded(stage, set(), staged) == ()
    with_scales = replace(staged, plan=replace(
        staged.plan, tensors=staged.plan.tensors + ("model.layers.0.self_attn.k_scale",)))
    with pytest.raises(PlanError, match="attn.k_scale"):
        check_all_loaded(stage, set(), with_scales)


@pytest.mark.parametrize("placement", ["linear", "round_robin"])
def test_expert_placements_are_vllms_determine_expert_map(placement: str) -> None:
    """pploader's view of vLLM's EP placements (and pploader's own --ep split, linear) equal
    vLLM's determine_expert_map for every count and EP size: the remainder on the first ranks."""
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    from pploader.integrations.engine_plan import linear_experts, round_robin_experts
    from pploader.planning.shard import local_experts
    ours = {"linear": linear_experts, "round_robin": round_robin_experts}[placement]
    for n in (2, 3, 7, 8, 9, 60, 64):
        for ep in range(2, min(n, 8) + 1):
            for rank in range(ep):
                count, emap, _ = determine_expert_map(ep, rank, n, placement)
                theirs = frozenset(torch.where(emap != -1)[0].tolist())
                assert ours(n, ep, rank) == theirs and len(theirs) == count
                if placement == "linear":
                    first, last = local_experts(n, ep, rank)
                    assert frozenset(range(first, last)) == theirs


@pytest.mark.parametrize("placement", ["linear", "round_robin"])
def test_engine_local_experts_reads_the_layers_map(placement: str, tmp_path: Path) -> None:
    """engine_local_experts takes what the model's MoE layers hold (their expert_map_manager,
    as vLLM's FusedMoE builds it); the engine plan then reads those experts whole, only them."""
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    from helpers import make_model, tiny_config
    from pploader import Topology
    from pploader.integrations.engine_plan import expert_of
    from pploader.integrations.vllm import engine_local_experts, plan_engine_stage
    cfg = dict(tiny_config("tiny-qwen3_moe"), num_experts=7)
    ckpt = make_model(tmp_path / "moe", cfg)

    class Manager:
        use_ep = True

        def __init__(self, rank: int) -> None:
            self.map = determine_expert_map(2, rank, 7, placement)[1]

        def get_local_expert_ids(self) -> list[int]:
            return torch.where(self.map != -1)[0].tolist()

    for rank in range(2):
        model = nn.Module()
        model.layer0 = nn.Module()
        model.layer1 = nn.Module()
        model.layer0.expert_map_manager = Manager(rank)   # type: ignore[assignment]
        model.layer1.expert_map_manager = Manager(rank)   # type: ignore[assignment]
        local = engine_local_experts(model, 7)
        assert local == frozenset(Manager(rank).get_local_expert_ids())
        staged = plan_engine_stage(str(ckpt), Topology(1, 2, 1, rank), (cfg["num_hidden_layers"],),
                                   "placed", local_experts=local)
        read = {expert_of(staged, i)[0] for i in staged.plan.items} - {None}
        assert read == local
    assert engine_local_experts(nn.Linear(2, 2), 7) is None   # no EP: experts split by TP
