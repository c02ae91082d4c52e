"""Small stage modules for binding / reload / layerwise tests (fused qkv + gate_up, stacked
experts, post-processes that alias, copy, delete or reshape their sources)."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator, Mapping, Optional

import pytest

import torch
import torch.nn.functional as F
from torch import nn

from pploader import StagePlan, Topology, bind_derived
from pploader.planning.checkpoint import open_checkpoint
from pploader.planning.plan import plan_rank
from pploader.families.base import Family, Layout, ShardRule
from pploader.families.common import (attention_rules, attention_tensors, globals_tensors,
                                      llama_globals, mlp_tensors, vocab_rules)
from pploader.families.fused import QKV, expert_fusions
from pploader.planning.partition import StageWindow, even_windows
from pploader.planning.spec import spec_from_config
from pploader.tiny import write_checkpoint


def _empty(*shape: int, dtype: torch.dtype, device: str) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def interleave(w: torch.Tensor) -> torch.Tensor:
    """[a0 a1 .. b0 b1 ..] -> [a0 b0 a1 b1 ..] (a re-layout a kernel might want)."""
    return w.view(2, -1).t().reshape(-1)


def deinterleave(w: torch.Tensor) -> torch.Tensor:
    return w.view(-1, 2).t().reshape(-1)


class Norm(nn.Module):
    """RMSNorm whose post-process derives an interleaved scale aliased onto its weight."""

    def __init__(self, h: int, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        self.weight = _empty(h, dtype=dtype, device=device)

    def process_weights_after_loading(self) -> None:
        bind_derived(self, "interleaved", "weight", interleave(self.weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = deinterleave(self.interleaved).float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * scale


class Attention(nn.Module):
    def __init__(self, cfg: Mapping, tp: int, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        h, d = cfg["hidden_size"], cfg["head_dim"]
        self.nh, self.nkv, self.d = cfg["num_attention_heads"] // tp, \
            max(1, cfg["num_key_value_heads"] // tp), d
        self.qkv_proj = Proj((self.nh + 2 * self.nkv) * d, h, dtype, device)
        self.o_proj = Proj(h, self.nh * d, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = (x @ self.qkv_proj.weight.float().t()).split(
            [self.nh * self.d, self.nkv * self.d, self.nkv * self.d], -1)
        q = q.view(t, self.nh, self.d).transpose(0, 1)
        k = k.view(t, self.nkv, self.d).transpose(0, 1).repeat_interleave(self.nh // self.nkv, 0)
        v = v.view(t, self.nkv, self.d).transpose(0, 1).repeat_interleave(self.nh // self.nkv, 0)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(0, 1).reshape(t, -1) @ self.o_proj.weight.float().t()


class Proj(nn.Module):
    """A linear layer's weight (vLLM-style naming: ``<name>.weight``)."""

    def __init__(self, out: int, inp: int, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        self.weight = _empty(out, inp, dtype=dtype, device=device)


class TransposedProj(Proj):
    """Derives a float32 transposed weight: other dtype and shape, so it cannot alias and
    becomes a separate parameter (updated in place on reload)."""

    def process_weights_after_loading(self) -> None:
        bind_derived(self, "weight_t", "weight", self.weight.t().float())


class DeletingProj(Proj):
    """A post-process that repacks its source into a new parameter and deletes it."""

    def process_weights_after_loading(self) -> None:
        self.weight_t = nn.Parameter(self.weight.detach().t().contiguous(), requires_grad=False)
        del self.weight


class ReshapingProj(Proj):
    """A post-process that re-lays out its source into new storage under the same name."""

    def process_weights_after_loading(self) -> None:
        self.weight.data = self.weight.data.t().contiguous()


class MLP(nn.Module):
    def __init__(self, h: int, inter: int, dtype: torch.dtype, device: str,
                 gate_up: type = Proj) -> None:
        super().__init__()
        self.gate_up_proj = gate_up(2 * inter, h, dtype, device)
        self.down_proj = TransposedProj(h, inter, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = (x @ self.gate_up_proj.weight.float().t()).chunk(2, -1)
        return (F.silu(g) * u) @ self.down_proj.weight_t


class DeletingMLP(MLP):
    def __init__(self, h: int, inter: int, dtype: torch.dtype, device: str) -> None:
        super().__init__(h, inter, dtype, device, gate_up=DeletingProj)


class ReshapingMLP(MLP):
    def __init__(self, h: int, inter: int, dtype: torch.dtype, device: str) -> None:
        super().__init__(h, inter, dtype, device, gate_up=ReshapingProj)


class Layer(nn.Module):
    def __init__(self, cfg: Mapping, tp: int, dtype: torch.dtype, device: str,
                 mlp: type = MLP) -> None:
        super().__init__()
        h = cfg["hidden_size"]
        self.input_layernorm = Norm(h, dtype, device)
        self.self_attn = Attention(cfg, tp, dtype, device)
        self.post_attention_layernorm = Norm(h, dtype, device)
        self.mlp = mlp(h, cfg["intermediate_size"] // tp, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class TinyLM(nn.Module):
    """One pipeline stage of a llama-shaped model with fused qkv / gate_up (vLLM naming).

    ``all_layers`` builds every layer (those of other stages stay on meta after loading)."""

    def __init__(self, cfg: Mapping, window: StageWindow, *, tp: int = 1,
                 dtype: torch.dtype = torch.bfloat16, device: str = "cpu", mlp: type = MLP,
                 all_layers: bool = False) -> None:
        super().__init__()
        h, vocab = cfg["hidden_size"], cfg["vocab_size"]
        self.window = window
        self.model = nn.Module()
        if window.has_embed:
            self.model.embed_tokens = Proj(vocab // tp, h, dtype, device)
        ids = range(cfg["num_hidden_layers"]) if all_layers else \
            range(window.start_layer, window.end_layer)
        self.model.layers = nn.ModuleDict({str(i): Layer(cfg, tp, dtype, device, mlp)
                                           for i in ids})
        if window.has_head:
            self.model.norm = Norm(h, dtype, device)
            self.lm_head = Proj(vocab // tp, h, dtype, device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens.weight.float()[ids]
        for i in range(self.window.start_layer, self.window.end_layer):
            x = self.model.layers[str(i)](x)
        return self.model.norm(x) @ self.lm_head.weight.float().t()


def param_ptrs(model: nn.Module) -> dict[str, int]:
    """data_ptr of every parameter and buffer by name (aliases and derived included)."""
    out = {n: p.data_ptr() for n, p in model.named_parameters(remove_duplicate=False)}
    out.update({n: b.data_ptr() for n, b in model.named_buffers(remove_duplicate=False)})
    return out


def storage_bytes(model: nn.Module) -> int:
    """Bytes of the distinct storages behind the model's tensors."""
    seen: dict[int, int] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        if t.device.type != "meta":
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def checksum(model: nn.Module) -> dict[str, float]:
    """A content fingerprint per tensor (float64 sums of values and of value x position)."""
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if t.device.type == "meta":
            continue
        flat = t.detach().reshape(-1).double()
        pos = torch.arange(flat.numel(), dtype=torch.float64)
        out[name] = (float(flat.sum()), float((flat * pos).sum()))  # type: ignore[assignment]
    return out


# ---- a tiny MoE family, written by the tests themselves ------------------------------------

def _moe_layout(config: Mapping) -> Layout:
    n = int(config["num_hidden_layers"])
    return Layout(n, ("full_attention",) * n, frozenset(range(n)), int(config["num_experts"]))


def _moe_template(spec) -> dict:  # type: ignore[no-untyped-def]
    h, inter, experts = spec.hidden_size, spec.int("moe_intermediate_size"), spec.num_experts
    out = globals_tensors(spec)
    for i in range(spec.num_layers):
        layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
                 **attention_tensors(spec), "mlp.gate.weight": (experts, h)}
        for e in range(experts):
            layer.update(mlp_tensors(h, inter, prefix=f"mlp.experts.{e}."))
        out.update({f"model.layers.{i}.{k}": v for k, v in layer.items()})
    return out


TINY_MOE = Family(
    name="tiny-moe", architectures=("TinyMoeForCausalLM",), layout=_moe_layout,
    globals=llama_globals(),
    expert_pattern=r"mlp\.experts\.(\d+)\.(?:gate_proj|up_proj|down_proj)\.weight",
    shard_rules=vocab_rules() + attention_rules() + (
        ShardRule(r"mlp\.experts\.\d+\.(gate_proj|up_proj)\.weight", 0),
        ShardRule(r"mlp\.experts\.\d+\.down_proj\.weight", 1)),
    template=_moe_template, fused_targets=(QKV, *expert_fusions()))

MOE_CONFIG = {"architectures": ["TinyMoeForCausalLM"], "hidden_size": 32,
              "moe_intermediate_size": 16, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 64, "num_experts": 4,
              "tie_word_embeddings": False, "dtype": "bfloat16"}


def make_moe(out: Path, seed: int = 0) -> Path:
    """Write a tiny MoE checkpoint (per-expert tensors, several shards)."""
    spec = spec_from_config(MOE_CONFIG, family=TINY_MOE)
    gen = torch.Generator().manual_seed(seed)
    tensors = {n: torch.randn(s, generator=gen).to(torch.bfloat16)
               for n, s in _moe_template(spec).items()}
    write_checkpoint(out, tensors, MOE_CONFIG, shard_bytes=20_000)
    return out


def plan_moe(model_dir: Path, topology: Topology) -> StagePlan:
    spec = spec_from_config(MOE_CONFIG, family=TINY_MOE)
    index = open_checkpoint(model_dir)
    window = even_windows(spec.num_layers, topology.pp_size)[topology.pp_rank]
    return StagePlan(spec, index, plan_rank(spec, index, topology, window))


class MoEStage(nn.Module):
    """Stage module with fused qkv and stacked experts ``w13_weight`` / ``w2_weight``."""

    def __init__(self, cfg: Mapping, window: StageWindow, *, tp: int = 1, ep: int = 1,
                 device: str = "meta") -> None:
        super().__init__()
        h, inter, d = cfg["hidden_size"], cfg["moe_intermediate_size"] // tp, cfg["head_dim"]
        e_local, dt = cfg["num_experts"] // ep, torch.bfloat16
        nh, nkv = cfg["num_attention_heads"] // tp, max(1, cfg["num_key_value_heads"] // tp)
        self.model = nn.Module()
        if window.has_embed:
            self.model.embed_tokens = nn.Module()
            self.model.embed_tokens.weight = _empty(cfg["vocab_size"] // tp, h, dtype=dt,
                                                    device=device)
        layers = {}
        for i in range(window.start_layer, window.end_layer):
            layer = nn.Module()
            layer.input_layernorm = nn.Module()
            layer.input_layernorm.weight = _empty(h, dtype=dt, device=device)
            layer.post_attention_layernorm = nn.Module()
            layer.post_attention_layernorm.weight = _empty(h, dtype=dt, device=device)
            layer.self_attn = nn.Module()
            layer.self_attn.qkv_proj = nn.Module()
            layer.self_attn.qkv_proj.weight = _empty((nh + 2 * nkv) * d, h, dtype=dt,
                                                     device=device)
            layer.self_attn.o_proj = nn.Module()
            layer.self_attn.o_proj.weight = _empty(h, nh * d, dtype=dt, device=device)
            layer.mlp = nn.Module()
            layer.mlp.gate = nn.Module()
            layer.mlp.gate.weight = _empty(cfg["num_experts"], h, dtype=dt, device=device)
            layer.mlp.experts = nn.Module()
            layer.mlp.experts.w13_weight = _empty(e_local, 2 * inter, h, dtype=dt, device=device)
            layer.mlp.experts.w2_weight = _empty(e_local, h, inter, dtype=dt, device=device)
            layers[str(i)] = layer
        self.model.layers = nn.ModuleDict(layers)
        if window.has_head:
            self.model.norm = nn.Module()
            self.model.norm.weight = _empty(h, dtype=dt, device=device)
            self.lm_head = nn.Module()
            self.lm_head.weight = _empty(cfg["vocab_size"] // tp, h, dtype=dt, device=device)


def tp_rows(t: torch.Tensor, rank: int, tp: int, units: Optional[int] = None) -> torch.Tensor:
    """Reference column-parallel slice: ``units`` (heads) split over tp, replicated when
    fewer than tp (rank r takes unit r * units // tp)."""
    units = units or t.shape[0]
    unit = t.shape[0] // units
    if units >= tp:
        per = units // tp
        return t[rank * per * unit:(rank + 1) * per * unit]
    u = rank * units // tp
    return t[u * unit:(u + 1) * unit]


def tp_cols(t: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    per = t.shape[1] // tp
    return t[:, rank * per:(rank + 1) * per]



@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Tiny matmuls: one intra-op thread avoids oversubscription stalls on a busy 2-core box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
