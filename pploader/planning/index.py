"""``CheckpointIndex``: where every tensor of a checkpoint lives, its shards' headers parsed on
first need; and the index file's strict parse (``read_index``). Its own module, below
checkpoint.py (local directories) and remote.py (object stores), which both build it.

An object store's headers are fetched through the ``read_header`` callable remote.py passes,
so this module never imports the object-store code.
"""
from __future__ import annotations

import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Optional, Sequence

from ..errors import CheckpointError
from .header import (MAX_HEADER_BYTES, ShardHeader, TensorEntry, _is_text, _short, loads_checked,
                     parse_header)

if TYPE_CHECKING:  # pragma: no cover
    from ..storage import ObjectStorage

__all__ = ["CheckpointIndex", "INDEX_NAME", "SINGLE_NAME", "index_from_headers", "read_index",
           "RemoteHeaderReader"]

#: how an object store's shard header is read (planning/remote.py's ``remote_header``)
RemoteHeaderReader = Callable[["ObjectStorage", str], ShardHeader]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
#: headers fetched at once from an object store
_HEADER_REQUESTS = 16


def _safe_relpath(value: object, tensor: str, index_file: str) -> str:
    """Reject weight_map values that could escape the model directory."""
    if not _is_text(tensor) or not tensor:
        raise CheckpointError(f"weight_map key {_short(tensor)} is not a valid tensor name",
                              file=index_file)
    if not isinstance(value, str) or not _is_text(value) or not value:
        raise CheckpointError(f"weight_map value {_short(value)} is not a file name",
                              file=index_file, tensor=tensor)
    if not _plain_file(value):
        raise CheckpointError(f"weight_map value {value!r} is not a plain relative file name",
                              file=index_file, tensor=tensor)
    return value


def _plain_file(value: str) -> bool:
    """``value`` passes :func:`_safe_relpath` (a str the caller checked; any name)."""
    return bool(value) and _is_text(value) and not (
        "\x00" in value or "\\" in value or value.startswith("/") or os.path.isabs(value)
        or any(p in ("", ".", "..") for p in value.split("/")))


