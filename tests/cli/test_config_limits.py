"""Hostile and contradictory config.json (issue 32): refused before anything grows with it, in
< 2 s and < 300 MB above the torch import, with one line naming the key; on every rank."""
from __future__ import annotations

import json
import re
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers import free_port, make_model, tiny_config

from pploader.errors import ConfigError
from pploader.planning.config_limits import (MAX_CONFIG_DEPTH, check_config_counts,
                                             read_json_limited, too_deep)
from pploader.planning.spec import spec_from_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama: 8 layers, 75 tensors."""
    return make_model(tmp_path_factory.mktemp("limits") / "ok")


def _with_config(src: Path, dst: Path, text: "str | None" = None, **changes: object) -> Path:
    shutil.copytree(src, dst)
    if text is not None:
        (dst / "config.json").write_text(text)
    elif changes:
        cfg = json.loads((src / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**cfg, **changes}))
    return dst


# ---- the pieces ---------------------------------------------------------------------------

@pytest.mark.parametrize("text,deep", [
    ("{}", False), ('{"a": [[[1]]]}', False), ("[" * 64 + "]" * 64, False),
    ("[" * 65 + "]" * 65, True), ("[" * 100_000 + "]" * 100_000, True),
    ("[" * 100_000, True),                        # unbalanced and deep
    ('{"s": "' + "[" * 500 + '"}', False),        # brackets inside a string do not count
    ('{"s": "\\"[[[[", "t": 1}', False),          # escaped quote inside a string
    ('{"a": [}', False),                          # invalid, shallow: the parser reports it
])
def test_too_deep_counts_nesting_outside_strings(text: str, deep: bool) -> None:
    assert too_deep(text, MAX_CONFIG_DEPTH) is deep


def test_read_json_limited_refuses_size_before_reading(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "config.json"
    with open(path, "wb") as fh:  # 8 GB, sparse: a read would take the machine's memory
        fh.truncate(8 << 30)
    reads: list[int] = []
    real_open = open

    class Counting:
        def __init__(self, fh: object) -> None:
            self.fh = fh

        def __getattr__(self, name: str) -> object:
            if name == "read":
                reads.append(1)
            return getattr(self.fh, name)

        def __enter__(self) -> "Counting":
            return self

        def __exit__(self, *exc: object) -> None:
            self.fh.close()  # type: ignore[attr-defined]

    monkeypatch.setattr("builtins.open", lambda *a, **k: Counting(real_open(*a, **k)))
    with pytest.raises(ConfigError, match="8589934592 bytes, over the 16 MiB limit"):
        read_json_limited(path)
    assert reads == []


def test_read_json_limited_refuses_deep_nesting_without_recursion(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ConfigError, match="more than 64 levels deep") as err:
        read_json_limited(path)
    assert not isinstance(err.value.__context__, RecursionError)


@pytest.mark.parametrize("key,value,needle", [
    ("num_hidden_layers", 10**9, "num_hidden_layers=1000000000 is outside [1, 10000]"),
    ("num_hidden_layers", 0, "num_hidden_layers=0 is outside"),
    ("num_hidden_layers", "8", "num_hidden_layers is '8', not an integer"),
    ("num_hidden_layers", 8.5, "num_hidden_layers is 8.5, not an integer"),
    ("num_hidden_layers", True, "num_hidden_layers is True, not an integer"),
    ("num_hidden_layers", [8], "num_hidden_layers is [8], not an integer"),
    ("num_attention_heads", 10**12, "num_attention_heads=1000000000000 is outside"),
    ("num_key_value_heads", -1, "num_key_value_heads=-1 is outside"),
    ("hidden_size", 2**70, "hidden_size=1180591620717411303424 is outside"),
    ("vocab_size", {"a": 1}, "vocab_size is {'a': 1}, not an integer"),
])
def test_counts_are_typed_and_bounded_naming_the_key(key: str, value: object,
                                                     needle: str) -> None:
    with pytest.raises(ConfigError, match=None) as err:
        spec_from_config(tiny_config(**{key: value}))
    assert needle in str(err.value) and f"fix {key}" in str(err.value)
    assert err.value.file == "config.json"


def test_counts_one_level_down_are_checked_and_null_is_absent() -> None:
    with pytest.raises(ConfigError, match="text_config.num_experts=99999999 is outside"):
        check_config_counts({"text_config": {"num_experts": 99_999_999}})
    check_config_counts({"num_key_value_heads": None, "head_dim": 32.0})  # both fine
    check_config_counts({"intermediate_size": [64, 128]})  # per layer (Gemma 3n)
    with pytest.raises(ConfigError, match="intermediate_size=-4 is outside"):
        check_config_counts({"intermediate_size": [64, -4]})
    with pytest.raises(ConfigError, match="num_hidden_layers is \\[4\\], not an integer"):
        check_config_counts({"num_hidden_layers": [4]})
    assert spec_from_config(tiny_config(num_hidden_layers=8.0)).num_layers == 8


def test_moe_counts_against_the_checkpoint(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Experts: a per-expert checkpoint cannot hold more experts than it has tensors; the
    template is never built (its size would grow as layers x experts)."""
    import pploader.families.moe as moe
    from pploader import Topology, plan_stage
    src = make_model(tmp_path / "mx", tiny_config("tiny-mixtral"))
    bad = _with_config(src, tmp_path / "bad", num_local_experts=60_000)
    built: list[int] = []
    real = moe.expert_tensors
    monkeypatch.setattr(moe, "expert_tensors",
                        lambda *a, **k: built.append(a[1]) or real(*a, **k))
    plan_stage(src, Topology(2, rank=1))  # the spy sees a template being built
    assert built and set(built) == {8}  # tiny-mixtral: 8 experts
    built.clear()
    with pytest.raises(ConfigError) as err:
        plan_stage(bad, Topology(2, rank=1))
    msg = str(err.value)
    assert "num_local_experts=60000 over" in msg and "fix num_local_experts" in msg
    assert built == []


