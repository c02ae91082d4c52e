"""The generic family's derived structure on disk (families/meta_store.py): it round-trips
exactly, a second ``pploader plan`` of the same model in a fresh process imports neither
torch nor transformers and prints the same plan, and a damaged or foreign entry is ignored."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pploader.families import hf_meta
from pploader.families.meta_store import MetaStore, decode, encode

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers")
_RUNNER = (
    "import runpy, sys\n"
    "sys.argv = ['pploader', *sys.argv[1:]]\n"
    "try:\n    runpy.run_module('pploader', run_name='__main__')\n"
    "except SystemExit as exc:\n    code = exc.code\n"
    "else:\n    code = 0\n"
    f"print('\\nHEAVY', code, sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))\n")


@pytest.fixture(scope="module")
def olmo2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny OLMo-2 (planned by the generic family: per-projection q/k norms)."""
    import torch
    import transformers
    torch.manual_seed(0)
    config = transformers.Olmo2Config(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=2)
    out = tmp_path_factory.mktemp("olmo2")
    transformers.Olmo2ForCausalLM(config).save_pretrained(out)
    return out


def _plan(model: Path, cache: str) -> tuple[list[str], str]:
    env = dict(os.environ, PPLOADER_CACHE_DIR=cache)
    out = subprocess.run([sys.executable, "-c", _RUNNER, "plan", "--model", str(model),
                          "--pp", "2", "--tp", "2"], capture_output=True, text=True,
                         timeout=300, cwd=REPO, env=env)
    *text, last = out.stdout.strip().splitlines()
    tag, code, heavy = last.split(" ", 2)
    assert tag == "HEAVY" and code == "0", (out.stdout[-2000:], out.stderr[-2000:])
    return eval(heavy), "\n".join(text)  # noqa: S307 - our own repr of a list


def test_derived_structure_round_trips_exactly(olmo2: Path) -> None:
    config = json.loads((olmo2 / "config.json").read_text())
    meta = hf_meta.derive(config)
    assert decode(json.loads(json.dumps(encode(meta)))) == meta
    store, key = MetaStore(olmo2.parent / "store"), json.dumps(config, sort_keys=True)
    assert store.load(key) is None
    store.save(key, meta)
    assert store.load(key) == meta
    other = json.dumps(dict(config, num_hidden_layers=2), sort_keys=True)
    assert store.path(other) != store.path(key) and store.load(other) is None


def test_a_damaged_or_foreign_entry_is_derived_again(olmo2: Path, tmp_path: Path) -> None:
    config = json.loads((olmo2 / "config.json").read_text())
    store, key = MetaStore(tmp_path), json.dumps(config, sort_keys=True)
    store.path(key).write_text("{not json")
    assert store.load(key) is None
    store.path(key).write_text(json.dumps({"config": "another config", "meta": {}}))
    assert store.load(key) is None
    store.path(key).write_text(json.dumps({"config": key, "meta": {"__pickle__": "x"}}))
    assert store.load(key) is None


def test_second_plan_imports_no_transformers(olmo2: Path, tmp_path: Path) -> None:
    first_heavy, first = _plan(olmo2, str(tmp_path))
    assert "transformers" in first_heavy  # the meta model was built once
    assert len(list((tmp_path / "meta").glob("meta-*.json"))) == 1
    second_heavy, second = _plan(olmo2, str(tmp_path))
    assert second_heavy == [] and second == first
    empty_heavy, third = _plan(olmo2, "")  # PPLOADER_CACHE_DIR="": no store
    assert "transformers" in empty_heavy and third == first
