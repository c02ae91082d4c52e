"""Ctrl-C and SIGTERM end every command cleanly (issue 43 item 4, issue 44 item 5): make-tiny
and convert stop at once with one line, exit 130 / 143 and no temporary output; a 2-rank
load under ``pploader.torchrun`` (launch/torchrun.sh) has every process gone within seconds,
exit 130 / 143, one line, no traceback, no --save-loaded file and no /dev/shm entry left;
--timeout ends a job whose peer hangs.

Bounds: the acceptance numbers (2 s for make-tiny / convert, 5 s for a torchrun job) hold on
an idle machine; the tests allow 2.5x that for a loaded one and still fail on a hang.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import pytest

from helpers import ROOT, pploader_cmd

from pploader.outputs import MARKER, TEMP_PREFIX

# bounds: the idle stop time x 4 for a loaded CI box (a clone's suite beside an engine suite,
# load 6-10, took 5.6 s against the 2 s stop's earlier 2.5x); a hang still fails here
STOP_S = 2.0 * 4  # make-tiny / convert: 2 s idle
JOB_STOP_S = 5.0 * 4  # a torchrun job: 5 s idle


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.pop("PPLOADER_LOG", None)
    env.update(extra)
    return env


def _big_config(folder: Path) -> Path:
    """A llama of ~1.2 GB: make-tiny takes seconds, so a signal lands mid-write."""
    cfg = json.loads((ROOT / "configs" / "models" / "tiny-llama.json").read_text())
    cfg.pop("pploader_tiny", None)
    cfg.update(hidden_size=1536, intermediate_size=4096, num_hidden_layers=16,
               num_attention_heads=24, num_key_value_heads=4, head_dim=64, vocab_size=32000)
    folder.mkdir()
    path = folder / "big.json"
    path.write_text(json.dumps(cfg))
    return path


def _pickled(folder: Path) -> Path:
    """A ~400 MB pickle checkpoint for `convert` (written by torch.save, trusted)."""
    import torch
    src = folder / "pickled"
    src.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    for i in range(8):
        torch.save({f"layer{i}.w{j}": torch.randn(1024, 1024, generator=gen)
                    for j in range(12)}, src / f"pytorch_model-{i}.bin")
    return src


def _interrupt(argv: list[str], signum: int, delay_s: float) -> tuple[int, float, str]:
    """Run ``argv``, send ``signum`` after ``delay_s``; (status, seconds to stop, stderr)."""
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=_env())
    time.sleep(delay_s)
    sent = time.monotonic()
    proc.send_signal(signum)
    try:
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"{argv[3]} ignored {signal.Signals(signum).name} for 60 s")
    assert proc.stderr is not None
    return code, time.monotonic() - sent, proc.stderr.read()


def _signal_trials(tmp_path: Path, argv: list[str], trials: int) -> None:
    """``trials`` SIGINTs and SIGTERMs at random moments: each stops within STOP_S with its
    status and one line, leaving no temporary and no partial output."""
    rng = random.Random(43)
    interrupted = 0
    for trial in range(trials):
        for signum, status, line in ((signal.SIGINT, 130, "pploader: interrupted (Ctrl-C)"),
                                     (signal.SIGTERM, 143, "pploader: terminated (SIGTERM)")):
            out = tmp_path / f"out-{signum}-{trial}"
            # after the interpreter's start (Python's own default before pploader runs)
            code, took, err = _interrupt(argv + [str(out)], signum, rng.uniform(0.8, 2.5))
            left = [p.name for p in tmp_path.iterdir() if p.name.startswith(TEMP_PREFIX)]
            assert left == [], (trial, signum, left)
            if (out / MARKER).is_file():  # finished before the signal (0), or the signal came
                # while the interpreter shut down after it (Python's default): complete output
                assert code in (0, -signum, status), (trial, signum, code, err)
                assert sorted(os.listdir(out))[-1] == "model.safetensors.index.json"
                continue
            interrupted += 1
            assert code == status, (trial, signum, code, err)
            assert took < STOP_S, (trial, signum, f"{took:.2f} s")
            assert err.strip() == line and "Traceback" not in err, err
            assert not out.exists(), sorted(os.listdir(out))
    assert interrupted >= trials, f"only {interrupted} of {2 * trials} runs were interrupted"


@pytest.mark.parametrize("trials", [pytest.param(3, id="3x2"),
                                    pytest.param(20, id="20x2", marks=pytest.mark.slow)])
def test_make_tiny_stops_on_every_signal_leaving_nothing(tmp_path: Path, trials: int) -> None:
    config = _big_config(tmp_path.parent / f"{tmp_path.name}-config")
    _signal_trials(tmp_path, pploader_cmd("make-tiny", str(config), "--shard-bytes", "32M"),
                   trials)


@pytest.mark.parametrize("trials", [pytest.param(2, id="2x2"),
                                    pytest.param(20, id="20x2", marks=pytest.mark.slow)])
def test_convert_stops_on_every_signal_leaving_nothing(tmp_path: Path, trials: int) -> None:
    src = _pickled(tmp_path.parent / f"{tmp_path.name}-src")
    _signal_trials(tmp_path, pploader_cmd("convert", str(src), "--allow-pickle",
                                          "--shard-bytes", "16M"), trials)


# ---- a 2-rank load under pploader.torchrun ----------------------------------------------------

def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (the ranks live in sessions of their own)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
            found += kids
            todo += kids
    return found


def _alive(pids: list[int]) -> list[int]:
    """The pids still running (zombies, waiting for their parent to reap them, are gone)."""
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in ("Z", "X"):
            alive.append(pid)
    return alive


def _shm_in_use() -> set[str]:
    """/dev/shm names some live process maps or holds open."""
    used: set[str] = set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            used.update(line.split("/dev/shm/", 1)[1].split()[0] for line in
                        (proc / "maps").read_text().splitlines() if "/dev/shm/" in line)
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("/dev/shm/"):
                    used.add(target[len("/dev/shm/"):].split()[0])
        except OSError:
            continue
    return used


def _torchrun_job(model: Path, save: Path, signum: Optional[int], *extra: str
                  ) -> tuple[int, float, list[str], list[int]]:
    """A PP=2 load whose rank 1 hangs mid-read under ``python -m pploader.torchrun``;
    ``signum`` to the launcher's process group once rank 1 hangs (None: wait for the
    timeout). (status, seconds from the signal until every process is gone, stderr lines,
    processes still alive then)."""
    argv = [sys.executable, "-m", "pploader.torchrun", "--standalone", "--nproc_per_node=2",
            "-m", "pploader", "load", "--model", str(model), "--pp", "2", "--no-progress",
            "--save-loaded", str(save), *extra]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(PPLOADER_FAULT="rank=1:hang"), start_new_session=True)
    lines: list[str] = []
    hung = threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line.rstrip("\n"))
            if "PPLOADER_FAULT: hang" in line:
                hung.set()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert hung.wait(180), lines
        time.sleep(0.5)  # rank 0 has written its temporary file and waits for rank 1
        pids = [proc.pid, *_children(proc.pid)]
        assert len(pids) >= 3, pids  # the launcher and its two ranks
        sent = time.monotonic()
        if signum is not None:
            os.killpg(proc.pid, signum)  # what a terminal's Ctrl-C does
        while _alive(pids) and time.monotonic() - sent < 120:
            time.sleep(0.05)
        took, alive = time.monotonic() - sent, _alive(pids)
        code = proc.wait(timeout=60)
        reader.join(10)
        return code, took, lines, alive
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.slow
@pytest.mark.parametrize("signum, status, line", [
    (signal.SIGINT, 130, "pploader: interrupted (Ctrl-C)"),
    (signal.SIGTERM, 143, "pploader: terminated (SIGTERM)")])
def test_torchrun_signal_ends_every_rank_with_one_line(tiny_llama: Path, tmp_path: Path,
                                                       signum: int, status: int,
                                                       line: str) -> None:
    shm_before = set(os.listdir("/dev/shm"))
    save = tmp_path / "saved"
    code, took, lines, alive = _torchrun_job(tiny_llama, save, signum, "--timeout", "120")
    assert alive == [] and took < JOB_STOP_S, (alive, f"{took:.2f} s", lines[-20:])
    assert code == status, (code, lines[-20:])
    text = "\n".join(lines)
    assert "Traceback" not in text and "death signal" not in text, text[-3000:]
    said = [ln for ln in lines if "pploader:" in ln and "PPLOADER_FAULT" not in ln]
    assert said == [line], said
    assert not save.exists(), sorted(os.listdir(save))  # rank 0's temporary file removed
    leaked = set(os.listdir("/dev/shm")) - shm_before - _shm_in_use()
    assert not leaked, leaked


@pytest.mark.slow
def test_timeout_ends_a_job_whose_peer_hangs(tiny_llama: Path, tmp_path: Path) -> None:
    """--timeout 5: rank 1 stops making progress; rank 0 names it and every process is gone
    within the timeout plus the launcher's shutdown; status 1, no traceback, no rank file."""
    save = tmp_path / "saved"
    code, took, lines, alive = _torchrun_job(tiny_llama, save, None, "--timeout", "5")
    assert alive == [] and took < 5 + JOB_STOP_S, (alive, f"{took:.2f} s", lines[-20:])
    assert code == 1, lines[-20:]
    text = "\n".join(lines)
    assert "rank 1: no answer within the load timeout" in text and "Traceback" not in text, \
        text[-3000:]
    assert lines[-1] == ("pploader: the job failed: rank 0 exited with status 1 (the ranks' "
                         "messages above say why)"), lines[-5:]
    assert not save.exists()


