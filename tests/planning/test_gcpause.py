"""planning/gcpause.py: the collector is paused inside a planning call and resumed after,
without a deferred scan of what the call made, and a caller's own freeze is left alone.

The collector's state is process-wide, and other tests leave threads behind (readers, thread
pools) that may allocate, plan or free objects meanwhile; each check therefore runs in a fresh
interpreter of its own."""
from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

import pytest

from pploader.planning.gcpause import gc_paused, without_gc


def check_paused_inside_resumed_after_with_nothing_left_young() -> None:
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        kept = [[i] for i in range(5000)]  # tracked objects made during the pause
        assert gc.get_count()[0] >= 5000
    assert gc.isenabled()
    assert gc.get_count()[0] < 5000      # moved on: no collection pending over them
    assert gc.get_freeze_count() == 0
    assert len(kept) == 5000


def check_nested_and_decorated() -> None:
    @without_gc
    def inner() -> bool:
        with gc_paused():
            return gc.isenabled()
    assert inner() is False
    assert gc.isenabled()


def check_a_callers_freeze_is_kept() -> None:
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 0
        with gc_paused():
            [[i] for i in range(100)]
        assert gc.get_freeze_count() == frozen and gc.isenabled()
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("check", [check_paused_inside_resumed_after_with_nothing_left_young,
                                   check_nested_and_decorated, check_a_callers_freeze_is_kept],
                         ids=lambda f: f.__name__[len("check_"):])
def test_in_a_fresh_interpreter(check) -> None:  # type: ignore[no-untyped-def]
    here = Path(__file__).parent
    code = f"import test_gcpause; test_gcpause.{check.__name__}()"
    run = subprocess.run([sys.executable, "-c", code], cwd=here, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
