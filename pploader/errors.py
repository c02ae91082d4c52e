"""pploader's error types: every failure names what it can (file, tensor, rank)."""
from __future__ import annotations

from typing import Mapping, Optional

__all__ = ["PPLoaderError", "CheckpointError", "ConfigError", "PlanError", "ReadError",
           "TopologyError", "UsageError", "ArgumentError", "RankFailure", "NotReadyError",
           "MemoryBudgetError"]


class PPLoaderError(Exception):
    """Base class of every error pploader raises on purpose."""

    def __init__(self, message: str, *, file: Optional[str] = None,
                 tensor: Optional[str] = None, rank: Optional[int] = None) -> None:
        self.file, self.tensor, self.rank, self.detail = file, tensor, rank, message
        super().__init__(self._compose())

    def _compose(self) -> str:
        where = []
        if self.rank is not None:
            where.append(f"rank {self.rank}")
        if self.file is not None:
            where.append(f"file {self.file}")
        if self.tensor is not None:
            where.append(f"tensor {self.tensor}")
        return f"{', '.join(where)}: {self.detail}" if where else self.detail

    def on_rank(self, rank: int) -> "PPLoaderError":
        """Attach the rank (kept if already set) and return self for re-raising."""
        if self.rank is None:
            self.rank = rank
            self.args = (self._compose(),)
        return self


class CheckpointError(PPLoaderError):
    """A checkpoint file, header or index is malformed or inconsistent."""


class ConfigError(PPLoaderError):
    """config.json is missing, unsupported or inconsistent with the checkpoint."""


class PlanError(PPLoaderError):
    """The requested layout cannot be planned (bad partition, indivisible shard, ...)."""


class ReadError(PPLoaderError):
    """Reading planned bytes failed (I/O error, file changed during load, cancelled)."""


class MemoryBudgetError(ReadError):
    """Out of memory while loading: an allocation of ``nbytes`` for ``tensor`` failed, or would
    take the reader past its ``budget_bytes`` (``in_use_bytes`` already allocated)."""

    def __init__(self, message: str, *, nbytes: int, in_use_bytes: int,
                 budget_bytes: Optional[int], file: Optional[str] = None,
                 tensor: Optional[str] = None, rank: Optional[int] = None) -> None:
        self.nbytes, self.in_use_bytes, self.budget_bytes = nbytes, in_use_bytes, budget_bytes
        super().__init__(message, file=file, tensor=tensor, rank=rank)


class TopologyError(PPLoaderError):
    """Ranks, sizes or launch environment are inconsistent."""


class UsageError(PPLoaderError):
    """A command-line option or environment setting is invalid (``pploader`` exits 2)."""


class ArgumentError(UsageError, ValueError):
    """An argument of the public API, or its command-line option, has the wrong type or is
    out of range (pploader/arguments.py); ``argument`` names it. Also a ValueError, as a
    bad argument is in Python."""

    def __init__(self, message: str, *, argument: str, rank: Optional[int] = None) -> None:
        self.argument = argument
        super().__init__(message, rank=rank)


class NotReadyError(PPLoaderError):
    """A model whose reload failed midway is not safe to use until restored."""


class RankFailure(PPLoaderError):
    """One combined error raised on every rank when any rank failed or went silent."""

    def __init__(self, failures: Mapping[int, str], *, silent: tuple[int, ...] = ()) -> None:
        self.failures = dict(sorted(failures.items()))
        self.silent = tuple(sorted(silent))
        lines = [f"{len(self.failures) + len(self.silent)} rank(s) failed:"]
        lines += [f"  rank {r}: {msg}" for r, msg in self.failures.items()]
        lines += [f"  rank {r}: no answer within the load timeout (hung or dead)" for r in self.silent]
        super().__init__("\n".join(lines))

    @property
    def input_only(self) -> bool:
        """True when every failing rank reported a mistake in the input (config, checkpoint,
        layout, arguments) and none went silent: the job failed before loading, exit 2."""
        return bool(self.failures) and not self.silent and all(
            m.split(":", 1)[0] in INPUT_ERRORS for m in self.failures.values())

    def first(self) -> str:
        """The lowest failing rank's message without its type name (one line)."""
        rank, msg = next(iter(self.failures.items()))
        kind, _, text = msg.partition(": ")
        text = text if kind in INPUT_ERRORS else msg
        return text if text.startswith(f"rank {rank}") else f"rank {rank}: {text}"


#: Error types that mean "the input is wrong" (CLI exit code 2), as Comm.agree names them;
#: a PermissionError (a file this user may not read) is the user's to fix too.
INPUT_ERRORS = frozenset({"ConfigError", "CheckpointError", "PlanError", "TopologyError",
                          "UsageError", "ArgumentError", "PermissionError"})
