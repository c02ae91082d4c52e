"""The fast planner equals a straightforward one (issue 17 item 6: planning speed).

The speed-ups (a hook-free header parse, per-stage results shared by a stage's ranks, one
selection per TP rule instead of per name, memoised exchange choices, per-tensor records built
in column passes, later layers of a kind checked by signature) must not change a single byte
range or error. Checked on real published
layouts (sparse files, tests/real_layouts.py) against computations that share nothing:
the strict header parser, a fresh index + roles per rank, and every item's selection, read
item and exchange choice recomputed per tensor without any memo.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pytest

import pploader.planning.header as ckpt
from pploader.errors import PlanError
from pploader.planning.checkpoint import open_checkpoint, parse_header
from pploader.planning.items import tensor_selection
from pploader.planning.plan import (DEFAULT_EXCHANGE_COST, RankPlan, ReadItem,
                                    checkpoint_roles, make_windows, plan_all, plan_rank,
                                    read_item)
from pploader.planning.quant import quant_scheme
from pploader.planning.redistribute import ExchangeItem, Exchanger
from pploader.planning.shard import local_experts
from pploader.planning.spec import load_spec
from pploader.planning.topology import Topology
from real_layouts import build_layout


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("equivalence-layouts")


@pytest.mark.parametrize("model", ["deepseek-v3", "llama-3.1-70b"])
def test_fast_header_parse_equals_the_strict_one(root: Path, model: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    path = build_layout(model, root)
    shards = sorted(path.glob("*.safetensors"))
    fast = [parse_header(p) for p in shards]
    monkeypatch.setattr(ckpt, "_fast_header", lambda *args: None)  # the strict path only
    strict = [parse_header(p) for p in shards]
    assert fast == strict
    assert sum(len(h.tensors) for h in fast) == len(open_checkpoint(path).weight_map)
    monkeypatch.undo()
    monkeypatch.setattr(ckpt, "_orjson", None)  # the stdlib fallback of the fast parse
    assert [parse_header(p) for p in shards] == strict


def test_fast_header_parse_refuses_what_it_cannot_prove(tmp_path: Path) -> None:
    """Duplicate keys hidden from a hook-free parser (a tensor, an entry key, the metadata)
    and escapes fall back to the strict parse, which names the problem."""
    entry = '{"dtype":"U8","shape":[1],"data_offsets":[%d,%d]}'
    cases = {
        "tensor": '{"a":%s,"a":%s}' % (entry % (0, 1), entry % (1, 2)),
        "key": '{"a":{"dtype":"U8","dtype":"U8","shape":[2],"data_offsets":[0,2]}}',
        "metadata": '{"__metadata__":{"k":"v","k":"w"},"a":%s}' % (entry % (0, 2)).replace(
            "[1]", "[2]"),
        "colon": '{"__metadata__":{"k:":"v:"},"a:b":%s,"a:b":%s}' % (entry % (0, 1),
                                                                     entry % (1, 2)),
    }
    for what, header in cases.items():
        raw = header.encode()
        raw += b" " * (-len(raw) % 8)
        path = tmp_path / f"{what}.safetensors"
        path.write_bytes(len(raw).to_bytes(8, "little") + raw + b"\0\0")
        assert ckpt._loads_fast(header.encode()) is not None  # the hook-free parse alone accepts it
        with pytest.raises(ckpt.CheckpointError, match="duplicate key"):
            parse_header(path)
    escaped = '{"\\u0061":%s}' % (entry % (0, 1))
    assert ckpt._loads_fast(escaped.encode()) is None


@pytest.mark.parametrize("orjson", [True, False])
def test_index_duplicates_are_refused_by_the_fast_parse(tmp_path: Path, orjson: bool,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The index's weight_map is a flat string map (counted without walking it): a repeated
    tensor, one with a ":" or '"'-free odd name, or a repeated top-level key is refused with
    the strict parser's message; a clean index parses to the same map either way."""
    if not orjson:
        monkeypatch.setattr(ckpt, "_orjson", None)
    clean = '{"metadata": {"total_size": 4}, "weight_map": {"a:b": "m.safetensors", "c": "m.safetensors"}}'
    assert ckpt.loads_checked(clean.encode()) == ckpt._loads(clean)
    for text in ('{"weight_map": {"a": "m.safetensors", "a": "n.safetensors"}}',
                 '{"weight_map": {"a": "m.safetensors"}, "weight_map": {"b": "m.safetensors"}}',
                 '{"metadata": {"k": 1, "k": 2}, "weight_map": {"a": "m.safetensors"}}'):
        assert ckpt._loads_fast(text.encode()) is not None  # the hook-free parse alone accepts it
        with pytest.raises(ckpt.CheckpointError, match="duplicate key"):
            ckpt.loads_checked(text.encode())


