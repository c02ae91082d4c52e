"""The CheckpointIndex of a model directory: the index (or single file), shard paths kept
inside the allowed roots, missing shards listed, headers parsed on demand (planning/header.py).

Re-exports the header names (``DTYPES``, ``TensorEntry``, ``parse_header`` ...) so callers keep
one import for "the checkpoint".
"""
from __future__ import annotations

import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional, Sequence

from ..errors import CheckpointError
from .gcpause import without_gc
from ..storage import is_remote
from .header import (DTYPES, MAX_HEADER_BYTES, MAX_TENSORS, FileIdentity, ObjectIdentity,
                     ShardHeader, TensorEntry, _is_text, _short, dtype_code, loads_checked,
                     parse_header)

if TYPE_CHECKING:  # pragma: no cover
    from ..storage import ObjectStorage

__all__ = ["DTYPES", "MAX_HEADER_BYTES", "MAX_TENSORS", "TensorEntry", "ShardHeader",
           "CheckpointIndex", "parse_header", "open_checkpoint", "FileIdentity", "ObjectIdentity",
           "dtype_code", "INDEX_NAME", "SINGLE_NAME"]

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


def check_model_dir(model_dir: os.PathLike | str) -> Path:
    """``model_dir`` as a Path when it is a directory; a CheckpointError saying what it is
    instead (missing, a file such as a shard given in place of its directory)."""
    root = Path(model_dir)
    if root.is_dir():
        return root
    if not os.path.lexists(root):
        raise CheckpointError("model directory does not exist: --model takes the directory "
                              "holding config.json and the *.safetensors shards", file=str(root))
    if root.is_file():
        raise CheckpointError("is a file, not a directory: --model takes the directory holding "
                              f"config.json and the shards (here: {root.parent})", file=str(root))
    raise CheckpointError("is not a directory (a dangling symlink?): --model takes the "
                          "directory holding config.json and the shards", file=str(root))


def inside_roots(root: Path, path: Path, extra: Sequence[os.PathLike | str], name: str) -> Path:
    """``path`` resolved; a CheckpointError when it resolves outside the allowed roots."""
    roots = allowed_root_dirs(root, extra)
    real = path.resolve()
    if not any(real == r or r in real.parents for r in roots):
        raise CheckpointError(f"resolves to {real}, outside the allowed roots "
                              f"({', '.join(map(str, roots))}); allow its directory with "
                              "--allow-root DIR (allowed_roots= in the API)", file=name)
    return real


def allowed_root_dirs(root: Path, extra: Sequence[os.PathLike | str]) -> list[Path]:
    """The model directory, its HF-cache repo folder when it is a snapshot, and ``extra``
    (a sequence of existing directories: a single string is refused, never taken for its
    characters, each of which would admit every path under ``/``)."""
    from ..arguments import check_paths
    extra = check_paths("allowed_roots", extra)
    roots = [root.resolve()]
    # Hugging Face cache: <repo>/snapshots/<rev>/file -> ../../blobs/<sha>
    for snap in (Path(os.path.abspath(root)), root.resolve()):
        if snap.parent.name == "snapshots":
            roots.append(snap.parent.parent.resolve())
    roots += [Path(p).resolve() for p in extra]
    return list(dict.fromkeys(roots))


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

    def __post_init__(self) -> None:
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
                _remote_header(self.storage, file)
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
        storage = self.storage
        todo = [f for f in dict.fromkeys(files) if f in self.paths and f not in self._headers]
        if len(todo) < 2:
            return
        with ThreadPoolExecutor(min(_HEADER_REQUESTS, len(todo))) as pool:
            fetched = list(pool.map(lambda f: _remote_header(storage, f), todo))
        for hdr in fetched:
            self._cross_check(hdr)
            self._headers[hdr.file] = hdr
            self._entries.update(hdr.tensors)

    def adopt(self, hdr: ShardHeader) -> None:
        """Take ``hdr`` as ``hdr.file``'s header without parsing it: the caller checked that
        the file holds the same header bytes as the checkpoint ``hdr`` was parsed from
        (planning/rebase.py), so the weight map cross-check holds as it did there."""
        self._headers[hdr.file] = hdr
        self._entries.update(hdr.tensors)

    def opened_files(self) -> tuple[str, ...]:
        """Files whose headers were read so far."""
        return tuple(self._headers)


