"""Tiny vision-language checkpoints with no hand-written pploader family, in every naming the
Hub has, and an exactness check that does not use pploader's naming logic (test utility).

Namings (``write``):

- ``original``: ``save_pretrained`` of transformers 5 (``language_model.model.layers.*``,
  ``language_model.lm_head.weight``, ``vision_tower.*``, ``multi_modal_projector.*``);
- ``transformers``: ``save_pretrained(save_original_format=False)``, the module tree's own
  names (``model.language_model.*``, ``model.vision_tower.*``, top-level ``lm_head.weight``);
- ``legacy``: the original with the CLIP / SigLIP tower under ``vision_tower.vision_model.*``,
  as checkpoints written before transformers 5 store it (llava-hf/llava-1.5-7b-hf,
  google/gemma-3-27b-it); the names are rewritten here by string, not by transformers.

``exactness_check`` asks transformers, not pploader, what each stored tensor is: the
checkpoint is loaded by ``from_pretrained`` (no missing or unexpected key), every parameter
was randomised before saving, so each stored tensor is matched to the module parameters
holding its exact bytes (tied parameters share one storage: one group). Per stage, the groups
the stage needs (from the module tree: the towers, projector and embedding on the first
stage, its window's decoder layers, the final norm and head on the last) must equal the
groups of the tensors its plan reads.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=160, max_position_embeddings=128)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              image_size=32, patch_size=8)

#: name -> (config class, model class, config kwargs); none has a hand-written family
MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llava": ("LlavaConfig", "LlavaForConditionalGeneration", dict(
        text_config=dict(TEXT, model_type="llama"), image_token_index=150,
        vision_config=dict(VISION, model_type="clip_vision_model", projection_dim=32))),
    "gemma3": ("Gemma3Config", "Gemma3ForConditionalGeneration", dict(  # head tied by default
        text_config=dict(TEXT, model_type="gemma3_text", sliding_window=16,
                         layer_types=["sliding_attention", "full_attention"] * 2),
        vision_config=dict(VISION, model_type="siglip_vision_model", vision_use_head=False),
        mm_tokens_per_image=4, image_token_index=150, boi_token_index=151,
        eoi_token_index=152)),
    "mistral3": ("Mistral3Config", "Mistral3ForConditionalGeneration", dict(
        text_config=dict(TEXT, model_type="mistral", tie_word_embeddings=False),
        image_token_index=150, tie_word_embeddings=False,  # a stored head, as Mistral-Small 3.1
        vision_config=dict(VISION, model_type="pixtral", head_dim=8))),
}
#: towers whose checkpoints exist with the ``vision_model.`` prefix (CLIP, SigLIP)
LEGACY = ("llava", "gemma3")


def build(name: str) -> torch.nn.Module:
    """The tiny model, every parameter random (no two tensors alike), fp32, eval."""
    import transformers
    cfg_cls, model_cls, kwargs = MODELS[name]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**kwargs)).float()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():  # norms start as ones: make each tensor unique
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    model.config.architectures = [model_cls]
    return model.eval()


def write(model: torch.nn.Module, out: Path, naming: str) -> Path:
    """``model`` saved in ``naming`` (see the module docstring) under ``out``."""
    if naming == "legacy":
        tmp = out.with_name(out.name + "-original")
        model.save_pretrained(tmp, max_shard_size="40KB")
        _rename(tmp, out, lambda n: "vision_tower.vision_model." + n[len("vision_tower."):]
                if n.startswith("vision_tower.") else n)
        shutil.rmtree(tmp)
        return out
    model.save_pretrained(out, max_shard_size="40KB",
                          **({"save_original_format": False} if naming == "transformers" else {}))
    return out


def _rename(src: Path, out: Path, rename: Any) -> None:
    """Copy a sharded checkpoint renaming every tensor (shards and index alike)."""
    from safetensors.torch import load_file, save_file
    out.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for shard in sorted(src.glob("*.safetensors")):
        tensors = {rename(k): v for k, v in load_file(str(shard)).items()}
        save_file(tensors, str(out / shard.name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard.name))
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"] = dict(sorted(weight_map.items()))
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    shutil.copy(src / "config.json", out / "config.json")


def _groups(model: torch.nn.Module) -> tuple[dict[str, int], dict[bytes, int]]:
    """Module key -> group (one per storage: tied parameters share one) and the bytes of
    each group's tensor -> group."""
    key_group: dict[str, int] = {}
    by_bytes: dict[bytes, int] = {}
    storages: dict[int, int] = {}
    for key, t in model.state_dict(keep_vars=False).items():
        group = storages.setdefault(t.untyped_storage().data_ptr(), len(storages))
        key_group[key] = group
        by_bytes.setdefault(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes(), group)
    return key_group, by_bytes


