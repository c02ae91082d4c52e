"""Every collective pploader does lives here: agreement on failure, report gathering,
progress counters, liveness, cancellation and tensor traffic.

Control traffic goes through the job's key-value store (the TCPStore every torch.distributed
job has) with bounded polling, never through a collective that could block forever:

- each rank posts its outcome for an agreement round, then one verdict is chosen with
  ``compare_set`` (first writer wins), so every rank reaches the *same* verdict even when
  ranks notice a problem at different moments;
- a background thread beats (``beat/<rank>``) and watches the job-wide ``failed`` counter;
  a rank whose beat stops for ``dead_after_s`` is dead (SIGKILL, crash, lost node);
- progress (bytes read) bumps ``act/<rank>``; a rank that is alive but makes no progress
  for ``timeout_s`` while others wait for it is hung (silent).

Tensor traffic uses the process groups built once in ``__init__``.

Which Comm of one rank talks to which Comm of another is explicit: a Comm's keys live under
its ``namespace`` (default ``"pploader"``: name it after the call's purpose, e.g.
``"vllm-reload"``) and that namespace's generation on this rank, counted in the job's store:
the n-th Comm of namespace N on one rank meets the n-th Comm of N on every other rank. Comms of
different namespaces may be built in any order; nothing is counted per process. (Process
subgroups are still built with ``new_group``, which torch requires in the same order.)
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import sys
import threading
import time
import weakref
from typing import Any, Callable, Iterable, Optional, TypeVar

import torch
import torch.distributed as dist

from ..errors import PPLoaderError, RankFailure, TopologyError
from ..planning.topology import Topology

logger = logging.getLogger(__name__)

__all__ = ["Comm", "DEFAULT_TIMEOUT_S", "DEFAULT_DEAD_AFTER_S", "DEFAULT_NAMESPACE",
           "run_guarded", "run_agreed", "start_refusal_gather"]

DEFAULT_TIMEOUT_S = 60.0
DEFAULT_DEAD_AFTER_S = 10.0
_BEAT_S = 0.5
_CANCELLED = "cancelled: another rank failed"
_STORE_ERRORS = (RuntimeError, OSError)  # DistStoreError / DistNetworkError are RuntimeErrors
DEFAULT_NAMESPACE = "pploader"
T = TypeVar("T")


def _stop_at_exit(ref: "weakref.ref[Comm]") -> None:
    comm = ref()
    if comm is not None:
        comm._stop_watcher()


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


class _Staleness:
    """How long, on this rank's clock, a peer's counter has not changed."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[int, float]] = {}

    def __call__(self, key: str, value: int, now: float) -> float:
        last = self._seen.get(key)
        if last is None or last[0] != value:
            self._seen[key] = (value, now)
            return 0.0
        return now - last[1]


