"""One validation of every option: the CLI's flags and the public API's arguments.

``OPTIONS`` is the table: per option its kind (bytes, count, seconds, number, choice, paths),
unit and accepted range, with the CLI flag and the API argument name. ``cli_args.py`` makes
each flag's argparse ``type`` from it (text -> value; a bad value is one line naming the flag
and the accepted range, exit 2); the public API checks the same values with :func:`check`
(an :class:`~pploader.errors.ArgumentError` naming the argument). A new option gets a row
here, or ``tests/cli/test_option_space.py`` fails.

Bytes are integers (``0.5`` bytes is a mistake, ``1e30`` too); memory budgets stop at what
this machine has. Imports nothing heavy (``pploader --help`` never imports torch).
"""
from __future__ import annotations

import math
import operator
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

from .errors import ArgumentError

__all__ = ["Spec", "OPTIONS", "BY_FLAG", "check", "check_paths", "check_choice", "spec",
           "check_type", "check_callable", "check_event", "check_device",
           "host_memory_bytes", "MAX_BYTES", "MAX_RANKS", "MAX_LAYERS", "IO_BACKENDS", "CACHE_DTYPES", "format_size"]

#: the most bytes any byte option takes (1 PiB: past any device, disk or shard)
MAX_BYTES = 1 << 50

#: the most ranks one layout dimension, and a whole job, may have (plan builds every rank)
MAX_RANKS = 1 << 16

#: the most layers a model may have (planning/config_limits.py's num_hidden_layers cap)
MAX_LAYERS = 10_000

#: cache dtypes the pools can hold (a torch dtype name; ``int3`` and friends are not caches)
CACHE_DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2",
                "float8_e4m3fnuz", "float8_e5m2fnuz", "int8", "uint8")

_UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}


def host_memory_bytes() -> int:
    """This machine's physical memory (MAX_BYTES when the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not Linux
        return MAX_BYTES


def format_size(n: float) -> str:
    """``n`` bytes as the largest exact-ish binary unit (``64 MiB``, ``1.5 GiB``)."""
    for unit, scale in (("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20),
                        ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} B"


Bound = Union[float, Callable[[], float]]


@dataclass(frozen=True)
class Spec:
    """One option. ``kind``: bytes | count | seconds | number | choice | paths | text.
    ``low`` / ``high``: the accepted range (inclusive; ``high`` may be a callable: what this
    machine has); ``choices``: for ``choice``; ``why``: what the upper bound stands for."""

    name: str
    flag: Optional[str]
    kind: str
    low: float = 1
    high: Bound = MAX_BYTES
    choices: Sequence[str] = ()
    why: str = ""
    example: str = ""
    noun: str = ""

    @property
    def upper(self) -> float:
        return self.high() if callable(self.high) else self.high

    def accepted(self) -> str:
        """The accepted values, for the error line."""
        if self.kind == "bytes":
            high = f"{format_size(self.upper)}{f' ({self.why})' if self.why else ''}"
            return (f"a whole number of bytes from {int(self.low)} to {high}, e.g. "
                    f"{self.example or '512M'}")
        if self.kind == "count":
            return (f"an integer from {int(self.low)} to {int(self.upper)}"
                    f"{f' ({self.why})' if self.why else ''}")
        if self.kind in ("seconds", "number"):
            unit = " seconds" if self.kind == "seconds" else ""
            return (f"a number in [{self.low:g}, {self.upper:g}]{unit}"
                    f"{f' ({self.why})' if self.why else ''}")
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices)
        if self.kind == "paths":
            return "a list of existing directories (not one string)"
        return "a non-empty value"

    # ---- the API side: Python values -----------------------------------------------------
    def check(self, value: Any, *, label: Optional[str] = None, text: Optional[str] = None,
              required: bool = False) -> Any:
        """``value`` when it is in range (None passes: "default", unless ``required``); else
        an ArgumentError naming ``label`` (default: the argument name) and ``text``."""
        label = label or self.name
        if value is None:
            if required:
                raise self._error(label, value, "is required")
            return None
        try:
            return self._checked(value, label)
        except ArgumentError as exc:
            if text is None:
                raise
            raise ArgumentError(exc.detail.replace(f"{label}={self._shown(value)} ",
                                                   f"{label}={text.strip()[:60]} ", 1),
                                argument=label) from None

    def _checked(self, value: Any, label: str) -> Any:
        if self.kind in ("bytes", "count"):
            if isinstance(value, bool) or isinstance(value, float) or not _is_integer(value):
                raise self._error(label, value, "is not an integer")
            value = operator.index(value)
            if value < self.low:
                raise self._error(label, value, f"is below {int(self.low)}")
            if value > self.upper:
                raise self._error(label, value, "is too large")
            return value
        if self.kind in ("seconds", "number"):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise self._error(label, value, "is not a number")
            if not math.isfinite(value) or not self.low <= value <= self.upper or (
                    self.kind == "seconds" and value <= 0):
                raise self._error(label, value, "is out of range")
            return value
        if self.kind == "choice":
            if not isinstance(value, str) or value not in self.choices:
                raise self._error(label, value, f"is not {self.noun or 'one of the choices'}")
            return value
        if self.kind == "paths":
            return check_paths(label, value)
        if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
            raise self._error(label, value, "is empty")
        return value

    @staticmethod
    def _shown(value: Any) -> str:
        shown = repr(value) if not isinstance(value, (int, float)) or isinstance(value, bool) \
            else f"{value:g}" if isinstance(value, float) else str(value)
        return shown[:60]

    def _error(self, label: str, value: Any, what: str) -> ArgumentError:
        return ArgumentError(f"{label}={self._shown(value)} {what}; give {self.accepted()}",
                             argument=label)

    # ---- the CLI side: text -> value -------------------------------------------------------
    def parse(self, text: str) -> Any:
        """The option's value from its command-line text (ArgumentError naming the flag)."""
        label = self.flag or self.name
        t = text.strip()
        if self.kind == "bytes":
            return self.check(_bytes_of(t, self, label), label=label, text=text)
        if self.kind == "count":
            try:
                value = int(t)
            except ValueError:
                raise self._error(label, text, "is not an integer") from None
            return self.check(value, label=label, text=text)
        if self.kind in ("seconds", "number"):
            try:
                number = float(t)
            except ValueError:
                raise self._error(label, text, "is not a number") from None
            return self.check(number, label=label, text=text)
        if self.kind == "choice":
            return self.check(t, label=label)
        if self.kind == "paths" and t:
            return check_paths(label, [text])[0]
        if not t:
            raise self._error(label, text, "is empty")
        return text


