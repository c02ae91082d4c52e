"""Issue 27: how a rank's bytes arrive is planned (planning/transfer.py) and run by one
executor seam (io/transfer/): every kind gives bitwise the direct reads, and the load phase
plans nothing (every planning builder raises while it runs)."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from helpers import run_ranks
from pploader import Topology
from pploader.errors import PlanError

#: the planning functions that build plans, windows, roles or sharing: none may run while
#: loading (their names; patched wherever a pploader module holds them)
BUILDERS = ("plan_rank", "plan_all", "plan_mtp", "make_windows", "checkpoint_roles",
            "share_reads", "share_node_reads", "plan_transfer", "plan_stage", "open_model",
            "open_checkpoint", "load_spec", "stage_window")


def forbid_planning() -> list[str]:
    """Replace every planning builder, in every loaded pploader module that holds it, by a
    function that raises: returns where each was replaced."""
    import pploader.planning.checkpoint as checkpoint
    import pploader.planning.plan as plan
    import pploader.planning.roles as roles
    import pploader.planning.share as share
    import pploader.planning.spec as spec
    import pploader.planning.stage as stage
    import pploader.planning.transfer as transfer
    originals = {name: getattr(mod, name) for mod in (checkpoint, plan, roles, share, spec,
                                                       stage, transfer)
                 for name in BUILDERS if hasattr(mod, name)}
    assert set(originals) == set(BUILDERS), set(BUILDERS) - set(originals)

    def forbidden(name: str) -> Callable[..., Any]:
        def raise_(*_: Any, **__: Any) -> Any:
            raise AssertionError(f"{name} called while loading: the load phase must not plan")
        return raise_
    replaced = []
    for modname, module in list(sys.modules.items()):
        if not modname.startswith("pploader") or module is None:
            continue
        for name, fn in originals.items():
            if getattr(module, name, None) is fn:
                setattr(module, name, forbidden(name))
                replaced.append(f"{modname}.{name}")
    return replaced


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _every_kind(rank: int, world: int, model: str) -> dict:
    from pploader import iter_stage_weights, load_stage, plan_stage
    from pploader.distributed.comm import Comm
    topo = Topology.for_world(world, rank, pp=2, tp=2)
    comm = Comm(topo, timeout_s=60)
    plans = {"direct": plan_stage(model, topo, exchange_cost=None),
             "exchange": plan_stage(model, topo, exchange_cost=0.0),
             "stage_read_once": plan_stage(model, topo, read_once=True),
             "node_read_once": plan_stage(model, topo, exchange_cost=0.0,
                                          node_ranks=range(world))}
    replaced = forbid_planning()
    out: dict[str, Any] = {"replaced": replaced, "kinds": {}, "tensors": {}, "streamed": {}}
    for name, staged in plans.items():
        out["kinds"][name] = staged.kind
        result = load_stage(staged, comm=comm)
        out["tensors"][name] = {k: _bytes(v) for k, v in result.state_dict.items()}
        out["streamed"][name] = {k: _bytes(v) for k, v in
                                 iter_stage_weights(staged, comm=comm)}
    comm.agree(None)
    comm.close()
    return out


@pytest.mark.slow
def test_every_transfer_kind_loads_the_direct_bytes_without_planning(
        tiny_checkpoints: Callable[[str], Path]) -> None:
    model = tiny_checkpoints("tiny-llama")
    results = run_ranks(_every_kind, 4, str(model))
    for rank, res in enumerate(results):
        assert res["kinds"] == {"direct": "direct", "exchange": "exchange",
                                "stage_read_once": "stage_read_once",
                                "node_read_once": "node_read_once"}, rank
        # the builders were really replaced where the load path could reach them
        assert {"pploader.planning.plan.plan_rank", "pploader.planning.stage.plan_stage",
                "pploader.stage.plan_stage", "pploader.planning.share.share_reads"} <= \
            set(res["replaced"])
        direct = res["tensors"]["direct"]
        assert direct
        for kind in ("exchange", "stage_read_once", "node_read_once"):
            assert res["tensors"][kind] == direct, (rank, kind)
            assert res["streamed"][kind] == direct, (rank, kind)


def test_forbid_planning_really_forbids(tiny_checkpoints: Callable[[str], Path],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard above is real: with it in place, planning raises (and a StagePlan made
    before loads without planning on one process)."""
    import pploader.planning.stage as stage
    from pploader import load_stage
    model = tiny_checkpoints("tiny-llama")
    staged = stage.plan_stage(model, Topology(2, rank=1))
    for modname in [m for m in sys.modules if m.startswith("pploader")]:
        for name in BUILDERS:  # undone by monkeypatch after the test
            if hasattr(sys.modules[modname], name):
                monkeypatch.setattr(sys.modules[modname], name,
                                    getattr(sys.modules[modname], name))
    forbid_planning()
    with pytest.raises(AssertionError, match="must not plan"):
        stage.plan_stage(model, Topology(2, rank=1))
    assert load_stage(staged).state_dict


def test_transfer_kinds_are_planned(tiny_checkpoints: Callable[[str], Path]) -> None:
    """The kind is decided at planning time, from the flags and the plan; read once per stage
    and per node exclude each other; the node must contain this rank."""
    from pploader import plan_stage
    model = tiny_checkpoints("tiny-llama")
    topo = Topology(1, 2, rank=1)
    assert plan_stage(model, topo, exchange_cost=None).kind == "direct"
    assert plan_stage(model, topo, exchange_cost=0.0).kind == "exchange"
    once = plan_stage(model, topo, read_once=True)
    assert once.kind == "stage_read_once" and once.transfer is not None
    assert once.transfer.shared is not None and once.transfer.ranks == (0, 1)
    node = plan_stage(model, topo, node_ranks=[0, 1])
    assert node.kind == "node_read_once" and node.transfer.node is not None
    with pytest.raises(PlanError, match="exclude each other"):
        plan_stage(model, topo, read_once=True, node_ranks=[0, 1])
    with pytest.raises(PlanError, match="must include this rank"):
        plan_stage(model, topo, node_ranks=[0])


def test_read_once_kinds_need_a_comm(tiny_checkpoints: Callable[[str], Path]) -> None:
    from pploader import load_stage, plan_stage
    model = tiny_checkpoints("tiny-llama")
    staged = plan_stage(model, Topology(1, 2, rank=0), read_once=True)
    with pytest.raises(ValueError, match="needs a Comm"):
        load_stage(staged)
    # an exchange plan without a Comm reads its targets directly
    exchange = plan_stage(model, Topology(1, 2, rank=0), exchange_cost=0.0)
    direct = plan_stage(model, Topology(1, 2, rank=0), exchange_cost=None)
    got, want = load_stage(exchange).state_dict, load_stage(direct).state_dict
    assert got.keys() == want.keys()
    assert all(_bytes(got[k]) == _bytes(want[k]) for k in want)


def test_device_windows_cut_in_plan_order_within_the_budget(
        tiny_checkpoints: Callable[[str], Path]) -> None:
    """The device stream's windows (io/transfer/direct.py): consecutive, in plan order, each
    within the budget unless one item alone is larger."""
    from pploader import plan_stage
    from pploader.io.transfer.direct import device_windows
    items = plan_stage(tiny_checkpoints("tiny-llama"), Topology(1)).plan.items
    budget = 32 << 10
    windows = device_windows(items, budget)
    assert [i for w in windows for i in w] == list(items)
    assert len(windows) > 2
    for w in windows:
        assert len(w) == 1 or sum(i.nbytes for i in w) <= budget
    assert device_windows(items, 1 << 40) == [tuple(items)]
