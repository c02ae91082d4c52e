"""The ``mapped`` backend (io/mapped.py): warm items are views of the page cache (no copy),
cold ones positional reads; a mix keeps plan order and equals the threaded backend bitwise."""
from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

from helpers import evict_or_skip, make_model, tiny_config
from pploader import Topology, load_stage, plan_stage
from pploader.io.backend import ReadOptions
from pploader.io.mapped import MappedBackend
from pploader.io.mapped_split import strided_runs


@pytest.fixture()
def llama(tmp_path: Path) -> Path:
    return make_model(tmp_path / "llama", tiny_config(vocab_size=250), shard_bytes=40_000)



@pytest.mark.parametrize("tp", [1, 2])
def test_half_warm_half_cold_equals_threaded(llama: Path, tp: int) -> None:
    staged = plan_stage(llama, Topology(1, tp, 1, tp - 1), range_cost_bytes=0)
    ref = load_stage(staged, io_backend="threaded").state_dict
    files = sorted({i.file for i in staged.plan.items})
    assert len(files) > 2
    gc.collect()
    cold = files[::2]
    for f in cold:
        evict_or_skip([llama / f])
    backend = MappedBackend(staged.plan, ReadOptions())
    got = list(backend)
    assert [t for t, _ in got] == [i.target for i in staged.plan.items]   # plan order
    for target, tensor in got:
        assert torch.equal(tensor, ref[target]), target
    cold_bytes = sum(i.read_bytes for i in staged.plan.items if i.file in cold)
    assert backend.stats.read_bytes == staged.plan.read_bytes
    assert backend.mapped_bytes == staged.plan.read_bytes - cold_bytes
    assert 0 < backend.warm_items < len(staged.plan.items)


def test_warm_whole_items_are_views_and_copy_on_write(llama: Path) -> None:
    """A view shares the file's pages (no fresh buffer); writing into it never reaches the
    file (private mapping)."""
    staged = plan_stage(llama, Topology(1))
    for path in llama.glob("*.safetensors"):
        path.read_bytes()
    before = {p.name: p.read_bytes() for p in llama.glob("*.safetensors")}
    backend = MappedBackend(staged.plan, ReadOptions())
    tensors = dict(backend)
    item = max(staged.plan.items, key=lambda i: i.read_bytes)
    t = tensors[item.target]
    assert t.untyped_storage().nbytes() == (llama / item.file).stat().st_size
    t.zero_()
    assert {p.name: p.read_bytes() for p in llama.glob("*.safetensors")} == before


def test_destinations_are_filled(llama: Path) -> None:
    staged = plan_stage(llama, Topology(1, 2, 1, 1), range_cost_bytes=0)
    ref = load_stage(staged, io_backend="threaded").state_dict
    dst = {k: torch.empty_like(v) for k, v in ref.items()}
    out = MappedBackend(staged.plan, ReadOptions()).load(dst)
    for k, v in ref.items():
        assert out[k] is dst[k] and torch.equal(dst[k], v), k


def _expand(runs: list) -> list:
    return [(off + i * stride, n) for off, n, count, stride in runs for i in range(count)]


def test_strided_runs() -> None:
    """Ranges grouped into (offset, length, count, stride) runs that expand back to them:
    a dim-1 shard's rows are one run; anything irregular still covered, in order."""
    assert strided_runs([(0, 4), (10, 4), (20, 4)]) == [(0, 4, 3, 10)]
    assert strided_runs([(0, 4), (4, 4), (8, 4)]) == [(0, 4, 3, 4)]
    assert strided_runs([(7, 5)]) == [(7, 5, 1, 5)]
    assert strided_runs([]) == []
    irregular = [(0, 4), (10, 4), (25, 4), (30, 2), (40, 2), (50, 2), (51, 2)]
    assert strided_runs(irregular) == [(0, 4, 2, 10), (25, 4, 1, 4), (30, 2, 3, 10),
                                       (51, 2, 1, 2)]
    # a box of a 3-d tensor [4, 6, 8] bytes: rows 1..3 of dims 1, bytes 2..5 of dim 2
    box = [(b * 48 + r * 8 + 2, 4) for b in range(4) for r in range(1, 4)]
    runs = strided_runs(box)
    assert _expand(runs) == box and len(runs) == 4
    torch.manual_seed(0)
    for _ in range(50):
        offs = torch.randint(0, 5, (20,)).cumsum(0) * 8
        ranges = [(int(o), int(n)) for o, n in zip(offs, torch.randint(1, 9, (20,)))]
        assert _expand(strided_runs(ranges)) == ranges


