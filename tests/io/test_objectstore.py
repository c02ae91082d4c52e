"""The s3 backend's request building (pure): adjacent ranges merged, nothing unneeded fetched,
large ranges cut into requests of at most REQUEST_BYTES."""
from __future__ import annotations

from pploader.io import objectstore
from pploader.io.objectstore import _batches, _merge


def _pieces(spans: list[tuple[str, int, int]]) -> list:
    buf = memoryview(bytearray(sum(n for _, _, n in spans)))
    out, pos = [], 0
    for file, offset, length in spans:
        out.append((file, offset, length, buf[pos:pos + length], f"t{offset}"))
        pos += length
    return out


def test_adjacent_ranges_merge_gaps_do_not(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(objectstore, "REQUEST_BYTES", 100)
    reqs = _merge(_pieces([("b", 0, 10), ("a", 50, 30), ("a", 20, 30), ("a", 90, 5)]))
    got = [(r.file, r.start, r.length, [v.nbytes for v in r.views]) for r in reqs]
    # a: [20, 80) merged (two views), [90, 95) apart (the gap is never fetched); b alone
    assert got == [("a", 20, 60, [30, 30]), ("a", 90, 5, [5]), ("b", 0, 10, [10])]


def test_large_ranges_are_cut(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(objectstore, "REQUEST_BYTES", 100)
    reqs = _merge(_pieces([("a", 0, 250), ("a", 250, 70)]))
    assert [(r.start, r.length) for r in reqs] == [(0, 100), (100, 100), (200, 100), (300, 20)]
    assert sum(r.length for r in reqs) == 320
    assert [v.nbytes for v in reqs[2].views] == [50, 50]  # the cut view, then the next range


class _Item:
    def __init__(self, n: int) -> None:
        self.read_bytes = n


def test_batches_bounded_by_the_window() -> None:
    items = tuple(_Item(n) for n in (40, 40, 30, 200, 10))
    sizes = [[i.read_bytes for i in b] for b in _batches(items, 100)]  # type: ignore[arg-type]
    assert sizes == [[40, 40], [30], [200], [10]]  # an item above the limit goes alone
