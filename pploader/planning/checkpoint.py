"""Strict safetensors header parsing and the CheckpointIndex of a model directory.

Only headers are read here (never tensor data). Every check the loader relies on later
(offsets tile the data region, span = numel x itemsize, file size matches) is done once,
up front, so a bad file fails before any rank allocates or reads a byte of it.
"""
from __future__ import annotations

import json
import math
import os
import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence

import torch

from ..errors import CheckpointError
from .gcpause import without_gc

try:  # optional (extra "fast"): 1.4x faster JSON; the stdlib parser is the fallback
    import orjson as _orjson
except ImportError:  # pragma: no cover - depends on the environment
    _orjson = None  # type: ignore[assignment]

__all__ = ["DTYPES", "MAX_HEADER_BYTES", "MAX_TENSORS", "TensorEntry", "ShardHeader",
           "CheckpointIndex", "parse_header", "open_checkpoint", "FileIdentity"]

MAX_HEADER_BYTES = 100 * 1024 * 1024
MAX_TENSORS = 2_000_000
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

#: safetensors dtype code -> (torch dtype, bytes per element)
DTYPES: Mapping[str, tuple[torch.dtype, int]] = {
    "F64": (torch.float64, 8), "F32": (torch.float32, 4), "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2), "I64": (torch.int64, 8), "I32": (torch.int32, 4),
    "I16": (torch.int16, 2), "I8": (torch.int8, 1), "U8": (torch.uint8, 1),
    "U16": (torch.uint16, 2), "U32": (torch.uint32, 4), "U64": (torch.uint64, 8),
    "BOOL": (torch.bool, 1), "F8_E4M3": (torch.float8_e4m3fn, 1),
    "F8_E5M2": (torch.float8_e5m2, 1), "F8_E8M0": (torch.float8_e8m0fnu, 1),
}
_DTYPE_CODE = {dt: code for code, (dt, _) in DTYPES.items()}


def dtype_code(dtype: torch.dtype) -> str:
    """safetensors code of a torch dtype (``torch.bfloat16`` -> ``"BF16"``)."""
    return _DTYPE_CODE[dtype]