def _is_integer(value: Any) -> bool:
    try:
        operator.index(value)
        return True
    except TypeError:
        return False


def _bytes_of(text: str, spec_: Spec, label: str) -> int:
    """Bytes from ``512M``, ``1G``, ``64KiB``, ``1048576``: a whole number of bytes."""
    t = text.lower()
    t = t[:-2] if t.endswith("ib") else t[:-1] if t.endswith("b") else t
    scale = 1
    if t and t[-1] in _UNITS:
        t, scale = t[:-1], _UNITS[t[-1]]
    try:
        number = float(t)
    except ValueError:
        raise spec_._error(label, text, "is not a size") from None
    if not math.isfinite(number):
        raise spec_._error(label, text, "is not a size")
    value = number * scale
    if value != int(value):
        raise spec_._error(label, text, "is not a whole number of bytes")
    return int(value)


def check_paths(name: str, value: Any, *, exist: bool = True) -> tuple[str, ...]:
    """A sequence of paths (a str or bytes is refused: iterating it would give its
    characters); each an existing directory when ``exist``."""
    if isinstance(value, (str, bytes, os.PathLike)):
        raise ArgumentError(f"{name}={value!r}: a single path, not a list of them; give "
                            f"{name}=[{os.fspath(value)!r}]", argument=name)
    try:
        items = list(value)
    except TypeError:
        raise ArgumentError(f"{name}={value!r}: not a list of paths; give a list of existing "
                            "directories", argument=name) from None
    out = []
    for item in items:
        if not isinstance(item, (str, os.PathLike)) or not os.fspath(item):
            raise ArgumentError(f"{name}: {item!r} is not a path; give a list of existing "
                                "directories", argument=name)
        path = os.fspath(item)
        if exist and not os.path.isdir(path):
            raise ArgumentError(f"{name}: {path} is not an existing directory; give a "
                                "directory that exists (symlink targets inside it are then "
                                "allowed)", argument=name)
        out.append(path)
    return tuple(out)


def check_type(name: str, value: Any, types: Union[type, tuple[type, ...]], what: str, *,
               optional: bool = True) -> Any:
    """``value`` when it is an instance of ``types`` (or None when ``optional``); else an
    ArgumentError naming ``name`` and saying what it must be (never an AttributeError deep
    inside)."""
    if (value is None and optional) or isinstance(value, types):
        return value
    raise ArgumentError(f"{name}={value!r:.60}: not {what}", argument=name)


def check_callable(name: str, value: Any) -> Any:
    """``value`` when it is callable (or None)."""
    if value is None or callable(value):
        return value
    raise ArgumentError(f"{name}={value!r:.60}: not callable; give a function or None",
                        argument=name)


def check_event(name: str, value: Any) -> Any:
    """A cancel event: None or an object with ``is_set()`` (a threading.Event)."""
    if value is None or callable(getattr(value, "is_set", None)):
        return value
    raise ArgumentError(f"{name}={value!r:.60}: not an event; give a threading.Event or None",
                        argument=name)


def check_device(name: str, value: Any, *, required: bool = False) -> Any:
    """A torch device (``"cpu"``, ``"cuda:1"``, a ``torch.device``); None passes unless
    ``required``."""
    if value is None and not required:
        return value
    import torch
    try:
        if isinstance(value, (str, torch.device)):
            return torch.device(value)
    except (RuntimeError, ValueError, TypeError):
        pass
    raise ArgumentError(f"{name}={value!r:.60}: not a device; give cpu, cuda or cuda:N",
                        argument=name)


