"""Where a checkpoint's bytes live when they are not local files: object stores.

A model path ``s3://bucket/prefix`` names a *storage* (:class:`ObjectStorage`: list the
objects under the prefix, ranged reads with the object's identity, whole small objects). Planning
reads ``config.json``, the index and the shards' headers through it (planning/remote.py); the
``s3`` read backend (io/objectstore.py) fetches each rank's planned byte ranges through it.
Local paths never come here: they keep their own code (no speed loss, identical plans).
"""
from __future__ import annotations

import os
import re

from .objects import ObjectInfo, ObjectStorage

__all__ = ["SCHEMES", "is_remote", "check_model_location", "ObjectInfo", "ObjectStorage", "open_storage"]

#: the URI schemes of object stores pploader reads
SCHEMES = ("s3://",)


def is_remote(path: "os.PathLike[str] | str") -> bool:
    """True for an object-store URI (``s3://...``), False for a local path."""
    return isinstance(path, str) and path.startswith(SCHEMES)


#: an S3 bucket name: 3-63 lower-case letters, digits, dots and hyphens, alphanumeric ends
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


def check_model_location(value: object, label: str = "model_dir") -> str:
    """``value`` when it is a usable model location: a non-empty local path (whether it
    exists is checked when it is opened) or a well-formed ``s3://bucket/prefix``. Otherwise
    an ArgumentError naming ``label`` and what is wrong with the URL (empty, no bucket, an
    invalid bucket name, whitespace, an upper-case or unknown scheme)."""
    from ..errors import ArgumentError

    def bad(what: str) -> ArgumentError:
        return ArgumentError(f"{label}: {str(value)[:80]!r}: {what}", argument=label)
    if not isinstance(value, (str, os.PathLike)):
        raise bad("not a path; give a model directory or s3://bucket/prefix")
    text = os.fspath(value)
    if not isinstance(text, str) or not text.strip():
        raise bad("empty; give a model directory or s3://bucket/prefix")
    scheme, sep, rest = text.partition("://")
    if not sep and not text.lower().startswith("s3:"):
        return text  # a local path
    if scheme.lower() == "s3" and scheme != "s3" or text.lower().startswith("s3:") and not sep:
        raise bad("write the scheme as s3://bucket/prefix (lower case, two slashes)")
    if scheme != "s3":
        raise bad(f"{scheme}:// is not a storage pploader reads; give a local directory or "
                  "s3://bucket/prefix")
    if any(c.isspace() for c in text):
        raise bad("contains whitespace; an s3:// URL has none (quote the path, or check for "
                  "a stray space)")
    bucket = rest.partition("/")[0]
    if not bucket:
        raise bad("no bucket; give s3://bucket/prefix")
    if not _BUCKET.fullmatch(bucket) or ".." in bucket:
        raise bad(f"{bucket!r} is not a valid bucket name (3-63 lower-case letters, digits, "
                  "dots and hyphens)")
    return text


def open_storage(uri: str, **options: object) -> ObjectStorage:
    """The storage of an object-store URI (``s3://bucket/prefix``)."""
    from .s3 import S3Options, S3Storage
    return S3Storage.from_uri(uri, S3Options(**options))  # type: ignore[arg-type]
