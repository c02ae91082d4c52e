"""What the engine suites (tests/sglang, tests/vllm) share: running every engine of a suite in
one subprocess (its ``engine.py SPEC OUT``) and reading what it recorded, the per-rank load
reports' metadata allowance, dropping a checkpoint's pages, and the engine's layer split
checked against its own ``get_pp_indices``. No engine import here."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: the prompts every engine test decodes greedily, and the tiny llama both suites serve
PROMPTS = [[1, 5, 9, 200, 17], [3, 1000, 42, 7]]
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
         "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 4, "head_dim": 32, "vocab_size": 2048,
         "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
         "hidden_act": "silu", "tie_word_embeddings": False, "dtype": "bfloat16",
         "bos_token_id": 1, "eos_token_id": 2}


def engine_marks(engine: str, slow: bool = True) -> list[Any]:
    """The ``pytestmark`` of an engine suite's test file: its marker, ``slow`` (engine
    starts), skipped unless the real engine is installed. tests/ is on sys.path (conftest), so
    tests/vllm is a namespace package ``vllm``: only a regular package (an ``__init__`` file,
    so an ``origin``) counts."""
    spec = importlib.util.find_spec(engine)
    installed = spec is not None and spec.origin is not None
    return [getattr(pytest.mark, engine), *([pytest.mark.slow] if slow else []),
            pytest.mark.skipif(not installed, reason=f"{engine} is not installed here: run "
                               f".ci/{engine}-suite.sh")]


def run_engines(script: Path, runs: list[dict[str, Any]], prompts: list[list[int]],
                work: Path, engine: str, max_tokens: int = 8, *, check: bool = True
                ) -> dict[str, dict[str, Any]]:
    """Every run of ``runs`` through ``script`` (one subprocess, engines one after another);
    the results by run name. ``PPLOADER_<ENGINE>_RESULTS`` names a finished run's out.json to
    re-check instead; ``PPLOADER_<ENGINE>_TIMEOUT`` bounds the subprocess (seconds).
    ``check``: a failed subprocess fails the test (else what finished is returned; the log is
    ``work / "engine.log"``)."""
    recorded = os.environ.get(f"PPLOADER_{engine.upper()}_RESULTS") if check else None
    if recorded:
        return {r["name"]: r for r in json.loads(Path(recorded).read_text())}
    spec, out = work / "spec.json", work / "out.json"
    spec.write_text(json.dumps({"prompts": prompts, "max_tokens": max_tokens, "runs": runs}))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    proc = subprocess.run([sys.executable, str(script), str(spec), str(out)], env=env,
                          cwd=work, capture_output=True, text=True,
                          timeout=int(os.environ.get(f"PPLOADER_{engine.upper()}_TIMEOUT",
                                                     "3600")))
    (work / "engine.log").write_text(proc.stdout + proc.stderr)
    done = {r["name"]: r for r in json.loads(out.read_text())} if out.exists() else {}
    if proc.returncode != 0 and check:
        pytest.fail(f"engine runs failed (rc {proc.returncode}; finished {sorted(done)}); "
                    f"log {work / 'engine.log'}:\n{(proc.stdout + proc.stderr)[-6000:]}")
    return done


def engine_main(one_run: Callable[[dict[str, Any], list[list[int]], int], dict[str, Any]],
                env: dict[str, str]) -> None:
    """An engine script's main (``script SPEC OUT``): the engine's environment ``env`` set
    where not set already, each run of SPEC through ``one_run``, OUT rewritten after each
    (partial results survive a later crash)."""
    for key, value in env.items():
        os.environ.setdefault(key, value)
    spec_path, out_path = sys.argv[1], sys.argv[2]
    spec = json.loads(Path(spec_path).read_text())
    results = []
    for run in spec["runs"]:
        results.append(one_run(run, spec["prompts"], spec.get("max_tokens", 8)))
        Path(out_path).write_text(json.dumps(results, indent=1))


def loads(run: dict[str, Any]) -> list[dict[str, Any]]:
    """Each rank's load report of a run."""
    return [r["load"] for r in run["reports"]]


def metadata_bytes(load: dict[str, Any]) -> int:
    """What a rank reads besides tensor data: the shards' headers it parses, plus config.json
    and the index (read by the spec, the checkpoint index and the engine window: three times
    at most). Negligible at real scale; ~1% of these tiny models' stages."""
    root = Path(load["model_dir"])
    files = [root / "config.json", root / "model.safetensors.index.json"]
    return load["header_bytes"] + 3 * sum(f.stat().st_size for f in files if f.exists())


def evict(model: str) -> int:
    """Drop a checkpoint's clean pages from the page cache; bytes still resident after."""
    from pploader.bench.methods import evict as evict_paths
    return evict_paths([str(p) for p in Path(model).glob("*.safetensors")])


def check_partition(partition: Callable[[int, int], tuple[int, ...]],
                    get_pp_indices: Callable[[int, int, int], tuple[int, int]],
                    variable: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine format's layer split equals the engine's ``get_pp_indices`` for 4-39 layers
    over PP 1-4, and follows the engine's partition variable (``variable`` = "1,4")."""
    monkeypatch.delenv(variable, raising=False)
    for layers in range(4, 40):
        for pp in range(1, 5):
            sizes = partition(layers, pp)
            starts = [sum(sizes[:r]) for r in range(pp)]
            assert [(s, s + n) for s, n in zip(starts, sizes)] == \
                [tuple(get_pp_indices(layers, r, pp)) for r in range(pp)]
    monkeypatch.setenv(variable, "1,4")
    assert tuple(partition(5, 2)) == (1, 4)