def stage_needs(model: torch.nn.Module, start: int, end: int, first: bool, last: bool
                ) -> set[str]:
    """The module keys a stage runs, from the module tree of a ``*ForConditionalGeneration``
    (``model.language_model`` = the language model, the rest of ``model`` = towers and
    projector): first stage towers + projector + embedding, then the window's layers, last
    stage the final norm and ``lm_head``."""
    need = set()
    for key in model.state_dict():
        if key.startswith("lm_head."):
            ok = last
        elif not key.startswith("model.language_model."):
            ok = first  # vision tower, projector
        else:
            rest = key[len("model.language_model."):]
            if rest.startswith("embed_tokens."):
                ok = first
            elif rest.startswith("norm."):
                ok = last
            elif rest.startswith("layers."):
                ok = start <= int(rest.split(".")[1]) < end
            else:
                raise AssertionError(f"unexpected language-model key {key}")
        if ok:
            need.add(key)
    return need


def exactness_check(model_dir: Path, pp: int, tp: int = 1) -> list[Any]:
    """PP=``pp`` (x TP=``tp``) plans of ``model_dir``, checked against transformers' own
    load of it (see the module docstring); returns the plans."""
    import transformers

    from helpers import reference_tensors
    from pploader.planning.checkpoint import open_checkpoint
    from pploader.planning.plan import plan_all
    from pploader.planning.spec import load_spec
    arch = json.loads((model_dir / "config.json").read_text())["architectures"][0]
    ref, info = getattr(transformers, arch).from_pretrained(
        model_dir, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    key_group, by_bytes = _groups(ref)
    stored = reference_tensors(model_dir)
    group_of = {}
    for name, t in stored.items():
        raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        assert raw in by_bytes, f"{name}: stored bytes are no parameter of the loaded model"
        group_of[name] = by_bytes[raw]
    assert set(group_of.values()) == set(key_group.values())  # every parameter stored
    plans = plan_all(load_spec(model_dir), open_checkpoint(model_dir), pp, tp, 1)
    layers = ref.config.get_text_config().num_hidden_layers
    windows = sorted({(p.window.start_layer, p.window.end_layer) for p in plans})
    assert windows[0][0] == 0 and windows[-1][1] == layers and len(windows) == pp
    assert all(a[1] == b[0] for a, b in zip(windows, windows[1:])), windows
    for plan in plans:
        w = plan.window
        need = {key_group[k] for k in stage_needs(ref, w.start_layer, w.end_layer,
                                                  w.pp_rank == 0, w.pp_rank == pp - 1)}
        names = [i.name for i in plan.items]
        assert len(names) == len(set(names)), f"rank {plan.topology.rank} reads a tensor twice"
        got = {group_of[n] for n in names}
        if need != got:
            inv = {g: k for k, g in key_group.items()}
            raise AssertionError(
                f"PP={pp} stage {w.pp_rank} (layers {w.start_layer}-{w.end_layer - 1}): needs "
                f"but does not read {sorted(inv[g] for g in need - got)[:4]}, reads but does "
                f"not need {sorted(inv[g] for g in got - need)[:4]}")
    return plans