def test_fault_budget_reads_cold_items_straight_into_destinations(llama: Path) -> None:
    """With ``fault_budget`` an item with missing pages is cold: it is read by positional
    reads straight into its destination (a 1-byte memory budget: no intermediate tensor);
    warm ones, dim-1 row runs included, are copied from the mapping (no read syscall)."""
    staged = plan_stage(llama, Topology(1, 2, 1, 1), range_cost_bytes=0)
    assert any(len(i.ranges) > 1 for i in staged.plan.items)  # dim-1 row runs
    ref = load_stage(staged, io_backend="threaded").state_dict
    files = sorted({i.file for i in staged.plan.items})
    gc.collect()
    for path in llama.glob("*.safetensors"):
        path.read_bytes()
    cold = files[::2]
    for f in cold:
        evict_or_skip([llama / f])
    dst = {k: torch.full_like(v, float("nan")) for k, v in ref.items()}
    backend = MappedBackend(staged.plan, ReadOptions(memory_budget_bytes=1), fault_budget=0.01)
    out = backend.load(dst)
    for k, v in ref.items():
        assert out[k] is dst[k] and torch.equal(dst[k], v), k
    warm = [i for i in staged.plan.items if i.file not in cold]
    cold_items = [i for i in staged.plan.items if i.file in cold]
    assert backend.warm_items == len(warm)
    assert backend.mapped_bytes == sum(i.read_bytes for i in warm)
    assert backend.stats.read_bytes == staged.plan.read_bytes
    assert backend.stats.syscalls >= len(cold_items)  # cold: positional reads only
    with pytest.raises(ValueError, match="fault_budget"):
        MappedBackend(staged.plan, ReadOptions(), fault_budget=-1)


def test_cold_fault_without_budget_asks_no_residency(llama: Path, monkeypatch) -> None:
    """``cold="fault"`` without ``fault_budget`` (the DCP reader's CPU path): no item's
    pages are looked up; every item, half the files evicted, is copied from the mapping into
    its destination bitwise (dim-1 row runs included), with no read syscall; the sampled
    check finds the evicted pages on the first load only (then ``cold_threads`` copy)."""
    from pploader.io import mapped_file
    staged = plan_stage(llama, Topology(1, 2, 1, 1), range_cost_bytes=0)
    assert any(len(i.ranges) > 1 for i in staged.plan.items)
    ref = load_stage(staged, io_backend="threaded").state_dict
    gc.collect()
    for f in sorted({i.file for i in staged.plan.items})[::2]:
        evict_or_skip([llama / f])

    def asked(*_: object) -> None:
        raise AssertionError("residency asked")
    monkeypatch.setattr(mapped_file.MappedFile, "missing", asked)
    monkeypatch.setattr(mapped_file.MappedFile, "resident", asked)
    dst = {k: torch.full_like(v, float("nan")) for k, v in ref.items()}
    for threads in (1, 3):
        backend = MappedBackend(staged.plan, ReadOptions(threads=threads), cold="fault",
                                cold_threads=4)
        out = backend.load(dst)
        assert backend.faulting == (threads == 1)  # the sample saw evicted pages, once
        for k, v in ref.items():
            assert out[k] is dst[k] and torch.equal(dst[k], v), (threads, k)
        assert backend.stats.read_bytes == backend.mapped_bytes == staged.plan.read_bytes
        assert backend.stats.syscalls == 0
        for t in dst.values():
            t.fill_(float("nan"))


