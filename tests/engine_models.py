"""Engine-shaped stage modules for tests/integrations/test_engines.py and docs/integration.md.

``SGLangStyleLlama`` is built the way SGLang builds a llama for one pipeline stage (its
``LlamaForCausalLM``: ``model.start_layer / end_layer`` from SGLang's split, a placeholder
wherever another stage owns a layer or the embedding / norm, parameters carrying a
``weight_loader``, a ``load_weights`` that stacks q/k/v and gate/up by shard id and *skips
every layer outside its window without a word*). SGLang itself has no CPU wheel, so this
stands in for it. ``HandStage`` is an engine with its own naming (``blocks.{i}.attn.qkv.w``).
Both compute a small llama-shaped forward (no rotary embedding) so that pipelines can be
compared with a single-stage run.
"""
from __future__ import annotations

import os
from typing import Callable, Iterable, Mapping, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

import pploader
from pploader import MissingLayer, make_stage_layers


def _param(*shape: int, loader: Optional[Callable] = None) -> nn.Parameter:
    p = nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16), requires_grad=False)
    p.weight_loader = loader or default_weight_loader  # type: ignore[attr-defined]
    return p


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape {list(loaded.shape)} into {list(param.shape)}")
    param.data.copy_(loaded)


def _rows_loader(sizes: Mapping[Union[str, int], tuple[int, int]]) -> Callable:
    """A fused parameter's loader: shard ``id`` goes to rows ``[start, start + n)``."""
    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Union[str, int]) -> None:
        start, n = sizes[shard_id]
        if loaded.shape[0] != n:
            raise ValueError(f"shard {shard_id}: {loaded.shape[0]} rows, expected {n}")
        param.data[start:start + n].copy_(loaded)
    return load


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()


