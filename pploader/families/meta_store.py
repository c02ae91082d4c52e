"""The generic family's derived checkpoint structure kept on disk, so that planning a model a
second time needs neither torch nor transformers.

Deriving a :class:`~pploader.families.hf_meta.MetaModel` builds the transformers model on the
``meta`` device: importing torch and transformers costs seconds before any planning. The
result is plain data, so :class:`MetaStore` writes it as JSON (never pickle: a cache file is
read back as data, nothing in it runs) under a key made of the parsed ``config.json``, the
installed transformers version and a digest of this folder's sources (a change to the
derivation makes a new key). A missing, stale or unreadable entry is derived again.

The store is used only where the application turns it on (``pploader``'s CLI does, under
its cache directory); library calls derive in memory as before.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any, Mapping, Optional

__all__ = ["MetaStore", "use_structure_cache", "encode", "decode"]

logger = logging.getLogger(__name__)

#: the JSON layout of an entry (bumped when ``encode`` changes)
FORMAT = 2


def encode(value: Any) -> Any:
    """``value`` as JSON data, its Python types tagged so :func:`decode` restores them
    exactly: dataclasses (by class name), tuples, frozensets, dicts with non-string keys."""
    from .hf_meta import MetaModel, Naming
    if isinstance(value, (MetaModel, Naming)):
        return {"__dataclass__": type(value).__name__,
                "fields": {f.name: encode(getattr(value, f.name))
                           for f in dataclasses.fields(value)}}
    if isinstance(value, tuple):
        if all(type(v) is str for v in value):  # names: the common case, kept flat
            return {"__strs__": list(value)}
        return {"__tuple__": [encode(v) for v in value]}
    if isinstance(value, frozenset):
        return {"__frozenset__": sorted((encode(v) for v in value), key=json.dumps)}
    if isinstance(value, Mapping):
        if all(type(k) is str and type(v) is tuple and all(type(d) is int for d in v)
               for k, v in value.items()):  # a template: name -> shape, kept flat
            return {"__shapes__": {k: list(v) for k, v in value.items()}}
        return {"__dict__": [[encode(k), encode(v)] for k, v in value.items()]}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot store a {type(value).__name__} in the meta store")


def decode(data: Any) -> Any:
    """The inverse of :func:`encode`."""
    from .hf_meta import MetaModel, Naming
    if isinstance(data, list):
        return [decode(v) for v in data]
    if not isinstance(data, dict):
        return data
    if "__dataclass__" in data:
        cls = {"MetaModel": MetaModel, "Naming": Naming}[data["__dataclass__"]]
        return cls(**{k: decode(v) for k, v in data["fields"].items()})
    if "__shapes__" in data:
        return {k: tuple(v) for k, v in data["__shapes__"].items()}
    if "__strs__" in data:
        return tuple(data["__strs__"])
    if "__tuple__" in data:
        return tuple(decode(v) for v in data["__tuple__"])
    if "__frozenset__" in data:
        return frozenset(decode(v) for v in data["__frozenset__"])
    if "__dict__" in data:
        return {decode(k): decode(v) for k, v in data["__dict__"]}
    raise ValueError(f"unknown entry {sorted(data)[:3]}")


@lru_cache(maxsize=1)
def _sources_digest() -> str:
    """sha256 of this folder's Python sources (the derivation and what it returns)."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).resolve().parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


@lru_cache(maxsize=1)
def _transformers_version() -> str:
    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return "none"


class MetaStore:
    """Derived structures as JSON files under ``directory`` (created on first write)."""

    def __init__(self, directory: "str | os.PathLike[str]") -> None:
        self.directory = Path(directory)

    def path(self, config_key: str) -> Path:
        """The entry of ``config_key`` (``json.dumps(config, sort_keys=True)``)."""
        key = hashlib.sha256("\0".join((str(FORMAT), config_key, _transformers_version(),
                                        _sources_digest())).encode()).hexdigest()
        return self.directory / f"meta-{key[:40]}.json"

    def load(self, config_key: str) -> Optional[Any]:
        """The stored structure of ``config_key``, or None (absent, unreadable or not a
        structure this code wrote: derived again and written over)."""
        path = self.path(config_key)
        try:
            data = json.loads(path.read_text())
            if data.get("config") != config_key:
                return None
            return decode(data["meta"])
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.debug("meta store: ignoring %s: %s", path, exc)
            return None

    def save(self, config_key: str, meta: Any) -> None:
        """Write ``meta`` for ``config_key`` (atomically: a temporary file renamed into
        place); a failure is logged and ignored (the next run derives again)."""
        path = self.path(config_key)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            text = json.dumps({"config": config_key, "meta": encode(meta)})
            fd, tmp = tempfile.mkstemp(prefix=".meta-", dir=self.directory)
            try:
                with os.fdopen(fd, "w") as fh:
                    fh.write(text)
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise
        except (OSError, TypeError, ValueError) as exc:
            logger.debug("meta store: not written (%s): %s", path, exc)


def use_structure_cache(directory: "str | os.PathLike[str] | None") -> None:
    """Keep the generic family's derived structures under ``directory`` between processes
    (a :class:`MetaStore`; None: in memory only, the default). ``pploader``'s CLI calls it
    with its cache directory; an embedder that plans the same models often can too."""
    from .hf_meta import use_store
    use_store(None if directory is None else MetaStore(directory))