class Comm:
    """The job's communication handle for one Topology (construct on all ranks)."""

    def __init__(self, topology: Topology, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 dead_after_s: Optional[float] = None, store: Optional[dist.Store] = None,
                 namespace: str = DEFAULT_NAMESPACE, store_host_rank: Optional[int] = 0,
                 max_poll_s: float = 0.2, groups: bool = True) -> None:
        """``timeout_s``: how long a rank may make no progress while others wait for it;
        ``dead_after_s`` (default min(10, timeout_s)): how long its heartbeat may stop;
        ``namespace``: the purpose of this handle; the n-th Comm of a namespace on each rank
        meets the n-th of the same namespace on every other rank (module docstring);
        ``store_host_rank``: the rank whose process hosts the store (named when the store
        is lost); None when no rank does (torchrun's agent): ``init_distributed()`` returns
        it as ``LaunchEnv.store_host_rank`` (this module reads no environment);
        ``max_poll_s``: the longest pause between an agreement's store polls (the most a rank
        that posted early waits past the last post; a reload between requests wants it short);
        the first pause is a fifth of it, at most 5 ms, each next one 1.5 times longer;
        ``groups`` False: no process subgroups (agreements only: they use the store; building
        gloo groups is a collective over every rank, seconds on a busy box)."""
        if not dist.is_initialized():
            raise TopologyError("torch.distributed is not initialised; call "
                                "pploader.distributed.bootstrap.init_distributed() first")
        if dist.get_world_size() != topology.world_size or dist.get_rank() != topology.rank:
            raise TopologyError(f"process group has world {dist.get_world_size()} rank "
                                f"{dist.get_rank()} but the topology is {topology.describe()} "
                                f"of {topology.world_size}")
        if timeout_s <= 0:
            raise TopologyError(f"timeout_s must be positive, got {timeout_s}")
        self.topology, self.timeout_s = topology, float(timeout_s)
        self.dead_after_s = float(min(DEFAULT_DEAD_AFTER_S, timeout_s)
                                  if dead_after_s is None else dead_after_s)
        base = store if store is not None else dist.distributed_c10d._get_default_store()
        if not isinstance(namespace, str) or not namespace.strip("/"):
            raise TopologyError(f"Comm namespace must be a non-empty name, got {namespace!r}")
        generation = base.add(f"pploader-namespaces/{namespace}/{topology.rank}", 1) - 1
        self.namespace = f"{namespace}/{generation}"
        self.store = dist.PrefixStore(self.namespace + "/", base)
        self._gen = 0
        self._expected_closers = topology.world_size
        self._concluded_failure = False
        self._abort_after_s: Optional[float] = None
        self._before_exit: Optional[Callable[[], None]] = None
        self.store_host_rank = store_host_rank
        self.max_poll_s = float(max_poll_s)
        self.cancel = threading.Event()
        self._closed = threading.Event()
        self.touch()
        self.store.add(f"beat/{self.rank}", 1)
        self._watcher = threading.Thread(target=self._watch, name="pploader-watch", daemon=True)
        self._watcher.start()
        atexit.register(_stop_at_exit, weakref.ref(self))
        self.tp_group = self.replica_group = self.stage_group = None
        if groups:
            self.tp_group = self._groups(lambda t: t.tp_group())
            self.replica_group = self._groups(lambda t: t.replica_group())
            self.stage_group = self._groups(lambda t: t.stage_group())

    @property
    def rank(self) -> int:
        return self.topology.rank

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    def _groups(self, members: Callable[[Topology], tuple[int, ...]]) -> Any:
        """Build one subgroup per distinct member set (all ranks call new_group in order)."""
        mine = None
        for ranks in sorted({members(t) for t in self.topology.all_ranks()}):
            group = dist.new_group(list(ranks)) if len(ranks) < self.world_size \
                else dist.group.WORLD
            if self.rank in ranks:
                mine = group
        return mine

    def _named_groups(self, group: str) -> dict[str, Any]:
        groups = {"stage": self.stage_group, "tp": self.tp_group, "replica": self.replica_group}
        if group not in groups:
            raise ValueError(f"unknown group {group!r}; known: {', '.join(groups)}")
        if self.world_size > 1 and all(g is None for g in groups.values()):
            raise ValueError("this Comm was made without process groups (groups=False)")
        return groups

    # ---- liveness ----------------------------------------------------------------------
    def touch(self) -> None:
        """Record progress for this rank (resets its hung clock on the other ranks)."""
        self.store.add(f"act/{self.rank}", 1)

    def _watch(self) -> None:
        """Beat; set ``cancel`` when any rank failed; optionally exit a rank left behind."""
        aborted_at: Optional[float] = None
        store_lost = False
        while not self._closed.wait(_BEAT_S):
            try:
                if not store_lost:
                    self.store.add(f"beat/{self.rank}", 1)
                    aborted = self.store.add("aborted", 0) > 0  # some rank concluded failure
                    if aborted or self.store.add("failed", 0) > 0:  # or posted an error
                        self.cancel.set()
                    if aborted and aborted_at is None:
                        aborted_at = time.monotonic()
            except _STORE_ERRORS:
                store_lost = True  # its host died: stop talking to it
                self.cancel.set()
                aborted_at = aborted_at or time.monotonic()
            if (aborted_at is not None and self._abort_after_s is not None
                    and not self._concluded_failure
                    and time.monotonic() - aborted_at > self._abort_after_s):
                sys.stderr.write(f"[rank {self.rank}] pploader: the job failed while this rank "
                                 f"was still busy for {self._abort_after_s:.0f} s (hung?); "
                                 "exiting\n")
                sys.stderr.flush()
                if self._before_exit is not None:
                    self._before_exit()
                os._exit(1)

    def watch_failures(self, *, abort_after_s: Optional[float] = None,
                       before_exit: Optional[Callable[[], None]] = None) -> threading.Event:
        """The event set as soon as any rank reports a failure (pass it to the Reader).

        With ``abort_after_s``, a rank still busy that long after the others concluded the
        job failed exits the process with status 1 (for command-line use: no orphans even
        under launchers that do not kill a job's remaining ranks), after ``before_exit``
        (e.g. removing its temporary output files).
        """
        self._abort_after_s = abort_after_s
        self._before_exit = before_exit
        return self.cancel

    # ---- agreement ---------------------------------------------------------------------
    def agree(self, error: Optional[BaseException], payload: Any = None) -> list[Any]:
        """Every rank reports ok (with a JSON-able ``payload``) or its error; if any rank
        failed, went silent or died, all raise the same RankFailure, else all get every
        rank's payload in rank order. Called on all ranks, in the same order.
        """
        msg = None if error is None else _describe(error)
        gen = self._gen
        self._gen += 1
        key = f"agree/{gen}"
        try:
            if msg is not None:
                self.store.add("failed", 1)
            self.store.set(f"{key}/{self.rank}", json.dumps([msg, payload]))
            self.store.add(f"{key}/count", 1)
            self.touch()
            verdict, values = self._decide(key)
        except _STORE_ERRORS as exc:
            self._concluded_failure = True
            self._expected_closers = 0
            host = self.store_host_rank
            if host is None or host == self.rank:
                lost = {self.rank: f"lost the job's key-value store ({exc}); the launcher's "
                        "agent hosting it probably died"}
            else:
                lost = {host: f"died: its process hosted the job's key-value store and is gone "
                        f"(rank {self.rank} saw: {exc})"}
            if msg is not None and not isinstance(error, dist.DistError):
                lost[self.rank] = msg  # its own failure, unless it was this same lost store
            logger.debug("rank %d: agreement %d: store lost (%s)", self.rank, gen, exc)
            raise RankFailure(lost) from exc
        if verdict != "ok":
            failure = json.loads(verdict)
            failures = {int(r): m for r, m in failure["failures"].items()}
            silent = tuple(failure["silent"])
            self._concluded_failure = True
            self._expected_closers = self.world_size - len(silent) - sum(
                1 for m in failures.values() if m.startswith("died:"))
            try:
                self.store.add("aborted", 1)
            except _STORE_ERRORS:
                pass
            logger.debug("rank %d: agreement %d failed: ranks %s failed, %s silent", self.rank,
                         gen, sorted(failures), list(silent))
            raise RankFailure(failures, silent=silent)
        logger.debug("rank %d: agreement %d: every rank ok", self.rank, gen)
        return [values[r][1] for r in range(self.world_size)]

    def _posted(self, key: str, ranks: Iterable[int]) -> list[int]:
        return [r for r in ranks if self.store.check([f"{key}/{r}"])]

    def _decide(self, key: str) -> tuple[str, dict[int, Any]]:
        """Wait for every rank's post, a verdict, or a dead/hung rank; return the verdict."""
        world = self.world_size
        stale = _Staleness()
        health_every = max(1.0, world / 64)  # O(missing ranks) store reads per check
        next_health = time.monotonic() + health_every
        posted: set[int] = set()
        poll = min(0.005, self.max_poll_s / 5)
        while True:
            if self.store.check([f"{key}/verdict"]):
                return self._finish(key, self.store.get(f"{key}/verdict").decode())
            if self.store.add(f"{key}/count", 0) >= world:
                return self._propose(key, range(world), silent=(), dead=())
            now = time.monotonic()
            if now >= next_health:
                next_health = now + health_every
                posted.update(self._posted(key, (r for r in range(world) if r not in posted)))
                dead, silent = [], []
                for r in range(world):
                    if r in posted:
                        continue
                    beat_s = stale(f"beat/{r}", self.store.add(f"beat/{r}", 0), now)
                    act_s = stale(f"act/{r}", self.store.add(f"act/{r}", 0), now)
                    if beat_s > self.dead_after_s:
                        dead.append(r)
                    elif act_s > self.timeout_s:
                        silent.append(r)
                if dead or silent:  # ranks still busy are left out: they will read the verdict
                    return self._propose(key, sorted(posted), silent=tuple(silent),
                                         dead=tuple(dead))
            time.sleep(poll)
            poll = min(poll * 1.5, self.max_poll_s)

    def _propose(self, key: str, ranks: Iterable[int], *, silent: tuple[int, ...],
                 dead: tuple[int, ...]) -> tuple[str, dict[int, Any]]:
        """Propose a verdict from the posts of ``ranks``; the first proposal stored wins."""
        ranks = list(ranks)
        values = {r: json.loads(v.decode()) for r, v in
                  zip(ranks, self.store.multi_get([f"{key}/{r}" for r in ranks]))}
        errors = {r: v[0] for r, v in values.items() if v[0] is not None}
        failures = {r: m for r, m in errors.items() if _CANCELLED not in m} or errors
        failures.update({r: f"died: no heartbeat for {self.dead_after_s:.0f} s (killed or "
                         "crashed)" for r in dead})
        proposal = "ok" if not failures and not silent else json.dumps(
            {"failures": {str(r): m for r, m in sorted(failures.items())},
             "silent": sorted(silent)})
        verdict = self.store.compare_set(f"{key}/verdict", "", proposal).decode()
        return self._finish(key, verdict, values)

    def _finish(self, key: str, verdict: str, values: Optional[dict[int, Any]] = None
                ) -> tuple[str, dict[int, Any]]:
        """An "ok" verdict is only ever proposed once every rank posted: read them all."""
        if verdict == "ok" and (values is None or len(values) < self.world_size):
            raws = self.store.multi_get([f"{key}/{r}" for r in range(self.world_size)])
            values = {r: json.loads(v.decode()) for r, v in enumerate(raws)}
        return verdict, values or {}

    # ---- teardown ----------------------------------------------------------------------
    def close(self, *, linger: bool = True) -> None:
        """Stop the watcher; with ``linger``, wait until every live rank has closed too (at
        most the load timeout), so a rank hosting the store does not leave before the others
        have read from it."""
        if self._closed.is_set():
            return
        self._stop_watcher()
        try:
            self.store.add("closed", 1)
            deadline = time.monotonic() + self.timeout_s
            while (linger and self.store.add("closed", 0) < self._expected_closers
                   and time.monotonic() < deadline):
                time.sleep(0.02)
        except _STORE_ERRORS:
            pass

    def _stop_watcher(self) -> None:
        """Stop and join the watcher: a daemon thread caught inside a store call when the
        interpreter exits is unwound through C++ frames and aborts the process."""
        self._closed.set()
        if self._watcher.is_alive() and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=10.0)

    def __enter__(self) -> "Comm":
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # ---- gathering ---------------------------------------------------------------------
    def gather_to_root(self, obj: Any) -> Optional[list[Any]]:
        """JSON-able ``obj`` from every rank, on rank 0 (None elsewhere); an agreement round,
        so a silent rank makes every rank raise."""
        values = self.agree(None, obj)
        return values if self.rank == 0 else None

    # ---- progress ----------------------------------------------------------------------
    def progress_adder(self, min_step_bytes: int = 32 << 20) -> Callable[[int], None]:
        """A callback adding to the job-wide loaded-bytes counter (batched store updates);
        each update also counts as this rank's progress. ``add.flush()`` sends the rest."""
        pending = [0, time.monotonic()]
        lock = threading.Lock()

        def send() -> None:
            self.store.add("progress", int(pending[0]))
            self.touch()
            pending[0], pending[1] = 0, time.monotonic()

        def add(nbytes: int) -> None:
            with lock:
                pending[0] += nbytes
                if pending[0] >= min_step_bytes or time.monotonic() - pending[1] > 0.2:
                    send()

        def flush() -> None:
            with lock:
                if pending[0]:
                    send()
        add.flush = flush  # type: ignore[attr-defined]
        return add

    def progress_total(self) -> int:
        """Bytes loaded so far by all ranks together."""
        return self.store.add("progress", 0)

    # ---- tensors -----------------------------------------------------------------------
    def broadcast(self, tensor: torch.Tensor, src: int, group: Any) -> None:
        """Broadcast ``tensor`` in place from global rank ``src`` within ``group``."""
        dist.broadcast(tensor, src=src, group=group)

    def broadcast_bytes(self, tensor: torch.Tensor, src: int, group: str) -> None:
        """Broadcast a contiguous tensor's bytes in place from global rank ``src`` over this
        rank's ``group`` ("stage", "tp" or "replica"); any dtype (fp8 too: sent as uint8).
        Read-once for replicas (planning/share.py) moves replicated tensors with it."""
        groups = self._named_groups(group)
        if tensor.numel():
            dist.broadcast(tensor.reshape(-1).view(torch.uint8), src=src, group=groups[group])

    def all_to_all_bytes(self, recv: torch.Tensor, recv_splits: list[int], send: torch.Tensor,
                         send_splits: list[int], group: str = "tp") -> None:
        """One all-to-all over this rank's ``group``: ``send`` (1-d uint8, cut by
        ``send_splits``, one part per member in group order, itself included) goes out and
        ``recv`` (1-d uint8) is filled with every member's part for this rank, in member
        order. CPU tensors over gloo, CUDA tensors over NCCL. Every member must call it with
        matching splits. Read-and-redistribute (io/transfer/exchange.py) batches many tensors into one."""
        groups = self._named_groups(group)
        if recv.dtype != torch.uint8 or send.dtype != torch.uint8 or recv.dim() != 1 \
                or send.dim() != 1:
            raise ValueError("all_to_all_bytes moves 1-d uint8 tensors")
        if sum(recv_splits) != recv.numel() or sum(send_splits) != send.numel():
            raise ValueError(f"splits {send_splits} / {recv_splits} do not match the buffers "
                             f"({send.numel()} / {recv.numel()} bytes)")
        dist.all_to_all_single(recv, send, recv_splits, send_splits, group=groups[group])

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        dist.send(tensor, dst)

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        dist.recv(tensor, src)