def _attend(x: torch.Tensor, qkv: torch.Tensor, out: torch.Tensor, nh: int, nkv: int,
            d: int) -> torch.Tensor:
    t = x.shape[0]
    q, k, v = (x @ qkv.float().t()).split([nh * d, nkv * d, nkv * d], -1)
    q = q.view(t, nh, d).transpose(0, 1)
    k = k.view(t, nkv, d).transpose(0, 1).repeat_interleave(nh // nkv, 0)
    v = v.view(t, nkv, d).transpose(0, 1).repeat_interleave(nh // nkv, 0)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return o.transpose(0, 1).reshape(t, -1) @ out.float().t()


# ---- SGLang-shaped ---------------------------------------------------------------------

class _Holder(nn.Module):
    """A module holding one parameter named ``weight`` (SGLang's linear / norm layers)."""

    def __init__(self, *shape: int, loader: Optional[Callable] = None) -> None:
        super().__init__()
        self.weight = _param(*shape, loader=loader)


class SGLangDecoderLayer(nn.Module):
    def __init__(self, cfg: Mapping) -> None:
        super().__init__()
        h, d, inter = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
        self.nh, self.nkv, self.d = cfg["num_attention_heads"], cfg["num_key_value_heads"], d
        q, kv = self.nh * d, self.nkv * d
        self.input_layernorm = _Holder(h)
        self.self_attn = nn.Module()
        self.self_attn.qkv_proj = _Holder(q + 2 * kv, h, loader=_rows_loader(
            {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}))
        self.self_attn.o_proj = _Holder(h, q)
        self.post_attention_layernorm = _Holder(h)
        self.mlp = nn.Module()
        self.mlp.gate_up_proj = _Holder(2 * inter, h, loader=_rows_loader(
            {0: (0, inter), 1: (inter, inter)}))
        self.mlp.down_proj = _Holder(h, inter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.self_attn
        x = x + _attend(_rms(x, self.input_layernorm.weight), a.qkv_proj.weight,
                        a.o_proj.weight, self.nh, self.nkv, self.d)
        g, u = (_rms(x, self.post_attention_layernorm.weight)
                @ self.mlp.gate_up_proj.weight.float().t()).chunk(2, -1)
        return x + (F.silu(g) * u) @ self.mlp.down_proj.weight.float().t()


class SGLangLlamaModel(nn.Module):
    def __init__(self, cfg: Mapping, pp_rank: int, pp_size: int) -> None:
        super().__init__()
        n = cfg["num_hidden_layers"]
        first, last = pp_rank == 0, pp_rank == pp_size - 1
        self.embed_tokens = _Holder(cfg["vocab_size"], cfg["hidden_size"]) if first \
            else MissingLayer(passthrough=True)
        # SGLang: make_layers(..., pp_rank, pp_size) -> (layers, start_layer, end_layer), its
        # get_pp_indices reading SGLANG_PP_LAYER_PARTITION itself
        self.start_layer, self.end_layer = pploader.get_pp_indices(
            n, pp_rank, pp_size, style="sglang",
            partition=os.environ.get("SGLANG_PP_LAYER_PARTITION"))
        self.layers = make_stage_layers(n, (self.start_layer, self.end_layer),
                                        lambda i: SGLangDecoderLayer(cfg))
        self.norm = _Holder(cfg["hidden_size"]) if last else MissingLayer(passthrough=True)


class SGLangStyleLlama(nn.Module):
    """One pipeline stage, shaped like SGLang's ``LlamaForCausalLM``."""

    stacked_params_mapping = [  # (param name, shard name, shard id), as SGLang lists them
        (".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"), (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1)]

    def __init__(self, cfg: Mapping, pp_rank: int = 0, pp_size: int = 1) -> None:
        super().__init__()
        self.first, self.last = pp_rank == 0, pp_rank == pp_size - 1
        self.model = SGLangLlamaModel(cfg, pp_rank, pp_size)
        if self.last:
            self.lm_head = _Holder(cfg["vocab_size"], cfg["hidden_size"])
        self.loaded: set[str] = set()  # parameter names load_weights wrote (for the tests)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """SGLang's loop: skip other stages' layers, stack by shard id, else load by name."""
        params = dict(self.named_parameters())
        loaded = self.loaded
        for name, tensor in weights:
            parts = name.split(".")
            layer = int(parts[2]) if name.startswith("model.layers.") else None
            if layer is not None and not self.model.start_layer <= layer < self.model.end_layer:
                continue  # what SGLang does with another stage's layer: nothing, silently
            for param_name, shard_name, shard_id in self.stacked_params_mapping:
                if shard_name in name:
                    fused = name.replace(shard_name, param_name)
                    params[fused].weight_loader(params[fused], tensor, shard_id)
                    loaded.add(fused)
                    break
            else:
                if name in params:
                    params[name].weight_loader(params[name], tensor)
                    loaded.add(name)
        return loaded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids on the first stage, hidden states after; logits from the last."""
        if self.first:
            x = self.model.embed_tokens.weight.float()[x]
        for i in range(self.model.start_layer, self.model.end_layer):
            x = self.model.layers[i](x)
        if not self.last:
            return x
        return _rms(x, self.model.norm.weight) @ self.lm_head.weight.float().t()


# ---- an engine with its own names ------------------------------------------------------

class _W(nn.Module):
    """One tensor, named ``w`` (this engine's convention)."""

    def __init__(self, *shape: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(shape, dtype=torch.bfloat16, device="meta"),
                              requires_grad=False)


class Block(nn.Module):
    def __init__(self, cfg: Mapping) -> None:
        super().__init__()
        h, d, inter = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
        self.nh, self.nkv, self.d = cfg["num_attention_heads"], cfg["num_key_value_heads"], d
        self.ln1, self.ln2 = _W(h), _W(h)
        self.attn = nn.Module()
        self.attn.qkv = _W((self.nh + 2 * self.nkv) * d, h)   # fused q, k, v
        self.attn.out = _W(h, self.nh * d)
        self.ffn = nn.Module()
        self.ffn.gate_up = _W(2 * inter, h)                    # fused gate, up
        self.ffn.down = _W(h, inter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + _attend(_rms(x, self.ln1.w), self.attn.qkv.w, self.attn.out.w, self.nh,
                        self.nkv, self.d)
        g, u = (_rms(x, self.ln2.w) @ self.ffn.gate_up.w.float().t()).chunk(2, -1)
        return x + (F.silu(g) * u) @ self.ffn.down.w.float().t()


class HandStage(nn.Module):
    """A hand-written engine's stage: full-length ``blocks`` with placeholders, own names."""

    def __init__(self, cfg: Mapping, window: pploader.StageWindow) -> None:
        super().__init__()
        self.window = window
        h, vocab = cfg["hidden_size"], cfg["vocab_size"]
        self.tok = _W(vocab, h) if window.has_embed else MissingLayer(passthrough=True)
        self.blocks = make_stage_layers(cfg["num_hidden_layers"], window, lambda i: Block(cfg))
        if window.has_head:
            self.final_norm, self.head = _W(h), _W(vocab, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.window.has_embed:
            x = self.tok.w.float()[x]
        for i in range(self.window.start_layer, self.window.end_layer):
            x = self.blocks[i](x)
        if not self.window.has_head:
            return x
        return _rms(x, self.final_norm.w) @ self.head.w.float().t()


#: Checkpoint (HF llama) names -> HandStage names.
HAND_NAMES = pploader.NameMap.of(
    substr={"self_attn.qkv_proj": "attn.qkv", "self_attn.o_proj": "attn.out",
            "input_layernorm": "ln1", "post_attention_layernorm": "ln2",
            "mlp.gate_up_proj": "ffn.gate_up", "mlp.down_proj": "ffn.down"},
    prefix={"model.layers.": "blocks.", "model.embed_tokens.": "tok.",
            "model.norm.": "final_norm.", "lm_head.": "head."},
    suffix={".weight": ".w"})


def run_pipeline(stages: list[nn.Module], ids: torch.Tensor) -> torch.Tensor:
    """The stages' forwards one after another (what the engine's PP send/recv does)."""
    x = ids
    with torch.no_grad():
        for stage in stages:
            x = stage(x)
    return x
