"""Stage windows and per-rank plans (one process, headers only)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import make_model, pploader_cmd, run, tiny_config
from pploader import PlanError, Topology
from pploader.planning.checkpoint import open_checkpoint
from pploader.planning.partition import balanced_windows, even_windows, explicit_windows
from pploader.planning.plan import plan_all
from pploader.planning.spec import load_spec


def test_even_windows_cover_all_layers_remainder_to_middle() -> None:
    w = even_windows(10, 4)
    assert [(x.start_layer, x.end_layer) for x in w] == [(0, 2), (2, 5), (5, 8), (8, 10)]
    assert w[0].has_embed and not w[0].has_head and w[-1].has_head
    for n in range(1, 40):
        for pp in range(1, min(n, 9) + 1):
            ws = even_windows(n, pp)
            assert ws[0].start_layer == 0 and ws[-1].end_layer == n
            assert all(a.end_layer == b.start_layer for a, b in zip(ws, ws[1:]))
            sizes = [x.num_layers for x in ws]
            assert max(sizes) - min(sizes) <= 1


def test_explicit_windows_validate() -> None:
    assert [x.num_layers for x in explicit_windows([1, 3, 2], 6, 3)] == [1, 3, 2]
    with pytest.raises(PlanError, match="sums to 5"):
        explicit_windows([1, 2, 2], 6, 3)
    with pytest.raises(PlanError, match="3 stages but pp is 2"):
        explicit_windows([1, 3, 2], 6, 2)
    with pytest.raises(PlanError, match="cannot split"):
        even_windows(3, 4)


def test_balanced_minimises_the_largest_stage() -> None:
    costs = [1, 1, 1, 1, 10, 10, 1, 1]
    ws = balanced_windows(costs, 3)
    stage = [sum(costs[w.start_layer:w.end_layer]) for w in ws]
    even = [sum(costs[w.start_layer:w.end_layer]) for w in even_windows(8, 3)]
    assert max(stage) <= max(even)
    assert max(stage) == 12  # [1,1,1,1,10] can't be beaten: best is 4 | 10 | 10+1+1 -> 12
    # embedding/head extras push layers away from the first/last stage
    ws2 = balanced_windows([1] * 8, 2, first_extra=4)
    assert ws2[0].num_layers < ws2[1].num_layers


@pytest.mark.parametrize("pp", [1, 2, 3, 4])
def test_union_of_stages_is_the_checkpoint(tiny_llama: Path, pp: int) -> None:
    spec, index = load_spec(tiny_llama), open_checkpoint(tiny_llama)
    plans = plan_all(spec, index, pp)
    held = [n for p in plans for n in p.tensors]
    assert sorted(held) == sorted(index.weight_map)  # no duplicates, nothing missing
    for p in plans:
        for item in p.items:
            entry = index.entry(item.name)
            assert item.ranges == ((entry.start, entry.nbytes),)
        assert p.read_bytes == p.ideal_bytes
        # files with nothing needed are never opened
        assert set(p.files) == {index.weight_map[n] for n in p.tensors}


def test_tied_embeddings_last_stage_reads_embed_as_head(tmp_path: Path) -> None:
    model = make_model(tmp_path / "tied", tiny_config(tie_word_embeddings=True))
    spec, index = load_spec(model), open_checkpoint(model)
    assert "lm_head.weight" not in index.weight_map
    plans = plan_all(spec, index, 2)
    last = {i.target: i.name for i in plans[-1].items}
    assert last["lm_head.weight"] == "model.embed_tokens.weight"
    assert "model.embed_tokens.weight" in plans[0].tensors
    assert "model.embed_tokens.weight" in plans[1].tensors  # the declared replica


def test_plan_cli_json(tiny_llama: Path) -> None:
    out = run(pploader_cmd("plan", "--model", str(tiny_llama), "--pp", "4", "--json"))
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert (doc["pp"], doc["tp"], doc["ep"]) == (4, 1, 1)
    assert [r["rank"] for r in doc["ranks"]] == [0, 1, 2, 3]
    for r in doc["ranks"]:
        for key in ("pp_rank", "tp_rank", "ep_rank", "start_layer", "end_layer", "ideal_bytes",
                    "files", "tensors"):
            assert key in r
    assert doc["ranks"][-1]["end_layer"] == 8
    table = run(pploader_cmd("plan", "--model", str(tiny_llama), "--pp", "2"))
    assert table.returncode == 0 and "planned read" in table.stdout


def test_plan_cli_bad_partition_exit_2(tiny_llama: Path) -> None:
    out = run(pploader_cmd("plan", "--model", str(tiny_llama), "--pp", "2", "--partition", "3,3"))
    assert out.returncode == 2
    assert "sums to 6" in out.stderr


def test_topology_rank_order_tp_innermost() -> None:
    topo = Topology(pp_size=2, tp_size=2, ep_size=2)
    coords = [(t.pp_rank, t.ep_rank, t.tp_rank) for t in topo.all_ranks()]
    assert coords == [(p, e, t) for p in range(2) for e in range(2) for t in range(2)]
    assert topo.with_rank(5).tp_group() == (4, 5)
    with pytest.raises(Exception, match="world size"):
        Topology.for_world(6, 0, pp=4)


def test_tied_single_stage_reads_the_embedding_once(tmp_path: Path) -> None:
    """PP=1: the stage holds the embedding and ties the head to it; one read, counted once."""
    model = make_model(tmp_path / "tied1", tiny_config(tie_word_embeddings=True))
    index = open_checkpoint(model)
    plan = plan_all(load_spec(model), index, 1)[0]
    targets = {i.target: i.name for i in plan.items}
    assert targets["model.embed_tokens.weight"] == "model.embed_tokens.weight"
    assert "lm_head.weight" not in targets
    assert [i.name for i in plan.items].count("model.embed_tokens.weight") == 1
    assert plan.ideal_bytes == plan.read_bytes == sum(
        index.entry(n).nbytes for n in index.weight_map)


@pytest.fixture(scope="module")
def padded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("totals")
    return {"llama": make_model(root / "llama", tiny_config(vocab_size=250)),  # padded vocab
            "moe": make_model(root / "moe", tiny_config("tiny-qwen3_moe"))}


@pytest.mark.parametrize("model, pp, tp, ep, options", [
    ("llama", 1, 4, 1, {}),                                                  # exchanged
    ("llama", 2, 4, 1, {"exchange_cost": None, "range_cost_bytes": 1 << 30}),  # boxes
    ("llama", 1, 4, 1, {"exchange_cost": None, "range_cost_bytes": 0}),        # row runs
    ("moe", 1, 2, 2, {"exchange_batch_bytes": 3000}),                        # row chunks
])
def test_plan_totals_equal_the_per_item_sums(padded: dict[str, Path], model: str, pp: int,
                                             tp: int, ep: int, options: dict) -> None:
    """The totals ``pploader plan`` prints, computed in C passes and once per kind of item,
    equal the per-item properties they stand for (read and ideal bytes, files, read methods,
    bytes exchanged)."""
    from pploader.planning.items import read_method_items
    plans = plan_all(load_spec(padded[model]), open_checkpoint(padded[model]), pp, tp, ep,
                     **options)
    seen: set[str] = set()
    for plan in plans:
        items = plan.items
        assert plan.read_bytes == sum(i.read_bytes for i in items)
        assert plan.ideal_bytes == sum(i.ideal_bytes for i in items)
        assert plan.files == tuple(dict.fromkeys(i.file for i in items if i.ranges))
        ex = plan.redistribute
        skip = ex.targets if ex is not None else frozenset()
        direct = [i for i in items if i.target not in skip]
        assert plan.direct_items == direct
        by = read_method_items(direct)
        assert by == {"whole": [i for i in direct if not i.gather and len(i.ranges) <= 1],
                      "rows": [i for i in direct if not i.gather and len(i.ranges) > 1],
                      "box": [i for i in direct if i.gather]}
        seen.update(k for k, v in by.items() if v)
        seen.update(["padded"] if any(i.pad_rows for i in items) else [])
        if ex is not None:
            seen.add("exchanged")
            me, peers = ex.tp_rank, range(len(ex.group))
            assert ex.read_bytes == sum(i.share.read_bytes for i in ex.items)
            assert ex.sent_bytes == sum(i.piece_bytes(me, q) for i in ex.items
                                        for q in peers if q != me)
            assert ex.received_bytes == sum(i.piece_bytes(p, me) for i in ex.items
                                            for p in peers if p != me)
    wanted = {"llama": {"whole", "padded"}, "moe": {"whole"}}[model] | (
        {"exchanged"} if options.get("exchange_cost", 0.5) is not None else
        {"box"} if options["range_cost_bytes"] else {"rows"})
    assert wanted <= seen  # each case exercises what it is there for


def test_totals_tell_apart_items_that_differ_in_one_field() -> None:
    """Hand-made items that share everything but pad rows, or rows but not selections, or
    selections but not rows: the totals computed once per kind count each kind apart."""
    from pploader.planning.items import ReadItem, total_ideal_bytes, total_read_bytes
    from pploader.planning.redistribute import ExchangeItem, Redistribute
    from pploader.planning.shard import Selection
    plain = ReadItem("a", "a", "f", "BF16", (4, 8), (4, 8), ((0, 64),), (4, 8))
    padded = plain._replace(name="b", target="b", pad_rows=1, ranges=((64, 48),))
    assert total_ideal_bytes([plain, padded, plain]) == 64 + 48 + 64
    assert total_read_bytes([plain, padded, plain]) == 64 + 48 + 64
    by_cols = tuple(Selection(((1, ((4 * q, 4),)),)) for q in range(2))  # column halves
    by_rows = tuple(Selection(((0, ((2 * q, 2),)),)) for q in range(2))  # row halves
    rows, other_rows = ((0, 2), (2, 2)), ((0, 1), (1, 3))
    share = plain._replace(ranges=((0, 32),), shape=(2, 8), buffer_shape=(2, 8))
    items = [ExchangeItem("w", "w", "f", "BF16", (4, 8), r, s, share, 0)
             for r, s in ((rows, by_cols), (rows, by_rows), (other_rows, by_cols),
                          (rows, by_cols))]
    for me in range(2):
        ex = Redistribute((0, 1), me, tuple(items), 0.5, 1 << 20)
        assert ex.sent_bytes == sum(i.piece_bytes(me, 1 - me) for i in items)
        assert ex.received_bytes == sum(i.piece_bytes(1 - me, me) for i in items)
