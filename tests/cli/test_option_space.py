"""The CLI's option space, generated (issue 32): every option of every command (read from the
parser itself, so a new option is covered the day it is added) x {0, -1, nan, inf, huge,
wrong type, empty}, and every environment variable the docs name x the same values, each on
an otherwise valid command line -> exit 0 or 2, never a traceback; an exit 2 is one line.

Runs in-process through ``pploader.cli.main``. ``load`` and ``bench`` stop where the job
would start (``init_distributed`` / the synthetic checkpoint's writer replaced): every check
before that point runs, nothing is launched or measured.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Iterator

import pytest

from helpers import JobStarted, make_model, run_cli

import pploader
import pploader.bench.cuda
import pploader.bench.data
from pploader.cli import build_parser

#: the hostile values: 0, -1, nan, inf, huge, wrong type, empty
VALUES = ("0", "-1", "nan", "inf", "9" * 30, "x!", "")

#: a valid command line per command ({m} model, {o} a fresh output path, {s} pickle dir)
BASE = {
    "plan": ["plan", "--model", "{m}", "--pp", "2"],
    "files": ["files", "--model", "{m}", "--pp", "2"],
    "load": ["load", "--model", "{m}"],
    "make-tiny": ["make-tiny", "llama", "{o}"],
    "convert": ["convert", "{s}", "{o}", "--allow-pickle"],
    "bench": ["bench", "--dir", "{o}"],
}

#: the environment variables docs/ name that pploader reads, and the command reading them
ENV = {"PPLOADER_LOG": "plan", "PPLOADER_BACKEND": "load", "LOCAL_WORLD_SIZE": "load",
       "VLLM_PP_LAYER_PARTITION": "plan", "SGLANG_PP_LAYER_PARTITION": "plan",
       "PPLOADER_FAULT": "load"}
#: what makes the command read the variable
ENV_ARGS = {"LOCAL_WORLD_SIZE": ["--read-once-node"],
            "VLLM_PP_LAYER_PARTITION": ["--partition", "vllm"],
            "SGLANG_PP_LAYER_PARTITION": ["--partition", "sglang"]}

_LAUNCH = ("RANK", "SLURM_PROCID", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK",
           "MV2_COMM_WORLD_RANK", "LOCAL_WORLD_SIZE", *ENV)


def _commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _options() -> Iterator[tuple[str, str, bool]]:
    """(command, option or positional name, takes a value) for every argument."""
    for name, parser in _commands().items():
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
                continue
            flag = action.option_strings[-1] if action.option_strings else action.dest
            yield name, flag, action.nargs != 0


CASES = [(cmd, flag, value) for cmd, flag, takes in _options()
         for value in (VALUES if takes else (None,))]
ENV_CASES = [(var, value) for var in ENV for value in VALUES]


def test_the_table_covers_every_command_and_option() -> None:
    assert set(_commands()) == set(BASE)
    per = {cmd: {f for c, f, _ in CASES if c == cmd} for cmd in BASE}
    assert {"--pp", "--tp", "--exchange-cost", "--tokens"} <= per["plan"]
    assert {"--save-loaded", "--io-backend", "--pool-device", "--timeout"} <= per["load"]
    assert {"--size-gb", "--repeat", "--rss-scale"} <= per["bench"]
    assert {"config", "out", "--seed", "--force"} <= per["make-tiny"]
    assert len(CASES) > 600


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import torch
    root = tmp_path_factory.mktemp("space")
    pickled = root / "pickled"
    pickled.mkdir()
    torch.save({"w": torch.ones(2, 2)}, pickled / "pytorch_model.bin")
    return {"m": make_model(root / "model"), "s": pickled}


@pytest.fixture()
def stopped(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)  # a value taken as a relative output path lands here

    def start(*a: object, **k: object) -> None:
        raise JobStarted()
    monkeypatch.setattr(pploader, "init_distributed", start)
    monkeypatch.setattr(pploader.bench.data, "write_synthetic", start)
    monkeypatch.setattr(pploader.bench.cuda, "main", start)
    for key in _LAUNCH:
        monkeypatch.delenv(key, raising=False)


def _argv(cmd: str, flag: str, value: "str | None", paths: dict[str, Path],
          out: Path) -> list[str]:
    argv = list(BASE[cmd])
    positional = [a.dest for a in _commands()[cmd]._actions if not a.option_strings]
    if flag in positional:  # replace the positional in its place
        at = 1 + [p for p in positional if p != "passthrough"].index(flag)
        argv[at] = value  # type: ignore[call-overload]
    elif flag in argv:  # an option the base already gives: its value replaced (a flag kept)
        if value is not None:
            argv[argv.index(flag) + 1] = value
    else:
        argv += [flag] if value is None else [flag, value]
    subs = {"{m}": str(paths["m"]), "{s}": str(paths["s"]), "{o}": str(out)}
    return [subs.get(a, a) for a in argv]


def _main(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[Any, str]:
    code, _, err = run_cli(argv, capsys)
    return (0 if code == "started" else code), err


def _check(code: Any, err: str, what: object) -> None:
    assert code in (0, 2), (what, code, err[-2000:])
    assert "Traceback" not in err, (what, err[-3000:])
    if code == 2:
        lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("usage:")
                 and not ln.startswith(" ")]
        assert len(lines) == 1 and "error:" in lines[0], (what, err[-2000:])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cmd,flag,value", CASES)
def test_option_value_exits_0_or_2(cmd: str, flag: str, value: "str | None",
                                   inputs: dict[str, Path], stopped: None, tmp_path: Path,
                                   capsys: pytest.CaptureFixture) -> None:
    argv = _argv(cmd, flag, value, inputs, tmp_path / "out")
    code, err = _main(argv, capsys)
    _check(code, err, argv)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("var,value", ENV_CASES)
def test_environment_value_exits_0_or_2(var: str, value: str, inputs: dict[str, Path],
                                        stopped: None, monkeypatch: pytest.MonkeyPatch,
                                        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cmd = ENV[var]
    monkeypatch.setenv(var, value)
    argv = _argv(cmd, "--model", str(inputs["m"]), inputs, tmp_path / "out") + ENV_ARGS.get(
        var, [])
    code, err = _main(argv, capsys)
    _check(code, err, (var, value))
    if value in ("x!", "nan", "-1") and var != "PPLOADER_FAULT":
        assert code == 2 and var in err, (var, value, err)  # refused, naming the variable