@dataclass(frozen=True)
class FileIdentity:
    """What a file looked like when planned; a change during the load is detected with it."""

    size: int
    inode: int
    mtime_ns: int
    ctime_ns: int = 0   # an in-place rewrite that restores mtime still moves ctime

    @classmethod
    def of(cls, st: os.stat_result) -> "FileIdentity":
        return cls(st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of one shard: absolute byte range ``[start, end)`` inside ``file``."""

    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype][0]

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][1]


@dataclass(frozen=True)
class ShardHeader:
    """A parsed and validated shard header."""

    file: str
    path: Path
    identity: FileIdentity
    header_bytes: int
    data_start: int
    tensors: Mapping[str, TensorEntry]
    metadata: Mapping[str, str]


def _sniff(head: bytes) -> str:
    text = head.lstrip()[:64].lower()
    if text.startswith(b"version https://git-lfs"):
        return " (it looks like a git-LFS pointer: fetch the real file with `git lfs pull`)"
    if text.startswith((b"<!doctype", b"<html", b"<?xml")):
        return " (it looks like an HTML page, e.g. a login or error page saved in its place)"
    return " (damaged, or not a safetensors file: fetch or write it again)"


_ENTRY_KEYS = frozenset({"dtype", "shape", "data_offsets"})
#: dims and byte sizes must fit a signed 64-bit integer (torch's sizes, the reference's usize)
_MAX_SIZE = 2 ** 63


def _no_duplicates(pairs: list) -> dict:
    """json object hook: a repeated key is an error (json and the reference keep the last)."""
    obj = dict(pairs)
    if len(obj) == len(pairs):  # the common case, at C speed
        return obj
    seen: set = set()
    for key, _ in pairs:
        if key in seen:
            raise CheckpointError(f"duplicate key {key!r} in the JSON",
                                  tensor=None if key in _ENTRY_KEYS else str(key))
        seen.add(key)
    return obj


def _no_constants(name: str) -> object:
    """json hook: NaN / Infinity are not JSON (Python's json accepts them by default)."""
    raise ValueError(f"{name} is not valid JSON")


def _is_text(x: object) -> bool:
    """A str that is valid Unicode (JSON escapes can smuggle in lone surrogates)."""
    if not isinstance(x, str):
        return False
    try:
        x.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _loads(raw: bytes | str) -> object:
    """Strict JSON: no duplicate keys, no NaN/Infinity."""
    return json.loads(raw, object_pairs_hook=_no_duplicates, parse_constant=_no_constants)


def _loads_fast(text: str) -> Optional[object]:
    """The JSON value of ``text`` without the per-object duplicate-key hook, or None when this
    fast parse cannot be trusted (then the caller parses with :func:`_loads`). Only text with
    no backslash qualifies: without escapes every ``:`` of the text is either a key separator
    or a character of a string, so the caller's count (``_colons_ok``) proves that no key was
    lost to a duplicate. NaN / Infinity are refused by both parsers."""
    if "\\" in text:
        return None
    try:
        if _orjson is not None:
            return _orjson.loads(text)
        return json.loads(text, parse_constant=_no_constants)
    except (ValueError, RecursionError, TypeError):
        return None  # the strict parse reports it (with its own message)


def _accounted_colons(value: object) -> int:
    """The ``:`` a JSON text without escapes holds for ``value``: one per object key, plus
    those inside its strings. Fewer than the text's count = a key lost to a duplicate."""
    if type(value) is str:
        return value.count(":")
    if type(value) is dict:
        values = value.values()
        return (len(value) + _colons(value) + _colons([v for v in values if type(v) is str])
                + sum(_accounted_colons(v) for v in values if type(v) in (dict, list)))
    if type(value) is list:
        return sum(_accounted_colons(v) for v in value if type(v) in (dict, list, str))
    return 0


def _colons(strings: Iterable[str]) -> int:
    """``:`` characters inside ``strings`` (joined once: C speed)."""
    return "".join(strings).count(":")


@without_gc
def parse_header(path: os.PathLike | str, *, file: Optional[str] = None,
                 max_header_bytes: int = MAX_HEADER_BYTES,
                 max_tensors: int = MAX_TENSORS) -> ShardHeader:
    """Read and strictly validate one safetensors header; no tensor data is read.

    ``file`` is the name used in messages and entries (default: the path's name).
    """
    path = Path(path)
    name = file if file is not None else path.name
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise CheckpointError(f"cannot open: {exc.strerror} (check that the file exists and is "
                              "readable by this user)", file=name) from exc
    try:
        st = os.fstat(fd)
        head = os.pread(fd, 64, 0)  # 8-byte length + enough to recognise LFS pointers / HTML
        if len(head) < 8:
            raise CheckpointError(f"not a safetensors file: {st.st_size} bytes, too short for the "
                                  f"8-byte header length{_sniff(head)}", file=name)
        (n,) = struct.unpack("<Q", head[:8])
        if n > max_header_bytes:
            raise CheckpointError(f"not a safetensors file: header length {n} exceeds the "
                                  f"{max_header_bytes}-byte limit{_sniff(head)}", file=name)
        if 8 + n > st.st_size:
            raise CheckpointError(f"truncated: header of {n} bytes does not fit in the "
                                  f"{st.st_size}-byte file{_sniff(head)}", file=name)
        raw = os.pread(fd, n, 8)
    finally:
        os.close(fd)
    if len(raw) != n:
        raise CheckpointError("file shrank while its header was read", file=name)
    if not raw.lstrip().startswith(b"{"):
        raise CheckpointError(f"not a safetensors file: header is not a JSON object{_sniff(head + raw)}",
                              file=name)
    # every tensor entry is a JSON object, so "{" bytes bound the tensor count from above
    # (escapes cannot hide a "{"); checked before paying for a JSON parse
    if raw.count(b"{") - 1 > max_tensors:
        raise CheckpointError(f"header has room for more than {max_tensors} tensors "
                              f"({raw.count(b'{') - 1} JSON objects): refusing to parse it",
                              file=name)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"header is not valid UTF-8 ({exc.reason} at byte {exc.start})",
                              file=name) from exc
    data_start = 8 + n
    data_len = st.st_size - data_start
    fast = _fast_header(name, text, data_start, data_len, max_tensors)
    if fast is not None:
        return ShardHeader(name, path, FileIdentity.of(st), n, data_start, *fast)
    try:
        obj = _loads(text)
    except CheckpointError as exc:
        raise CheckpointError(exc.detail, file=name, tensor=exc.tensor) from None
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"header is not valid JSON: {exc}", file=name) from None
    if not isinstance(obj, dict):
        raise CheckpointError("header is not a JSON object", file=name)
    metadata = _metadata(name, obj.pop("__metadata__", None))
    if len(obj) > max_tensors:
        raise CheckpointError(f"header declares {len(obj)} tensors, more than {max_tensors}",
                              file=name)
    tensors: dict[str, TensorEntry] = {}
    for tname, info in obj.items():
        tensors[tname] = _entry(name, tname, info, data_start, data_len)
    _check_tiling(name, tensors, data_start, data_len)
    return ShardHeader(name, path, FileIdentity.of(st), n, data_start, tensors, metadata)


