"""Vision-language checkpoints through the generic family (no hand-written pploader code):
tiny LLaVA (CLIP tower), Gemma-3 (SigLIP tower, head tied by default) and Mistral-3 (Pixtral
tower, untied ``language_model.lm_head.weight``), written in every naming the Hub has
(tests/vl_models.py: transformers 5's default, its module names, and the older
``vision_tower.vision_model.*``), planned at PP = 2..4 (and PP=2 x TP=2) and checked by
``vl_models.exactness_check``: transformers' own ``from_pretrained`` of the checkpoint says what
each stored tensor is (by its bytes), the module tree says what each stage runs.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import vl_models

pytest.importorskip("transformers")

CASES = [(m, n) for m in vl_models.MODELS for n in ("original", "transformers", "legacy")
         if n != "legacy" or m in vl_models.LEGACY]


@pytest.fixture(scope="module")
def quiet() -> None:
    import transformers
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, quiet: None) -> dict:
    root = tmp_path_factory.mktemp("vl")
    out = {}
    for model_name in vl_models.MODELS:
        model = vl_models.build(model_name)
        for m, naming in CASES:
            if m == model_name:
                out[m, naming] = vl_models.write(model, root / f"{m}-{naming}", naming)
    return out


@pytest.mark.parametrize("model_name,naming", CASES)
def test_vl_plans_exact_at_pp_2_to_4(checkpoints: dict, model_name: str, naming: str) -> None:
    from pploader.planning.checkpoint import open_checkpoint
    from pploader.planning.spec import load_spec
    path = checkpoints[model_name, naming]
    spec = load_spec(path).for_checkpoint(open_checkpoint(path).weight_map)
    assert spec.family.name == f"generic:{model_name}"
    assert spec.family.format == {"legacy": "prefixed"}.get(naming, naming)
    names = set(open_checkpoint(path).weight_map)
    if naming == "legacy":
        assert any(n.startswith("vision_tower.vision_model.") for n in names)
    if model_name == "mistral3":  # untied: the head stored under the language model
        assert ("language_model.lm_head.weight" if naming != "transformers" else
                "lm_head.weight") in names
    if model_name == "gemma3":  # tied by the config class's default: no head stored
        assert spec.tie_word_embeddings and not any("lm_head" in n for n in names)
    for pp in (2, 3, 4):
        plans = vl_models.exactness_check(path, pp)
        towers = [{i.name for i in p.items if "vision_tower" in i.name or "projector" in i.name}
                  for p in plans]
        assert towers[0] and not any(towers[1:])  # the encoders on the first stage only


@pytest.mark.parametrize("model_name,naming", [("llava", "legacy"), ("mistral3", "original"),
                                               ("gemma3", "transformers")])
def test_vl_tp2_replicates_encoders_and_splits_the_language_model(
        checkpoints: dict, model_name: str, naming: str) -> None:
    """PP=2 x TP=2: the vision tower and projector are read whole by both TP ranks (engines run
    them data-parallel); the language model's attention and MLP are split as for text models."""
    from pploader.planning.checkpoint import open_checkpoint
    path = checkpoints[model_name, naming]
    index = open_checkpoint(path)
    plans = vl_models.exactness_check(path, 2, 2)
    first = [p for p in plans if p.topology.pp_rank == 0]
    assert len(first) == 2
    sizes: dict[str, list[int]] = {}
    for plan in first:
        for item in plan.items:
            sizes.setdefault(item.name, []).append(item.nbytes)
    encoders = [n for n in sizes if "vision_tower" in n or "multi_modal_projector" in n]
    assert encoders and all(sizes[n] == [index.entry(n).nbytes] * 2 for n in encoders)
    q = next(n for n in sizes if n.endswith("layers.0.self_attn.q_proj.weight")
             and "language_model" in n)
    assert sizes[q] == [index.entry(q).nbytes // 2] * 2


def test_the_check_catches_a_misplaced_tower(checkpoints: dict,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Not vacuous: plans whose vision tower moved from the first stage to the last fail it."""
    from dataclasses import replace
    import pploader.planning.plan as plan_mod
    real = plan_mod.plan_all

    def moved(*args: object, **kwargs: object) -> list:
        plans = real(*args, **kwargs)  # type: ignore[arg-type]
        tower = [i for i in plans[0].items if "vision_tower" in i.name]
        return [replace(plans[0], items=tuple(i for i in plans[0].items if i not in tower)),
                *plans[1:-1], replace(plans[-1], items=tuple(plans[-1].items) + tuple(tower))]
    monkeypatch.setattr(plan_mod, "plan_all", moved)
    with pytest.raises(AssertionError, match="stage 0 .*needs but does not read.*vision_tower"):
        vl_models.exactness_check(checkpoints["llava", "legacy"], 2)


def test_legacy_naming_is_what_transformers_loads(checkpoints: dict) -> None:
    """The rewritten legacy checkpoint is a real one: transformers loads it with no missing or
    unexpected key into the same weights as the original naming."""
    import transformers
    cls = transformers.LlavaForConditionalGeneration
    legacy = cls.from_pretrained(checkpoints["llava", "legacy"], dtype=torch.float32)
    original = cls.from_pretrained(checkpoints["llava", "original"], dtype=torch.float32)
    a, b = legacy.state_dict(), original.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_mixed_naming_is_refused(checkpoints: dict, tmp_path: Path) -> None:
    """Half legacy, half current tower names: unknown tensors, refused naming one."""
    from pploader import PlanError
    from pploader.planning.checkpoint import open_checkpoint
    from pploader.planning.plan import plan_all
    from pploader.planning.spec import load_spec
    src = checkpoints["llava", "original"]
    vl_models._rename(src, tmp_path / "mixed", lambda n: n.replace(
        "vision_tower.embeddings.", "vision_tower.vision_model.embeddings."))
    with pytest.raises(PlanError, match=r"vision_tower\.") as err:
        plan_all(load_spec(tmp_path / "mixed"), open_checkpoint(tmp_path / "mixed"), 2)
    assert err.value.tensor is not None
