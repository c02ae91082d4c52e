"""QK norms spanning the whole projection under TP, as vLLM holds them (issue 41, item 3).

MiniMax-M2's ``q_norm`` [heads x head_dim] and ``k_norm`` [kv heads x head_dim] are split
with the heads (vLLM's ``MiniMaxText01RMSNormTP``; with fewer kv heads than ranks, rank r
holds kv head ``r // (tp / kv)``); OLMoE / Olmo2 / Olmo3 keep them whole on every rank
(vLLM gathers q and k before the norm). The reference slices are written here from those
rules; every rank's bytes must equal them, the rest of the plan loading as the sweep checks.
DeepSeek-V3.2's indexer (its ``index_head_dim``-wide key norm included) is replicated, as
vLLM's ``Indexer`` is.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import generic_sweep
from helpers import reference_tensors
from pploader.families.base import ShardRule
from pploader.io.read import Reader
from pploader.planning.checkpoint import open_checkpoint
from pploader.planning.plan import plan_all
from pploader.planning.spec import load_spec


@pytest.fixture(scope="module", autouse=True)
def quiet() -> None:
    import transformers
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def _want(full: torch.Tensor, name: str, arch: str, cfg: dict, tp: int, r: int) -> torch.Tensor:
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    if arch != "MiniMaxM2ForCausalLM":
        return full                                   # gathered q / k: whole norms
    units = cfg["num_attention_heads"] if "q_norm" in name else cfg["num_key_value_heads"]
    head = r * units // tp if units < tp else None    # a replicated kv head
    if head is not None:
        return full[head * hd:(head + 1) * hd]
    per = units // tp * hd
    return full[r * per:(r + 1) * per]


@pytest.mark.parametrize("model_type, arch, tps", [
    ("minimax_m2", "MiniMaxM2ForCausalLM", (2, 4)),
    ("olmoe", "OlmoeForCausalLM", (2,)),
    ("olmo2", "Olmo2ForCausalLM", (2,)),
])
def test_projection_norms_follow_the_engine(tmp_path: Path, model_type: str, arch: str,
                                            tps: tuple[int, ...]) -> None:
    model = generic_sweep._checkpoint(model_type, arch, tmp_path)
    cfg = model.config.to_dict()
    spec, index = load_spec(tmp_path), open_checkpoint(tmp_path)
    ref = reference_tensors(tmp_path)
    norms = [n for n in ref if n.endswith(("q_norm.weight", "k_norm.weight"))]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    assert norms and any(ref[n].shape[0] > hd for n in norms)  # whole-projection widths
    for tp in tps:
        for plan in plan_all(spec, index, pp=2, tp=tp):
            got = dict(Reader(plan))
            for name in norms:
                if name in got:
                    want = _want(ref[name], name, arch, cfg, tp, plan.topology.tp_rank)
                    assert torch.equal(got[name], want), (arch, name, tp, plan.topology.rank)
            assert set(got) >= {n for n in norms if n in plan.tensors}


def test_deepseek_v32_indexer_is_replicated(tmp_path: Path) -> None:
    """Its indexer's rules (wq_b, wk, weights_proj, k_norm weight and bias): whole on every
    rank (its MLA under TP: tests/families/test_mla_tp.py)."""
    generic_sweep._checkpoint("deepseek_v32", "DeepseekV32ForCausalLM", tmp_path)
    spec, index = load_spec(tmp_path), open_checkpoint(tmp_path)
    spec = spec.for_checkpoint(index.weight_map)
    prefix = spec.family.layer_name(0, "")
    indexer = [n[len(prefix):] for n in index.weight_map
               if n.startswith(prefix) and ".indexer." in n]
    assert {"self_attn.indexer.k_norm.weight", "self_attn.indexer.k_norm.bias"} <= set(indexer)
    for comp in indexer:
        rule = spec.family.shard_rule(comp)
        assert rule is not None and rule.dim is None and rule.segments is None, comp


def test_whole_projection_norm_without_an_engine_rule_is_refused() -> None:
    from pploader.families.generic_tp import _projection_norm
    assert _projection_norm("p", "k_norm", 64 * 4, 8, 4, 64, "SomeForCausalLM") is None
    assert _projection_norm("p", "k_norm", 64, 8, 4, 64, "SomeForCausalLM") == \
        ShardRule("p", None)  # one head wide: replicated
    assert _projection_norm("p", "q_norm", 64 * 8, 8, 4, 64, "MiniMaxM2ForCausalLM"
                            ).units is not None
    assert _projection_norm("p", "k_norm", 64 * 4, 8, 4, 64, "OlmoeForCausalLM") == \
        ShardRule("p", None)
