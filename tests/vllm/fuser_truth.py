"""vLLM's own decision, per linear, when its transformers backend builds a checkpoint's model
(ground truth for pploader/families/hf_fusers.py; run in the vLLM venv, no engine started):
builds transformers' base model on ``meta`` as the backend does, detects fusions with vLLM's
``Fusers`` (its fx trace, source rewrite and per-instance validation, at the TP size asked),
then walks the modules as ``recursive_replace`` does and prints, as JSON, how each linear of the
base model becomes a vLLM layer: ``qkv:q`` / ``qkv:k`` / ``qkv:v`` (``QKVParallelLinear``),
``packed_qkv``, ``merged`` (``MergedColumnParallelLinear``), ``mla_whole`` (MLA's
``disable_tp`` merged down projection or replicated ``kv_a_proj``), else the style
``replace_linear_class`` gets (``colwise`` / ``rowwise`` / ``replicate`` / ...), keyed by the
module's name below the base model; ``vocab`` for vocabulary embeddings.

    ~/.cache/pploader/vllm-venv/bin/python tests/vllm/fuser_truth.py CHECKPOINT_DIR [TP] [--classes]

The checkpoint's transformers version must be importable there (a newer model type than the
venv's transformers: put that transformers first on ``PYTHONPATH``).
"""
from __future__ import annotations

import json
import re
import sys
from typing import Any


#: the fusers that merge or re-style linears (RMSNorm / attention fusers change no split)
#: the key of the layers vLLM refuses to build (no attention-interface call), as a list's str
UNBUILT = "<layers vLLM cannot build: no attention-interface call>"
_STACKING = {"QKVFuser", "PackedQKVFuser", "MLAFuser", "GLUFuser", "MergedColumnParallelFuser"}


def decide(path: str, tp: int, classes_only: bool = False) -> dict[str, Any]:
    """Per linear (below the base model), or with ``classes_only`` per module class with two
    linears or more (``{"fusers": [...], "linears": {name: kind}}``), vLLM's decision."""
    import torch
    from torch import nn
    from transformers import AutoModel
    from vllm.config import ModelConfig
    from vllm.model_executor.models.transformers.fuser import Fusers
    from vllm.model_executor.models.transformers.fusers import (
        GLUFuser, MergedColumnParallelFuser, MLAFuser, PackedQKVFuser, QKVFuser)

    mc = ModelConfig(model=path, skip_tokenizer_init=True, model_impl="transformers")
    config = mc.hf_config

    class _Parallel:
        tensor_parallel_size = tp

    class _Config:
        model_config = mc
        parallel_config = _Parallel()
        quant_config = None

    with torch.device("meta"):
        model = AutoModel.from_config(config, dtype=torch.float32)
    fusers = Fusers(model, _Config())  # type: ignore[arg-type]
    plan = {"model." + k: v for k, v in (model.tp_plan or {}).items()}

    def sizes(cfg: Any) -> set[int]:
        out: set[int] = set()
        for k, v in vars(cfg).items():
            if hasattr(v, "to_dict") and hasattr(v, "model_type"):
                out |= sizes(v)
            elif "vocab_size" in k and isinstance(v, int):
                out.add(v)
        return out

    vocab_sizes = sizes(config)
    vocab = {m for m in model.get_input_embeddings().modules() if isinstance(m, nn.Embedding)}
    vocab |= {m for m in model.modules()
              if isinstance(m, nn.Embedding) and m.num_embeddings in vocab_sizes}
    out: dict[str, str] = {}
    classes: dict[str, Any] = {}

    def fused(module: nn.Module, prefix: str) -> dict[str, str]:
        done: dict[str, str] = {}
        for f in fusers[module]:
            if isinstance(f, QKVFuser):
                done.update({f.q_name: "qkv:q", f.k_name: "qkv:k", f.v_name: "qkv:v"})
                if f.o_name:
                    done[f.o_name] = "rowwise"
            elif isinstance(f, PackedQKVFuser):
                done[f.qkv_name] = "packed_qkv"
                if f.o_name:
                    done[f.o_name] = "rowwise"
            elif isinstance(f, MLAFuser):
                if f.q_a_proj_name is not None:
                    done[f.q_a_proj_name] = done[f.kv_a_proj_name] = "mla_whole"
                    done[f.q_b_proj_name] = "colwise"  # type: ignore[index]
                else:
                    done[f.kv_a_proj_name] = "replicate"
                    done[f.q_proj_name] = "colwise"  # type: ignore[index]
                done[f.kv_b_proj_name] = "colwise"
                if f.o_proj_name:
                    done[f.o_proj_name] = "rowwise"
            elif isinstance(f, MergedColumnParallelFuser):  # GLU too
                done.update({n: "merged" for n in f.linear_names})
                if isinstance(f, GLUFuser) and f.down_name:
                    done[f.down_name] = "rowwise"
        return done

    for module in model.modules():  # the fusion of each class with sibling linears
        linears = [n for n, c in module.named_children() if isinstance(c, nn.Linear)]
        if len(linears) >= 2 or fusers[module]:
            got = fused(module, "")
            kinds = sorted(type(f).__name__ for f in fusers[module])
            entry = {"fusers": [k for k in kinds if k in _STACKING],
                     "linears": {n: got[n] for n in linears if n in got}}
            classes.setdefault(type(module).__name__, entry)

    def walk(module: nn.Module, prefix: str, skip: dict[str, str]) -> None:
        for name, child in module.named_children():
            qual = f"{prefix}.{name}"
            rel = qual[len("model."):]
            if name in skip:
                out[rel] = skip[name]
            elif isinstance(child, nn.Linear):
                pattern = next((p for p in plan if re.match(p, qual)), None)
                style = plan.get(pattern, "replicate") if pattern else "replicate"
                out[rel] = style if isinstance(style, str) else repr(style)
            elif isinstance(child, (nn.Conv2d, nn.Conv3d, nn.LayerNorm)):
                continue
            elif child in vocab:
                out[rel] = "vocab"
            elif fusers[child]:
                walk(child, qual, fused(child, qual))
            elif type(child).__name__ != "MoERunner":
                walk(child, qual, {})

    walk(model, "model", {})
    # vLLM builds its attention per layer from the modules that call transformers' attention
    # interface (AttentionFuser); a layer with none makes it refuse the model, at any TP
    from vllm.model_executor.models.transformers.fuser import get_fusers
    from vllm.model_executor.models.transformers.fusers import AttentionFuser
    served = {m.layer_idx for m in model.modules()
              if isinstance(getattr(m, "layer_idx", None), int)
              and any(isinstance(f, AttentionFuser) for f in get_fusers(m))}
    text = config.get_text_config()
    missing = [i for i in range(text.num_hidden_layers) if i not in served]
    if classes_only:
        return classes
    out[UNBUILT] = str(missing)
    return out


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--classes"]
    print(json.dumps(decide(args[0], int(args[1]) if len(args) > 1 else 2,
                            "--classes" in sys.argv),
                     indent=1, sort_keys=True))
