"""io/staging.py on a CPU-only host: the process's ring per GPU is made once, lent to one
load at a time (a second load gets its own), paused while lent and resumed when given back.
CUDA is faked as available (the ring's page-locking then fails and leaves slots pageable,
which is what a load without ready staging reads through anyway)."""
from __future__ import annotations

import pytest
import torch

from pploader.io import staging


@pytest.fixture()
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    staging.release_staging()
    yield
    staging.release_staging()


def test_no_staging_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA host")
    assert staging.start_staging("cuda") is None
    assert staging.process_staging("cpu") is None


def test_one_ring_per_gpu_lent_once_resumed_after(fake_cuda: None) -> None:
    ring = staging.process_staging("cuda:0", threads=2)
    assert ring is not None and staging.process_staging("cuda", threads=2) is ring
    assert staging.process_staging("cuda:1", threads=2) is not ring
    assert staging.start_staging("cuda:0", threads=2) is ring and ring._preparer is not None
    lent, shared = staging.lend_staging("cuda:0", threads=2)
    assert lent is ring and shared and ring._halt.is_set()  # paused for the load
    other, shared = staging.lend_staging("cuda:0", threads=2)
    assert other is not ring and not shared  # never two loads on one ring's slots
    assert staging.start_staging("cuda:0", threads=2) is ring and ring._halt.is_set()
    staging.return_staging(other)  # not the process's: nothing changes
    assert ring._halt.is_set()
    staging.return_staging(ring)
    assert not ring._halt.is_set()  # resumed
    ring._preparer.join()
    assert ring.ready_slots == ring.threads * ring.per_thread  # every slot tried once
    again, shared = staging.lend_staging("cuda:0", threads=2)
    assert again is ring and shared
    staging.return_staging(ring)


def test_a_reader_page_locks_a_slot_it_reaches_first(fake_cuda: None,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The default (``lock_in_load``): a reader at a slot the background preparer has not
    reached page-locks it once (pageable copies ran 4x slower on 2x H200); with it off, the
    slot is used pageable and the driver is never called."""
    from pploader.io import pinned_ring
    calls: list[int] = []
    monkeypatch.setattr(pinned_ring, "_host_register", lambda ptr, n, dev: calls.append(n))
    ring = staging.process_staging("cuda:0", threads=2)
    assert ring is not None and ring.lock_in_load
    ring.lock_in_load = False
    ring.reached(0, 0)  # used pageable: no driver call
    assert calls == [] and ring.ready_slots == 0
    ring.lock_in_load = True
    ring.reached(0, 0)
    ring.reached(0, 0)  # once per slot
    assert len(calls) == 1


def test_an_unindexed_cuda_device_is_the_current_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """``device="cuda"`` as the docs write it reaches the backends as the current GPU's index
    (their reader threads call ``torch.cuda.set_device``, which refuses an unindexed device
    on torch 2.11); an indexed device and the CPU pass unchanged."""
    from pploader.io.registry import indexed_device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert indexed_device("cuda") == torch.device("cuda", 1)
    assert indexed_device(torch.device("cuda")) == torch.device("cuda", 1)
    assert indexed_device("cuda:0") == torch.device("cuda", 0)
    assert indexed_device(0) == torch.device("cuda", 0)
    assert indexed_device("cpu") == torch.device("cpu")
