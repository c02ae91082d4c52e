"""The one place that knows the read backends and picks one: ``BACKENDS`` (add a row for a new
backend file), :func:`select_backend` (by device, or by name), :func:`open_backend`.

Torch-free on import (the CLI's ``--help`` lists the backends from here); a backend's module is
imported only when it is opened.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

from ..errors import ArgumentError

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from ..planning.rank_plan import RankPlan
    from .backend import ReadBackend, ReadOptions

__all__ = ["BackendInfo", "BACKENDS", "AUTO", "backend_names", "backends_help",
           "select_backend", "open_backend", "prepare_staging", "shared_staging",
           "plan_storage"]

AUTO = "auto"


@dataclass(frozen=True)
class BackendInfo:
    """A read backend: its name (``--io-backend``), where its factory lives
    (``module:function``, ``factory(plan, device, options) -> ReadBackend``), the device types it
    loads onto, and what it is for (the CLI help). ``staging`` (optional, ``module:function``,
    ``staging(device, options)``): host staging made ahead of a load (start-up work such as
    page-locking, done while the caller plans), passed back as ``ReadOptions.ring``; it has a
    ``stop_preparing()`` called before the load. ``storage``: where the plan's files live
    (``file``: local paths; ``s3``: ``s3://`` objects); ``auto`` picks by the plan's paths."""

    name: str
    factory: str
    devices: tuple[str, ...]
    purpose: str
    staging: str = ""
    storage: str = "file"


#: Every read backend. Order matters: ``auto`` takes the first that loads onto the device.
BACKENDS: tuple[BackendInfo, ...] = (
    BackendInfo("threaded", "pploader.io.read:open_threaded", ("cpu",),
                "CPU default: threaded positional preadv, adjacent tensors in one call, bounded "
                "window, owned or borrowed tensors"),
    BackendInfo("pinned", "pploader.io.device:open_pinned", ("cuda",),
                "GPU default: reads into a reused ring of pinned host slots, async copies to "
                "the device, O_DIRECT when the files are not in the page cache",
                staging="pploader.io.device:prepared_staging"),
    BackendInfo("buffered", "pploader.io.buffered:open_buffered", ("cpu",),
                "plain open + seek + readinto, one request per range, no threads, no mmap: "
                "the simplest reference (and the example of adding a backend)"),
    BackendInfo("mapped", "pploader.io.mapped:open_mapped", ("cpu",),
                "views of a private file mapping for bytes already in the page cache (the "
                "consumer's copy is the only one), threaded positional reads for the rest"),
    BackendInfo("s3", "pploader.io.objectstore:open_s3", ("cpu", "cuda"),
                "s3:// model paths (picked for them): ranged GETs of the rank's byte ranges, "
                "merged, many in flight, into the reader's buffers", storage="s3"),
)


def backend_names(backends: Sequence[BackendInfo] = BACKENDS) -> list[str]:
    """``auto`` and every backend's name (the CLI's choices)."""
    return [AUTO, *(b.name for b in backends)]


def backends_help(backends: Sequence[BackendInfo] = BACKENDS) -> str:
    """One line per backend: name, devices, purpose."""
    return "; ".join(f"{b.name} ({'/'.join(b.devices)}): {b.purpose}" for b in backends)


def _device_type(device: "str | torch.device") -> str:
    return str(device).split(":", 1)[0]


def plan_storage(plan: "RankPlan") -> str:
    """Where a plan's files live: ``s3`` for ``s3://`` objects, else ``file``."""
    return "s3" if any(str(p).startswith("s3://") for p in plan.paths.values()) else "file"


def select_backend(device: "str | torch.device", name: Optional[str] = None,
                   backends: Sequence[BackendInfo] = BACKENDS, storage: str = "file"
                   ) -> BackendInfo:
    """The backend for ``device`` and ``storage``: ``name`` when given (checked: it must exist
    and load onto that device type from that storage), else (``None`` / ``auto``) the first in
    ``backends`` that does."""
    kind = _device_type(device)
    if name is not None and name != AUTO:
        for b in backends:
            if b.name == name:
                if kind not in b.devices:
                    raise ArgumentError(f"io_backend={name!r} loads onto "
                                        f"{'/'.join(b.devices)}, not {device}",
                                        argument="io_backend")
                if b.storage != storage:
                    raise ArgumentError(f"io_backend={name!r} reads {b.storage} storage, not "
                                        f"{storage} (use --io-backend auto)",
                                        argument="io_backend")
                return b
        raise ArgumentError(f"io_backend={name!r} is not a read backend; give one of "
                            + ", ".join(backend_names(backends)), argument="io_backend")
    for b in backends:
        if kind in b.devices and b.storage == storage:
            return b
    raise ValueError(f"no read backend loads onto {device} (known: "
                     + ", ".join(f"{b.name} ({'/'.join(b.devices)})" for b in backends) + ")")


def open_backend(plan: "RankPlan", device: "str | torch.device" = "cpu",
                 options: Optional["ReadOptions"] = None, name: Optional[str] = None,
                 backends: Sequence[BackendInfo] = BACKENDS) -> "ReadBackend":
    """A backend reading ``plan`` onto ``device`` (see :func:`select_backend`); nothing is read
    until its ``load()`` or iteration."""
    from .backend import ReadOptions
    info = select_backend(device, name, backends, plan_storage(plan))
    module, _, attr = info.factory.partition(":")
    factory = getattr(importlib.import_module(module), attr)
    return factory(plan, indexed_device(device), options or ReadOptions())  # type: ignore[no-any-return]


def indexed_device(device: "str | torch.device | int") -> "torch.device":
    """``device`` as a ``torch.device``; a CUDA device without an index (``"cuda"``, as the
    docs write it) becomes the current GPU's: the backends' reader threads bind to it with
    ``torch.cuda.set_device``, which refuses an unindexed device (torch 2.11)."""
    import torch
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def prepare_staging(device: "str | torch.device", options: Optional["ReadOptions"] = None,
                    name: Optional[str] = None, backends: Sequence[BackendInfo] = BACKENDS
                    ) -> Any:
    """Start the chosen backend's staging for ``device`` ahead of a load (None when the backend
    has none): the caller plans and agrees meanwhile, calls ``stop_preparing()`` on it before
    the load and passes it as ``ReadOptions(ring=...)``."""

    from .backend import ReadOptions
    info = select_backend(device, name, backends)
    if not info.staging:
        return None
    module, _, attr = info.staging.partition(":")
    factory = getattr(importlib.import_module(module), attr)
    return factory(indexed_device(device), options or ReadOptions())


def shared_staging(plan: "RankPlan", device: "str | torch.device", options: "ReadOptions",
                   name: Optional[str] = None, backends: Sequence[BackendInfo] = BACKENDS
                   ) -> "ReadOptions":
    """``options`` with staging that several backend runs of one load of ``plan`` can share (a
    CUDA backend's pinned ring, made now and page-locked as it is used), so such a load
    page-locks once. Unchanged when ``options.ring`` is already set or the backend that reads
    ``plan`` (by its storage) has no staging."""
    from dataclasses import replace

    if options.ring is not None:
        return options
    info = select_backend(device, name, backends, plan_storage(plan))
    if not info.staging:
        return options
    module, _, attr = info.staging.partition(":")
    staging = getattr(importlib.import_module(module), attr)(indexed_device(device), options)
    staging.stop_preparing()  # page-locked on first use, beside the load's own reads
    return replace(options, ring=staging)