@pytest.mark.slow
def test_launch_torchrun_sh_passes_a_failed_ranks_status(tiny_llama: Path) -> None:
    """launch/torchrun.sh runs pploader.torchrun: a mistake in the input (--pp 3 on 2 ranks)
    exits 2, the ranks' status, with one closing line and no traceback (plain torchrun: 1)."""
    proc = subprocess.run([str(ROOT / "launch" / "torchrun.sh"), "--model", str(tiny_llama),
                           "--pp", "3"], capture_output=True, text=True, timeout=240,
                          env=_env(NPROC_PER_NODE="2", PYTHON=sys.executable))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("pploader: the job failed: rank ") and "status 2" in last, last


def test_one_line_per_node_and_none_for_torchruns_stop() -> None:
    """Who writes the signal's line: local rank 0 under any launcher, nobody under
    pploader.torchrun (it writes the job's line), nobody for torchrun's SIGTERM to the ranks
    left after a failure."""
    from pploader.cli_signals import QUIET_ENV, _speaks, exit_status, signal_line
    parent = os.getppid()
    assert _speaks(signal.SIGINT, {}, None) and _speaks(signal.SIGTERM, {}, parent)
    for key in ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"):
        assert _speaks(signal.SIGTERM, {key: "0"}, 12345)
        assert not _speaks(signal.SIGTERM, {key: "3"}, 12345)
    torchrun = {"TORCHELASTIC_RUN_ID": "x", "LOCAL_RANK": "0"}
    assert _speaks(signal.SIGINT, torchrun, parent)  # torchrun forwarding a Ctrl-C
    assert not _speaks(signal.SIGTERM, torchrun, parent)  # torchrun stopping the rest
    assert _speaks(signal.SIGTERM, torchrun, parent + 1)  # someone else's kill
    assert not _speaks(signal.SIGINT, {**torchrun, QUIET_ENV: "1"}, None)
    assert (exit_status(signal.SIGINT), exit_status(signal.SIGTERM)) == (130, 143)
    assert signal_line(signal.SIGTERM, "[rank 3] ") == "[rank 3] pploader: terminated (SIGTERM)\n"


def test_other_threads_say_nothing_after_the_signal() -> None:
    """A thread still writing once the watcher ends the process (the main thread failing on
    a temporary the watcher is removing: CI's one flaky convert run) adds nothing to the
    one line. The removal is slowed here so that the main thread writes during it."""
    script = (
        "import os, signal, sys, threading, time\n"
        "import pploader.outputs as outputs\n"
        "from pploader.cli_signals import exit_on_signals\n"
        "ending = threading.Event()\n"
        "def slow_discard():\n"
        "    ending.set()\n"
        "    time.sleep(0.5)\n"
        "outputs.discard_pending = slow_discard\n"
        "with exit_on_signals():\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    end = time.monotonic() + 10\n"
        "    while time.monotonic() < end:\n"
        "        if ending.is_set():\n"
        "            sys.stderr.write('pploader: error: a vanished temporary\\n')\n"
        "        time.sleep(0.001)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=_env(), timeout=60)
    assert proc.returncode == 143, proc.stderr[-500:]
    assert proc.stderr == "pploader: terminated (SIGTERM)\n", proc.stderr[-500:]
