"""pploader's record of vLLM's transformers-backend fusions (pploader/families/hf_fusers.py)
against vLLM's own detection: for the tiny config of each type, vLLM 0.32's ``Fusers`` (its fx
trace, source rewrite and per-instance checks, at TP=2) run on transformers' base model built
on ``meta`` (tests/vllm/fuser_truth.py; no engine), and each module class with two linears or
more must be recorded in ``FUSIONS`` with the same role for each linear; and the decoder layers
vLLM refuses to build (no module calling transformers' attention interface) must be those
``hf_fusers.unbuilt_layers`` finds. Marked ``vllm``: skipped
unless this interpreter has vllm (``.ci/vllm-suite.sh``); a type the installed transformers
lacks is skipped. Takes seconds.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from engine_suite import engine_marks

pytestmark = engine_marks("vllm", slow=False)

sys.path.insert(0, str(Path(__file__).resolve().parent))

#: the transformers-backend types whose classes FUSIONS records
TYPES = ["diffllama", "minimax", "axk2", "phi4_multimodal", "doge", "flex_olmo", "aria_text",
         "gpt_neox"]
#: fuser_truth's kinds -> hf_fusers' roles
ROLES = {"qkv:q": "qkv", "qkv:k": "qkv", "qkv:v": "qkv", "merged": "merged",
         "rowwise": "row", "colwise": "col", "mla_whole": "whole", "replicate": "whole"}


def _tiny_config_dir(model_type: str, path: Path) -> Path:
    """The sweep's tiny config of ``model_type`` saved in ``path`` (skipped when the installed
    transformers lacks the type)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    if model_type not in CONFIG_MAPPING_NAMES:
        pytest.skip(f"the installed transformers has no {model_type}")
    import generic_sweep
    from sweep_shrink import tiny_config
    config = tiny_config(model_type)
    config.architectures = [generic_sweep.causal_lm_types()[model_type]]
    config.save_pretrained(path)
    return path


@pytest.mark.parametrize("model_type", TYPES)
def test_recorded_fusions_are_vllms(model_type: str, tmp_path: Path) -> None:
    import fuser_truth
    from pploader.families.hf_fusers import FUSIONS
    classes = fuser_truth.decide(str(_tiny_config_dir(model_type, tmp_path)), 2,
                                 classes_only=True)
    checked = 0
    for cls, entry in classes.items():
        if not entry["linears"] and cls not in FUSIONS:
            continue  # a norm or a module of one linear: nothing to merge
        assert cls in FUSIONS, (cls, entry)
        assert {n: ROLES[k] for n, k in entry["linears"].items()} == FUSIONS[cls], cls
        checked += 1
    assert checked


@pytest.mark.parametrize("model_type", TYPES)
def test_layers_vllm_cannot_build_are_pploaders(model_type: str, tmp_path: Path) -> None:
    # vLLM refuses a model one of whose decoder layers has no module calling transformers'
    # attention interface (DiffLlama, MiniMax's lightning layers); pploader's reading of the
    # forward sources (hf_fusers.unbuilt_layers) must find the same layers
    import torch
    from torch import nn
    from transformers import AutoConfig, AutoModel
    import fuser_truth
    from pploader.families.hf_fusers import unbuilt_layers
    vllm = fuser_truth.decide(str(_tiny_config_dir(model_type, tmp_path)), 2)[fuser_truth.UNBUILT]
    config = AutoConfig.from_pretrained(tmp_path)
    with torch.device("meta"):
        model = AutoModel.from_config(config)
    num = config.get_text_config().num_hidden_layers
    layers = next(m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == num)
    assert str([i for i, _ in unbuilt_layers(layers, num)]) == vllm
