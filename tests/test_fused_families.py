"""Fused and stacked targets of the MoE / hybrid families, bound by ``load_stage_into``.

For each family a tiny checkpoint (make-tiny, the family's on-disk naming) is bound, for every
rank of PP=2 x TP{1,2} x EP{1,2} (single process, one explicit Topology per rank), into a stage
module whose fused tensors are named as a serving stack names them (vLLM): ``qkv_proj``,
``gate_up_proj``, MLA's ``fused_qkv_a_proj``, Qwen3.5's ``in_proj_qkvz`` / ``in_proj_ba``,
stacked experts ``w13_weight`` / ``w2_weight`` [E_local, ...].

What is independent of the code under test: the fusion table of each case (which checkpoint
pieces make which fused tensor, in which order), the local experts of an EP rank and the TP
slicing of every piece (written here from the architecture, applied to ``safe_open`` tensors).
The module is built from the plan's local shapes plus that table, so a family that does not
declare a fusion leaves the fused tensor missing and its pieces unexpected.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import pytest
import torch
from torch import nn

from bind_models import one_thread  # noqa: F401 - autouse fixture
from bind_models import tp_cols, tp_rows
from helpers import make_model, reference_tensors, tiny_config
from pploader import Topology, load_stage_into, plan_stage
from pploader.planning.checkpoint import DTYPES
from pploader.families import find_family
from pploader.families.fused import match_fused
from pploader.tiny import write_checkpoint

Slicer = Callable[[torch.Tensor, Topology], torch.Tensor]
LAYER = re.compile(r"^(?P<prefix>(?:.*\.)?layers\.\d+\.)(?P<component>.+)$")
TOPOLOGIES = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (tp, ep), all at pp=2


# ---- TP / EP slicing of the reference tensors (the architecture's rules, written here) ------

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
    """EP rank r holds the contiguous block [r*E/ep, (r+1)*E/ep)."""
    return range(topo.ep_rank * num_experts // topo.ep_size,
                 (topo.ep_rank + 1) * num_experts // topo.ep_size)


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


QKV = ("self_attn.qkv_proj.weight",
       ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"))


def gate_up(prefix: str) -> tuple[str, tuple[str, ...]]:
    return (f"{prefix}gate_up_proj.weight",
            (f"{prefix}gate_proj.weight", f"{prefix}up_proj.weight"))


def experts(prefix: str, gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj"
            ) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """``{e}``: one row of the stacked tensor per local expert."""
    w13 = tuple(f"{prefix}{{e}}.{n}.weight" for n in (gate, up) if n)
    return ((prefix + "w13_weight", w13), (prefix + "w2_weight", (f"{prefix}{{e}}.{down}.weight",)))


# ---- the cases ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    config: str
    num_experts: int
    fusions: tuple[tuple[str, tuple[str, ...]], ...]  # fused tensor <- pieces, in slice order
    slicers: tuple[tuple[str, Slicer], ...]            # component regex -> reference slicing


def gdn(cfg: Mapping) -> tuple[tuple, tuple]:
    """Qwen3.5's split GDN projections: (fusions, slicers)."""
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    kd, vd = nk * cfg["linear_key_head_dim"], nv * cfg["linear_value_head_dim"]
    return ((("linear_attn.in_proj_qkvz.weight",
              ("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight")),
             ("linear_attn.in_proj_ba.weight",
              ("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight"))),
            ((r"linear_attn\.in_proj_qkv\.weight", segment_rows((kd, kd, vd), (nk, nk, nv))),
             (r"linear_attn\.in_proj_[zba]\.weight", rows(nv))))


