"""The CLI's option table, generated from the parser itself (issues 32, 43): every option of
every command x every invalid class of value (empty, 0, negative, fraction, NaN, inf, huge,
wrong type). A value the option's table row (pploader/arguments.py) does not accept exits 2
with one line naming the option, no traceback, nothing written; a value it accepts parses.
An option added without a row in the table (or in ``OWN`` below, for the few with their own
parser) fails ``test_every_option_has_a_validation``.

Runs in-process through ``pploader.cli.main``; ``load`` and ``bench`` stop where the job
would start (``init_distributed`` / the synthetic checkpoint's writer replaced). A few
subprocess runs check the "no traceback" property end to end.
"""
from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest

from helpers import JobStarted, make_model, run_cli

import pploader
import pploader.bench.cuda
import pploader.bench.data
from pploader.arguments import IO_BACKENDS, OPTIONS, Spec
from pploader.cli import build_parser
from pploader.errors import ArgumentError

#: the invalid classes of value
CLASSES = {"empty": "", "zero": "0", "negative": "-1", "fraction": "0.5", "nan": "nan",
           "inf": "inf", "huge": "1e30", "huge_int": "9" * 30, "wrong_type": "x!"}

#: a valid command line per command ({m} model, {o} a fresh output path, {s} pickle dir)
BASE = {
    "plan": ["plan", "--model", "{m}", "--pp", "2"],
    "files": ["files", "--model", "{m}", "--pp", "2"],
    "load": ["load", "--model", "{m}"],
    "make-tiny": ["make-tiny", "llama", "{o}"],
    "convert": ["convert", "{s}", "{o}", "--allow-pickle"],
    "bench": ["bench", "--dir", "{o}"],
}

_NAMES = tuple(c for c in CLASSES if c != "empty")  # any non-empty text is a file name

#: options with a parser of their own (not a table row): the classes each accepts. Output
#: paths accept any non-empty name; the rest accept none of the invalid classes but the ones
#: named (a fraction of a GB, 0 = skip).
OWN: dict[tuple[str, str], tuple[str, ...]] = {
    **{(cmd, "--partition"): () for cmd in ("plan", "files", "load")},
    **{(cmd, "--exchange-cost"): ("zero", "fraction") for cmd in ("plan", "files", "load")},
    ("plan", "--device"): (), ("load", "--device"): (), ("load", "--pool-device"): (),
    ("plan", "--device-memory"): (), ("load", "--device-memory"): (),
    ("files", "--format"): (), ("make-tiny", "config"): (), ("convert", "src"): (),
    ("make-tiny", "out"): _NAMES, ("convert", "dst"): _NAMES, ("load", "--save-loaded"): _NAMES,
    ("bench", "--dir"): _NAMES, ("bench", "--markdown"): _NAMES, ("bench", "--plot"): _NAMES,
    ("bench", "--render"): (), ("bench", "--size-gb"): ("fraction",),
    ("bench", "--rss-scale"): ("zero",), ("bench", "--plan-tensors"): ("zero",),
    ("bench", "--device"): (), ("bench", "--methods"): (), ("bench", "--caches"): (),
    ("bench", "--modes"): (),
}

#: the environment variables docs/ name: (command, the options that make it apply)
ENV = {"PPLOADER_LOG": ("plan", []), "PPLOADER_BACKEND": ("load", []),
       "LOCAL_WORLD_SIZE": ("load", ["--read-once-node"]),
       "VLLM_PP_LAYER_PARTITION": ("plan", ["--partition", "vllm"]),
       "SGLANG_PP_LAYER_PARTITION": ("plan", ["--partition", "sglang"])}

_LAUNCH = ("RANK", "WORLD_SIZE", "SLURM_PROCID", "PMI_RANK", "OMPI_COMM_WORLD_RANK",
           "PMIX_RANK", "MV2_COMM_WORLD_RANK", "LOCAL_WORLD_SIZE", *ENV)


def _commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _options() -> Iterator[tuple[str, str, argparse.Action]]:
    """(command, option or positional name, action) of every argument taking a value."""
    for name, parser in _commands().items():
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS \
                    or action.nargs == 0:
                continue
            yield name, action.option_strings[-1] if action.option_strings else action.dest, \
                action


def _row(action: argparse.Action) -> Optional[Spec]:
    return getattr(action.type, "spec", None)


def _accepts(spec: Spec, cls: str) -> bool:
    """Whether ``spec`` accepts the class ``cls``, worked out from its kind and range (not by
    calling its parser)."""
    if spec.kind in ("bytes", "count"):
        return cls == "zero" and spec.low <= 0
    if spec.kind in ("seconds", "number"):
        return (cls == "zero" and spec.low <= 0 < spec.upper and spec.kind == "number") or (
            cls == "fraction" and spec.low <= 0.5 <= spec.upper)
    return False  # choice, paths (none of these exists), text (--model: none exists)


