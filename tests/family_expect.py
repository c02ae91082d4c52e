"""How a family's tensors must come out, written from the architectures (not from pploader's
family code): reference TP / EP slicing of ``safe_open`` tensors and fused-target layouts.
The rows of tests/family_table.py are built from these helpers."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from bind_models import tp_cols, tp_rows
from pploader import Topology

Slicer = Callable[[torch.Tensor, Topology], torch.Tensor]   # one rank's piece of a tensor
TpSlice = Callable[[torch.Tensor, int], torch.Tensor]      # rank r of TP=2


# ---- TP=2 reference slices (tests/families/test_families.py) ------------------------------------------

def halves(t: torch.Tensor, r: int, dim: int = 0) -> torch.Tensor:
    return t.chunk(2, dim)[r]


def segments(t: torch.Tensor, r: int, sizes: list[int], replicate: tuple[int, ...] = (),
             dim: int = 0) -> torch.Tensor:
    """Each segment halved on its own (or, when listed in ``replicate``, kept whole)."""
    parts = t.split(sizes, dim)
    return torch.cat([p if i in replicate else halves(p, r, dim) for i, p in enumerate(parts)],
                     dim)


def whole(t: torch.Tensor, r: int) -> torch.Tensor:
    return t


def row_halves(t: torch.Tensor, r: int) -> torch.Tensor:
    return halves(t, r, 1)


# ---- any topology: slicers and fused layouts (tests/families/test_fused_families.py) ------------------

def rows(units: int = 0) -> Slicer:
    """Column-parallel: dim 0 split by ``units`` (heads; 0 = rows), replicated below tp."""
    return lambda t, topo: tp_rows(t, topo.tp_rank, topo.tp_size, units or None)


def cols() -> Slicer:
    return lambda t, topo: tp_cols(t, topo.tp_rank, topo.tp_size)


def replicated() -> Slicer:
    return lambda t, topo: t


def segment_rows(sizes: tuple[int, ...], units: tuple[int, ...]) -> Slicer:
    """Several parts along dim 0, each split on its own; the rank's pieces concatenated."""
    def f(t: torch.Tensor, topo: Topology) -> torch.Tensor:
        assert sum(sizes) == t.shape[0]
        parts = t.split(list(sizes))
        return torch.cat([tp_rows(p, topo.tp_rank, topo.tp_size, u) for p, u in zip(parts, units)])
    return f


def local_experts(num_experts: int, topo: Topology) -> range:
    """EP rank r holds a contiguous block, the first E % ep ranks one more (vLLM's linear)."""
    base, extra = divmod(num_experts, topo.ep_size)
    first = topo.ep_rank * base + min(topo.ep_rank, extra)
    return range(first, first + base + (1 if topo.ep_rank < extra else 0))


def stacked_gate_up(num_experts: int, inter: int) -> Slicer:
    """3-D [E, 2I, H] = [gate; up] on dim 1: local experts, then each half split by tp."""
    def f(t: torch.Tensor, topo: Topology) -> torch.Tensor:
        e = local_experts(num_experts, topo)
        gate, up = t[e.start:e.stop].split([inter, inter], dim=1)
        return torch.cat([gate.chunk(topo.tp_size, 1)[topo.tp_rank],
                          up.chunk(topo.tp_size, 1)[topo.tp_rank]], dim=1)
    return f


def stacked_down(num_experts: int) -> Slicer:
    """3-D [E, H, I]: local experts, then I split by tp."""
    def f(t: torch.Tensor, topo: Topology) -> torch.Tensor:
        e = local_experts(num_experts, topo)
        return t[e.start:e.stop].chunk(topo.tp_size, 2)[topo.tp_rank]
    return f


def attention(cfg: Mapping, prefix: str = r"self_attn\.") -> tuple[tuple[str, Slicer], ...]:
    return ((prefix + r"q_proj\.weight", rows(cfg["num_attention_heads"])),
            (prefix + r"[kv]_proj\.weight", rows(cfg["num_key_value_heads"])))


def per_expert(prefix: str, col: str = "gate_proj|up_proj", row: str = "down_proj"
               ) -> tuple[tuple[str, Slicer], ...]:
    return ((prefix + rf"\d+\.({col})\.weight", rows()),
            (prefix + rf"\d+\.({row})\.weight", cols()))


Fusion = tuple[str, tuple[str, ...]]   # fused tensor <- checkpoint pieces, in slice order

QKV: Fusion = ("self_attn.qkv_proj.weight",
               ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"))


def gate_up(prefix: str) -> Fusion:
    return (f"{prefix}gate_up_proj.weight",
            (f"{prefix}gate_proj.weight", f"{prefix}up_proj.weight"))


def experts(prefix: str, gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj"
            ) -> tuple[Fusion, ...]:
    """``{e}``: one row of the stacked tensor per local expert."""
    w13 = tuple(f"{prefix}{{e}}.{n}.weight" for n in (gate, up) if n)
    return ((prefix + "w13_weight", w13), (prefix + "w2_weight", (f"{prefix}{{e}}.{down}.weight",)))


@dataclass(frozen=True)
class Case:
    """A family's fused-binding expectations for its tiny config."""

    config: str
    num_experts: int
    fusions: tuple[Fusion, ...]                       # fused tensor <- pieces, in slice order
    slicers: tuple[tuple[str, Slicer], ...]            # component regex -> reference slicing


def gdn(cfg: Mapping) -> tuple[tuple[Fusion, ...], tuple[tuple[str, Slicer], ...]]:
    """Qwen3.5's split GDN projections: (fusions, slicers)."""
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    kd, vd = nk * cfg["linear_key_head_dim"], nv * cfg["linear_value_head_dim"]
    return ((("linear_attn.in_proj_qkvz.weight",
              ("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight")),
             ("linear_attn.in_proj_ba.weight",
              ("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight"))),
            ((r"linear_attn\.in_proj_qkv\.weight", segment_rows((kd, kd, vd), (nk, nk, nv))),
             (r"linear_attn\.in_proj_[zba]\.weight", rows(nv))))


MLP_ROWS = ((r"mlp\.(gate|up)_proj\.weight", rows()),)
SHARED_ROWS = ((r"mlp\.shared_experts?\.(gate|up)_proj\.weight", rows()),)
FF_ROWS = ((r"feed_forward\.(gate|up)_proj\.weight", rows()),)
