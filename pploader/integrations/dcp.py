"""pploader as a ``torch.distributed.checkpoint`` storage reader for Hugging Face checkpoints.

``dcp.load(state_dict, storage_reader=PPLoaderStorageReader(model_dir))`` fills a job's state
dict (plain tensors, DTensor local shards of any mesh, a pipeline stage's subset) with the same
keys as torch's ``HuggingFaceStorageReader``: the checkpoint's tensor names, or a
:class:`~pploader.bind.names.NameMap` / ``rename`` callable for modules whose names differ.

Any DCP planner drives it (the default one included). ``read_metadata`` comes from the index
and the headers, each shard's header parsed only when the planner first asks for a tensor in it
(so a stage parses only its shards); ``read_data`` turns each DCP ``ReadItem`` (storage offsets
and lengths of one local shard) into a pploader read item of exactly those byte ranges (dim-1
shards as row runs, as the planner makes them) and reads them straight into the destination
tensors: on CUDA with the device's read backend (``io/registry.py``: the pinned ring), on CPU
with the ``mapped`` backend (every shard one strided copy from a mapping of its file, a cold
one's pages read around each fault; as many copy threads as the ranks on this host leave
cores: dcp_metadata.py). Strict: stored dtype = destination dtype, box inside the
stored shape, files unchanged since their headers were read; errors name the rank, file and
tensor.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, TypeVar

import torch
from torch.distributed.checkpoint import StorageReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.planner import ReadItem as DCPReadItem
from torch.futures import Future

from ..arguments import check, check_callable, check_device, check_paths, check_type
from ..distributed.comm import start_refusal_gather
from ..errors import CheckpointError, PlanError, PPLoaderError, ReadError
from ..io.backend import ReadBackend, ReadOptions, ReadStats, merge_stats
from ..io.mapped import COLD_THREADS, open_mapped
from ..io.read import default_window_bytes
from ..io.registry import open_backend, prepare_staging, select_backend
from ..planning.checkpoint import (DTYPES, CheckpointIndex, TensorEntry, check_model_dir,
                                   open_checkpoint)
from ..planning.header import FileIdentity, ShardHeader
from ..planning.items import ReadItem, placed_item, relative_item
from ..planning.partition import StageWindow
from ..planning.rank_plan import RankPlan
from ..planning.shard import Selection
from ..planning.topology import Topology
from ..storage import check_model_location
from .dcp_metadata import (GlobalStep, LazyStorage, LazyTensors, LocalFacts, copy_threads,
                           file_identities)

if TYPE_CHECKING:  # pragma: no cover
    from ..bind.names import NameMap

__all__ = ["PPLoaderStorageReader", "DCP_SHARDING_KEY"]

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: the header metadata key torch's HF writer sets on distributed (unconsolidated) saves
DCP_SHARDING_KEY = "DCP_SHARDING_INFO"


class PPLoaderStorageReader(StorageReader):
    """A DCP ``StorageReader`` over a Hugging Face safetensors directory, read by pploader.

    ``names`` (a ``NameMap``) or ``rename`` (checkpoint name -> state-dict key, None to leave
    a tensor out) give the state-dict keys; by default they are the checkpoint names, as with
    torch's ``HuggingFaceStorageReader``. ``io_backend`` / ``threads`` / ``window_bytes`` pick
    and size the read backend (``None``: on CPU ``mapped``, every shard copied from a mapping
    of its file, else the device's default; ``threads`` None: on CPU the host's cores shared
    among the ranks on it, as DCP's global plan step finds them, at most 4). ``range_cost_bytes``: 0 reads
    exactly the requested bytes (a dim-1 shard as one range per row); above 0, a strided shard
    whose runs would cost more than that many bytes each is read as its covering box and
    gathered (fewer requests, more bytes). ``topology``: the rank named in errors and plans
    (``mesh_topology``; default: the process-group rank). ``stats`` / ``header_bytes`` /
    ``read_bytes``: what the last ``read_data`` did and what reading the headers cost.
    ``staging_device`` (default ``"auto"``: the current GPU when this process has initialised
    CUDA, as a job whose model is on a GPU has; None: none): the process's host staging for
    it (io/staging.py, the pinned ring) is started when the reader is made, so it is
    page-locked while DCP plans (and, with ``pploader.start_staging()`` at start-up, while
    the job builds its model); a load never waits for it and later loads reuse it. ``process_group``: the group given to
    ``dcp.load`` when it is not the default one (the ranks agree on their destination checks
    over it before any reads).
    """

    def __init__(self, path: "str | os.PathLike[str]", *, names: Optional[NameMap] = None,
                 rename: Optional[Callable[[str], Optional[str]]] = None,
                 io_backend: Optional[str] = None, threads: Optional[int] = None,
                 window_bytes: Optional[int] = None, range_cost_bytes: int = 0,
                 topology: Optional[Topology] = None,
                 allowed_roots: Sequence["str | os.PathLike[str]"] = (),
                 staging_device: "str | torch.device | None" = "auto",
                 process_group: Any = None) -> None:
        super().__init__()
        if names is not None and rename is not None:
            raise ValueError("give names= (a NameMap) or rename= (a callable), not both")
        check(io_backend=io_backend, threads=threads, window_bytes=window_bytes,
              range_cost_bytes=range_cost_bytes)  # the CLI's ranges (arguments.py)
        if names is not None:
            from ..bind.names import NameMap  # bind/ only when names are given (a light import)
            check_type("names", names, NameMap, "a NameMap")
        check_callable("rename", rename)
        check_type("topology", topology, Topology, "a Topology")
        if not (isinstance(staging_device, str) and staging_device == "auto"):
            check_device("staging_device", staging_device)
        allowed_roots = check_paths("allowed_roots", allowed_roots)
        self.path = Path(check_model_location(path, "path"))
        self._rename: Callable[[str], Optional[str]] = (
            rename if rename is not None else names.to_module if names is not None
            else _same)
        self.io_backend, self.threads, self.window_bytes = io_backend, threads, window_bytes
        self.range_cost_bytes = range_cost_bytes
        self.topology, self.allowed_roots = topology, tuple(allowed_roots)
        self.process_group = process_group
        self.load_id = uuid.uuid4().hex
        self.stats = ReadStats()
        self._index: Optional[CheckpointIndex] = None
        self._keys: dict[str, str] = {}          # state-dict key -> checkpoint name
        self._planned: Optional[tuple[tuple[DCPReadItem, ...], list[ReadItem]]] = None
        self._rank: Optional[int] = None
        self._copy_threads: Optional[int] = None  # this load's CPU threads (the global step)
        #: each local shard's identity when ``read_metadata`` ran: a header parsed later must
        #: come from the same file, and the reads check their descriptors against it
        self._pinned: dict[str, FileIdentity] = {}
        self._verified: set[str] = set()      # shards whose parsed header matched its pin
        if isinstance(staging_device, str) and staging_device == "auto":
            staging_device = "cuda" if torch.cuda.is_available() and \
                torch.cuda.is_initialized() else None
        self.staging_device = torch.device(staging_device) if staging_device is not None \
            else None
        self._staging: Any = None                # the backend's staging for staging_device
        self._start_staging()

    # -- StorageReader ------------------------------------------------------------------

    def reset(self, checkpoint_id: "str | os.PathLike[str] | None" = None) -> None:
        """A fresh load (of ``checkpoint_id`` when given): headers are read again."""
        if checkpoint_id is not None:
            self.path = Path(checkpoint_id)
        self.load_id = uuid.uuid4().hex
        self.stats = ReadStats()
        self._index, self._keys, self._planned = None, {}, None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: "str | os.PathLike[str]") -> bool:
        """A directory holding an index or ``*.safetensors`` files."""
        root = Path(checkpoint_id)
        return root.is_dir() and any(root.glob("*.safetensors"))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's tensors as DCP metadata; headers are parsed on first access."""
        check_model_dir(self.path)
        index = open_checkpoint(self.path, allowed_roots=self.allowed_roots)
        keys: dict[str, str] = {}
        for name in index.weight_map:
            key = self._rename(name)
            if key is None:
                continue
            if key in keys:
                raise CheckpointError(f"checkpoint tensors {keys[key]} and {name} both map to "
                                      f"state-dict key {key}: fix the NameMap / rename",
                                      file=index.source, tensor=name, rank=self._rank)
            keys[key] = name
        self._index, self._keys, self._planned = index, keys, None
        self._pinned, self._verified = file_identities(index), set()
        metadata = Metadata(state_dict_metadata=LazyTensors(self.entry, keys),  # type: ignore[arg-type]
                            storage_data=LazyStorage(keys))
        metadata.storage_meta = StorageMeta(load_id=self.load_id)
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        """Remember this rank (for errors) and that the metadata is ours."""
        if self._index is None:
            raise CheckpointError("set_up_storage_reader before read_metadata: pass this "
                                  "reader's own metadata", file=str(self.path))
        rank = kwargs.get("rank")
        if rank is None and torch.distributed.is_available() and \
                torch.distributed.is_initialized():
            rank = torch.distributed.get_rank()
        # no process group (``no_dist``): the one process is rank 0
        self._rank = self.topology.rank if self.topology is not None else rank or 0

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Plan every request's bytes now (headers only): a bad request fails on every rank
        (DCP gathers the error) before any rank reads a byte. The plan carries this rank's
        host and CPUs to the coordinator."""
        self._plan_items(plan.items)
        return dataclasses.replace(plan, storage_data=LocalFacts.here())

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Tell each rank's plan how many ranks load (the coordinator sees every plan), so
        ``read_data`` knows whether its destination checks must be agreed on first, and how
        many CPU copy threads it gets (its host's cores shared among the ranks there)."""
        threads = copy_threads([p.storage_data for p in plans], COLD_THREADS)
        return [dataclasses.replace(p, storage_data=GlobalStep(len(plans), n))
                for p, n in zip(plans, threads)]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read each request's bytes straight into ``planner.resolve_tensor(request)``, once
        every rank's destinations passed their checks (dtype, shape, device): a refusal on
        one rank means no rank writes a byte."""
        stats = ReadStats()
        refusal: Optional[BaseException] = None
        targets: list[tuple[DCPReadItem, torch.Tensor]] = []
        try:
            items = self._plan_items(plan.items)
            for req, item in zip(plan.items, items):
                dst = planner.resolve_tensor(req).detach()
                self._check_destination(item, dst)
                targets.append((req, dst))
        except Exception as exc:  # noqa: BLE001 - agreed on below, then re-raised
            refusal = exc
        step = getattr(plan, "storage_data", None)
        # the ranks' verdicts travel while this rank maps its files and advises their pages;
        # the gate waits for them before the first write (or raises a refusal)
        gate = self._start_agreement(refusal, step)
        if refusal is not None:
            gate()
        self._copy_threads = self.threads or (
            step.copy_threads if isinstance(step, GlobalStep) else None)
        direct: dict[torch.device, list[tuple[ReadItem, torch.Tensor]]] = {}
        copied: list[tuple[ReadItem, torch.Tensor]] = []
        for (req, dst), item in zip(targets, items):
            if dst.is_contiguous() and self._has_backend(dst.device):
                direct.setdefault(dst.device, []).append((item, dst))
            else:
                copied.append((item, dst))
        with torch.no_grad():
            for device, pairs in sorted(direct.items(), key=lambda kv: kv[0].type != "cpu"):
                backend = self._open(self._rank_plan([i for i, _ in pairs]), device, gate)
                backend.load({i.target: d for i, d in pairs})
                merge_stats(stats, backend.stats)
            gate()  # no load above (or none that called it): agree before any write
            if copied:  # strided destinations: a borrowed CPU ring, one copy_ each
                sub = self._rank_plan([i for i, _ in copied])
                views = {i.target: d for i, d in copied}
                total = sum(max(i.nbytes, i.read_bytes) for i, _ in copied)
                window = self.window_bytes or min(default_window_bytes(sub),
                                                  max(total, sub.largest_item_bytes))
                backend = open_backend(sub, "cpu", ReadOptions(
                    window_bytes=window, threads=self._copy_threads, mode="borrowed"),
                    self._backend_name(torch.device("cpu")))
                for target, tensor in backend:
                    views[target].copy_(tensor)  # synchronous: the ring slot is free after
                merge_stats(stats, backend.stats)
        for req, dst in targets:
            planner.commit_tensor(req, dst)
        self.stats = stats
        logger.debug("rank %s: %d requests, %d bytes in %.3f s", self._rank, len(items),
                     stats.read_bytes, stats.seconds)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _start_agreement(self, refusal: Optional[BaseException], step: Any
                         ) -> Callable[[], None]:
        """The gate before this rank's first write: raises ``refusal``, or a refusal of
        another rank, once; the ranks' verdicts are exchanged from now on.

        Every rank of the load reaches ``read_data`` (DCP runs it on all of them), so one
        all-reduce there carries each rank's verdict. The DCP group is the default one when
        the global plan step saw as many plans as the job has ranks; a subgroup is used when
        given as ``process_group``; otherwise (a custom planner dropped ``storage_data``) each
        rank checks only its own requests."""
        ranks = step.ranks if isinstance(step, GlobalStep) else 1
        group = self.process_group
        dist = torch.distributed
        finish: Optional[Callable[[], dict[int, str]]] = None
        if group is not None or (ranks > 1 and dist.is_available() and dist.is_initialized()
                                 and ranks == dist.get_world_size()):
            finish = start_refusal_gather(None if refusal is None else str(refusal), group)
        passed: list[bool] = []

        def gate() -> None:
            if passed:
                return
            passed.append(True)
            others = finish() if finish is not None else {}
            if refusal is not None:
                raise refusal
            if others:
                first = min(others)
                raise ReadError(f"rank(s) {sorted(others)} refused their requests before any "
                                f"rank read (rank {first}: {others[first]}); nothing was read",
                                file=None, rank=self._rank)
        return gate

    # -- pploader side ------------------------------------------------------------------

    @property
    def header_bytes(self) -> int:
        """Bytes of the shard headers read so far (plus the index file when there is one)."""
        index = self._require_index()
        parsed = sum(index.header(f).header_bytes for f in index.opened_files())
        source = Path(index.root) / index.source
        return parsed + (source.stat().st_size if source.name.endswith(".json") else 0)

    @property
    def read_bytes(self) -> int:
        """Tensor bytes the last ``read_data`` read (the backends' own count)."""
        return self.stats.read_bytes

    def entry(self, key: str) -> TensorEntry:
        """The header entry of state-dict ``key`` (its shard's header parsed on first need);
        a shard written by a distributed DCP save (several chunks per tensor) is refused."""
        index = self._require_index()
        name = self._keys.get(key)
        if name is None:
            raise CheckpointError("state-dict key not in the checkpoint", file=index.source,
                                  tensor=key, rank=self._rank)
        entry = self._on_rank(index.entry, name)
        if DCP_SHARDING_KEY in self._header(entry.file).metadata:
            raise CheckpointError("shard was written by a distributed DCP save (tensors in "
                                  "chunks): consolidate it first (torch's "
                                  "consolidate_safetensors_files) or load it with torch's "
                                  "HuggingFaceStorageReader", file=entry.file, tensor=name,
                                  rank=self._rank)
        return entry

    def _header(self, file: str) -> ShardHeader:
        """``file``'s header, refused unless the file is the one ``read_metadata`` saw."""
        hdr = self._on_rank(self._require_index().header, file)
        if file not in self._verified:
            then, now = self._pinned.get(file), hdr.identity
            if then is not None and now != then:
                raise CheckpointError(
                    f"file changed after read_metadata (then size {then.size}, inode "
                    f"{then.inode}, mtime_ns {then.mtime_ns}; now size {now.size}, inode "
                    f"{now.inode}, mtime_ns {now.mtime_ns}): publish new checkpoints by "
                    "writing elsewhere and renaming, and load again", file=file,
                    rank=self._rank)
            self._verified.add(file)
        return hdr

    def _on_rank(self, fn: Callable[[str], T], arg: str) -> T:
        """``fn(arg)``, its pploader error naming this rank."""
        try:
            return fn(arg)
        except PPLoaderError as exc:
            raise exc.on_rank(self._rank) if self._rank is not None else exc

    def _require_index(self) -> CheckpointIndex:
        if self._index is None:
            raise CheckpointError("read_metadata has not run", file=str(self.path),
                                  rank=self._rank)
        return self._index

    def _plan_items(self, requests: Sequence[DCPReadItem]) -> list[ReadItem]:
        """One pploader item per DCP request: exactly its box's bytes, targets unique (the
        requests ``prepare_local_plan`` planned are not planned again by ``read_data``)."""
        key = tuple(requests)
        if self._planned is not None and self._planned[0] == key:
            return self._planned[1]
        out, seen = [], set()
        for req in requests:
            name = req.storage_index.fqn
            target = name if name not in seen else \
                f"{name}@{list(req.dest_offsets)}<-{list(req.storage_offsets)}"
            seen.add(target)
            out.append(self._item(req, name, target))
        self._planned = (key, out)
        return out

    def _item(self, req: DCPReadItem, key: str, target: str) -> ReadItem:
        entry = self.entry(key)
        if req.type != LoadItemType.TENSOR:
            raise PlanError(f"request of type {req.type.name}: a Hugging Face checkpoint holds "
                            "tensors only", file=entry.file, tensor=key, rank=self._rank)
        offsets = tuple(req.storage_offsets)
        lengths = tuple(req.lengths)
        chunk = req.storage_index.offset
        if chunk is not None and any(chunk):
            raise PlanError(f"request for chunk at offsets {list(chunk)}: a Hugging Face "
                            "checkpoint holds each tensor whole (one chunk at 0)",
                            file=entry.file, tensor=key, rank=self._rank)
        shape = entry.shape
        if len(offsets) != len(shape) or len(lengths) != len(shape) or any(
                o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, lengths, shape)):
            raise PlanError(f"request offsets {list(offsets)} lengths {list(lengths)} do not "
                            f"fit the stored shape {list(shape)}", file=entry.file,
                            tensor=key, rank=self._rank)
        dims = tuple((d, ((o, n),)) for d, (o, n, s) in enumerate(zip(offsets, lengths, shape))
                     if (o, n) != (0, s))
        if not math.prod(lengths):  # an empty shard: nothing to read
            return ReadItem(entry.name, target, entry.file, entry.dtype, lengths, shape, (),
                            lengths)
        # planned once per process per (dtype, shape, box) at offset 0, then moved to each
        # tensor (the same projection in every layer, every load): a dim-1 box's row runs are
        # computed once
        rel = relative_item(entry.dtype, shape, Selection(dims), self.range_cost_bytes)
        return placed_item(rel, entry, target)

    def _check_destination(self, item: ReadItem, dst: torch.Tensor) -> None:
        dtype = DTYPES[item.dtype][0]
        if tuple(dst.shape) != item.shape:
            raise ReadError(f"destination has shape {list(dst.shape)}, the request reads "
                            f"{list(item.shape)} of {item.name} {list(item.source_shape)}",
                            file=item.file, tensor=item.target, rank=self._rank)
        if dst.dtype != dtype:
            raise ReadError(f"destination is {dst.dtype}, the checkpoint stores {dtype} "
                            "(pploader's DCP reader does not cast: make the state dict's "
                            "tensor the stored dtype, or cast after loading)",
                            file=item.file, tensor=item.target, rank=self._rank)
        if dst.device.type == "meta":
            raise ReadError("destination is on the meta device: materialise the module "
                            "(to_empty) before dcp.load", file=item.file, tensor=item.target,
                            rank=self._rank)

    def _start_staging(self) -> None:
        """Start the staging device's backend staging now (the process's, io/staging.py:
        kept across loads and readers), so its page-locking runs while the job plans."""
        if self.staging_device is None or self.staging_device.type == "cpu":
            return
        if self.staging_device.index is None and self.staging_device.type == "cuda":
            self.staging_device = torch.device("cuda", torch.cuda.current_device())
        try:
            self._staging = prepare_staging(self.staging_device,
                                            ReadOptions(threads=self.threads),
                                            self._backend_name(self.staging_device))
        except Exception as exc:  # noqa: BLE001 - the load reads with what it finds
            logger.debug("no early staging for %s: %s", self.staging_device, exc)

    def _open(self, plan: RankPlan, device: torch.device, gate: Callable[[], None]
              ) -> ReadBackend:
        """The read backend of ``plan`` onto ``device``: the configured one, else on CPU the
        ``mapped`` backend with ``cold="fault"`` and no residency checks: every shard one
        strided copy from a ``MADV_NORMAL`` mapping, its resident pages mapped by the
        kernel's fault-around, its missing ones read around each fault in large requests,
        as torch's reader's ``safe_open`` mapping does), else the device's default."""
        if device.type == "cpu" and self.io_backend is None:  # it calls ``gate`` itself
            return open_mapped(plan, device,
                               dataclasses.replace(self._options(device), before_write=gate),
                               cold="fault", cold_threads=self.threads or COLD_THREADS)
        gate()
        return open_backend(plan, device, self._options(device), self._backend_name(device))

    def _has_backend(self, device: torch.device) -> bool:
        try:
            select_backend(device, self._backend_name(device))
        except ValueError:
            return False
        return True

    def _backend_name(self, device: torch.device) -> Optional[str]:
        """The configured backend where it loads onto ``device``, else the device's default."""
        if self.io_backend is None:
            return None
        try:
            select_backend(device, self.io_backend)
        except ValueError:
            return None
        return self.io_backend

    def _options(self, device: torch.device) -> ReadOptions:
        # no ring: the backend lends the process's staging (io/staging.py), which
        # ``_start_staging`` started; the load pauses its page-locking and reads with it
        return ReadOptions(window_bytes=self.window_bytes if device.type != "cpu" else None,
                           threads=self._copy_threads if device.type == "cpu" else self.threads)

    def _rank_plan(self, items: Sequence[ReadItem]) -> RankPlan:
        """The pploader plan of these items (what the read backends take)."""
        index = self._require_index()
        files = list(dict.fromkeys(i.file for i in items))
        index.require(files, self._rank)
        headers = {f: self._header(f) for f in files}
        topo = self.topology
        if topo is None:
            rank = self._rank or 0
            world = torch.distributed.get_world_size() if torch.distributed.is_available() \
                and torch.distributed.is_initialized() else rank + 1
            topo = Topology(pp_size=max(world, rank + 1), rank=rank)
        return RankPlan(model=str(self.path), topology=topo,
                        window=StageWindow(topo.pp_rank, 0, 0, False, False), experts=None,
                        items=tuple(items), paths={f: str(h.path) for f, h in headers.items()},
                        identities={f: h.identity for f, h in headers.items()},
                        header_bytes=sum(h.header_bytes for h in headers.values()),
                        tensors=tuple(dict.fromkeys(i.name for i in items)),
                        range_cost_bytes=self.range_cost_bytes)


def _same(name: str) -> str:
    return name

