"""Test-only fault injection for the fail-together tests (docs/launch.md, "Testing faults").

``PPLOADER_FAULT="rank=R:ACTION[:after_bytes=N]"`` makes rank R, once it has read N bytes
(default 0: at its first progress report), do ACTION:

- ``raise``: raise RuntimeError("injected fault ...") inside the load;
- ``hang``: stop making progress forever (sleeps; its heartbeat keeps going);
- ``kill``: SIGKILL itself (no cleanup, no message).

Read in exactly one place (``pploader load``, which imports this module only when
PPLOADER_FAULT is set); unset, it does nothing. Never set it in
production.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

from ..errors import PPLoaderError

__all__ = ["Fault", "fault_from_env", "with_fault", "FAULT_ENV"]

FAULT_ENV = "PPLOADER_FAULT"
_ACTIONS = ("raise", "hang", "kill")


@dataclass(frozen=True)
class Fault:
    """One injected fault: on ``rank``, after ``after_bytes`` bytes, do ``action``."""

    rank: int
    action: str
    after_bytes: int = 0


def fault_from_env(env: Optional[Mapping[str, str]] = None) -> Optional[Fault]:
    """Parse PPLOADER_FAULT, or None when unset."""
    env = os.environ if env is None else env
    text = env.get(FAULT_ENV, "").strip()
    if not text:
        return None
    fields: dict[str, str] = {}
    action = None
    for part in text.split(":"):
        if part in _ACTIONS:
            action = part
        elif "=" in part:
            k, v = part.split("=", 1)
            fields[k.strip()] = v.strip()
        else:
            raise PPLoaderError(f"{FAULT_ENV}={text!r}: unknown part {part!r}")
    try:
        rank, after = int(fields.pop("rank")), int(fields.pop("after_bytes", "0"))
    except (KeyError, ValueError):
        raise PPLoaderError(f"{FAULT_ENV}={text!r}: expected rank=R:raise|hang|kill"
                            "[:after_bytes=N]") from None
    if action is None or fields:
        raise PPLoaderError(f"{FAULT_ENV}={text!r}: expected rank=R:raise|hang|kill"
                            "[:after_bytes=N]")
    return Fault(rank, action, after)


def with_fault(fault: Optional[Fault], rank: int,
               on_progress: Callable[[int], None]) -> Callable[[int], None]:
    """``on_progress`` wrapped so that ``fault`` fires on ``rank`` (unchanged otherwise)."""
    if fault is None or fault.rank != rank:
        return on_progress
    done = [0]

    def hooked(nbytes: int) -> None:
        on_progress(nbytes)
        done[0] += nbytes
        if done[0] < fault.after_bytes:
            return
        sys.stderr.write(f"[rank {rank}] pploader: {FAULT_ENV}: {fault.action} after "
                         f"{done[0]} bytes at t={time.time():.3f}\n")
        sys.stderr.flush()
        if fault.action == "raise":
            raise RuntimeError(f"injected fault ({FAULT_ENV}) on rank {rank} after "
                               f"{done[0]} bytes")
        if fault.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        while True:  # hang
            time.sleep(3600)
    if hasattr(on_progress, "flush"):  # Comm.progress_adder's callback has one
        hooked.flush = on_progress.flush  # type: ignore[attr-defined]
    return hooked
