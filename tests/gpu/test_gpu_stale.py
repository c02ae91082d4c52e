"""CI guard (CPU): the GPU path must not change without a recorded green ``pytest -m gpu`` run.

See tests/gpu/last_run.py for what counts as the GPU path and how the record is made.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

HERE = Path(__file__).resolve().parent


def _last_run_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_last_run", HERE / "last_run.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


last_run = _last_run_module()


def test_gpu_path_unchanged_since_last_gpu_run() -> None:
    assert last_run.LAST_RUN.exists(), f"no tests/gpu/LAST_RUN: {last_run.HOW_TO_FIX}"
    changed, data = last_run.stale_files()
    assert not changed, (
        f"GPU-path sources changed since the last recorded GPU run (commit {data.get('commit')}, "
        f"{data.get('date')}, {data.get('device')}): {', '.join(changed)}. {last_run.HOW_TO_FIX}")
    assert data["failed"] == 0 and data["errors"] == 0 and data["passed"] > 0, data


def test_gpu_path_set_covers_the_device_code() -> None:
    files = last_run.gpu_path_sources()
    for must in ("pploader/io/device.py", "pploader/bind/write.py", "pploader/stage.py",
                 "tests/gpu/test_gpu.py"):
        assert must in files
    assert not any(Path(f).name.startswith("bench") for f in files)


def _fake_repo(root: Path) -> None:
    (root / "pploader").mkdir(parents=True)
    (root / "tests" / "gpu").mkdir(parents=True)
    (root / "pploader" / "gpu.py").write_text("x = 'cuda'\n")
    (root / "pploader" / "cpu.py").write_text("x = 1\n")
    (root / "pploader" / "bench_x.py").write_text("x = 'cuda'\n")
    (root / "tests" / "gpu" / "test_gpu.py").write_text("pass\n")


def _junit(path: Path, tests: int, failures: int = 0, errors: int = 0, skipped: int = 0) -> Path:
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="{tests}" '
                    f'failures="{failures}" errors="{errors}" skipped="{skipped}"/></testsuites>')
    return path


def test_record_then_any_gpu_source_change_is_stale(tmp_path: Path) -> None:
    _fake_repo(tmp_path)
    out = tmp_path / "LAST_RUN"
    data = last_run.record(_junit(tmp_path / "j.xml", 5), "2x H100", 2, "abc", root=tmp_path,
                           out=out)
    assert data["passed"] == 5
    assert set(data["sources"]) == {"pploader/gpu.py", "tests/gpu/test_gpu.py"}
    assert last_run.stale_files(tmp_path, out)[0] == []
    (tmp_path / "pploader" / "cpu.py").write_text("x = 2\n")       # not GPU path: still current
    (tmp_path / "pploader" / "bench_x.py").write_text("x = 'cuda2'\n")
    assert last_run.stale_files(tmp_path, out)[0] == []
    (tmp_path / "pploader" / "gpu.py").write_text("x = 'cuda' \n")  # GPU path edited
    assert last_run.stale_files(tmp_path, out)[0] == ["pploader/gpu.py"]
    (tmp_path / "pploader" / "gpu.py").write_text("x = 'cuda'\n")
    (tmp_path / "pploader" / "cpu.py").write_text("import torch.cuda\n")  # joins the GPU path
    assert last_run.stale_files(tmp_path, out)[0] == ["pploader/cpu.py"]


def test_harnesses_the_gpu_tests_import_are_gpu_path(tmp_path: Path) -> None:
    """benchmarks/ is outside the package: its modules count when a GPU test imports them
    (directly or through another harness), and only then."""
    _fake_repo(tmp_path)
    bench = tmp_path / "benchmarks"
    bench.mkdir()
    (bench / "__init__.py").write_text("")
    (bench / "dma.py").write_text("from .shared import f\n")
    (bench / "shared.py").write_text("def f(): pass\n")
    (bench / "other.py").write_text("x = 'cuda'\n")       # no GPU test imports it
    (tmp_path / "tests" / "gpu" / "test_gpu.py").write_text(
        "def test_x():\n    from benchmarks import dma as d\n")
    out = tmp_path / "LAST_RUN"
    data = last_run.record(_junit(tmp_path / "j.xml", 5), "2x H100", 2, "abc", root=tmp_path,
                           out=out)
    assert {"benchmarks/dma.py", "benchmarks/shared.py"} <= set(data["sources"])
    assert "benchmarks/other.py" not in data["sources"]
    (bench / "other.py").write_text("x = 'cuda2'\n")
    assert last_run.stale_files(tmp_path, out)[0] == []
    (bench / "shared.py").write_text("def f(): return 1\n")
    assert last_run.stale_files(tmp_path, out)[0] == ["benchmarks/shared.py"]


def test_the_gpu_suite_harness_is_in_the_gpu_path() -> None:
    """tests/gpu/test_gpu.py imports benchmarks.page_cache_dma: the set holds it."""
    assert "benchmarks/page_cache_dma.py" in last_run.gpu_path_sources()


@pytest.mark.parametrize("counts,gpus", [(dict(tests=5, failures=1), 2),
                                          (dict(tests=5, errors=1), 2),
                                          (dict(tests=0), 2),
                                          (dict(tests=5, skipped=2), 2),
                                          (dict(tests=5), 1)])
def test_no_record_unless_green_on_two_gpus(tmp_path: Path, counts: dict, gpus: int) -> None:
    _fake_repo(tmp_path)
    out = tmp_path / "LAST_RUN"
    with pytest.raises(SystemExit, match="not recording"):
        last_run.record(_junit(tmp_path / "j.xml", **counts), "H100", gpus, "abc",
                        root=tmp_path, out=out)
    assert not out.exists()


def test_record_is_json_with_the_promised_fields(tmp_path: Path) -> None:
    _fake_repo(tmp_path)
    out = tmp_path / "LAST_RUN"
    last_run.record(_junit(tmp_path / "j.xml", 3), "2x H200", 2, "deadbeef", root=tmp_path, out=out)
    data = json.loads(out.read_text())
    for key in ("commit", "date", "device", "gpus", "passed", "failed", "errors", "skipped",
                "sources_sha256", "sources"):
        assert key in data
