"""``pploader bench --dcp`` (pploader/bench/dcp.py): both readers run on fresh PP ranks and
fill the same values (the bench refuses otherwise); pploader's count is the local bytes."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from helpers import run
from pploader.bench.dcp import _ranks, _ratios


def test_ranks_option() -> None:
    assert _ranks(None, 4) == [0, 1, 2, 3]
    assert _ranks("0,2", 4) == [0, 2]
    with pytest.raises(SystemExit, match="outside 0..3"):
        _ranks("4", 4)


def test_ratios_with_a_base_reader() -> None:
    """``--base DIR`` adds pploader_base: its median over torch's beside pploader's."""
    summary = [{"cache": "warm", "load": "first", "reader": r, "wall_s": w}
               for r, w in (("pploader", 0.3), ("pploader_base", 0.6), ("torch_hf", 0.4))]
    (row,) = _ratios(summary)
    assert row["pploader_over_torch"] == pytest.approx(0.75)
    assert row["base_over_torch"] == pytest.approx(1.5)
    assert "base_over_torch" not in _ratios(summary[::2])[0]


@pytest.mark.slow
def test_bench_dcp_end_to_end_tiny(tmp_path: Path) -> None:
    res = run([sys.executable, "-m", "pploader", "bench", "--dcp", "--", "--size-gb", "0.02",
               "--layers", "4", "--pp", "2", "--tp", "1", "--caches", "warm",
               "--dir", str(tmp_path), "--json"], timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads(res.stdout)
    got = {s["reader"]: s for s in doc["summary"]}
    assert set(got) == {"pploader", "torch_hf"}
    for r in got["pploader"]["ranks"]:
        assert r["reader_bytes"] == r["local_bytes"] > 0
        assert r["rchar"] <= 1.02 * r["local_bytes"] + r["header_bytes"]
    assert [r["rank"] for r in got["torch_hf"]["ranks"]] == [0, 1]