def test_contradictory_architecture_and_model_type_follow_architectures() -> None:
    """``architectures`` and ``model_type`` that disagree: planned by ``architectures``, as
    the engines dispatch (issue 31), never a self-contradicting refusal (issue 32)."""
    spec = spec_from_config(tiny_config("tiny-mixtral", model_type="llama"))
    assert spec.family.name == "mixtral" and spec.architecture == "MixtralForCausalLM"
    assert spec.num_experts == 8


def test_unreadable_model_directory_is_one_line(tiny: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture) -> None:
    """Permission bits mean nothing to root (the CI runs as root): the check is os.access."""
    from pploader.cli import main
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, m, **k: False if Path(p) == tiny
                        else real(p, m, **k))
    for argv in (["plan", "--model", str(tiny), "--pp", "2"],
                 ["files", "--model", str(tiny), "--pp", "2"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "permission denied" in err and "Traceback" not in err


def test_permission_error_from_a_shard_is_one_line(tiny: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture) -> None:
    """Any OSError a user causes (here: a PermissionError from deep inside) is one line."""
    import pploader.job as job
    from pploader.cli import main

    def denied(*a: object, **k: object) -> None:
        raise PermissionError(13, "Permission denied", str(tiny / "model.safetensors.index.json"))
    monkeypatch.setattr(job, "open_checkpoint", denied)
    assert main(["plan", "--model", str(tiny), "--pp", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "model.safetensors.index.json: Permission denied; give this user read access" in err


# ---- the acceptance numbers ------------------------------------------------------------------

_MEASURE = textwrap.dedent("""
    import json, resource, sys, time
    import torch  # the baseline: everything above it is pploader's
    from pploader.cli import main
    def peak():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    base, out = peak(), {}
    for name, model in json.loads(sys.argv[1]).items():
        t0 = time.perf_counter()
        code = main(["plan", "--model", model, "--pp", "2"])
        out[name] = [code, time.perf_counter() - t0, peak() - base]
    print("RESULT " + json.dumps(out))
""")

HOSTILE = {
    "huge_sparse": None,   # an 8 GB config.json (sparse)
    "deep": "[" * 100_000 + "]" * 100_000,
    "layers_1e9": {"num_hidden_layers": 10**9},
    "layers_1e5": {"num_hidden_layers": 10**5},
    "layers_5000": {"num_hidden_layers": 5000},  # inside the cap: refused by the checkpoint
    "heads_1e9": {"num_attention_heads": 10**9},
    "experts_1e9": {"num_local_experts": 10**9, "architectures": ["MixtralForCausalLM"],
                    "model_type": "mixtral"},
}


def _hostile_models(tiny: Path, root: Path) -> dict[str, str]:
    out = {}
    for name, change in HOSTILE.items():
        if isinstance(change, dict):
            d = _with_config(tiny, root / name, **change)
        elif isinstance(change, str):
            d = _with_config(tiny, root / name, text=change)
        else:
            d = _with_config(tiny, root / name)
            with open(d / "config.json", "r+b") as fh:
                fh.truncate(8 << 30)
        out[name] = str(d)
    return out


def test_hostile_configs_refused_fast_with_bounded_memory(tiny: Path, tmp_path: Path) -> None:
    """Every hostile config: exit 2 within 2 s; the peak RSS of all of them together stays
    under 300 MB above the torch import (one process, so the peak covers every case)."""
    models = _hostile_models(tiny, tmp_path)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("PPLOADER_LOG", None)
    proc = subprocess.run([sys.executable, "-c", _MEASURE, json.dumps(models)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(next(ln[7:] for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")))
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == len(HOSTILE) and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for name, (code, seconds, grown) in got.items():
        assert code == 2, (name, proc.stderr)
        assert seconds < 2.0, (name, seconds)
        assert grown < 300e6, (name, grown)
    keys = {"layers_1e9": "num_hidden_layers", "layers_1e5": "num_hidden_layers",
            "layers_5000": "num_hidden_layers", "heads_1e9": "num_attention_heads",
            "experts_1e9": "num_local_experts", "deep": "levels deep",
            "huge_sparse": "16 MiB limit"}
    for name, line in zip(HOSTILE, lines):  # main ran the cases in HOSTILE's order
        assert keys[name] in line, (name, line)
    at = list(HOSTILE).index("layers_5000")
    assert "checkpoint holds only 75 tensors (layers 0..7)" in lines[at], lines[at]
    print({k: (round(s, 3), round(m / 1e6, 1)) for k, (_, s, m) in got.items()})


@pytest.mark.slow
def test_hostile_config_refused_on_every_rank(tiny: Path, tmp_path: Path) -> None:
    """Under `load`, each of 2 ranks refuses it the same way: one line, exit 2."""
    model = _with_config(tiny, tmp_path / "bad", num_hidden_layers=10**9)
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MASTER_PORT=str(port),
                   SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank),
                   SLURM_STEP_ID="0", SLURM_JOB_ID="1", SLURM_JOB_NODELIST="localhost")
        env.pop("PPLOADER_LOG", None)
        procs.append(subprocess.Popen([sys.executable, "-m", "pploader", "load", "--model",
                                       str(model), "--pp", "2"], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=env))
    for rank, proc in enumerate(procs):
        _, err = proc.communicate(timeout=120)
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert proc.returncode == 2, err
        assert len(lines) == 1 and lines[0].startswith(f"[rank {rank}] pploader: error:"), err
        assert "num_hidden_layers=1000000000" in lines[0], err


# ---- a million-tensor header -----------------------------------------------------------------

_HEADER_MEASURE = textwrap.dedent("""
    import json, resource, sys, time
    import torch
    from pploader.cli import main
    def peak():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    base = peak()
    t0 = time.perf_counter()
    code = main(["plan", "--model", sys.argv[1], "--pp", "1"])
    print("RESULT " + json.dumps([code, time.perf_counter() - t0, peak() - base]))
""")


def _million_tensor_model(src: Path, dst: Path, count: int = 1_000_000) -> int:
    """``src``'s config and a single shard whose header declares ``count`` one-byte tensors
    (a valid header: it tiles its data region). Returns the header's length."""
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    entry = '"t{0}":{{"dtype":"U8","shape":[1],"data_offsets":[{0},{1}]}}'
    head = ("{" + ",".join(entry.format(i, i + 1) for i in range(count)) + "}").encode()
    head += b" " * (-len(head) % 8)
    with open(dst / "model.safetensors", "wb") as fh:
        fh.write(len(head).to_bytes(8, "little") + head)
        fh.truncate(8 + len(head) + count)
    return len(head)


def test_million_tensor_header_refused_with_bounded_memory(tiny: Path, tmp_path: Path) -> None:
    """Refused from a count of "{" bytes before any JSON parse: the cost is the header's
    bytes (<= MAX_HEADER_BYTES), here ~70 MB and well under a second of work."""
    from pploader.planning.header import MAX_HEADER_BYTES, MAX_TENSORS
    length = _million_tensor_model(tiny, tmp_path / "wide")
    assert length <= MAX_HEADER_BYTES
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("PPLOADER_LOG", None)
    proc = subprocess.run([sys.executable, "-c", _HEADER_MEASURE, str(tmp_path / "wide")],
                          capture_output=True, text=True, timeout=300, env=env)
    code, seconds, grown = json.loads(next(ln[7:] for ln in proc.stdout.splitlines()
                                           if ln.startswith("RESULT ")))
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert f"room for more than {MAX_TENSORS} tensors" in lines[0], lines[0]
    assert grown < length + 50e6, (grown, length)  # the header's bytes, nothing like a parse
    assert seconds < 5.0, seconds
    print({"header_mb": round(length / 1e6, 1), "seconds": round(seconds, 3),
           "rss_over_torch_mb": round(grown / 1e6, 1)})


def test_strict_parse_names_the_key_and_keeps_transformers_infinity() -> None:
    """NaN / infinities / a repeated key refused naming the key path (issue 43); the
    ``Infinity`` transformers itself writes for Mamba2-style ``time_step_limit`` (no limit)
    is a real config and parses."""
    from pploader.planning.config_limits import parse_json_limited
    assert parse_json_limited(b'{"time_step_limit": [0.0, Infinity]}', "c")[
        "time_step_limit"][1] == float("inf")  # type: ignore[index]
    for text, needle in [(b'{"rms_norm_eps": NaN}', "rms_norm_eps is nan"),
                         (b'{"a": {"b": [1, -Infinity]}}', "a.b[1] is -inf"),
                         (b'{"x": 1e999}', "x is inf"),
                         (b'{"time_step_limit": [NaN, 1]}', "time_step_limit[0] is nan"),
                         (b'{"tie_word_embeddings": true, "tie_word_embeddings": false}',
                          "key 'tie_word_embeddings' appears twice")]:
        with pytest.raises(ConfigError, match=re.escape(needle)):
            parse_json_limited(text, "c")
    for key, value, needle in [("tie_word_embeddings", "false", "not true / false"),
                               ("quantization_config", "fp8", "not an object")]:
        with pytest.raises(ConfigError, match=re.escape(f"{key} is {value!r}, {needle}")):
            spec_from_config(tiny_config(**{key: value}))
