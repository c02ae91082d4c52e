"""``python -m pploader.torchrun``: torchrun whose Ctrl-C and SIGTERM end the job as a shell
expects (launch/torchrun.sh runs it; every torchrun argument works the same).

Plain ``torchrun`` answers a Ctrl-C with its own traceback (``SignalException``), warnings
from its agent and exit status 1, and waits up to 30 s before it kills a rank that does not
stop. Here:

- the ranks' pploader handles the signal (``pploader.cli_signals``: temporary output removed,
  exit at once) and stays quiet; this process writes the job's one line;
- torchrun's "death signal" / "closing signal" warnings are dropped, nothing else;
- a rank still alive ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` s (default here 3) after the signal
  is killed;
- the status is the shell's convention, 130 for SIGINT and 143 for SIGTERM;
- a failed rank ends it with that rank's status (2: a mistake in the input, 1: the load
  failed; the ranks' own messages say what) and one line, instead of torchrun's
  ``ChildFailedError`` traceback and 1.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Any, Optional, Sequence

__all__ = ["main"]

#: seconds torchrun waits for the ranks after a signal before it kills them (its default: 30)
SHUTDOWN_TIMEOUT_S = 3

_NOISE = ("death signal, shutting down workers", "closing signal")

_TORCHRUN_LOGGERS = ("torch.distributed.elastic.agent.server.api",
                     "torch.distributed.elastic.multiprocessing.api")


class _DropSignalNoise(logging.Filter):
    """torchrun's own messages about a signal it got and forwards (the job's line says it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(text in record.getMessage() for text in _NOISE)


def _root_cause(exc: Any) -> tuple[int, int]:
    """(rank, status) of the rank that failed first, passing over the ranks torchrun itself
    stopped with SIGTERM after it (status 143 or -15)."""
    stopped = (128 + signal.SIGTERM, -signal.SIGTERM)
    failures = sorted(exc.failures.items(), key=lambda kv: (kv[1].exitcode in stopped,
                                                             kv[1].timestamp, kv[0]))
    rank, failure = failures[0] if failures else exc.get_first_failure()
    return rank, failure.exitcode


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run torchrun with ``argv`` (default: this process's arguments); its status."""
    from .cli_signals import QUIET_ENV, exit_status, signal_line
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_TIMEOUT_S))
    os.environ[QUIET_ENV] = "1"  # the ranks inherit it: this process prints the one line
    try:
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import main as torchrun
    except KeyboardInterrupt:
        sys.stderr.write(signal_line(2))
        return exit_status(2)
    for name in _TORCHRUN_LOGGERS:
        logging.getLogger(name).addFilter(_DropSignalNoise())
    try:
        torchrun(list(sys.argv[1:] if argv is None else argv))
    except SignalException as exc:
        sys.stderr.write(signal_line(int(exc.sigval)))
        return exit_status(int(exc.sigval))
    except ChildFailedError as exc:
        rank, code = _root_cause(exc)
        sys.stderr.write(f"pploader: the job failed: rank {rank} exited with status {code} "
                         "(the ranks' messages above say why)\n")
        return code if 0 < code < 256 else 1  # < 0: killed by a signal
    except KeyboardInterrupt:  # before torchrun installed its handlers
        sys.stderr.write(signal_line(2))
        return exit_status(2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
