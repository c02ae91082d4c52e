"""planning/gcpause.py: the collector is paused inside a planning call and resumed after,
without a deferred scan of what the call made, and a caller's own freeze is left alone."""
from __future__ import annotations

import gc

from pploader.planning.gcpause import gc_paused, without_gc


def test_paused_inside_resumed_after_with_nothing_left_young() -> None:
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        kept = [[i] for i in range(5000)]  # tracked objects made during the pause
        assert gc.get_count()[0] >= 5000
    assert gc.isenabled()
    assert gc.get_count()[0] < 5000      # moved on: no collection pending over them
    assert gc.get_freeze_count() == 0
    assert len(kept) == 5000


def test_nested_and_decorated() -> None:
    @without_gc
    def inner() -> bool:
        with gc_paused():
            return gc.isenabled()
    assert inner() is False
    assert gc.isenabled()


def test_a_callers_freeze_is_kept() -> None:
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 0
        with gc_paused():
            [[i] for i in range(100)]
        # still frozen (an unfreeze would empty it); "<=": another thread of the test process
        # may free a frozen object meanwhile, which lowers the count
        assert 0 < gc.get_freeze_count() <= frozen and gc.isenabled()
    finally:
        gc.unfreeze()
