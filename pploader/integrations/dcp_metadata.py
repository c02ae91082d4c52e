"""What :class:`~pploader.integrations.dcp.PPLoaderStorageReader` tells DCP and what DCP's plan
steps carry back to it: the checkpoint as lazy DCP metadata (a shard's header parsed only when
the planner asks for a tensor in it), each local shard's identity when ``read_metadata`` ran,
and the facts the global plan step turns into each rank's CPU copy threads (ranks on one host
share its cores: 4 ranks on 2 cores copy on one thread each, not four).
"""
from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Mapping
from typing import Callable, Iterator, Optional, Sequence

import torch
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties, TensorStorageMetadata)

from ..planning.checkpoint import DTYPES, CheckpointIndex, TensorEntry
from ..planning.header import FileIdentity

__all__ = ["LazyTensors", "LazyStorage", "LocalFacts", "GlobalStep", "copy_threads",
           "file_identities"]


class LazyTensors(Mapping):
    """``Metadata.state_dict_metadata``: every state-dict key of the checkpoint, each entry's
    ``TensorStorageMetadata`` built (and its shard's header parsed, by ``entry``) on first
    access."""

    def __init__(self, entry: Callable[[str], TensorEntry], keys: Mapping[str, str]) -> None:
        self._entry, self._keys = entry, keys
        self._built: dict[str, TensorStorageMetadata] = {}

    def __getitem__(self, key: str) -> TensorStorageMetadata:
        md = self._built.get(key)
        if md is None:
            entry = self._entry(key)
            size = torch.Size(entry.shape)
            md = TensorStorageMetadata(
                properties=TensorProperties(dtype=DTYPES[entry.dtype][0]), size=size,
                chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * len(size)), sizes=size)])
            self._built[key] = md
        return md

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


class LazyStorage(Mapping):
    """``Metadata.storage_data``: ``MetadataIndex`` (key, zero offsets) -> the checkpoint name
    (an HF checkpoint holds each tensor whole, as one chunk at offset 0)."""

    def __init__(self, keys: Mapping[str, str]) -> None:
        self._keys = keys

    def __getitem__(self, index: MetadataIndex) -> str:
        return self._keys[index.fqn]

    def __contains__(self, index: object) -> bool:
        return isinstance(index, MetadataIndex) and index.fqn in self._keys

    def __iter__(self) -> Iterator[MetadataIndex]:
        return (MetadataIndex(k) for k in self._keys)

    def __len__(self) -> int:
        return len(self._keys)


@dataclasses.dataclass(frozen=True)
class LocalFacts:
    """What one rank's local plan (``LoadPlan.storage_data``) tells the coordinator: the host
    it runs on (name and boot id) and the CPUs it may run on (its affinity)."""

    host: str
    cpus: frozenset[int]

    @classmethod
    def here(cls) -> "LocalFacts":
        try:
            cpus = frozenset(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # pragma: no cover - not Linux
            cpus = frozenset(range(os.cpu_count() or 1))
        try:
            with open("/proc/sys/kernel/random/boot_id") as fh:
                boot = fh.read().strip()
        except OSError:  # pragma: no cover - not Linux
            boot = ""
        return cls(f"{socket.gethostname()}/{boot}", cpus)


@dataclasses.dataclass(frozen=True)
class GlobalStep:
    """What DCP's global plan step tells each rank's plan (``LoadPlan.storage_data``): how
    many ranks load (whether destination checks must be agreed on) and this rank's CPU copy
    threads (None: the backend's default)."""

    ranks: int
    copy_threads: Optional[int] = None


def copy_threads(facts: Sequence[object], cap: int) -> list[Optional[int]]:
    """Per rank (plan order): its CPUs divided among the ranks of its host whose CPUs overlap
    its own, between 1 and ``cap``; None for a plan that carried no :class:`LocalFacts` (a
    custom planner replaced ``storage_data``)."""
    out: list[Optional[int]] = []
    for f in facts:
        if not isinstance(f, LocalFacts):
            out.append(None)
            continue
        sharing = sum(1 for g in facts if isinstance(g, LocalFacts) and g.host == f.host
                      and g.cpus & f.cpus)
        out.append(max(1, min(cap, len(f.cpus) // max(sharing, 1))))
    return out


def file_identities(index: CheckpointIndex) -> dict[str, FileIdentity]:
    """Each local shard's identity now (a stat; headers parsed already give theirs)."""
    if index.storage is not None:  # objects: every ranged GET names the planned ETag
        return {}
    parsed = set(index.opened_files())
    out = {}
    for file, path in index.paths.items():
        if file in parsed:
            out[file] = index.header(file).identity
        else:
            try:
                out[file] = FileIdentity.of(os.stat(path))
            except OSError:
                continue  # refused, naming the file, when its header is read
    return out