def _accepted(cmd: str, flag: str, action: argparse.Action) -> tuple[str, ...]:
    spec = _row(action)
    if spec is not None:
        return tuple(c for c in CLASSES if _accepts(spec, c))
    return OWN.get((cmd, flag), ())  # an option in neither: test_every_option_... fails


OPTION_LIST = list(_options())
CASES = [(cmd, flag, cls) for cmd, flag, action in OPTION_LIST for cls in CLASSES
         if cls not in _accepted(cmd, flag, action)]
ACCEPTED = [(cmd, flag, cls) for cmd, flag, action in OPTION_LIST for cls in CLASSES
            if cls in _accepted(cmd, flag, action) and (cmd, flag) not in OWN]


def test_every_option_has_a_validation() -> None:
    """A new option needs a row in pploader/arguments.py (its ``type=_typed(flag)``) or an
    entry in OWN: an unchecked option (no type, no choices) is what issue 43 found."""
    unchecked = [(cmd, flag) for cmd, flag, action in OPTION_LIST
                 if _row(action) is None and (cmd, flag) not in OWN]
    assert not unchecked, f"options without validation (add a row to arguments.OPTIONS): " \
        f"{unchecked}"
    stale = set(OWN) - {(cmd, flag) for cmd, flag, _ in OPTION_LIST}
    assert not stale, stale
    assert set(_commands()) == set(BASE)
    assert len(CASES) > 400


def test_every_row_bounds_its_values() -> None:
    """Every table row has a finite range below the ``huge`` values (so 1e30 is refused)."""
    for spec in OPTIONS.values():
        if spec.kind in ("bytes", "count", "seconds", "number"):
            assert math.isfinite(spec.upper) and spec.upper < 1e30, spec.name
            assert spec.low >= 0, spec.name
    assert not {v for s in OPTIONS.values() for v in s.choices} & set(CLASSES.values())


def test_io_backend_choices_are_the_registry_names() -> None:
    from pploader.io.registry import backend_names
    assert list(IO_BACKENDS) == backend_names()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import torch
    root = tmp_path_factory.mktemp("space")
    pickled = root / "pickled"
    pickled.mkdir()
    torch.save({"w": torch.ones(2, 2)}, pickled / "pytorch_model.bin")
    return {"m": make_model(root / "model"), "s": pickled}