def make_case(name: str) -> Case:
    cfg = tiny_config(f"tiny-{name}")
    cfg = cfg.get("text_config", cfg)
    e = int(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts")
            or 0)
    mlp = ((r"mlp\.(gate|up)_proj\.weight", rows()),)
    shared = ((r"mlp\.shared_experts?\.(gate|up)_proj\.weight", rows()),)
    if name == "qwen3_moe":
        inter = cfg["moe_intermediate_size"]
        return Case(name, e, (QKV, gate_up("mlp."), *experts("mlp.experts."),
                              ("mlp.experts.w13_weight", ("mlp.experts.gate_up_proj",)),
                              ("mlp.experts.w2_weight", ("mlp.experts.down_proj",))),
                    attention(cfg) + mlp + per_expert(r"mlp\.experts\.")
                    + ((r"mlp\.experts\.gate_up_proj", stacked_gate_up(e, inter)),
                       (r"mlp\.experts\.down_proj", stacked_down(e))))
    if name == "mixtral":  # w1 = gate, w3 = up, w2 = down
        return Case(name, e, (QKV, *experts("block_sparse_moe.experts.", "w1", "w3", "w2")),
                    attention(cfg) + per_expert(r"block_sparse_moe\.experts\.", "w1|w3", "w2"))
    if name == "deepseek_v3":  # MLA: the two replicated low-rank inputs fuse; q_b / kv_b do not
        return Case(name, e, (("self_attn.fused_qkv_a_proj.weight",
                               ("self_attn.q_a_proj.weight",
                                "self_attn.kv_a_proj_with_mqa.weight")),
                              gate_up("mlp."), gate_up("mlp.shared_experts."),
                              *experts("mlp.experts.")),
                    ((r"self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.weight", replicated()),)
                    + mlp + shared + per_expert(r"mlp\.experts\."))
    if name in ("qwen3_5_moe", "qwen3_5_moe_vl"):  # gated q ([q, gate] per head), split GDN
        fusions, slicers = gdn(cfg)
        return Case(name, e, (QKV, *fusions, gate_up("mlp.shared_expert."),
                              *experts("mlp.experts.")),
                    attention(cfg) + slicers + shared + per_expert(r"mlp\.experts\."))
    if name == "qwen3_5":
        fusions, slicers = gdn(cfg)
        return Case(name, e, (QKV, gate_up("mlp."), *fusions), attention(cfg) + slicers + mlp)
    if name == "qwen3_next":  # GDN in_proj_qkvz / ba stored fused already
        return Case(name, e, (QKV, gate_up("mlp."), gate_up("mlp.shared_expert."),
                              *experts("mlp.experts.")),
                    attention(cfg) + mlp + shared + per_expert(r"mlp\.experts\."))
    if name in ("bamba", "falcon_h1"):
        return Case(name, e, (QKV, gate_up("feed_forward.")),
                    attention(cfg) + ((r"feed_forward\.(gate|up)_proj\.weight", rows()),))
    if name == "jamba":  # attention every 4th layer, experts every other, Mamba1 unfused
        return Case(name, e, (QKV, gate_up("feed_forward."), *experts("feed_forward.experts.")),
                    attention(cfg) + ((r"feed_forward\.(gate|up)_proj\.weight", rows()),)
                    + per_expert(r"feed_forward\.experts\."))
    if name == "nemotron_h":  # ungated experts: w13 holds up alone
        return Case(name, e, (("mixer.qkv_proj.weight", tuple(f"mixer.{n}_proj.weight"
                                                             for n in "qkv")),
                              *experts("mixer.experts.", gate="")),
                    attention(cfg, r"mixer\.") + per_expert(r"mixer\.experts\.", "up_proj"))
    if name == "granitemoehybrid":  # experts 3-D on disk: renamed into w13 / w2
        inter = cfg["intermediate_size"]
        return Case(name, e, (QKV, ("block_sparse_moe.experts.w13_weight",
                                    ("block_sparse_moe.input_linear.weight",)),
                              ("block_sparse_moe.experts.w2_weight",
                               ("block_sparse_moe.output_linear.weight",))),
                    attention(cfg)
                    + ((r"block_sparse_moe\.input_linear\.weight", stacked_gate_up(e, inter)),
                       (r"block_sparse_moe\.output_linear\.weight", stacked_down(e))))
    raise KeyError(name)


