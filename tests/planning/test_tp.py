"""Tensor-parallel shards read by byte range.

- property tests (hypothesis): random shapes, dims, segments, units, padding, experts and TP
  sizes -> the Reader's bytes equal reference slicing written here, and the ranks' shards
  concatenated segment by segment give back the full tensor;
- tiny llama at TP 1/2/4 (x PP 2), one process per plan: every shard equals the reference
  slicing, shards reassemble the checkpoint bitwise, bytes read per rank (reader's own stats)
  <= 1.01 x ideal for dim-0 / replicated tensors; dim-1 figures are printed;
- a real gloo job PP=2 x TP=2 (run_ranks), plain and read-once-for-replicas.
"""
from __future__ import annotations

import math
import os
import re
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Optional

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from helpers import make_model, reference_tensors, run_ranks, tiny_config
from pploader import PlanError, Topology
from pploader.planning.checkpoint import open_checkpoint
from pploader.planning.plan import plan_all
from pploader.planning.spec import load_spec
from pploader.planning.checkpoint import FileIdentity, parse_header
from pploader.families.base import ShardRule
from pploader.planning.partition import StageWindow
from pploader.planning.plan import RankPlan, read_item
from pploader.io.read import Reader
from pploader.planning.share import share_reads
from pploader.planning.shard import DEFAULT_RANGE_COST_BYTES, Selection, tp_selection

TP_SIZES = (1, 2, 4)


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _one_plan(path: Path, items: list) -> RankPlan:
    """A RankPlan over one file (the Reader needs nothing else)."""
    return RankPlan(model=str(path.parent), topology=Topology(1),
                    window=StageWindow(0, 0, 1, True, True), experts=None, items=tuple(items),
                    paths={path.name: str(path)},
                    identities={path.name: FileIdentity.of(os.stat(path))}, header_bytes=0)