@dataclass
class CheckpointIndex:
    """Where every tensor of a model directory lives; headers are parsed on first need.

    ``weight_map`` comes from ``model.safetensors.index.json`` (or from the headers when the
    directory has one or several shards and no index). Files are only opened when a tensor in
    them is needed, so a stage never touches shards it does not need.
    """

    root: "Path | str"               # a directory, or an object-store prefix URI
    weight_map: Mapping[str, str]
    paths: Mapping[str, "Path | str"]  # local paths, or object URIs
    source: str
    _headers: dict[str, ShardHeader] = field(default_factory=dict, repr=False)
    _counts: Optional[Counter] = field(default=None, repr=False)
    #: every entry of the headers parsed so far, by name (``entry``'s one-lookup fast path)
    _entries: dict[str, TensorEntry] = field(default_factory=dict, repr=False)
    #: shards the index names that are absent from the directory (stage-only copies): fine
    #: until a plan needs one (``require``)
    missing: tuple[str, ...] = ()
    #: the object store the shards live in (planning/remote.py); None: local files
    storage: Optional["ObjectStorage"] = field(default=None, repr=False)
    #: how a shard's header is read from ``storage`` (planning/remote.py passes it)
    read_header: Optional[RemoteHeaderReader] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.storage is not None and self.read_header is None:
            raise ValueError("a CheckpointIndex over an object store needs read_header")
        for hdr in self._headers.values():
            self._entries.update(hdr.tensors)

    @property
    def files(self) -> tuple[str, ...]:
        """The shards present in the directory (``missing`` lists the absent ones)."""
        return tuple(self.paths)

    def require(self, files: Iterable[str], rank: Optional[int] = None) -> None:
        """Refuse, listing every one at once, the absent shards among ``files`` (the shards a
        plan reads; ``rank``: the rank whose plan, named in the error); absent shards nobody
        here needs are fine (a node holding its stages)."""
        if not self.missing:
            return
        gone = sorted(set(files).intersection(self.missing))
        if isinstance(self.root, Path):  # a local directory (objects are listed, never FIFOs)
            _refuse_not_regular(self.root, gone, self.source)
        if gone:
            raise CheckpointError(f"{len(gone)} file(s) named in {self.source} are missing: "
                                  + ", ".join(gone) + f" (needed by this plan; {len(self.paths)} "
                                  f"of {len(self.paths) + len(self.missing)} shards are present "
                                  f"in {self.root}): copy or download them (`pploader files` "
                                  "lists the shards each node needs)", file=self.source,
                                  rank=rank)

    def header(self, file: str) -> ShardHeader:
        """The validated header of ``file``, cross-checked against the weight_map."""
        hdr = self._headers.get(file)
        if hdr is None:
            self.require((file,))
            hdr = parse_header(self.paths[file], file=file) if self.storage is None else \
                self._remote_header(file)
            self._cross_check(hdr)
            self._headers[file] = hdr
            self._entries.update(hdr.tensors)
        return hdr

    def _cross_check(self, hdr: ShardHeader) -> None:
        files_of = list(map(self.weight_map.get, hdr.tensors))
        if files_of.count(hdr.file) == len(files_of) and \
                self._names_per_file().get(hdr.file, 0) == len(files_of):
            return  # every header tensor maps here and the counts agree (one C-level pass)
        for tname in hdr.tensors:  # name the first tensor that does not
            mapped = self.weight_map.get(tname)
            if mapped is None:
                raise CheckpointError(f"tensor is in the shard but not in {self.source}",
                                      file=hdr.file, tensor=tname)
            if mapped != hdr.file:
                raise CheckpointError(f"tensor appears in both {hdr.file} and {mapped} "
                                      f"({self.source} maps it to {mapped})",
                                      file=hdr.file, tensor=tname)
        if self._names_per_file().get(hdr.file, 0) == len(hdr.tensors):
            return  # every header tensor maps here and the counts agree: the same names
        for tname, mapped in self.weight_map.items():
            if mapped == hdr.file and tname not in hdr.tensors:
                raise CheckpointError(f"{self.source} maps this tensor to {hdr.file} but the "
                                      "shard's header does not contain it",
                                      file=hdr.file, tensor=tname)

    def _names_per_file(self) -> Mapping[str, int]:
        if self._counts is None:
            self._counts = Counter(self.weight_map.values())
        return self._counts

    def entry(self, name: str) -> TensorEntry:
        """The entry of one tensor (parses its shard's header if needed)."""
        found = self._entries.get(name)
        if found is not None:
            return found
        try:
            file = self.weight_map[name]
        except KeyError:
            raise CheckpointError("tensor not in the checkpoint", file=self.source,
                                  tensor=name) from None
        return self.header(file).tensors[name]

    def entry_map(self, files: Iterable[str]) -> Mapping[str, TensorEntry]:
        """Every entry parsed so far by name, after parsing the headers of ``files``: one
        dict lookup per tensor for a planner that visits tens of thousands."""
        files = list(files)
        self._fetch_headers(files)
        for file in files:
            self.header(file)
        return self._entries

    def entries(self, names: Iterable[str]) -> dict[str, TensorEntry]:
        return {n: self.entry(n) for n in names}

    def validate_all(self) -> None:
        """Parse every shard's header (used by balanced partitioning and `validate`)."""
        self.require(self.missing)
        self._fetch_headers(self.paths)
        for file in self.paths:
            self.header(file)

    def _fetch_headers(self, files: Iterable[str]) -> None:
        """In an object store, fetch the not yet parsed headers of ``files`` concurrently (two
        round trips each, all at once instead of one after another); checked in ``files``
        order, so the first bad one is reported as a sequential parse would."""
        if self.storage is None:
            return
        todo = [f for f in dict.fromkeys(files) if f in self.paths and f not in self._headers]
        if len(todo) < 2:
            return
        with ThreadPoolExecutor(min(_HEADER_REQUESTS, len(todo))) as pool:
            fetched = list(pool.map(self._remote_header, todo))
        for hdr in fetched:
            self._cross_check(hdr)
            self._headers[hdr.file] = hdr
            self._entries.update(hdr.tensors)

    def _remote_header(self, file: str) -> ShardHeader:
        assert self.storage is not None and self.read_header is not None  # __post_init__
        return self.read_header(self.storage, file)

    def adopt(self, hdr: ShardHeader) -> None:
        """Take ``hdr`` as ``hdr.file``'s header without parsing it: the caller checked that
        the file holds the same header bytes as the checkpoint ``hdr`` was parsed from
        (planning/rebase.py), so the weight map cross-check holds as it did there."""
        self._headers[hdr.file] = hdr
        self._entries.update(hdr.tensors)

    def opened_files(self) -> tuple[str, ...]:
        """Files whose headers were read so far."""
        return tuple(self._headers)