def _direct_items(plan: RankPlan, spec_path: Path) -> tuple[list[ReadItem], list[str]]:
    """Every item of ``plan`` recomputed per tensor, from a fresh index and no memo; and
    the targets a memo-free exchanger picks."""
    index = open_checkpoint(spec_path)
    spec = load_spec(spec_path).for_checkpoint(index.weight_map)
    roles = checkpoint_roles(spec, index)
    spec = roles.spec
    topo = plan.topology
    experts = (local_experts(spec.num_experts, topo.ep_size, topo.ep_rank)
               if spec.num_experts and topo.ep_size > 1 else None)
    scheme = quant_scheme(spec)
    every = dict(roles.items())
    items, exchanged = [], []
    for item in plan.items:
        entry = index.entry(item.name)
        role = every[item.name]
        sel = tensor_selection(spec, role, entry, topo, experts, index, scheme)
        items.append(read_item(entry, item.target, sel, plan.range_cost_bytes))
        if topo.tp_size > 1:
            chooser = Exchanger(topo, range_cost_bytes=plan.range_cost_bytes,
                                exchange_cost=DEFAULT_EXCHANGE_COST)  # fresh: no memo
            if chooser.consider(entry, item.target, sel, (item.name,), lambda peer: tensor_selection(
                    spec, role, entry, peer, experts, index, scheme)):
                exchanged.append(item.target)
    return items, exchanged


@pytest.mark.parametrize("model,pp,tp,ep,ranks", [
    ("deepseek-v3", 16, 8, 1, [127]),      # the last stage (4 layers + head), TP slices
    ("deepseek-v3", 8, 1, 8, [0, 63]),     # first / last stage, 32 of 256 experts each
    ("llama-3.1-70b", 1, 8, 1, [0, 7]),    # every layer, TP8 (row-parallel exchanges)
    ("qwen3-next-80b-a3b", 16, 4, 1, [29]),  # TP4 hybrid (gated delta net + attention, MoE)
    ("nemotron-h-8b", 2, 4, 1, [5]),       # TP4 hybrid (Mamba2 + attention)
    ("jamba-v0.1", 4, 2, 2, [0, 15]),      # hybrid of 4 layer kinds (Mamba / attention x
    #                                        dense / MoE): per-component memos across stages
    ("mixtral-8x7b", 2, 2, 2, [0, 7]),     # every rank and plan_all (shared memos) compared
])
def test_fast_plans_equal_direct_per_tensor_plans(root: Path, model: str, pp: int, tp: int,
                                                  ep: int, ranks: list[int]) -> None:
    path = build_layout(model, root)
    index = open_checkpoint(path)
    spec = load_spec(path)
    roles = checkpoint_roles(spec, index)   # shared by every rank planned, as in plan_all
    windows = make_windows(roles.spec, index, pp, roles=roles)
    topo = Topology(pp, tp, ep)
    small = pp * tp * ep <= 8   # small layouts: every stage, and plan_all compared too
    stages = set(range(pp)) if small else {topo.with_rank(r).pp_rank for r in ranks}
    shared = {t.rank: plan_rank(roles.spec, index, t, windows[t.pp_rank], roles=roles)
              for t in topo.all_ranks() if t.pp_rank in stages}
    if small:
        assert plan_all(load_spec(path), open_checkpoint(path), pp, tp, ep) == \
            [shared[r] for r in range(pp * tp * ep)]
    plans = list(shared.values())
    for rank in ranks:
        plan = shared[rank]
        # one rank planned alone, from a fresh index (nothing shared with the others)
        fresh = open_checkpoint(path)
        alone = plan_rank(load_spec(path), fresh, plan.topology,
                          make_windows(load_spec(path), fresh, pp)[plan.topology.pp_rank])
        assert alone == plan
        assert alone.redistribute == plan.redistribute
        direct, exchanged = _direct_items(plan, path)
        assert list(plan.items) == direct
        ex = plan.redistribute
        assert sorted(ex.targets if ex is not None else ()) == sorted(exchanged)
    # items and shares are built from columns (tuple.__new__): each a whole ReadItem
    shares = [i.share for p in plans if p.redistribute for i in p.redistribute.items]
    assert all(type(i) is ReadItem and len(i) == len(ReadItem._fields)
               for i in [*shares, *(i for p in plans for i in p.items)])
    assert all(type(i) is ExchangeItem and len(i) == len(ExchangeItem._fields)
               for p in plans if p.redistribute for i in p.redistribute.items)


