"""The ``buffered`` read backend: plain ``open`` + ``seek`` + ``readinto``, one request per byte
range, on the calling thread; no mmap, no threads, no ring.

The simplest correct backend, and the worked example of adding one (docs/architecture.md):
this file plus one row in ``io/registry.py``'s ``BACKENDS``. Useful as a reference when a faster
backend is suspected of a wrong byte, and on file systems where positional vectored reads
misbehave. Items are read one at a time: host memory in flight is one item (plus the scratch of a
coalesced strided read).
"""
from __future__ import annotations

import logging
import time
from io import BufferedReader
from typing import Iterator, Mapping, Optional

import torch

from ..errors import ReadError
from ..planning.items import ReadItem
from ..planning.rank_plan import RankPlan
from .backend import ReadOptions, ReadStats, check_identity, item_dtype, materialise

__all__ = ["BufferedBackend", "open_buffered"]

logger = logging.getLogger(__name__)


class BufferedBackend:
    """Reads a plan with buffered file objects (see the module docstring)."""

    def __init__(self, plan: RankPlan, options: ReadOptions) -> None:
        self.plan, self.options, self.stats = plan, options, ReadStats()

    def _err(self, msg: str, item: ReadItem) -> ReadError:
        return ReadError(msg, file=item.file, tensor=item.name, rank=self.plan.topology.rank)

    def _read(self, files: dict[str, BufferedReader], item: ReadItem, dst: torch.Tensor) -> None:
        """``dst`` <- the item's tensor: its ranges read in order, then :func:`materialise`."""
        cancel = self.options.cancel
        if cancel is not None and cancel.is_set():
            raise self._err("cancelled: another rank failed", item)
        raw = dst.reshape(-1).view(torch.uint8) if item.direct else \
            torch.empty(item.read_bytes, dtype=torch.uint8)
        if item.ranges and item.file not in files:
            try:
                files[item.file] = open(self.plan.paths[item.file], "rb")  # noqa: SIM115
            except OSError as exc:
                raise self._err(f"cannot open: {exc.strerror}", item) from exc
            check_identity(self.plan, item.file, files[item.file].fileno(), item.name)
        view, pos = memoryview(raw.numpy()), 0  # type: ignore[arg-type]
        for offset, length in item.ranges:
            f = files[item.file]
            f.seek(offset)
            got = 0
            while got < length:
                n = f.readinto(view[pos + got:pos + length])
                if not n:
                    raise self._err(f"file changed during load: unexpected end of file at "
                                    f"offset {offset + got} (truncated while loading?)", item)
                got += n
                self.stats.syscalls += 1
            pos += length
        self.stats.read_bytes += pos
        self.stats.items += 1
        materialise(item, raw, dst)
        if self.options.on_progress is not None:
            self.options.on_progress(item.read_bytes)

    def _each(self, destinations: Optional[Mapping[str, torch.Tensor]]
              ) -> Iterator[tuple[str, torch.Tensor]]:
        start, files = time.perf_counter(), dict[str, BufferedReader]()
        try:
            for item in self.plan.items:
                dst = torch.empty(item.shape, dtype=item_dtype(item)) if destinations is None \
                    else destinations.get(item.target)
                if dst is None or tuple(dst.shape) != item.shape or not dst.is_contiguous() \
                        or dst.dtype != item_dtype(item) or dst.device.type != "cpu":
                    raise self._err(f"destination {item.target} is not a contiguous cpu tensor "
                                    f"of {item.shape} {item_dtype(item)}", item)
                self._read(files, item, dst)
                yield item.target, dst
            for file, f in files.items():  # nothing changed while we read
                check_identity(self.plan, file, f.fileno())
        finally:
            for f in files.values():
                f.close()
            self.stats.seconds = time.perf_counter() - start
            logger.debug("rank %d: buffered read of %d bytes in %d request(s)",
                         self.plan.topology.rank, self.stats.read_bytes, self.stats.syscalls)

    def load(self, destinations: Optional[Mapping[str, torch.Tensor]] = None
             ) -> dict[str, torch.Tensor]:
        """Every item as a fresh CPU tensor, or read into ``destinations``."""
        return dict(self._each(destinations))

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._each(None)


def open_buffered(plan: RankPlan, device: torch.device, options: ReadOptions
                  ) -> BufferedBackend:
    """The ``buffered`` backend's factory (io/registry.py)."""
    if device.type != "cpu":
        raise ValueError(f"the buffered backend loads onto cpu, not {device}")
    return BufferedBackend(plan, options)