def check_choice(name: str, value: Any, choices: Sequence[str]) -> str:
    """``value`` when it is one of ``choices`` (an ArgumentError naming ``name`` else)."""
    return Spec(name, None, "choice", choices=tuple(choices)).check(value)


#: io/registry.py's backend_names() (a literal: this module imports nothing of pploader but
#: its errors, so every folder may use it; tests/cli/test_option_space.py checks the two agree)
IO_BACKENDS = ("auto", "threaded", "pinned", "buffered", "mapped", "s3")


_RAM = "this machine's memory"

#: every option with a value: API name -> Spec (the few CLI options with a parser of their own,
#: such as --partition, --exchange-cost or output paths, are listed in the generated test's
#: ``OWN`` with the values they accept)
OPTIONS: dict[str, Spec] = {s.name: s for s in (
    # layout
    Spec("pp", "--pp", "count", 1, MAX_RANKS),
    Spec("tp", "--tp", "count", 1, MAX_RANKS),
    Spec("ep", "--ep", "count", 1, MAX_RANKS),
    Spec("nodes", "--nodes", "count", 1, MAX_RANKS),
    Spec("ranks_per_node", "--ranks-per-node", "count", 1, MAX_RANKS),
    Spec("node", "--node", "count", 0, MAX_RANKS - 1),
    Spec("rank", "--rank", "count", 0, MAX_RANKS - 1),
    # TP slice reads
    Spec("range_cost_bytes", "--range-cost", "bytes", 0, 1 << 30,
         why="a seek that costs more than 1 GiB of transfer is no seek", example="64K"),
    Spec("exchange_cost", None, "number", 0, 1000,
         why="bytes read per byte exchanged; past 1000 use off"),
    Spec("exchange_batch_bytes", "--exchange-batch", "bytes", 1, host_memory_bytes, why=_RAM,
         example="64M"),
    # reads
    Spec("window_bytes", "--window-bytes", "bytes", 1, host_memory_bytes, why=_RAM),
    Spec("memory_budget_bytes", "--memory-budget", "bytes", 1, host_memory_bytes, why=_RAM,
         example="8G"),
    Spec("threads", "--threads", "count", 1, 1024),
    Spec("device_window_bytes", None, "bytes", 1, MAX_BYTES),
    Spec("timeout_s", "--timeout", "seconds", 1, 7 * 86400, why="a week"),
    Spec("io_backend", "--io-backend", "choice", choices=IO_BACKENDS,
         noun="a read backend"),
    Spec("backend", "--backend", "choice", choices=("gloo", "nccl", "mpi"),
         noun="a torch.distributed backend"),
    # pools
    Spec("tokens", "--tokens", "count", 1, 1 << 32, why="a pool that size fits no device"),
    Spec("requests", "--requests", "count", 1, 1 << 24),
    Spec("max_context", "--max-context", "count", 1, 1 << 32),
    Spec("page_size", "--page-size", "count", 1, 1 << 20),
    Spec("budget_bytes", "--cache-budget", "bytes", 1, MAX_BYTES, example="20G"),
    Spec("device_bytes", "--device-memory", "bytes", 1, MAX_BYTES, example="80G"),
    Spec("memory_fraction", "--memory-fraction", "number", 0.01, 1),
    Spec("mamba_ratio", "--mamba-ratio", "number", 0, 1),
    Spec("kv_dtype", "--kv-dtype", "choice", choices=CACHE_DTYPES,
         noun="a cache dtype"),
    Spec("ssm_dtype", "--ssm-dtype", "choice", choices=CACHE_DTYPES, noun="a cache dtype"),
    # paths
    Spec("allowed_roots", "--allow-root", "paths"),
    Spec("model", "--model", "text"),
    # make-tiny / convert
    Spec("shard_bytes", "--shard-bytes", "bytes", 1 << 16, 1 << 40,
         why="a shard past 1 TiB is no shard", example="4G"),
    Spec("seed", "--seed", "count", 0, (1 << 63) - 1),
    # bench (the synthetic checkpoint and the measurement)
    Spec("layers", "--layers", "count", 1, 10_000),
    Spec("shards", "--shards", "count", 1, 10_000),
    Spec("repeat", "--repeat", "count", 1, 1_000),
    Spec("torch_threads", "--torch-threads", "count", 1, 1024),
)}

#: CLI flag -> Spec
BY_FLAG: dict[str, Spec] = {s.flag: s for s in OPTIONS.values() if s.flag}


def spec(name: str) -> Spec:
    """The table's row for API argument ``name``."""
    return OPTIONS[name]


def check(**values: Any) -> None:
    """Check API arguments by name against the table (None = the default, passes)."""
    for name, value in values.items():
        OPTIONS[name].check(value)