def index_from_headers(root: "Path | str", paths: Mapping[str, "Path | str"],
                       headers: Mapping[str, ShardHeader], storage: Any = None,
                       read_header: Optional[RemoteHeaderReader] = None) -> "CheckpointIndex":
    """The index of a checkpoint without ``model.safetensors.index.json``: the weight map
    from every shard's header (in ``headers``' order); a tensor in two shards is refused."""
    weight_map: dict[str, str] = {}
    for file, hdr in headers.items():
        for tname in hdr.tensors:
            if tname in weight_map:
                raise CheckpointError(f"tensor appears in both {weight_map[tname]} and {file}",
                                      file=file, tensor=tname)
            weight_map[tname] = file
    source = SINGLE_NAME if list(headers) == [SINGLE_NAME] else "the shard headers"
    return CheckpointIndex(root, weight_map, dict(paths), source, dict(headers),
                           storage=storage, read_header=read_header)


def read_index(index_path: Path, name: str = INDEX_NAME) -> dict[str, str]:
    """The validated weight_map of an index file (no shard is opened here)."""
    if index_path.stat().st_size > MAX_HEADER_BYTES:
        raise CheckpointError(f"larger than {MAX_HEADER_BYTES} bytes: not an index file",
                              file=name)
    return _read_index_bytes(index_path.read_bytes(), name)


def _read_index_bytes(raw: bytes, name: str = INDEX_NAME) -> dict[str, str]:
    """The validated weight_map of an index file's bytes."""
    try:
        obj = loads_checked(raw)  # UTF-8 checked by the parse (or decoded for the strict one)
    except CheckpointError as exc:
        raise CheckpointError(exc.detail, file=name, tensor=exc.tensor) from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"not valid JSON: {exc}", file=name) from None
    wmap = obj.get("weight_map") if isinstance(obj, dict) else None
    if not isinstance(wmap, dict) or not wmap:
        raise CheckpointError("missing or empty weight_map object", file=name)
    values = wmap.values()
    if set(map(type, values)) == {str}:  # the usual case: each distinct file checked once,
        files = dict.fromkeys(values)
        if b"\\" not in raw and "" not in wmap and all(map(_plain_file, files)):
            # no escape: every key is valid text (non-empty checked), every file is fine
            return wmap if type(wmap) is dict else dict(wmap)
        # one is not: named with the first tensor naming it (reversed: the earliest name
        # wins), in index order
        first = dict(zip(reversed(values), reversed(wmap.keys())))
        for f in files:
            _safe_relpath(f, first[f], name)
        return wmap if type(wmap) is dict else dict(wmap)
    checked: set = set()  # shards repeat: validate each distinct value once
    for t, f in wmap.items():
        if not isinstance(f, str) or f not in checked:
            checked.add(_safe_relpath(f, t, name))
    return dict(wmap)


def _refuse_not_regular(root: Path, files: Sequence[str], source: str) -> None:
    """A name in ``files`` (not regular files) that exists as something else — a FIFO, a
    directory, a device — is named as such, not as missing."""
    import stat
    for f in files:
        try:
            mode = os.stat(root / f).st_mode
        except OSError:
            continue  # absent (or a dangling link): really missing
        kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket"
                if stat.S_ISSOCK(mode) else "not a regular file")
        raise CheckpointError(f"is {kind}, not a regular file: replace it with the shard "
                              f"{source} names", file=f)