def test_cached_pages_counts_resident_pages(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """cachestat's count of a byte range: every page after a read, fewer after eviction;
    ``resident_bytes_of_ranges`` (which counts with cachestat where it can) agrees with its
    mincore fallback on both."""
    from pploader.io import pagecache
    from pploader.io.pagecache import PAGE_BYTES, cached_pages, resident_bytes_of_ranges
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(range(256)) * (64 * PAGE_BYTES // 256))
    path.read_bytes()

    def both() -> tuple[int, int]:
        fast = resident_bytes_of_ranges(str(path), [(0, 64 * PAGE_BYTES)], sample_bytes=0)[0]
        with monkeypatch.context() as m:
            m.setattr(pagecache, "_cachestat_ok", [False])  # the mincore fallback
            slow = resident_bytes_of_ranges(str(path), [(0, 64 * PAGE_BYTES)],
                                            sample_bytes=0)[0]
        return fast, slow
    fd = os.open(path, os.O_RDONLY)
    try:
        got = cached_pages(fd, 0, 64 * PAGE_BYTES)
        if got is None:
            pytest.skip("no cachestat on this kernel (the mincore fallback is used)")
        assert got == 64 and both() == (64 * PAGE_BYTES, 64 * PAGE_BYTES)
        assert cached_pages(fd, 8 * PAGE_BYTES, 4 * PAGE_BYTES) == 4
        evict_or_skip([path])
        fast, slow = both()
        assert cached_pages(fd, 0, 64 * PAGE_BYTES) == fast // PAGE_BYTES < 64
        assert fast == slow
    finally:
        os.close(fd)


def test_nearly_resident_samples_the_span_it_is_asked_about(tmp_path: Path) -> None:
    """The whole-stage warm check (``MappedFile.nearly_resident``): true for a file just read;
    false once its second half is evicted, sampled or page by page; a span inside the
    resident half is still warm."""
    from pploader.io.mapped_file import MappedFile
    from pploader.io.pagecache import PAGE_BYTES, cached_pages
    size = 1024 * PAGE_BYTES
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(size))
    path.read_bytes()
    fd = os.open(path, os.O_RDONLY)
    try:
        if cached_pages(fd, 0, PAGE_BYTES) is None:
            pytest.skip("no cachestat on this kernel (callers look item by item)")
        f = MappedFile(fd, torch.from_file(str(path), size=size, dtype=torch.uint8))
        assert f.nearly_resident() and f.nearly_resident(sample_bytes=0)
        os.fdatasync(fd)  # dirty pages stay until written back
        os.posix_fadvise(fd, size // 2, size // 2, os.POSIX_FADV_DONTNEED)
        if cached_pages(fd, size // 2, size // 2) > size // PAGE_BYTES // 20:
            pytest.skip("this file system keeps the pages resident (no eviction)")
        small = 4 * PAGE_BYTES  # windows spread over the file: some land in the cold half
        assert not f.nearly_resident(sample_bytes=small)
        assert not f.nearly_resident(sample_bytes=0)
        assert f.nearly_resident(0, size // 2, sample_bytes=small)
        assert not f.nearly_resident(size // 4, size, sample_bytes=0)
    finally:
        os.close(fd)


def test_fault_budget_splits_a_partly_resident_item(tmp_path: Path) -> None:
    """Pages dropped from the middle of two items: their resident rows / pages are copied
    from the mapping and only the rest is read (some, not all, of their bytes; rchar = the
    reader's count); every value equal to the threaded backend's."""
    from pploader.report import proc_io
    model = make_model(tmp_path / "big", tiny_config(vocab_size=250, hidden_size=1024,
                                                    intermediate_size=4096,
                                                    num_hidden_layers=2),
                       shard_bytes=64_000_000)
    staged = plan_stage(model, Topology(1, 2, 1, 0), range_cost_bytes=0)
    ref = load_stage(staged, io_backend="threaded").state_dict
    gc.collect()
    for path in model.glob("*.safetensors"):
        path.read_bytes()
    rows = max((i for i in staged.plan.items if len(i.ranges) > 1), key=lambda i: i.read_bytes)
    whole = max((i for i in staged.plan.items if len(i.ranges) == 1), key=lambda i: i.read_bytes)
    for item in (rows, whole):  # drop the middle half of each (whole large folios in it)
        lo, hi = item.ranges[0][0], item.ranges[-1][0] + item.ranges[-1][1]
        fd = os.open(model / item.file, os.O_RDONLY)
        os.fdatasync(fd)
        os.posix_fadvise(fd, lo + (hi - lo) // 4, (hi - lo) // 2, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    dst = {k: torch.full_like(v, float("nan")) for k, v in ref.items()}
    backend = MappedBackend(staged.plan, ReadOptions(threads=1), fault_budget=0.0)
    io0 = proc_io()
    backend.load(dst)
    rchar = proc_io()["rchar"] - io0["rchar"]
    for k, v in ref.items():
        assert torch.equal(dst[k], v), k
    read = backend.stats.read_bytes - backend.mapped_bytes
    assert backend.stats.read_bytes == staged.plan.read_bytes
    if read == 0:
        pytest.skip("this file system keeps the pages resident (no eviction)")
    assert read < rows.read_bytes + whole.read_bytes  # split: not the two items whole
    n = len(staged.plan.items)  # a dropped large folio may reach into a neighbouring item
    assert n - 4 <= backend.warm_items < n
    assert read <= rchar <= read + 4096, (read, rchar)


def test_split_resident_covers_every_byte_once() -> None:
    """Rows and a one-range item split at missing pages: resident stretches + exact reads
    cover each byte of the item once, in destination order."""
    from pploader.io.mapped_split import split_resident
    from pploader.planning.items import ReadItem
    page = 16
    bitmap = bytes([1] * 4 + [0] * 3 + [1] * 9)  # pages 4..6 missing (bytes 64..111)
    for runs in ([(8, 6, 20, 12)], [(5, 200, 1, 200)]):
        ranges = tuple((off + r * stride, n) for off, n, count, stride in runs
                       for r in range(count))
        item = ReadItem("w", "w", "f", "U8", (sum(n for _, n in ranges),), (256,), ranges,
                        (sum(n for _, n in ranges),))
        stretches, reads = split_resident(item, runs, lambda a, b: bitmap[a:b + 1], page)
        got = {}  # destination pos -> file offset, byte by byte
        for s in stretches:
            for r in range(s.rows):
                for k in range(s.length):
                    got[s.pos + r * s.length + k] = s.offset + r * s.stride + k
        for rd in reads:
            pos = int(rd.target.rsplit("@", 1)[1])
            for off, n in rd.ranges:
                for k in range(n):
                    got[pos] = off + k
                    pos += 1
            assert all(64 - 16 < off < 112 + 16 for off, _ in rd.ranges)  # near the hole
        want = [off + k for off, n in ranges for k in range(n)]
        assert [got[i] for i in range(len(want))] == want and len(got) == len(want)
        assert stretches and reads


def _evicted(llama: Path) -> None:
    gc.collect()   # no earlier view still maps the files (mapped pages stay resident)
    evict_or_skip(sorted(llama.glob("*.safetensors")))


@pytest.mark.parametrize("tp", [1, 2])
def test_readahead_cold_items_are_views_equal_to_threaded(llama: Path, tp: int) -> None:
    """``cold="readahead"``: cold items arrive as views of the mapping too (no read syscall,
    no fresh buffer for a whole-range item), counted as read ahead, in plan order."""
    staged = plan_stage(llama, Topology(1, tp, 1, tp - 1), range_cost_bytes=0)
    ref = {k: v.clone() for k, v in load_stage(staged, io_backend="threaded")
           .state_dict.items()}
    _evicted(llama)
    backend = MappedBackend(staged.plan, ReadOptions(), cold="readahead")
    got = list(backend)
    assert [t for t, _ in got] == [i.target for i in staged.plan.items]
    for target, tensor in got:
        assert torch.equal(tensor, ref[target]), target
    assert backend.stats.read_bytes == backend.mapped_bytes == staged.plan.read_bytes
    assert 0 < backend.readahead_bytes <= staged.plan.read_bytes
    assert backend.mapped_items == len(staged.plan.items)
    assert backend.stats.syscalls == 0


def test_readahead_starts_a_prefetch_thread_only_for_a_stage_with_cold_pages(
        llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage resident throughout is handed as views with no prefetch thread (the consumer's
    copy faults the pages in); one with cold pages gets the thread."""
    import pploader.io.mapped as mapped_mod
    made: list[object] = []
    real = mapped_mod.Prefetch

    def counting(*args: object, **kwargs: object) -> object:
        made.append(args)
        return real(*args, **kwargs)  # type: ignore[arg-type]
    monkeypatch.setattr(mapped_mod, "Prefetch", counting)
    staged = plan_stage(llama, Topology(1, 2, 1, 1), range_cost_bytes=0)
    for path in llama.glob("*.safetensors"):
        path.read_bytes()  # warm
    warm = MappedBackend(staged.plan, ReadOptions(), cold="readahead")
    got = dict(warm)
    assert not made and warm.readahead_bytes == 0
    assert warm.warm_items == sum(1 for i in staged.plan.items if i.ranges)
    del got, warm
    _evicted(llama)
    cold = MappedBackend(staged.plan, ReadOptions(), cold="readahead")
    list(cold)
    assert len(made) == 1 and cold.readahead_bytes > 0


def test_whole_items_are_full_tensor_views_counting_only_their_ranges(llama: Path) -> None:
    """``whole``: a TP slice is handed as its full source tensor (a view of the mapping),
    while only the slice's bytes count as read; ``whole`` needs ``cold="readahead"``."""
    from helpers import reference_tensors
    staged = plan_stage(llama, Topology(1, 2, 1, 1), range_cost_bytes=0)
    split = [i for i in staged.plan.items if i.shape != i.source_shape]
    assert split
    whole = {i.target: (staged.index.entry(i.name).start, staged.index.entry(i.name).nbytes)
             for i in split}
    ref = reference_tensors(llama)
    backend = MappedBackend(staged.plan, ReadOptions(), cold="readahead", whole=whole)
    got = dict(backend)
    for item in split:
        assert got[item.target].shape == item.source_shape
        assert torch.equal(got[item.target], ref[item.name]), item.name
    assert backend.stats.read_bytes == staged.plan.read_bytes
    with pytest.raises(ValueError, match="readahead"):
        MappedBackend(staged.plan, ReadOptions(), whole=whole)


def test_readahead_refuses_a_file_changed_after_planning(llama: Path, tmp_path: Path) -> None:
    """A shard rewritten shorter after planning: ReadError naming it before any view."""
    from pploader.errors import ReadError
    staged = plan_stage(llama, Topology(1))
    first = staged.plan.items[0].file
    with open(llama / first, "r+b") as fh:
        fh.truncate((llama / first).stat().st_size - 1000)
    with pytest.raises(ReadError, match="changed during load") as info:
        list(MappedBackend(staged.plan, ReadOptions(), cold="readahead"))
    assert first in str(info.value)