@pytest.fixture()
def stopped(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An empty working directory (a value taken as a relative output path lands here), the
    job's start replaced, no launcher variables."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)

    def start(*a: object, **k: object) -> None:
        raise JobStarted()
    monkeypatch.setattr(pploader, "init_distributed", start)
    monkeypatch.setattr(pploader.bench.data, "write_synthetic", start)
    monkeypatch.setattr(pploader.bench.cuda, "main", start)
    for key in _LAUNCH:
        monkeypatch.delenv(key, raising=False)
    return cwd


def _argv(cmd: str, flag: str, value: Optional[str], paths: dict[str, Path],
          out: Path) -> list[str]:
    argv = list(BASE[cmd])
    positional = [a.dest for a in _commands()[cmd]._actions if not a.option_strings
                  and a.help != argparse.SUPPRESS]
    if flag in positional:  # replace the positional in its place
        argv[1 + positional.index(flag)] = value  # type: ignore[call-overload]
    elif flag in argv:
        argv[argv.index(flag) + 1] = value  # type: ignore[call-overload]
    else:
        argv += [flag, value]  # type: ignore[list-item]
    subs = {"{m}": str(paths["m"]), "{s}": str(paths["s"]), "{o}": str(out)}
    return [subs.get(a, a) for a in argv]


def _one_line(err: str, what: object) -> str:
    assert "Traceback" not in err, (what, err[-3000:])
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "error:" in lines[0], (what, err[-2000:])
    return lines[0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cmd,flag,cls", CASES)
def test_invalid_value_exits_2_naming_the_option(cmd: str, flag: str, cls: str,
                                                 inputs: dict[str, Path], stopped: Path,
                                                 tmp_path: Path,
                                                 capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    argv = _argv(cmd, flag, CLASSES[cls], inputs, out)
    code, _, err = run_cli(argv, capsys)
    assert code == 2, (argv, code, err[-2000:])
    line = _one_line(err, argv)
    name = flag if flag.startswith("-") else f"argument {flag}"
    assert name in line or (flag == "config" and "config" in line) or (
        flag == "src" and "model directory does not exist" in line), (argv, line)
    assert not out.exists() and not any(stopped.iterdir()), argv  # nothing written


@pytest.mark.parametrize("cmd,flag,cls", ACCEPTED)
def test_accepted_value_parses(cmd: str, flag: str, cls: str, inputs: dict[str, Path],
                               tmp_path: Path) -> None:
    argv = _argv(cmd, flag, CLASSES[cls], inputs, tmp_path / "out")
    args = build_parser().parse_args(argv)
    dest = next(a.dest for c, f, a in OPTION_LIST if (c, f) == (cmd, flag))
    assert getattr(args, dest) == float(CLASSES[cls]), (argv, getattr(args, dest))


@pytest.mark.parametrize("spec", list(OPTIONS.values()), ids=list(OPTIONS))
def test_the_api_refuses_what_the_cli_refuses(spec: Spec) -> None:
    """The same row checks a Python value: a wrong type or a value out of range is an
    ArgumentError naming the argument; a string is never taken for a number."""
    bad: list[Any] = ["", "x!", math.nan, math.inf, 1e30, -1, True, object()]
    if spec.kind in ("bytes", "count"):
        bad += [0.5, "4"] + ([0] if spec.low > 0 else [])
    for value in bad:
        if spec.kind == "text" and isinstance(value, str) and value:
            continue  # a path: whether it exists is checked where it is opened
        with pytest.raises(ArgumentError) as exc:
            spec.check(value)
        assert exc.value.argument == spec.name and spec.name in str(exc.value), value


@pytest.mark.timeout(60)
@pytest.mark.parametrize("var", list(ENV))
@pytest.mark.parametrize("value", ["x!", "-1", "nan", ""])
def test_environment_value_refused_where_it_applies(var: str, value: str,
                                                    inputs: dict[str, Path], stopped: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Path,
                                                    capsys: pytest.CaptureFixture) -> None:
    """Refused (exit 2, naming the variable) when the command reads it; never in the way of
    a command that does not (a broken VLLM_PP_LAYER_PARTITION with --partition even)."""
    cmd, applies = ENV[var]
    monkeypatch.setenv(var, value)
    if var == "LOCAL_WORLD_SIZE":  # --read-once-node needs a world of several ranks
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    argv = _argv(cmd, "--model", str(inputs["m"]), inputs, tmp_path / "out")
    code, _, err = run_cli(argv + applies, capsys)
    if value != "":  # empty: as if unset
        assert code == 2, (var, value, code, err[-2000:])
        assert var in _one_line(err, (var, value))
    if applies:  # without the option the variable is not read: no error from it
        monkeypatch.delenv("RANK", raising=False)
        monkeypatch.delenv("WORLD_SIZE", raising=False)
        code, _, err = run_cli(argv, capsys)
        assert code in (0, "started") and var not in err, (var, value, code, err[-2000:])


@pytest.mark.parametrize("argv,needle", [
    (["load", "--model", "{m}", "--window-bytes", "0.5"], "--window-bytes: '0.5' is not a "
     "whole number of bytes"),
    (["plan", "--model", "S3://bucket/m", "--pp", "1"], "lower case"),
    (["load", "--model", "{m}", "--requests", "1e30"], "--requests: '1e30' is not an integer"),
    (["make-tiny", "llama", "{o}", "--shard-bytes", "1"], "--shard-bytes: 1 is below 65536"),
])
def test_subprocess_one_line_no_traceback(argv: list[str], needle: str,
                                          inputs: dict[str, Path], tmp_path: Path) -> None:
    """End to end, as a user runs it: exit 2, one line, no traceback, nothing written."""
    out = tmp_path / "out"
    argv = [a.replace("{m}", str(inputs["m"])).replace("{o}", str(out)) for a in argv]
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH}
    env["PYTHONPATH"] = str(Path(pploader.__file__).resolve().parents[1])
    proc = subprocess.run([sys.executable, "-m", "pploader", *argv], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path, env=env)
    assert proc.returncode == 2, proc.stderr
    assert needle in _one_line(proc.stderr, argv)
    assert not out.exists()


@pytest.mark.parametrize("env,needle", [
    ({"PPLOADER_TEST_WORKERS": "abc"}, "PPLOADER_TEST_WORKERS='abc'"),
    ({"PPLOADER_TEST_WORKERS": "0"}, "PPLOADER_TEST_WORKERS='0'"),
    ({"PPLOADER_TORCH": "numpy"}, "PPLOADER_TORCH='numpy' is not a torch requirement"),
    ({"PPLOADER_TORCH": "torch==2.13.0; rm -rf ~"}, "is not a torch requirement"),
])
def test_launch_script_variables_refused_before_any_setup(env: dict, needle: str,
                                                          tmp_path: Path) -> None:
    """launch/test.sh's variables: one line, exit 2, before a venv is made or pip runs."""
    root = Path(pploader.__file__).resolve().parents[1]
    venv = tmp_path / "venv"
    proc = subprocess.run(["bash", str(root / "launch" / "test.sh")], capture_output=True,
                          text=True, timeout=60,
                          env={**os.environ, "PPLOADER_VENV": str(venv), **env})
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], proc.stderr
    assert not venv.exists()
