"""Transfer ``direct``: the rank reads its own plan through one read backend."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, Mapping, Optional

import torch

from ..backend import ReadBackend, ReadOptions, ReadStats
from ..registry import open_backend

if TYPE_CHECKING:  # pragma: no cover
    from ...distributed.comm import Comm
    from ...planning.stage import StagePlan

__all__ = ["DirectTransfer"]


class DirectTransfer:
    """The plan read by one backend (``open_backend``); ``load(destinations)`` fills the
    caller's tensors in place, as the backend does."""

    kind = "direct"

    def __init__(self, staged: "StagePlan", device: torch.device, options: ReadOptions,
                 comm: Optional["Comm"] = None, io_backend: Optional[str] = None) -> None:
        self.plan = staged.plan
        self.backend: ReadBackend = open_backend(staged.plan, device, options, io_backend)

    @property
    def stats(self) -> ReadStats:  # type: ignore[override]
        return self.backend.stats

    def load(self, destinations: Optional[Mapping[str, torch.Tensor]] = None
             ) -> dict[str, torch.Tensor]:
        return self.backend.load(destinations)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.backend)

    def report(self) -> dict[str, Any]:
        return {}