def _metadata(file: str, metadata: object) -> dict:
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or not all(
            _is_text(k) and _is_text(v) for k, v in metadata.items()):
        raise CheckpointError("__metadata__ must map strings to strings", file=file)
    return metadata


#: dtype code -> bytes per element (the fast path's lookup)
_ITEMSIZE = {code: size for code, (_, size) in DTYPES.items()}
_new = object.__new__


def _fast_header(file: str, text: str, data_start: int, data_len: int, max_tensors: int
                 ) -> Optional[tuple[dict[str, TensorEntry], dict]]:
    """The entries and metadata of a well-formed header, parsed without per-object Python
    hooks and checked in one tight loop; None when anything is unusual (escapes, a duplicate
    key, any entry the strict checks would refuse), and then ``parse_header`` parses the
    text again strictly, so every error keeps its precise message. Accepts exactly what the
    strict path accepts, with the same entries (tests/planning/test_plan_equivalence.py, the fuzzer)."""
    obj = _loads_fast(text)
    if type(obj) is not dict:
        return None
    had_metadata = "__metadata__" in obj
    metadata = obj.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    elif type(metadata) is not dict or not all(
            type(k) is str and type(v) is str for k, v in metadata.items()):
        return None
    if len(obj) > max_tensors:
        return None
    itemsizes, new, entry_cls = _ITEMSIZE, _new, TensorEntry
    tensors: dict[str, TensorEntry] = {}
    spans: list[tuple[int, int, str]] = []
    keys, prod, in_order, cursor = _ENTRY_KEYS, math.prod, True, 0
    for tname, info in obj.items():
        if type(info) is not dict or info.keys() != keys or not tname or not tname.isascii():
            return None
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        itemsize = itemsizes.get(dtype) if type(dtype) is str else None
        if itemsize is None or type(shape) is not list or type(offsets) is not list \
                or len(offsets) != 2 or len(shape) > 8:
            return None
        begin, end = offsets
        if type(begin) is not int or type(end) is not int or not 0 <= begin <= end <= data_len:
            return None
        for d in shape:
            if type(d) is not int or d < 0:
                return None
        numel = prod(shape)
        # numel > 0 bounds every dim by the data length; an empty tensor may not hide a huge dim
        if numel * itemsize != end - begin or (not numel and shape and max(shape) >= _MAX_SIZE):
            return None
        if begin != cursor:
            in_order = False
        cursor = end
        e = new(entry_cls)
        object.__setattr__(e, "__dict__", {"name": tname, "file": file, "dtype": dtype,
                                           "shape": tuple(shape), "start": data_start + begin,
                                           "end": data_start + end})
        tensors[tname] = e
        spans.append((begin, end, tname))
    # every ":" is a key separator or inside a string (no escapes): equal counts = no key
    # was lost to a duplicate (entries: 3 keys, dtype codes hold no ":")
    key_count = 4 * len(obj) + had_metadata + len(metadata)
    in_strings = _colons(obj) + _colons(metadata) + _colons(metadata.values())
    if text.count(":") != key_count + in_strings:
        return None
    if in_order:  # written in offset order (the common case): tiled iff it ends at the end
        return (tensors, metadata) if cursor == data_len else None
    spans.sort()
    cursor = 0
    for begin, end, _ in spans:
        if begin != cursor:
            return None  # overlap or hole: the strict path names the tensor
        cursor = end
    if cursor != data_len:
        return None
    return tensors, metadata