@without_gc
def open_checkpoint(model_dir: os.PathLike | str, *,
                    allowed_roots: Sequence[os.PathLike | str] = ()) -> CheckpointIndex:
    """Index a model directory without reading tensor data.

    With ``model.safetensors.index.json`` the weight_map is validated (safe relative names)
    before any shard is opened. Absent shards are recorded in ``missing`` and refused only when
    a plan needs them (``CheckpointIndex.require``: every missing one a plan reads, listed at
    once), so a node may hold just the shards of its own stages.
    Without it, every ``*.safetensors`` file's header is read.
    An ``s3://bucket/prefix`` is indexed the same way from the object store
    (planning/remote.py).
    """
    if is_remote(model_dir):
        from .remote import open_remote_checkpoint  # object stores only: their modules too
        return open_remote_checkpoint(str(model_dir))
    root = check_model_dir(model_dir)
    roots = allowed_root_dirs(root, allowed_roots)
    index_path = root / INDEX_NAME
    if os.path.lexists(index_path):
        weight_map = read_index(resolve_files(root, [INDEX_NAME], roots, str(root))[INDEX_NAME])
        counts = Counter(weight_map.values())  # the shards in first-use order, and the
        files = list(counts)                   # header cross-check's names per shard
        present = [f for f in files if (root / f).is_file()]
        paths = resolve_files(root, present, roots, INDEX_NAME)
        return CheckpointIndex(root, weight_map, paths, INDEX_NAME, _counts=counts,
                               missing=tuple(f for f in files if f not in paths))
    shards = sorted(p.name for p in root.glob("*.safetensors"))
    if not shards:
        pickled = sorted(p.name for p in root.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        hint = (f"; found only pickle files ({', '.join(pickled[:4])}): pploader never unpickles "
                "by default. If you trust them, convert once with `pploader convert "
                "--allow-pickle SRC DST` (torch.load(weights_only=True), see "
                "docs/reliability.md)") if pickled else ""
        hint = hint or ": --model must be the directory holding the checkpoint's shards"
        raise CheckpointError(f"no {INDEX_NAME} and no *.safetensors files{hint}", file=str(root))
    paths = resolve_files(root, shards, roots, str(root))
    headers = {file: parse_header(paths[file], file=file) for file in shards}
    return index_from_headers(root, paths, headers)


def _remote_header(storage: "ObjectStorage", file: str) -> ShardHeader:
    from .remote import remote_header
    return remote_header(storage, file)


def index_from_headers(root: "Path | str", paths: Mapping[str, "Path | str"],
                       headers: Mapping[str, ShardHeader], storage: Any = None
                       ) -> "CheckpointIndex":
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
                           storage=storage)


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


def resolve_files(root: Path, files: Sequence[str], roots: Sequence[Path],
             source: str) -> dict[str, Path]:
    """Resolve shard paths (symlinks allowed inside the roots); list every missing one."""
    missing = [f for f in files if not (root / f).is_file()]
    _refuse_not_regular(root, missing, source)
    if missing:
        raise CheckpointError(f"{len(missing)} file(s) named in {source} are missing: "
                              + ", ".join(missing) + " (copy or download them into the model "
                              "directory)", file=source)
    paths = {}
    base = root.resolve()
    plain = base in roots  # a plain name in ``root`` that is not a link resolves to base / f
    for f in files:
        path = root / f
        if plain and "/" not in f and f not in (".", "..") and not path.is_symlink():
            paths[f] = base / f  # what ``resolve`` gives, without its lstat per component
            continue
        real = path.resolve()
        if not any(real == r or r in real.parents for r in roots):
            raise CheckpointError(f"resolves to {real}, outside the allowed roots "
                                  f"({', '.join(map(str, roots))}); allow its directory with "
                                  "--allow-root DIR (allowed_roots= in the API)", file=f)
        paths[f] = real
    return paths
