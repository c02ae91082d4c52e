"""What an object store is to pploader: ``ObjectStorage`` (the protocol every store
implements) and ``ObjectInfo`` (an object's size and ETag). Its own module, below the package's
``__init__`` (which opens a store) and ``s3.py`` (which implements one), so neither imports the
other's module at load.
"""
from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Optional, Protocol, Sequence

__all__ = ["ObjectInfo", "ObjectStorage"]


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