def run_agreed(comm: Optional[Comm], fn: Callable[[], T],
               share: Optional[Callable[[T], Any]] = None, *,
               rank: Optional[int] = None) -> tuple[T, list[Any]]:
    """Run one step of a fail-together sequence on every rank (called on all ranks, in the
    same order): ``fn()``, then one agreement round.

    If any rank's ``fn`` raised, went silent or died, every rank raises the same RankFailure
    (chained from its own error, if it had one). Else every rank gets ``fn``'s result and
    every rank's ``share(result)`` (JSON-able; None without ``share``), in rank order.
    A PPLoaderError from ``fn`` is tagged with ``rank`` (default: the comm's) first. Without a
    ``comm`` (one process): ``fn``'s own error, or ``(result, [share(result)])``.
    """
    rank = rank if rank is not None else comm.rank if comm is not None else None
    error: Optional[BaseException] = None
    result: Optional[T] = None
    payload: Any = None
    try:
        result = fn()
        payload = share(result) if share is not None else None
    except Exception as exc:  # noqa: BLE001 - reported to every rank, then re-raised
        if isinstance(exc, PPLoaderError) and rank is not None:
            exc.on_rank(rank)
        if comm is None:
            raise
        error = exc
    if comm is None:
        return result, [payload]  # type: ignore[return-value]
    try:
        shared = comm.agree(error, payload)
    except RankFailure as failure:
        raise failure from error
    return result, shared  # type: ignore[return-value]


