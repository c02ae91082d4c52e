"""Planning from an object store (``s3://bucket/prefix``): config.json and the index fetched
whole, each needed shard's header by two ranged GETs (its first 64 bytes: the 8-byte length;
then the header) — nothing else. The result is the same ``CheckpointIndex`` / config a local directory gives, with
object URIs as paths and ``ObjectIdentity`` (size + ETag) as identities.

Pure in the planning sense: reads only config, index and headers, no collectives.
"""
from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

from ..errors import CheckpointError, ConfigError, PPLoaderError, ReadError
from ..storage import ObjectStorage, open_storage
from ..storage.s3 import ObjectStoreError
from .header import (MAX_HEADER_BYTES, MAX_TENSORS, ObjectIdentity, ShardHeader,
                     header_from_bytes, header_length)
from .index import INDEX_NAME, CheckpointIndex, _read_index_bytes, index_from_headers

__all__ = ["remote_bytes", "open_remote_checkpoint", "remote_header", "planning_error"]

#: config.json and the index are fetched whole, up to this size (as a local index is limited)
MAX_METADATA_BYTES = MAX_HEADER_BYTES


def planning_error(exc: ObjectStoreError, kind: type[PPLoaderError] = CheckpointError,
                   name: Optional[str] = None) -> PPLoaderError:
    """An object-store failure while planning: an input error (``kind``, exit 2) for a
    missing object or bucket or refused credentials, else a ReadError; names the object."""
    cls = kind if exc.input_error else ReadError
    return cls(exc.detail, file=exc.uri if name is None else f"{name} ({exc.uri})")


def _fetch_whole(storage: ObjectStorage, name: str, kind: type[PPLoaderError]) -> bytes:
    try:
        data, info = storage.read(name, 0, MAX_METADATA_BYTES + 1)
    except ObjectStoreError as exc:
        raise planning_error(exc, kind) from None
    if info.size > MAX_METADATA_BYTES:
        raise kind(f"larger than {MAX_METADATA_BYTES} bytes: not a {name}",
                   file=storage.uri(name))
    return data


def remote_bytes(uri: str, name: str, max_bytes: int) -> tuple[bytes, str]:
    """(the object ``name`` under ``uri``, fetched whole up to ``max_bytes``; its URI): what
    ``spec.read_config`` parses with the limits every storage shares."""
    from .config_limits import too_large
    storage = open_storage(uri)
    try:
        data, info = storage.read(name, 0, max_bytes + 1)
    except ObjectStoreError as exc:
        raise planning_error(exc, ConfigError) from None
    if info.size > max_bytes:
        raise too_large(name, info.size, max_bytes, storage.uri(name))
    return data, storage.uri(name)


def _listing(storage: ObjectStorage, kind: type[PPLoaderError]) -> dict:
    try:
        return dict(storage.list())
    except ObjectStoreError as exc:
        raise planning_error(exc, kind) from None


def remote_header(storage: ObjectStorage, name: str, *,
                  max_header_bytes: int = MAX_HEADER_BYTES,
                  max_tensors: int = MAX_TENSORS) -> ShardHeader:
    """One shard's validated header: GET its first 64 bytes (the 8-byte length, and enough to
    recognise a git-LFS pointer or an HTML page, as a local file's first read; the response
    gives the size and ETag), then GET the header itself naming that ETag."""
    try:
        head, info = storage.read(name, 0, 64)
        n = header_length(name, head, info.size, max_header_bytes)
        raw = storage.read(name, 8, n, etag=info.etag)[0] if n else b""
    except ObjectStoreError as exc:
        raise planning_error(exc, CheckpointError, name) from None
    if len(raw) != n:
        raise CheckpointError("object shrank while its header was read", file=name)
    return header_from_bytes(name, storage.uri(name), ObjectIdentity.of_object(
        info.size, info.etag), info.size, head, raw, max_tensors)


def open_remote_checkpoint(uri: str) -> CheckpointIndex:
    """The CheckpointIndex of ``s3://bucket/prefix``: one LIST of the prefix (which shards are
    present), the index fetched whole when there is one (no shard is read), else every
    ``*.safetensors`` object's header."""
    storage = open_storage(uri)
    objects = _listing(storage, CheckpointError)
    if INDEX_NAME in objects:
        weight_map = _read_index_bytes(_fetch_whole(storage, INDEX_NAME, CheckpointError))
        counts = Counter(weight_map.values())
        files = list(counts)
        paths = {f: storage.uri(f) for f in files if f in objects}
        return CheckpointIndex(storage.root, weight_map, paths, INDEX_NAME, _counts=counts,
                               missing=tuple(f for f in files if f not in paths),
                               storage=storage, read_header=remote_header)
    shards = sorted(n for n in objects if n.endswith(".safetensors"))
    if not shards:
        raise CheckpointError(f"no {INDEX_NAME} and no *.safetensors objects under the prefix: "
                              "--model s3://bucket/prefix must hold the checkpoint's shards"
                              + ("" if objects else " (the prefix is empty: check the path)"),
                              file=storage.root + "/")
    with ThreadPoolExecutor(min(16, len(shards))) as pool:  # every header, at once
        fetched = list(pool.map(lambda f: remote_header(storage, f), shards))
    return index_from_headers(storage.root, {f: storage.uri(f) for f in shards},
                              dict(zip(shards, fetched)), storage=storage,
                              read_header=remote_header)

