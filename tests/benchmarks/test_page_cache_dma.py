"""The page-cache DMA benchmark's CPU side: its files, their chunking and the output check
(the GPU methods run in tests/gpu/test_gpu.py and on the device, docs/benchmarks-gpu.md)."""
from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import page_cache_dma as pcd


def test_stage_files_chunk_exactly_and_verify_catches_a_wrong_byte(tmp_path: Path) -> None:
    pcd._write_stages(tmp_path, stages=2, stage_mib=4)
    paths = pcd._stage_files(tmp_path / "1")
    assert [p.stat().st_size for p in paths] == [2 << 20, 2 << 20]
    assert paths[0].read_bytes() != (tmp_path / "0" / "part0.bin").read_bytes()  # stamped
    sizes = [p.stat().st_size for p in paths]
    chunks = pcd._chunks(sizes, 3 << 19)  # 1.5 MiB: a short last chunk per file
    for i, size in enumerate(sizes):
        mine = [(off, n) for f, off, n in chunks if f == i]
        assert mine[0][0] == 0 and sum(n for _, n in mine) == size
        assert all(a + n == b for (a, n), (b, _) in zip(mine, mine[1:]))
    copies = [src.clone() for _, src in pcd._mapped(paths)]
    pcd._verify(paths, copies)
    copies[1][-1] ^= 1
    with pytest.raises(AssertionError, match="part1.bin: wrong bytes"):
        pcd._verify(paths, copies)


def test_stage_size_must_split_into_whole_blocks(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="multiple of 128 MiB"):
        pcd._write_stages(tmp_path, stages=1, stage_mib=130)
