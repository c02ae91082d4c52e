"""PP=2 forward of a vision-language model's text path through the generic family.

Tiny LLaVA / Gemma-3 / Mistral-3 checkpoints (tests/vl_models.py, no hand-written pploader
code; LLaVA in the older ``vision_tower.vision_model.*`` naming) are loaded stage by stage
by pploader (``build_stage``: each stage reads only its plan) and run with ``input_ids`` only,
stage 0's boundary handed to stage 1; the logits must equal those of transformers'
``from_pretrained`` of the whole model from the same directory.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import vl_models
from pploader.planning.topology import Topology

transformers = pytest.importorskip("transformers")

from pploader.integrations.hf import build_stage  # noqa: E402

CASES = [("llava", "legacy"), ("gemma3", "original"), ("mistral3", "original")]


@pytest.mark.parametrize("model_name,naming", CASES)
def test_pp2_text_path_equals_transformers(model_name: str, naming: str,
                                           tmp_path: Path) -> None:
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    path = vl_models.write(vl_models.build(model_name), tmp_path / model_name, naming)
    _, model_cls, _ = vl_models.MODELS[model_name]
    ids = torch.randint(0, 140, (2, 9), generator=torch.Generator().manual_seed(0))
    ref = getattr(transformers, model_cls).from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref(input_ids=ids, use_cache=False).logits
    stages = [build_stage(path, Topology(2, rank=r)) for r in range(2)]
    got = stages[1].forward(ids, stages[0].forward(ids))
    assert isinstance(got, torch.Tensor) and got.shape == want.shape
    diff = (got - want).abs().max().item()
    print(f"{model_name} ({naming}) PP=2 max abs diff {diff:.1e}")
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), diff
    # each stage holds only its part: the tower on stage 0, nothing of it on stage 1
    tower = [[p for n, p in s.model.named_parameters() if "vision_tower" in n] for s in stages]
    assert tower[0] and all(not p.is_meta for p in tower[0])
    assert all(p.is_meta or p.numel() == 0 for p in tower[1])
    assert stages[0].plan.tensors and not any("vision_tower" in t for t in stages[1].plan.tensors)
    assert not set(stages[0].plan.tensors) & set(stages[1].plan.tensors) - {
        t for t in stages[0].plan.tensors if t.endswith("embed_tokens.weight")}


def test_tied_config_with_a_stored_language_model_head(tmp_path: Path) -> None:
    """Gemma-3 ties its head by default; a checkpoint that nevertheless stores
    ``language_model.lm_head.weight`` (different from the embedding) is planned with that
    head read by the last stage, as transformers keeps it; PP=2 logits equal transformers'."""
    import json
    from safetensors.torch import save_file
    transformers.logging.set_verbosity_error()
    model = vl_models.build("gemma3")
    path = vl_models.write(model, tmp_path / "gemma3", "original")
    head = model.get_output_embeddings().weight.detach().clone() * -0.5
    save_file({"language_model.lm_head.weight": head.contiguous()},
              str(path / "head.safetensors"), metadata={"format": "pt"})
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["language_model.lm_head.weight"] = "head.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    ids = torch.randint(0, 140, (1, 7), generator=torch.Generator().manual_seed(2))
    ref = transformers.Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    assert torch.equal(ref.lm_head.weight, head)  # transformers reads the stored head
    with torch.no_grad():
        want = ref.eval()(input_ids=ids, use_cache=False).logits
    stages = [build_stage(path, Topology(2, rank=r)) for r in range(2)]
    last = {(i.name, i.target) for i in stages[1].plan.items}
    assert ("language_model.lm_head.weight", "language_model.lm_head.weight") in last
    assert not any("embed_tokens" in name for name, _ in last)
    got = stages[1].forward(ids, stages[0].forward(ids))
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got - want).abs().max().item()


def _gloo_rank(rank: int, world: int, path: str) -> dict:
    """One gloo rank: its stage of the VL model and the pipeline forward (text path)."""
    from pploader.distributed.comm import Comm
    from pploader.integrations.hf import pipeline_forward
    topo = Topology.for_world(world, rank)
    comm = Comm(topo, timeout_s=60)
    stage = build_stage(path, topo)
    ids = torch.randint(0, 140, (2, 9), generator=torch.Generator().manual_seed(0))
    logits = pipeline_forward(stage, ids, comm)
    comm.close()
    return {"logits": logits, "tensors": list(stage.plan.tensors)}


@pytest.mark.slow
def test_pp2_text_path_over_gloo(tmp_path: Path) -> None:
    """The same as above as two processes: stage 0 sends its boundary over gloo."""
    from helpers import reference_tensors, run_ranks
    transformers.logging.set_verbosity_error()
    path = vl_models.write(vl_models.build("llava"), tmp_path / "llava", "legacy")
    results = run_ranks(_gloo_rank, 2, str(path), timeout_s=120)
    ids = torch.randint(0, 140, (2, 9), generator=torch.Generator().manual_seed(0))
    ref = transformers.LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        want = ref.eval()(input_ids=ids, use_cache=False).logits
    assert results[0]["logits"] is None and torch.equal(results[1]["logits"], want)
    read = [t for r in results for t in r["tensors"]]
    assert sorted(read) == sorted(reference_tensors(path))  # each tensor by one stage
