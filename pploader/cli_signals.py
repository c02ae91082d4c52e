"""Ctrl-C and SIGTERM on the command line: the process ends at once, cleanly.

:func:`exit_on_signals` blocks SIGINT and SIGTERM in the main thread before any other thread
starts (torch's, the readers', the heartbeat), so every thread inherits the block and one
watcher thread receives the signal even while the main thread waits on a lock or sits in a
long C call (where Python's own handler would not run until it returned: a hung load or a
big shard write could not be interrupted). The watcher silences the other threads' stderr (a
write into a temporary it is removing fails there), removes pploader's temporary output in
progress (:func:`pploader.outputs.discard_pending`), writes one line and leaves with the
conventional status, 130 (SIGINT) or 143 (SIGTERM), through ``os._exit``: never a hang in
teardown (threads, the store, a peer that is gone).

The line is written once per node (:func:`_speaks`): by local rank 0 (or without a
launcher), not under ``pploader.torchrun`` (which prints the job's one line), and not for
torchrun's SIGTERM to the ranks left after another one failed.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Iterator, Mapping, Optional

__all__ = ["exit_on_signals", "exit_status", "signal_line", "QUIET_ENV"]

#: set by ``pploader.torchrun`` for its ranks: the launcher prints the one line, not the ranks
QUIET_ENV = "PPLOADER_SIGNAL_QUIET"

_SIGNALS = (signal.SIGINT, signal.SIGTERM)

#: where launchers put a rank's index on its node (torchrun, Slurm, Open MPI)
_LOCAL_RANK_ENV = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK")


def exit_status(signum: int) -> int:
    """The shell's status of a job ended by ``signum``: 128 + its number (130, 143)."""
    return 128 + int(signum)


def signal_line(signum: int, prefix: str = "") -> str:
    """The one line pploader writes when a signal ends it."""
    what = "interrupted (Ctrl-C)" if signum == signal.SIGINT else \
        f"terminated ({signal.Signals(signum).name})"
    return f"{prefix}pploader: {what}\n"


def _speaks(signum: int, env: Mapping[str, str], sender: Optional[int]) -> bool:
    """Whether this process writes the line: once per node (local rank 0), not under
    ``pploader.torchrun`` (it writes the job's line), and not for a SIGTERM from torchrun,
    which stops the ranks left after another failed (that failure is the job's message).
    torchrun starts each rank in a session of its own: a Ctrl-C reaches the ranks only as
    torchrun's forwarded SIGINT."""
    if env.get(QUIET_ENV) == "1":
        return False
    launched = "TORCHELASTIC_RUN_ID" in env  # a torchrun rank: its parent is the launcher
    if launched and signum == signal.SIGTERM and sender == os.getppid():
        return False
    local = next((env[k] for k in _LOCAL_RANK_ENV if env.get(k, "").strip()), "0")
    return local.strip() == "0"


def _take_stderr() -> Optional[int]:
    """Point descriptor 2 at /dev/null for every other thread and return a copy of the old
    one (None when there is none): a thread still running while the output is removed (a
    write into a temporary that just vanished) must not add its error to the one line."""
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:
        return None
    with contextlib.suppress(OSError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)
        os.close(null)
    return saved


def _end(signum: int, sender: Optional[int], prefix: str) -> None:
    """Silence the other threads, remove the temporary output, say why (maybe), leave with
    128 + signum."""
    from .outputs import discard_pending
    line_fd = _take_stderr()
    try:
        discard_pending()
    finally:
        if line_fd is not None and _speaks(signum, os.environ, sender):
            with contextlib.suppress(OSError):
                os.write(line_fd, signal_line(signum, prefix).encode())
        os._exit(exit_status(signum))


@contextlib.contextmanager
def exit_on_signals(prefix: str = "") -> Iterator[None]:
    """Within the block, SIGINT / SIGTERM end the process at once (see the module doc);
    ``prefix`` starts the line (``[rank N] ``). A no-op off the main thread."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(
            signal, "pthread_sigmask"):
        yield
        return
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            info = signal.sigtimedwait(_SIGNALS, 0.1)
            if info is not None:
                _end(info.si_signo, info.si_pid or None, prefix)
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    watcher = threading.Thread(target=watch, name="pploader-signals", daemon=True)
    watcher.start()
    try:
        yield
    except KeyboardInterrupt:  # raised before the block took effect
        _end(signal.SIGINT, None, prefix)
    finally:
        stop.set()
        watcher.join()
        pending = signal.sigpending() & set(_SIGNALS)
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
        for signum in sorted(pending):  # arrived as the block ended: still honoured
            _end(signum, None, prefix)