def _small_deepseek(root: Path, change: Callable[[dict], None]) -> Path:
    """A 6-layer, 8-expert DeepSeek-V3 (FP8 + block scales) as one sparse shard, its
    ``{name: (dtype, shape)}`` edited by ``change`` first."""
    from real_layouts import _write_sparse, real_config, real_tensors
    from pploader.planning.spec import spec_from_config
    config = dict(real_config("deepseek-v3"), num_hidden_layers=6, n_routed_experts=8,
                  num_experts_per_tok=2, n_group=1, topk_group=1, num_nextn_predict_layers=0,
                  first_k_dense_replace=1)
    tensors = real_tensors(spec_from_config(config))
    change(tensors)
    root.mkdir()
    _write_sparse(root / "model.safetensors", tensors)
    (root / "config.json").write_text(json.dumps(config))
    return root


def test_a_layer_like_a_checked_one_is_not_rechecked_but_a_different_one_is(
        tmp_path: Path) -> None:
    """Strict accounting checks the first layer of each kind name by name and the others by
    signature (planning/accounting.py): a defect in a later layer changes its signature, so
    it is still found, with the message of a full check (every bad layer named)."""
    good = _small_deepseek(tmp_path / "good", lambda t: None)
    index = open_checkpoint(good)
    roles = checkpoint_roles(load_spec(good), index)
    plan_rank(roles.spec, index, Topology(1), make_windows(roles.spec, index, 1)[0], roles=roles)
    assert sum(map(len, roles.checked_layers.values())) == 2  # dense layer 0, MoE layers 1-5
    scale = "model.layers.{}.mlp.experts.3.down_proj.weight_scale_inv"

    def bad_shape(t: dict) -> None:
        dtype, shape = t[scale.format(4)]
        t[scale.format(4)] = (dtype, (shape[0] + 1,) + shape[1:])

    with pytest.raises(PlanError, match=r"shape \[.*\] in the checkpoint .* expected") as err:
        plan_all(*_opened(_small_deepseek(tmp_path / "shape", bad_shape)), 1)
    assert err.value.tensor == scale.format(4)

    def two_missing(t: dict) -> None:
        del t[scale.format(2)], t[scale.format(5)]

    with pytest.raises(PlanError, match="2 required tensor") as err:
        plan_all(*_opened(_small_deepseek(tmp_path / "missing", two_missing)), 1)
    assert scale.format(2) in str(err.value) and scale.format(5) in str(err.value)


def _opened(path: Path) -> tuple:
    return load_spec(path), open_checkpoint(path)