def _entry(file: str, tname: str, info: object, data_start: int, data_len: int) -> TensorEntry:
    def bad(msg: str) -> CheckpointError:
        return CheckpointError(msg, file=file, tensor=tname)

    if not tname or not (tname.isascii() or _is_text(tname)):
        raise CheckpointError("tensor name is empty or not valid Unicode", file=file,
                              tensor=ascii(tname))
    if type(info) is not dict or len(info) != 3 or not _ENTRY_KEYS.issuperset(info):
        raise bad("entry must be an object with exactly dtype, shape and data_offsets")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if type(dtype) is not str or dtype not in DTYPES:
        raise bad(f"unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
    if type(shape) is not list or not _nonnegative_ints(shape):
        raise bad(f"shape must be a list of non-negative integers, got {_short(shape)}")
    if (type(offsets) is not list or len(offsets) != 2 or not _nonnegative_ints(offsets)
            or offsets[0] > offsets[1]):
        raise bad(f"data_offsets must be two integers 0 <= begin <= end, got {_short(offsets)}")
    begin, end = offsets
    span = _span_bytes(shape, DTYPES[dtype][1])
    if span is None:
        raise bad(f"size overflow: shape {_short(shape)} x {DTYPES[dtype][1]} bytes does not fit "
                  "in 64 bits")
    if end - begin != span:
        raise bad(f"byte span {end - begin} != numel x itemsize = {span} for shape "
                  f"{_short(shape)} {dtype}")
    if end > data_len:
        raise bad(f"data_offsets end {end} is past the end of the data region ({data_len} bytes): "
                  "file truncated?")
    return TensorEntry(tname, file, dtype, tuple(shape), data_start + begin, data_start + end)


def _nonnegative_ints(values: list) -> bool:
    """Every value an int (not a bool) >= 0 (a plain loop: shapes are short)."""
    for v in values:
        if type(v) is not int or v < 0:
            return False
    return True


def _short(value: object, limit: int = 120) -> str:
    """repr for messages, cut short (a hostile header can hold million-element lists)."""
    if isinstance(value, list) and len(value) > 8:
        return repr(value[:8])[:-1] + f", ... ({len(value)} items)]"
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "...]"


def _span_bytes(shape: list, itemsize: int) -> Optional[int]:
    """numel x itemsize, or None when a dim or the product overflows 64 bits. Multiplied
    step by step so a huge shape list cannot make a huge integer."""
    if len(shape) <= 8:  # real shapes: one C product, exact (Python ints do not overflow)
        total = math.prod(shape) * itemsize
        return total if max(shape, default=0) < _MAX_SIZE and total < _MAX_SIZE else None
    if any(d >= _MAX_SIZE for d in shape):
        return None
    if 0 in shape:
        return 0
    total = itemsize
    for d in shape:
        total *= d
        if total >= _MAX_SIZE:
            return None
    return total


def _check_tiling(file: str, tensors: Mapping[str, TensorEntry], data_start: int,
                  data_len: int) -> None:
    cursor = data_start
    for entry in sorted(tensors.values(), key=lambda e: (e.start, e.end)):
        if entry.start < cursor:
            raise CheckpointError(f"byte range overlaps the previous tensor's (starts at "
                                  f"{entry.start - data_start}, previous ends at "
                                  f"{cursor - data_start})", file=file, tensor=entry.name)
        if entry.start > cursor:
            raise CheckpointError(f"hole of {entry.start - cursor} bytes before this tensor",
                                  file=file, tensor=entry.name)
        cursor = entry.end
    if cursor != data_start + data_len:
        extra = data_start + data_len - cursor
        raise CheckpointError(f"{extra} unexpected bytes after the data region "
                              "(8 + header + data end != file size)", file=file)


def _safe_relpath(value: object, tensor: str, index_file: str) -> str:
    """Reject weight_map values that could escape the model directory."""
    if not _is_text(tensor) or not tensor:
        raise CheckpointError(f"weight_map key {_short(tensor)} is not a valid tensor name",
                              file=index_file)
    if not isinstance(value, str) or not _is_text(value) or not value:
        raise CheckpointError(f"weight_map value {_short(value)} is not a file name",
                              file=index_file, tensor=tensor)
    parts = value.split("/")
    if ("\x00" in value or "\\" in value or value.startswith("/") or os.path.isabs(value)
            or any(p in ("", ".", "..") for p in parts)):
        raise CheckpointError(f"weight_map value {value!r} is not a plain relative file name",
                              file=index_file, tensor=tensor)
    return value


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
    roots = _allowed_roots(root, extra)
    real = path.resolve()
    if not any(real == r or r in real.parents for r in roots):
        raise CheckpointError(f"resolves to {real}, outside the allowed roots "
                              f"({', '.join(map(str, roots))}); allow its directory with "
                              "--allow-root DIR (allowed_roots= in the API)", file=name)
    return real


def _allowed_roots(root: Path, extra: Sequence[os.PathLike | str]) -> list[Path]:
    """The model directory, its HF-cache repo folder when it is a snapshot, and ``extra``."""
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

    root: Path
    weight_map: Mapping[str, str]
    paths: Mapping[str, Path]
    source: str
    _headers: dict[str, ShardHeader] = field(default_factory=dict, repr=False)
    _counts: Optional[Counter] = field(default=None, repr=False)
    #: every entry of the headers parsed so far, by name (``entry``'s one-lookup fast path)
    _entries: dict[str, TensorEntry] = field(default_factory=dict, repr=False)
    #: shards the index names that are absent from the directory (stage-only copies): fine
    #: until a plan needs one (``require``)
    missing: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for hdr in self._headers.values():
            self._entries.update(hdr.tensors)

    @property
    def files(self) -> tuple[str, ...]:
        """The shards present in the directory (``missing`` lists the absent ones)."""
        return tuple(self.paths)

    def require(self, files: Iterable[str]) -> None:
        """Refuse, listing every one at once, the absent shards among ``files`` (the shards a
        plan reads); absent shards nobody here needs are fine (a node holding its stages)."""
        if not self.missing:
            return
        gone = sorted(set(files).intersection(self.missing))
        if gone:
            raise CheckpointError(f"{len(gone)} file(s) named in {self.source} are missing: "
                                  + ", ".join(gone) + f" (needed by this plan; {len(self.paths)} "
                                  f"of {len(self.paths) + len(self.missing)} shards are present "
                                  f"in {self.root}): copy or download them (`pploader files` "
                                  "lists the shards each node needs)", file=self.source)

    def header(self, file: str) -> ShardHeader:
        """The validated header of ``file``, cross-checked against the weight_map."""
        hdr = self._headers.get(file)
        if hdr is None:
            self.require((file,))
            hdr = parse_header(self.paths[file], file=file)
            self._cross_check(hdr)
            self._headers[file] = hdr
            self._entries.update(hdr.tensors)
        return hdr

    def _cross_check(self, hdr: ShardHeader) -> None:
        for tname in hdr.tensors:
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
        for file in files:
            self.header(file)
        return self._entries

    def entries(self, names: Iterable[str]) -> dict[str, TensorEntry]:
        return {n: self.entry(n) for n in names}

    def validate_all(self) -> None:
        """Parse every shard's header (used by balanced partitioning and `validate`)."""
        self.require(self.missing)
        for file in self.paths:
            self.header(file)

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
    """
    root = check_model_dir(model_dir)
    roots = _allowed_roots(root, allowed_roots)
    index_path = root / INDEX_NAME
    if os.path.lexists(index_path):
        weight_map = _read_index(_resolve(root, [INDEX_NAME], roots, str(root))[INDEX_NAME])
        files = list(dict.fromkeys(weight_map.values()))
        present = [f for f in files if (root / f).is_file()]
        paths = _resolve(root, present, roots, INDEX_NAME)
        return CheckpointIndex(root, weight_map, paths, INDEX_NAME,
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
    paths = _resolve(root, shards, roots, str(root))
    weight_map = {}
    headers: dict[str, ShardHeader] = {}
    for file in shards:
        hdr = parse_header(paths[file], file=file)
        for tname in hdr.tensors:
            if tname in weight_map:
                raise CheckpointError(f"tensor appears in both {weight_map[tname]} and {file}",
                                      file=file, tensor=tname)
            weight_map[tname] = file
        headers[file] = hdr
    source = SINGLE_NAME if shards == [SINGLE_NAME] else "the shard headers"
    return CheckpointIndex(root, weight_map, paths, source, headers)


def _read_index(index_path: Path, name: str = INDEX_NAME) -> dict[str, str]:
    """The validated weight_map of an index file (no shard is opened here)."""
    if index_path.stat().st_size > MAX_HEADER_BYTES:
        raise CheckpointError(f"larger than {MAX_HEADER_BYTES} bytes: not an index file",
                              file=name)
    try:
        text = index_path.read_bytes().decode("utf-8")
        obj = _loads_fast(text)
        if obj is None or text.count(":") != _accounted_colons(obj):
            obj = _loads(text)  # escapes or a duplicate key: the strict parse decides
    except CheckpointError as exc:
        raise CheckpointError(exc.detail, file=name, tensor=exc.tensor) from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"not valid JSON: {exc}", file=name) from None
    wmap = obj.get("weight_map") if isinstance(obj, dict) else None
    if not isinstance(wmap, dict) or not wmap:
        raise CheckpointError("missing or empty weight_map object", file=name)
    checked: set = set()  # shards repeat: validate each distinct value once
    for t, f in wmap.items():
        if not isinstance(f, str) or f not in checked:
            checked.add(_safe_relpath(f, t, name))
    return dict(wmap)


def _resolve(root: Path, files: Sequence[str], roots: Sequence[Path],
             source: str) -> dict[str, Path]:
    """Resolve shard paths (symlinks allowed inside the roots); list every missing one."""
    missing = [f for f in files if not (root / f).is_file()]
    if missing:
        raise CheckpointError(f"{len(missing)} file(s) named in {source} are missing: "
                              + ", ".join(missing) + " (copy or download them into the model "
                              "directory)", file=source)
    paths = {}
    for f in files:
        real = (root / f).resolve()
        if not any(real == r or r in real.parents for r in roots):
            raise CheckpointError(f"resolves to {real}, outside the allowed roots "
                                  f"({', '.join(map(str, roots))}); allow its directory with "
                                  "--allow-root DIR (allowed_roots= in the API)", file=f)
        paths[f] = real
    return paths