# ---- reference slicing (independent of pploader.planning.shard) ----------------------------------
def ref_shard(full: torch.Tensor, dim: int, segments: tuple[int, ...],
              units: tuple[Optional[int], ...], tp: int, r: int, pad: bool) -> torch.Tensor:
    """What TP rank ``r`` holds: each segment split into ``units`` heads (None: rows), heads
    dealt out evenly, or (fewer heads than ranks) head ``r // (tp // units)`` replicated."""
    if pad:
        per = -(-full.shape[0] // tp)
        part = full[r * per:(r + 1) * per]
        zeros = torch.zeros((per - part.shape[0],) + tuple(full.shape[1:]), dtype=full.dtype)
        return torch.cat([part, zeros])
    pieces = []
    for seg, u in zip(full.split(list(segments), dim), units):
        if seg.shape[dim] == 0:
            continue
        if u is None:
            pieces.append(seg.tensor_split(tp, dim)[r])
        elif u >= tp:
            heads = seg.tensor_split(u, dim)
            pieces.extend(heads[r * (u // tp):(r + 1) * (u // tp)])
        else:
            pieces.append(seg.tensor_split(u, dim)[r // (tp // u)])
    return torch.cat(pieces, dim) if pieces else full.narrow(dim, 0, 0)


def ref_reassemble(shards: list[torch.Tensor], dim: int, segments: tuple[int, ...],
                   units: tuple[Optional[int], ...], tp: int, size: int,
                   pad: bool) -> torch.Tensor:
    """Concatenate the ranks' shards segment by segment (one copy of replicated heads)."""
    if pad:
        per = -(-size // tp)
        return torch.cat([s[:max(0, min(per, size - r * per))] for r, s in enumerate(shards)])
    parts, offset = [], 0
    for seg, u in zip(segments, units):
        width = seg // u if u is not None and u < tp else seg // tp
        owners = [r for r in range(tp) if u is None or u >= tp or r % (tp // u) == 0]
        parts.extend(shards[r].narrow(dim, offset, width) for r in owners)
        offset += width
    return torch.cat(parts, dim)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def shard_cases(draw: st.DrawFn) -> dict:
    tp = draw(st.sampled_from([1, 2, 3, 4]))
    ndim = draw(st.integers(1, 3))
    dim = draw(st.integers(0, ndim - 1))
    pad = dim == 0 and draw(st.booleans())
    segments: list[int] = []
    units: list[Optional[int]] = []
    if pad:
        size = draw(st.integers(1, 13))
    else:
        for _ in range(draw(st.integers(1, 4))):
            mode = draw(st.sampled_from(["rows", "split", "replicate"]))
            width = draw(st.integers(1, 3))
            if mode == "rows":
                segments.append(tp * draw(st.integers(0, 3)))
                units.append(None)
            elif mode == "split" or tp == 1:
                u = tp * draw(st.integers(1, 3))
                segments.append(u * width)
                units.append(u)
            else:
                u = draw(st.sampled_from([d for d in _divisors(tp) if d < tp]))
                segments.append(u * width)
                units.append(u)
        if sum(segments) == 0:
            segments, units = [tp], [None]
        size = sum(segments)
    shape = [draw(st.integers(1, 5)) for _ in range(ndim)]
    shape[dim] = size
    experts = None
    if ndim == 3 and dim != 0 and draw(st.booleans()):
        first = draw(st.integers(0, shape[0] - 1))
        experts = (first, draw(st.integers(1, shape[0] - first)))
    return dict(tp=tp, dim=dim, pad=pad, shape=tuple(shape), segments=tuple(segments),
                units=tuple(units), experts=experts,
                dtype=draw(st.sampled_from([torch.uint8, torch.bfloat16, torch.float32])),
                range_cost=draw(st.sampled_from([0, 64, DEFAULT_RANGE_COST_BYTES, 10 ** 12])),
                seed=draw(st.integers(0, 2 ** 16)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shard_cases())
def test_reader_equals_reference_slicing(case: dict) -> None:
    tp, dim, shape = case["tp"], case["dim"], case["shape"]
    gen = torch.Generator().manual_seed(case["seed"])
    full = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    full = full.view(-1)[:math.prod(shape)].reshape(shape) if case["dtype"] == torch.uint8 else \
        torch.randint(0, 256, shape[:-1] + (shape[-1] * case["dtype"].itemsize,), generator=gen,
                      dtype=torch.uint8).view(case["dtype"])
    units_arg = None if all(u is None for u in case["units"]) else case["units"]
    rule = ShardRule("t", dim, pad=case["pad"],
                     segments=(lambda _s, v=case["segments"]: v) if not case["pad"] else None,
                     units=(lambda _s, v=units_arg: v) if units_arg is not None else None)
    experts = case["experts"]
    source = full if experts is None else full.narrow(0, *experts)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.safetensors"
        save_file({"pad": torch.zeros(3, dtype=torch.uint8), "t": full}, str(path))
        entry = parse_header(path).tensors["t"]
        shards = []
        for r in range(tp):
            sel = tp_selection(rule, shape, None, r, tp, "t")  # type: ignore[arg-type]
            if experts is not None:
                sel = Selection(((0, (experts,)),)).merged(sel)
            item = read_item(entry, "t", sel, case["range_cost"])
            reader = Reader(_one_plan(path, [item]))
            got = dict(reader)["t"]
            want = (ref_shard(source, dim, case["segments"], case["units"], tp, r, case["pad"])
                    if tp > 1 else source)
            assert tuple(got.shape) == tuple(want.shape) == item.shape == sel.shape(shape)
            assert _bytes(got) == _bytes(want)
            assert reader.stats.read_bytes == item.read_bytes
            if item.direct:  # byte runs read exactly the needed bytes
                assert item.read_bytes == item.ideal_bytes
            if case["range_cost"] == 0:
                assert item.direct
            shards.append(got)
        if tp > 1:
            back = ref_reassemble(shards, dim, case["segments"], case["units"], tp,
                                  source.shape[dim], case["pad"])
            assert _bytes(back) == _bytes(source)


@pytest.mark.parametrize("rule, shape, tp, match", [
    (ShardRule("t", 0), (6, 4), 4, r"dim 0 of shape \[6, 4\] over tp=4"),
    (ShardRule("t", 1, units=lambda s: 3), (4, 6), 2, r"3 units .* tp=2"),
    (ShardRule("t", 0, units=lambda s: 2), (6, 4), 4, r"tp=4"),   # 3-row units replicated: ok?
    (ShardRule("t", 0, segments=lambda s: (3, 4)), (6, 4), 2, r"do not sum to 6"),
    (ShardRule("t", 2), (6, 4), 2, r"dim 2 of a 2-d tensor"),
    (ShardRule("t", 1, pad=True), (6, 4), 4, r"padded .* dim 0"),
    (ShardRule("t", 0, segments=lambda s: (2, 4)), (6, 4), 4, r"segment of 2 does not divide"),
])
def test_indivisible_splits_name_tensor_shape_dim_tp(rule: ShardRule, shape: tuple, tp: int,
                                                    match: str) -> None:
    if rule.units is not None and rule.dim == 0 and shape == (6, 4):
        # 2 units of 3 rows replicated over tp=4: valid (GQA with kv_heads < tp)
        sel = tp_selection(rule, shape, None, 3, tp, "t")  # type: ignore[arg-type]
        assert sel.dims == ((0, ((3, 3),)),)
        return
    with pytest.raises(PlanError, match=match) as err:
        tp_selection(rule, shape, None, 0, tp, "model.x.weight")  # type: ignore[arg-type]
    assert err.value.tensor == "model.x.weight"


def test_whole_dim_selection_is_replicated() -> None:
    """A rule whose pieces cover the dim (one unit per segment, replicated) is no split."""
    rule = ShardRule("t", 0, segments=lambda s: (2, 2), units=lambda s: 1)
    assert tp_selection(rule, (4, 3), None, 1, 2, "t") == Selection()  # type: ignore[arg-type]


# ---- tiny llama at TP 1 / 2 / 4 ------------------------------------------------------------
#: component regex -> (dim, units per segment or None, padded): the test's own statement of
#: how a llama splits (heads for q/k/v/o, rows for the MLP, padded vocab).
LLAMA_RULES = [
    (r"model\.embed_tokens\.weight|lm_head\.weight", 0, None, True),
    (r".*q_proj\.weight", 0, "heads", False),
    (r".*[kv]_proj\.weight", 0, "kv_heads", False),
    (r".*o_proj\.weight", 1, "heads", False),
    (r".*(gate|up)_proj\.weight", 0, None, False),
    (r".*down_proj\.weight", 1, None, False),
]


def llama_rule(name: str, cfg: dict) -> tuple[Optional[int], tuple, bool]:
    for rx, dim, units, pad in LLAMA_RULES:
        if re.fullmatch(rx, name):
            n = {None: None, "heads": cfg["num_attention_heads"],
                 "kv_heads": cfg["num_key_value_heads"]}[units]
            return dim, (n,), pad
    return None, (), False


@pytest.fixture(scope="module")
def llama_tp(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """tiny llama with a vocab (250) that does not divide by 4: the padded vocab path."""
    cfg = tiny_config(vocab_size=250)
    return make_model(tmp_path_factory.mktemp("llama-tp"), cfg, shard_bytes=90_000), cfg


@pytest.mark.parametrize("tp", TP_SIZES)
def test_llama_tp_shards_bitwise_and_bytes(llama_tp: tuple[Path, dict], tp: int) -> None:
    model, cfg = llama_tp
    ref = reference_tensors(model)
    spec, index = load_spec(model), open_checkpoint(model)
    plans = plan_all(spec, index, pp=2, tp=tp)
    shards: dict[str, list] = {}
    for plan in plans:
        r = plan.topology.tp_rank
        got = dict(Reader(plan))
        by_target = {i.target: i for i in plan.items}
        for target, tensor in got.items():
            full = ref[by_target[target].name]
            dim, units, pad = llama_rule(target, cfg)
            want = full if dim is None or tp == 1 else ref_shard(
                full, dim, (full.shape[dim],), units, tp, r, pad)
            assert _bytes(tensor) == _bytes(want), (target, tp, r)
            shards.setdefault(target, [None] * tp)[r] = tensor
        # bytes: dim-0 / replicated items read exactly their slice; dim-1 figures reported
        rows = [i for i in plan.items if llama_rule(i.target, cfg)[0] in (None, 0)]
        cols = [i for i in plan.items if llama_rule(i.target, cfg)[0] == 1]
        for group, bound in ((rows, 1.01), (cols, float(tp))):
            reader = Reader(replace(plan, items=tuple(group)))
            dict(reader)
            ideal = sum(i.ideal_bytes for i in group)
            assert reader.stats.read_bytes <= bound * ideal
            if group is cols and group:
                print(f"tp={tp} rank {plan.topology.rank}: dim-1 read "
                      f"{reader.stats.read_bytes} B for {ideal} B ideal "
                      f"({reader.stats.read_bytes / ideal:.2f}x)")
    assert set(shards) == set(ref)
    for name, parts in shards.items():
        dim, units, pad = llama_rule(name, cfg)
        back = parts[0] if dim is None or tp == 1 else ref_reassemble(
            parts, dim, (ref[name].shape[dim],), units, tp, ref[name].shape[dim], pad)
        assert _bytes(back) == _bytes(ref[name]), name


def test_byte_exact_mode_reads_exactly_ideal(llama_tp: tuple[Path, dict]) -> None:
    """range_cost_bytes=0 turns every slice, dim-1 too, into byte runs: read == ideal."""
    from pploader.planning.plan import make_windows, plan_rank
    model, _ = llama_tp
    spec, index = load_spec(model), open_checkpoint(model)
    windows = make_windows(spec, index, 2)
    for topo in Topology(2, 4).all_ranks():
        plan = plan_rank(spec, index, topo, windows[topo.pp_rank], range_cost_bytes=0)
        reader = Reader(plan)
        dict(reader)
        assert reader.stats.read_bytes == plan.ideal_bytes


# ---- read once for replicas (pure) ---------------------------------------------------------
def test_share_reads_reads_each_replica_once(llama_tp: tuple[Path, dict]) -> None:
    model, _ = llama_tp
    spec, index = load_spec(model), open_checkpoint(model)
    plans = plan_all(spec, index, pp=2, tp=4)
    for stage in range(2):
        stage_plans = [p for p in plans if p.topology.pp_rank == stage]
        shared = share_reads(stage_plans)
        norms = {i.name for i in stage_plans[0].items if "norm" in i.name}
        for r, sp in shared.items():
            assert {s.item.name for s in sp.shared} == norms  # kv heads: 2 ranks share each,
            assert all(s.group == "stage" for s in sp.shared)  # but no group of that shape
            assert [(s.item.name, s.reader) for s in sp.shared] == \
                [(s.item.name, s.reader) for s in shared[stage_plans[0].topology.rank].shared]
        unique = sum(s.item.read_bytes for s in next(iter(shared.values())).shared)
        assert sum(sp.reads.read_bytes for sp in shared.values()) == unique
        loads = [sp.reads.read_bytes for sp in shared.values()]
        assert max(loads) - min(loads) <= max(s.item.read_bytes for s in
                                              next(iter(shared.values())).shared)


def test_share_reads_with_experts_uses_the_replica_group(tmp_path: Path) -> None:
    """EP=2 x TP=2: norms/router are stage-wide replicas, attention slices are shared by the
    ranks of equal tp_rank (replica group), experts are never shared."""
    from pploader.families import supported_architectures
    if "MixtralForCausalLM" not in supported_architectures():
        pytest.skip("no MoE family registered")
    model = make_model(tmp_path / "moe", tiny_config("tiny-mixtral"))
    plans = plan_all(load_spec(model), open_checkpoint(model), pp=1, tp=2, ep=2)
    shared = share_reads(plans)
    for r, sp in shared.items():
        groups = {s.item.name: s.group for s in sp.shared}
        assert groups, r
        assert all(g == "replica" for n, g in groups.items() if "self_attn" in n)
        assert all(g == "stage" for n, g in groups.items() if "norm" in n)
        assert not any(".experts." in n for n in groups)
        assert all(set(s.ranks) == set(plans[r].topology.replica_group())
                   for s in sp.shared if s.group == "replica")
        own = {i.name for i in sp.own.items}
        assert own.isdisjoint(groups) and own | set(groups) == set(plans[r].tensors)


def test_share_reads_needs_the_whole_stage(llama_tp: tuple[Path, dict]) -> None:
    model, _ = llama_tp
    plans = plan_all(load_spec(model), open_checkpoint(model), pp=1, tp=2)
    with pytest.raises(PlanError, match="every rank of one stage"):
        share_reads(plans[:1])


# ---- a real gloo job: PP=2 x TP=2 ----------------------------------------------------------
def _tp_rank(rank: int, world: int, model: str, pp: int = 2, tp: int = 2, ep: int = 1) -> dict:
    from pploader import load_stage, plan_stage
    from pploader.distributed.comm import Comm
    topo = Topology.for_world(world, rank, pp=pp, tp=tp, ep=ep)
    comm = Comm(topo, timeout_s=60)
    staged = plan_stage(model, topo)
    plain = load_stage(staged)
    once = load_stage(plan_stage(model, topo, read_once=True), comm=comm)
    comm.agree(None)
    comm.close()
    return {"plain": {k: _bytes(v) for k, v in plain.state_dict.items()},
            "once": {k: _bytes(v) for k, v in once.state_dict.items()},
            "plain_read": plain.stats.read_bytes, "once_read": once.stats.read_bytes,
            "planned": staged.plan.read_bytes, "tp_rank": topo.tp_rank}


@pytest.mark.slow
def test_gloo_pp2_tp2_plain_and_read_once(llama_tp: tuple[Path, dict]) -> None:
    model, cfg = llama_tp
    ref = reference_tensors(model)
    results = run_ranks(_tp_rank, 4, str(model))
    spec, index = load_spec(model), open_checkpoint(model)
    plans = plan_all(spec, index, pp=2, tp=2)
    shared = {**share_reads(plans[:2]), **share_reads(plans[2:])}
    for rank, res in enumerate(results):
        assert res["plain"] == res["once"]
        by_target = {i.target: i.name for i in plans[rank].items}
        assert set(res["plain"]) == set(by_target)
        for target, raw in res["plain"].items():
            full = ref[by_target[target]]
            dim, units, pad = llama_rule(target, cfg)
            want = full if dim is None else ref_shard(full, dim, (full.shape[dim],), units, 2,
                                                      res["tp_rank"], pad)
            assert raw == _bytes(want), target
        assert res["plain_read"] == res["planned"]
        assert res["once_read"] == shared[rank].read_bytes  # reader's own accounting
    for stage in ((0, 1), (2, 3)):
        replicated = sum(s.item.read_bytes for s in shared[stage[0]].shared)
        assert replicated > 0
        saved = sum(results[r]["plain_read"] - results[r]["once_read"] for r in stage)
        assert saved == replicated * (len(stage) - 1)  # each replica read once, not twice


def test_compare_tp_reads_accounting(llama_tp: tuple[Path, dict]) -> None:
    """The benchmark function's bytes: pploader reads its plan, read-all reads everything."""
    from benchmarks.tp_bytes_read import compare_tp_reads
    model, _ = llama_tp
    out = compare_tp_reads(model, pp=2, tp=2, cold=False)
    plans = plan_all(load_spec(model), open_checkpoint(model), pp=2, tp=2)
    total = sum(t.numel() * t.element_size() for t in reference_tensors(model).values())
    assert [r["rank"] for r in out["ranks"]] == [0, 1, 2, 3]
    for row, plan in zip(out["ranks"], plans):
        assert row["pploader_read_bytes"] == plan.read_bytes
        assert row["ideal_bytes"] == plan.ideal_bytes <= row["pploader_read_bytes"]
        assert row["read_all_bytes"] == total
    assert out["total"]["read_reduction"] > 1.5


@pytest.mark.slow
def test_gloo_ep2_tp2_read_once_over_replica_groups(tmp_path: Path) -> None:
    """MoE, EP=2 x TP=2: attention slices travel over the replica groups, norms over the
    stage; the result equals the plain load bitwise and storage reads drop accordingly."""
    from pploader.families import supported_architectures
    if "MixtralForCausalLM" not in supported_architectures():
        pytest.skip("no MoE family registered")
    model = make_model(tmp_path / "moe", tiny_config("tiny-mixtral"))
    results = run_ranks(_tp_rank, 4, str(model), 1, 2, 2)
    plans = plan_all(load_spec(model), open_checkpoint(model), pp=1, tp=2, ep=2)
    shared = share_reads(plans)
    assert {s.group for sp in shared.values() for s in sp.shared} == {"stage", "replica"}
    for rank, res in enumerate(results):
        assert res["plain"] == res["once"]
        assert res["once_read"] == shared[rank].read_bytes
    saved = sum(r["plain_read"] - r["once_read"] for r in results)
    assert saved == sum(s.item.read_bytes * (len(s.ranks) - 1)
                        for sp in shared.values() for s in sp.shared if s.reader == sp.rank)