def run_guarded(comm: Optional[Comm], fn: Callable[[], T], *, rank: Optional[int] = None) -> T:
    """Run ``fn`` on every rank; if any rank fails, every rank raises one RankFailure
    (:func:`run_agreed` without payloads; without a ``comm``, ``fn`` alone)."""
    return run_agreed(comm, fn, rank=rank)[0]


def start_refusal_gather(refusal: Optional[str], group: Any = None
                         ) -> Callable[[], dict[int, str]]:
    """Every rank's refusal (None: ready) in ``group``, by group rank, for a step every rank
    of the group is known to reach (DCP's ``read_data``), so it cannot wait on a rank that
    never comes (a rank that dies there fails the collective's own timeout). Started now,
    finished by the returned call: the flag's all-reduce runs while the caller prepares what
    needs no agreement (mapping, page advice), so waiting for the slowest rank overlaps that
    work. One all-reduce of a flag when every rank is ready (no pickling, one round trip);
    the messages are all-gathered only when some rank refused."""
    backend = str(dist.get_backend(group))
    device = torch.device("cpu") if "gloo" in backend or "nccl" not in backend else \
        torch.device("cuda", torch.cuda.current_device())
    flag = torch.tensor([0 if refusal is None else 1], dtype=torch.int32, device=device)
    work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, async_op=True)

    def finish() -> dict[int, str]:
        work.wait()
        if not int(flag.item()):
            return {}
        found: list[Optional[str]] = [None] * dist.get_world_size(group)
        dist.all_gather_object(found, refusal, group=group)
        return {r: str(e) for r, e in enumerate(found) if e is not None}
    return finish
