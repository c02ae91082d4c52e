"""integrations/engine_core.py and engine_reload.py without an engine: the load every engine
format runs (vLLM's, SGLang's), driven here into the SGLang-shaped stage of
tests/engine_models.py (its ``load_weights`` skips other stages' layers without a word)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pploader import PlanError, Topology
from pploader.bind.module_state import find_module_state
from pploader.integrations.engine_core import (LAST, check_all_loaded, load_engine_stage,
                                               loader_options, plan_engine_stage)
from pploader.integrations.engine_reload import same_layout
from pploader.planning.partition import engine_layer_counts

from engine_models import SGLangStyleLlama, run_pipeline
from helpers import make_model, tiny_config

CFG = tiny_config()


def _stage(model_dir: Path, pp_rank: int, pp: int) -> SGLangStyleLlama:
    model = SGLangStyleLlama(CFG, pp_rank, pp)
    split = engine_layer_counts("sglang", CFG["num_hidden_layers"], pp)
    load_engine_stage(model, str(model_dir), Topology(pp, rank=pp_rank), split,
                      model.load_weights, engine="SGLang")
    return model


def test_load_engine_stage_reads_only_the_stage_into_the_engines_load_weights(
        tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """PP=3 over 8 layers (SGLang's split 2, 3, 3): every parameter of each stage written by
    the engine's own loader, each rank read exactly its stage, the pipeline's logits equal a
    single stage's bit for bit; the load state travels with the model."""
    monkeypatch.delenv("SGLANG_PP_LAYER_PARTITION", raising=False)
    ids = torch.arange(10)
    want = run_pipeline([_stage(tiny_llama, 0, 1)], ids)
    stages = [_stage(tiny_llama, r, 3) for r in range(3)]
    for stage in stages:
        assert stage.loaded == {n for n, _ in stage.named_parameters()}
        state = find_module_state(stage).engine_load  # type: ignore[union-attr]
        assert state.engine == "SGLang"
        window = state.staged.plan.window
        assert (window.start_layer, window.end_layer) == \
            (stage.model.start_layer, stage.model.end_layer)
        assert state.report["read_bytes"] == state.report["ideal_bytes"] \
            == state.staged.plan.ideal_bytes
    assert [find_module_state(s).engine_load.report["items"]  # type: ignore[union-attr]
            for s in stages] == [len(find_module_state(s).engine_load.staged.plan.items)
                                 for s in stages]
    assert LAST["load"]["pp_rank"] == 2
    assert torch.equal(run_pipeline(stages, ids), want)


def test_window_other_than_the_engines_is_an_error_naming_the_engine(tiny_llama: Path) -> None:
    model = SGLangStyleLlama(CFG, 0, 3)                     # SGLang built layers 0-1
    with pytest.raises(PlanError, match=r"SGLang's model holds layers \(0, 2\) but "
                                        r"get_pp_indices gives \(0, 3\)"):
        plan_engine_stage(str(tiny_llama), Topology(3, rank=0), (3, 3, 2), "placed", model,
                          engine="SGLang")


def test_a_parameter_the_engine_did_not_write_is_an_error(tiny_llama: Path) -> None:
    """A loader that drops one tensor (an engine whose names differ): the strict check names
    the parameter left unwritten; ``ignore`` exempts parameters the engine fills itself."""
    model = SGLangStyleLlama(CFG, 0, 2)
    split = engine_layer_counts("sglang", CFG["num_hidden_layers"], 2)

    def lossy(weights):  # type: ignore[no-untyped-def]
        return model.load_weights((n, t) for n, t in weights if "layers.1.mlp.down" not in n)
    with pytest.raises(PlanError, match=r"1 parameter\(s\) .*model.layers.1.mlp.down_proj"):
        load_engine_stage(model, str(tiny_llama), Topology(2, rank=0), split, lossy)
    staged = plan_engine_stage(str(tiny_llama), Topology(2, rank=0), split, "placed")
    names = {n for n, _ in model.named_parameters()}
    assert check_all_loaded(model, names, staged) == ()
    with pytest.raises(PlanError, match="returned no set"):
        check_all_loaded(model, None, staged)
    assert check_all_loaded(model, names - {"model.layers.0.mlp.down_proj.weight"}, staged,
                            ignore=lambda n: n.endswith("down_proj.weight")) == ()


def test_loader_options_refuse_unknown_keys_and_values() -> None:
    assert loader_options({}) == ("placed", 0, "mapped")
    assert loader_options({"tp_mode": "full", "io_backend": "threaded"})[::2] == \
        ("full", "threaded")
    with pytest.raises(ValueError, match="unknown pploader model_loader_extra_config keys"):
        loader_options({"tp_mod": "full"})
    with pytest.raises(ValueError, match="tp_mode must be one of"):
        loader_options({"tp_mode": "halves"})


def test_reload_layout_check_names_the_changed_tensor(tiny_llama: Path, tmp_path: Path) -> None:
    """A new checkpoint whose stage tensors differ in shape from the served ones is refused
    with the tensor named (engine_reload.same_layout, run before anything is written)."""
    split = engine_layer_counts("sglang", CFG["num_hidden_layers"], 2)
    served = plan_engine_stage(str(tiny_llama), Topology(2, rank=1), split, "placed")
    other = make_model(tmp_path / "wide", dict(CFG, intermediate_size=CFG["intermediate_size"]
                                               * 2))
    new = plan_engine_stage(str(other), Topology(2, rank=1), split, "placed")
    with pytest.raises(PlanError, match="differ from the served ones") as err:
        same_layout(served, new, 1)
    assert err.value.tensor is not None and "mlp" in err.value.tensor
    same_layout(served, plan_engine_stage(str(tiny_llama), Topology(2, rank=1), split,
                                          "placed"), 1)


class _Draft(torch.nn.Module):
    """An engine's NextN draft model, SGLang-shaped: a parameter per checkpoint tensor of
    its MTP layer, the embedding and head it takes from the target later; ``load_weights``
    keeps only names of that layer (as SGLang's does) and returns what it wrote."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], prefix: str) -> None:
        super().__init__()
        self.names = {n: f"p{i}" for i, n in enumerate(sorted(shapes))}
        self.prefix = prefix
        for name, attr in self.names.items():
            self.register_parameter(attr, torch.nn.Parameter(
                torch.zeros(shapes[name], dtype=torch.bfloat16), requires_grad=False))
        self.shared = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
        self.seen: list[str] = []

    def load_weights(self, weights: object) -> set[str]:
        written = set()
        for name, tensor in weights:  # type: ignore[attr-defined]
            self.seen.append(name)
            if name.startswith(self.prefix) and name in self.names:
                getattr(self, self.names[name]).data.copy_(tensor)
                written.add(self.names[name])
        return written


def test_a_draft_worker_reads_only_its_mtp_layer_less_what_it_shares(tmp_path: Path) -> None:
    """tiny-deepseek_v3 (4 layers + MTP layers 4 and 5): the draft of MTP layer k is handed
    exactly layer 4+k's tensors under their checkpoint names, less the embedding and head it
    shares from the target, with the bytes read equal to theirs; the other MTP layer, the
    decoder layers and the shared copies are never read; a draft parameter left unwritten is
    an error naming the draft."""
    from pploader.families.generic_mtp import TARGET_SHARED
    from pploader.integrations.engine_core import load_engine_draft
    from pploader.planning.spec import load_spec

    from helpers import CONFIGS, reference_tensors
    import json
    raw = json.loads((CONFIGS / "tiny-deepseek_v3.json").read_text())
    raw.pop("pploader_tiny")
    model_dir = make_model(tmp_path / "ds", raw, shard_bytes=150_000)
    ref = reference_tensors(model_dir)
    layers = load_spec(model_dir).num_layers
    seen: list[set[str]] = []
    for k in range(2):
        prefix = f"model.layers.{layers + k}."
        mine = {n: tuple(t.shape) for n, t in ref.items() if n.startswith(prefix)
                and not n.endswith(("embed_tokens.weight", "shared_head.head.weight"))}
        draft = _Draft(mine, prefix)
        report = load_engine_draft(draft, str(model_dir), k, draft.load_weights,
                                   shared=TARGET_SHARED, engine="SGLang",
                                   ignore=lambda name: name == "shared")
        assert set(draft.seen) == set(mine) == set(report["tensors"])
        assert report["read_bytes"] == report["ideal_bytes"] == sum(
            ref[n].numel() * ref[n].element_size() for n in mine)
        assert LAST["draft"] is report and report["layer"] == layers + k
        for name, attr in draft.names.items():
            assert torch.equal(getattr(draft, attr), ref[name]), name
        seen.append(set(mine))
    assert not seen[0] & seen[1]
    draft = _Draft(dict(mine, **{f"{prefix}extra.weight": (2,)}), prefix)
    with pytest.raises(PlanError, match="SGLang's draft model .MTP layer 1.*not loaded"):
        load_engine_draft(draft, str(model_dir), 1, draft.load_weights, shared=TARGET_SHARED,
                          engine="SGLang", ignore=lambda name: name == "shared")
