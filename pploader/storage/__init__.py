"""Where a checkpoint's bytes live when they are not local files: object stores.

A model path ``s3://bucket/prefix`` names a *storage* (:class:`ObjectStorage`: list the
objects under the prefix, ranged reads with the object's identity, whole small objects). Planning
reads ``config.json``, the index and the shards' headers through it (planning/remote.py); the
``s3`` read backend (io/objectstore.py) fetches each rank's planned byte ranges through it.
Local paths never come here: they keep their own code (no speed loss, identical plans).
"""
from __future__ import annotations

import os
from typing import Any, Mapping, NamedTuple, Optional, Protocol, Sequence

__all__ = ["SCHEMES", "is_remote", "ObjectInfo", "ObjectStorage", "open_storage"]

#: the URI schemes of object stores pploader reads
SCHEMES = ("s3://",)


def is_remote(path: "os.PathLike[str] | str") -> bool:
    """True for an object-store URI (``s3://...``), False for a local path."""
    return isinstance(path, str) and path.startswith(SCHEMES)


class ObjectInfo(NamedTuple):
    """An object's size and ETag (its identity: a rewrite changes the ETag)."""

    size: int
    etag: str


class ObjectStorage(Protocol):
    """One model prefix in an object store. Errors are ``storage.s3.ObjectStoreError``
    naming the object's URI (never a credential)."""

    root: str

    def uri(self, name: str) -> str:
        """The URI of ``name`` under the prefix (for messages and plans)."""

    def list(self) -> Mapping[str, ObjectInfo]:
        """Every object directly under the prefix, by name."""

    def read(self, name: str, start: int, length: int,
             etag: Optional[str] = None) -> tuple[bytes, ObjectInfo]:
        """``length`` bytes from ``start`` (fewer at the object's end) and the object's info;
        with ``etag``, refused unless the object still has it."""

    def read_into(self, name: str, start: int, views: Sequence[memoryview],
                  info: ObjectInfo, cancel: Optional[Any] = None) -> int:
        """Fill ``views`` (consecutive) from ``start`` in one ranged request; the object must
        still match ``info``; ``cancel.is_set()`` stops it. Returns the bytes fetched."""


def open_storage(uri: str, **options: object) -> ObjectStorage:
    """The storage of an object-store URI (``s3://bucket/prefix``)."""
    from .s3 import S3Options, S3Storage
    return S3Storage.from_uri(uri, S3Options(**options))  # type: ignore[arg-type]
