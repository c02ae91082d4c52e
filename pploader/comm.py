"""Every collective pploader does lives here: agreement on failure, report gathering,
progress counters, cancellation and tensor broadcasts.

Control traffic (who failed, reports, progress) goes through the job's key-value store
(the TCPStore every torch.distributed job has) with bounded polling, so a dead or hung rank
can never block the others past ``timeout_s``: they stop waiting, name the silent ranks,
and exit. Tensor traffic uses the process groups built once in ``__init__``.
"""
from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence, TypeVar

import torch
import torch.distributed as dist

from .errors import RankFailure, TopologyError
from .topology import Topology

__all__ = ["Comm", "DEFAULT_TIMEOUT_S", "run_guarded"]

DEFAULT_TIMEOUT_S = 60.0
_POLL_S = 0.05
_CANCELLED = "cancelled: another rank failed"
T = TypeVar("T")


class Comm:
    """The job's communication handle for one Topology (called on all ranks)."""

    def __init__(self, topology: Topology, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 store: Optional[dist.Store] = None, namespace: str = "pploader") -> None:
        if not dist.is_initialized():
            raise TopologyError("torch.distributed is not initialised; call "
                                "pploader.bootstrap.init_distributed() first")
        if dist.get_world_size() != topology.world_size or dist.get_rank() != topology.rank:
            raise TopologyError(f"process group has world {dist.get_world_size()} rank "
                                f"{dist.get_rank()} but the topology is {topology.describe()} "
                                f"of {topology.world_size}")
        self.topology, self.timeout_s = topology, timeout_s
        base = store if store is not None else dist.distributed_c10d._get_default_store()
        self.store = dist.PrefixStore(namespace + "/", base)
        self._gen = 0
        self.cancel = threading.Event()
        self._stop = threading.Event()
        self._watcher: Optional[threading.Thread] = None
        self.tp_group = self._groups(lambda t: t.tp_group())
        self.replica_group = self._groups(lambda t: t.replica_group())
        self.stage_group = self._groups(lambda t: t.stage_group())

    @property
    def rank(self) -> int:
        return self.topology.rank

    def _groups(self, members: Callable[[Topology], tuple[int, ...]]) -> Any:
        """Build one subgroup per distinct member set (all ranks call new_group in order)."""
        mine = None
        for ranks in sorted({members(t) for t in self.topology.all_ranks()}):
            group = dist.new_group(list(ranks)) if len(ranks) < self.topology.world_size \
                else dist.group.WORLD
            if self.rank in ranks:
                mine = group
        return mine

    # ---- store helpers -----------------------------------------------------------------
    def _wait_all(self, prefix: str, timeout_s: float) -> tuple[dict[int, Any], tuple[int, ...]]:
        """Values posted by every rank under ``prefix/<rank>``, and the silent ranks."""
        deadline = time.monotonic() + timeout_s
        values: dict[int, Any] = {}
        world = self.topology.world_size
        while True:
            for r in range(world):
                key = f"{prefix}/{r}"
                if r not in values and self.store.check([key]):
                    values[r] = json.loads(self.store.get(key).decode())
            if len(values) == world or time.monotonic() > deadline:
                return values, tuple(r for r in range(world) if r not in values)
            time.sleep(_POLL_S)

    # ---- agreement ---------------------------------------------------------------------
    def agree(self, error: Optional[BaseException], payload: Any = None) -> list[Any]:
        """Every rank reports ok (with a JSON-able ``payload``) or its error; if any rank
        failed, all raise the same RankFailure, else all get every rank's payload.

        Ranks that post nothing within the timeout are named as silent (hung or dead).
        """
        msg = None if error is None else f"{type(error).__name__}: {error}"
        gen = self._gen
        self._gen += 1
        try:
            if msg is not None:
                self.store.add("failed", 1)
            self.store.set(f"status/{gen}/{self.rank}", json.dumps([msg, payload]))
            values, silent = self._wait_all(f"status/{gen}", self.timeout_s)
            self._linger(f"seen/{gen}")
        except (RuntimeError, OSError) as exc:  # the store itself is gone (its host died)
            raise RankFailure({self.rank: msg} if msg else {},
                              silent=(0,) if self.rank else ()) from exc
        errors = {r: v[0] for r, v in values.items() if v[0] is not None}
        failures = {r: v for r, v in errors.items() if _CANCELLED not in v} or errors
        if failures or silent:
            raise RankFailure(failures, silent=silent)
        return [values[r][1] for r in range(self.topology.world_size)]

    def _linger(self, key: str, limit_s: float = 5.0) -> None:
        """Rank 0 (which may host the store) waits until every rank has read the results."""
        self.store.add(key, 1)
        if self.rank != 0:
            return
        deadline = time.monotonic() + limit_s
        while self.store.add(key, 0) < self.topology.world_size and time.monotonic() < deadline:
            time.sleep(_POLL_S)

    def watch_failures(self) -> threading.Event:
        """Start a thread that sets ``self.cancel`` as soon as any rank reports a failure."""
        def loop() -> None:
            while not self._stop.wait(0.2):
                try:
                    if self.store.add("failed", 0) > 0:
                        self.cancel.set()
                        return
                except (RuntimeError, OSError):
                    self.cancel.set()
                    return
        if self._watcher is None:
            self._watcher = threading.Thread(target=loop, name="pploader-watch", daemon=True)
            self._watcher.start()
        return self.cancel

    def close(self) -> None:
        self._stop.set()

    # ---- gathering ---------------------------------------------------------------------
    def gather_to_root(self, obj: Any) -> Optional[list[Any]]:
        """JSON-able ``obj`` from every rank, on rank 0 (None elsewhere)."""
        gen = self._gen
        self._gen += 1
        self.store.set(f"gather/{gen}/{self.rank}", json.dumps(obj))
        if self.rank != 0:
            return None
        values, silent = self._wait_all(f"gather/{gen}", self.timeout_s)
        if silent:
            raise RankFailure({}, silent=silent)
        return [values[r] for r in range(self.topology.world_size)]

    # ---- progress ----------------------------------------------------------------------
    def progress_adder(self, min_step_bytes: int = 32 << 20) -> Callable[[int], None]:
        """A callback adding to the job-wide loaded-bytes counter (batched store updates)."""
        pending = [0, time.monotonic()]
        lock = threading.Lock()

        def add(nbytes: int) -> None:
            with lock:
                pending[0] += nbytes
                if pending[0] >= min_step_bytes or time.monotonic() - pending[1] > 0.2:
                    self.store.add("progress", pending[0])
                    pending[0], pending[1] = 0, time.monotonic()

        def flush() -> None:
            with lock:
                if pending[0]:
                    self.store.add("progress", pending[0])
                    pending[0] = 0
        add.flush = flush  # type: ignore[attr-defined]
        return add

    def progress_total(self) -> int:
        return self.store.add("progress", 0)

    # ---- tensors -----------------------------------------------------------------------
    def broadcast(self, tensor: torch.Tensor, src: int, group: Any) -> None:
        """Broadcast ``tensor`` in place from global rank ``src`` within ``group``."""
        dist.broadcast(tensor, src=src, group=group)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        dist.send(tensor, dst)

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        dist.recv(tensor, src)


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def run_guarded(comm: Comm, fn: Callable[[], T]) -> T:
    """Run ``fn`` on every rank; if any rank fails, every rank raises one RankFailure."""
    comm.watch_failures()
    error: Optional[BaseException] = None
    result: Optional[T] = None
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - reported to every rank, then re-raised
        error = exc
    comm.agree(error)
    return result  # type: ignore[return-value]
