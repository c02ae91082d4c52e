"""Fused and stacked targets of the MoE / hybrid families, bound by ``load_stage_into``.

For each family a tiny checkpoint (make-tiny, the family's on-disk naming) is bound, for every
rank of PP=2 x TP{1,2} x EP{1,2} (single process, one explicit Topology per rank), into a stage
module whose fused tensors are named as a serving stack names them (vLLM): ``qkv_proj``,
``gate_up_proj``, MLA's ``fused_qkv_a_proj``, Qwen3.5's ``in_proj_qkvz`` / ``in_proj_ba``,
stacked experts ``w13_weight`` / ``w2_weight`` [E_local, ...].

What is independent of the code under test: the fusions of each family (tests/family_table.py,
``Row.fused``: which checkpoint pieces make which fused tensor, in which order), the local
experts of an EP rank and the TP slicing of every piece (tests/family_expect.py, written from
the architecture, applied to ``safe_open`` tensors).
The module is built from the plan's local shapes plus that table, so a family that does not
declare a fusion leaves the fused tensor missing and its pieces unexpected.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Mapping

import pytest
import torch
from torch import nn

from bind_models import one_thread  # noqa: F401 - autouse fixture
from family_expect import Case, local_experts
from family_table import BY_FAMILY, ROWS
from helpers import reference_tensors, tiny_config
from pploader import Topology, load_stage_into, plan_stage
from pploader.planning.checkpoint import DTYPES
from pploader.families import find_family
from pploader.families.fused import match_fused
from pploader.tiny import write_checkpoint

LAYER = re.compile(r"^(?P<prefix>(?:.*\.)?layers\.\d+\.)(?P<component>.+)$")
TOPOLOGIES = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (tp, ep), all at pp=2

#: families with a ``fused`` entry in the table (llama / qwen2 / qwen3: tests/bind/test_place.py)
FAMILIES = [r.family for r in ROWS if r.fused is not None and r.tiny]


def make_case(name: str) -> Case:
    """The table's fused targets and reference slicing for the family's tiny config."""
    row = BY_FAMILY[name]
    cfg = tiny_config(row.tiny)  # type: ignore[arg-type]
    cfg = cfg.get("text_config", cfg)
    fusions, slicers = row.fused(cfg, row.experts)  # type: ignore[misc]
    return Case(name, row.experts, fusions, slicers)


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
def test_family_binds_fused_and_stacked(tiny_checkpoints: Callable[[str], Path],
                                        name: str) -> None:
    case, path = make_case(name), tiny_checkpoints(f"tiny-{name}")
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
        tiny_checkpoints: Callable[[str], Path], tmp_path: Path) -> None:
    """transformers' own naming (3-D ``mlp.experts.gate_up_proj`` / ``down_proj``, written
    here from the per-expert tensors) fills ``w13_weight`` / ``w2_weight`` exactly as the
    per-expert naming does."""
    case, per_expert_dir = make_case("qwen3_moe"), tiny_checkpoints("tiny-qwen3_moe")
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