FAMILIES = ["qwen3_moe", "mixtral", "deepseek_v3", "qwen3_5_moe", "qwen3_5_moe_vl", "qwen3_5",
            "qwen3_next", "jamba", "bamba", "falcon_h1", "nemotron_h", "granitemoehybrid"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = make_model(tmp_path_factory.mktemp(name), tiny_config(f"tiny-{name}"))
        return made[name]
    return get


# ---- module factory and expectations -------------------------------------------------------

Layout = dict[str, tuple[bool, list[list[str]]]]


def fused_layout(names: set[str], case: Case, topo: Topology) -> Layout:
    """Fused module tensor -> (stacked, rows of checkpoint pieces): one row per local expert
    when stacked, else a single row; for the pieces this rank's plan holds."""
    prefixes = sorted({m["prefix"] for n in names if (m := LAYER.match(n))})
    out: Layout = {}
    for p in prefixes:
        for target, parts in case.fusions:
            ids = local_experts(case.num_experts, topo) if "{e}" in parts[0] else [None]
            rows_ = [[p + part.format(e=e) for part in parts] for e in ids]
            present = [n in names for row in rows_ for n in row]
            if any(present):
                assert all(present), f"{p}{target}: plan lacks some of {rows_}"
                out[p + target] = ("{e}" in parts[0], rows_)
    return out


def consumed(layout: Layout) -> set[str]:
    return {n for _, rows_ in layout.values() for row in rows_ for n in row}


def _add(root: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    *path, leaf = name.split(".")
    mod = root
    for part in path:
        if not hasattr(mod, part):
            mod.add_module(part, nn.Module())
        mod = getattr(mod, part)
    mod.register_parameter(leaf, nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"),
                                              requires_grad=False))


def stage_module(items: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                 layout: Layout) -> nn.Module:
    """Fused tensors per ``layout``; every other planned piece under its own name (meta)."""
    root = nn.Module()
    for name, (shape, dtype) in items.items():
        if name not in consumed(layout):
            _add(root, name, shape, dtype)
    for name, (stacked, rows_) in layout.items():
        first, dtype = items[rows_[0][0]]
        row_shape = (sum(items[n][0][0] for n in rows_[0]), *first[1:])
        _add(root, name, (len(rows_), *row_shape) if stacked else row_shape, dtype)
    return root


def bind_and_check(model_dir: Path, case: Case, topo: Topology,
                   ref: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    staged = plan_stage(model_dir, topo)
    items = {i.target: (tuple(i.shape), DTYPES[i.dtype][0]) for i in staged.plan.items}
    source = {i.target: i.name for i in staged.plan.items}  # a tied head reads the embedding
    layout = fused_layout(set(items), case, topo)
    module = stage_module(items, layout)
    result = load_stage_into(module, staged, process=False)
    where = topo.describe()
    assert result.missing == () and result.unexpected == (), (where, result)
    tensors = dict(module.named_parameters())
    assert not any(re.search(r"\.experts\.\d+\.", n) for n in tensors), where  # all stacked
    slicers = [(re.compile(rx), f) for rx, f in case.slicers]

    def local(name: str) -> torch.Tensor:
        component = LAYER.match(name)["component"]  # type: ignore[index]
        f = next(f for rx, f in slicers if rx.fullmatch(component))
        return f(ref[name], topo)

    for name, (stacked, rows_) in layout.items():
        want = [torch.cat([local(n) for n in row]) for row in rows_]
        expect = torch.stack(want) if stacked else want[0]
        assert torch.equal(tensors[name], expect), (where, name)
    if topo.tp_size == 1:  # unfused tensors: whole (TP slicing of those is test_tp's subject)
        for name in set(items) - consumed(layout):
            assert torch.equal(tensors[name], ref[source[name]]), (where, name)
    return {n: t.detach().clone() for n, t in tensors.items()}


# ---- tests ------------------------------------------------------------------------------------

def test_declared_fusions_cover_the_cases() -> None:
    """Every piece a case fuses is matched by its family's data, as a part of that target."""
    for name in FAMILIES:
        case = make_case(name)
        family, _ = find_family(tiny_config(f"tiny-{name}"))
        for target, parts in case.fusions:
            for i, part in enumerate(parts):
                m = match_fused(family.fused_targets, part.format(e=3))
                assert m is not None, (name, part)
                assert (m.target, m.part) == (target, i), (name, part)


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_family_binds_fused_and_stacked(checkpoints: Callable[[str], Path], name: str) -> None:
    case, path = make_case(name), checkpoints(name)
    ref = reference_tensors(path)
    exercised: set[str] = set()
    for tp, ep in TOPOLOGIES:
        if ep > 1 and not case.num_experts:
            continue
        for topo in Topology(2, tp, ep).all_ranks():
            filled = bind_and_check(path, case, topo, ref)
            exercised |= {t for n in filled for t, _ in case.fusions if n.endswith("." + t)}
    on_disk = {m["component"] for n in ref if (m := LAYER.match(n))}
    assert exercised == {t for t, parts in case.fusions if parts[0].format(e=0) in on_disk}


@pytest.mark.slow
def test_qwen3_moe_both_namings_fill_the_same_stacked_module(
        checkpoints: Callable[[str], Path], tmp_path: Path) -> None:
    """transformers' own naming (3-D ``mlp.experts.gate_up_proj`` / ``down_proj``, written
    here from the per-expert tensors) fills ``w13_weight`` / ``w2_weight`` exactly as the
    per-expert naming does."""
    case, per_expert_dir = make_case("qwen3_moe"), checkpoints("qwen3_moe")
    ref = reference_tensors(per_expert_dir)
    cfg = tiny_config("tiny-qwen3_moe")
    stacked: dict[str, torch.Tensor] = {}
    for name, t in ref.items():
        m = re.fullmatch(r"(.*\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight", name)
        if m is None:
            stacked[name] = t
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp.experts."
        if p + "0.gate_proj.weight" not in ref:
            continue  # a dense layer (mlp_only_layers)
        ids = range(case.num_experts)
        stacked[p + "gate_up_proj"] = torch.stack([torch.cat(
            [ref[f"{p}{e}.gate_proj.weight"], ref[f"{p}{e}.up_proj.weight"]]) for e in ids])
        stacked[p + "down_proj"] = torch.stack([ref[f"{p}{e}.down_proj.weight"] for e in ids])
    write_checkpoint(tmp_path, stacked, cfg, shard_bytes=150_000)
    assert plan_stage(tmp_path, Topology(1)).spec.family.format == "transformers"
    for tp, ep in [(1, 1), (2, 2)]:
        for topo in Topology(2, tp, ep).all_ranks():
            a = bind_and_check(per_expert_dir, case, topo, ref)
            b = bind_and_check(tmp_path, case, topo, stacked)
            assert a.keys() == b.keys() and any(n.endswith("w13_weight") for n in b)
            assert all(torch.equal(a[n], b[n]) for n in a), topo.describe()
