"""Cyclic garbage collection paused while planning builds its objects.

Planning a large checkpoint creates hundreds of thousands of small container objects (parsed
header JSON, entries, roles, read items) and none of them forms a reference cycle, yet each
allocation burst makes the cyclic collector scan every live object again: on DeepSeek-V3's
92 k tensors that scanning was more than half of the planning time. The collector is paused
for the duration of a planning call and resumed (only if it was running) afterwards;
reference counting still frees everything as usual.

Resuming plainly would not save the scan, only move it: every object made during the pause is
still in the youngest generation, so the first allocation after ``gc.enable()`` starts a
collection that traverses all of them (a quarter of a TP8 rank's plan of DeepSeek-V3). On
resume the young generations (the pause's objects, and whatever the caller made just before)
are therefore moved to the oldest generation first (``gc.freeze()`` then ``gc.unfreeze()``:
two list splices), where only a full collection looks at them, and by then a released plan is
long freed by reference counting. Skipped when the caller froze objects
itself (``gc.get_freeze_count()``): unfreezing would undo its freeze. Pure: no I/O, no
collective.
"""
from __future__ import annotations

import functools
import gc
from contextlib import contextmanager
from typing import Callable, Iterator, TypeVar

__all__ = ["gc_paused", "without_gc"]

F = TypeVar("F", bound=Callable)


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic collector inside the block (nested blocks are fine)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        if gc.get_freeze_count() == 0:  # the young generations to the oldest one
            gc.freeze()
            gc.unfreeze()
        gc.enable()


def without_gc(func: F) -> F:
    """Decorator: ``func`` runs with the cyclic collector paused (:func:`gc_paused`)."""
    @functools.wraps(func)
    def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
        with gc_paused():
            return func(*args, **kwargs)
    return wrapper  # type: ignore[return-value]
