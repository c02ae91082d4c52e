"""One safetensors shard's header, parsed strictly: ``TensorEntry``, ``ShardHeader``,
``parse_header`` (the dtype table, ``DTYPES`` / ``dtype_code``, is dtype_table.py's, re-exported).

Only headers are read here (never tensor data). Every check the loader relies on later
(offsets tile the data region, span = numel x itemsize, file size matches) is done once,
up front, so a bad file fails before any rank allocates or reads a byte of it.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from itertools import chain, repeat
from operator import add, itemgetter, le, mul, sub
from dataclasses import dataclass
from pathlib import Path
from functools import partial
from typing import TYPE_CHECKING, Mapping, NamedTuple, Optional

from ..errors import CheckpointError
from .dtype_table import DTYPES, ITEMSIZE, dtype_code
from .gcpause import without_gc

if TYPE_CHECKING:  # pragma: no cover
    import torch

try:  # optional (extra "fast"): 1.4x faster JSON; the stdlib parser is the fallback
    import orjson as _orjson
except ImportError:  # pragma: no cover - depends on the environment
    _orjson = None  # type: ignore[assignment]

__all__ = ["DTYPES", "MAX_HEADER_BYTES", "MAX_TENSORS", "TensorEntry", "ShardHeader",
           "parse_header", "FileIdentity", "ObjectIdentity", "dtype_code", "loads_checked",
           "header_length", "header_from_bytes"]

MAX_HEADER_BYTES = 100 * 1024 * 1024
#: tensors one header may declare: real shards hold up to a few 10 k (a whole DeepSeek-V3 /
#: Kimi-K2 checkpoint has 92 k / 140 k over 60+ files); checked by counting "{" bytes before
#: parsing, so a hostile million-tensor header costs its bytes (<= MAX_HEADER_BYTES), not a parse
MAX_TENSORS = 1 << 18

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
class ObjectIdentity(FileIdentity):
    """An object-store object's identity when planned: its size and ETag (no inode or times;
    they stay 0). Every ranged GET of the load names the ETag (``If-Match``), so an object
    rewritten mid-load fails the read as a changed local file does."""

    etag: str = ""

    @classmethod
    def of_object(cls, size: int, etag: str) -> "ObjectIdentity":
        return cls(size, 0, 0, 0, etag)


class TensorEntry(NamedTuple):
    """One tensor of one shard: absolute byte range ``[start, end)`` inside ``file``.

    An immutable named tuple, not a frozen dataclass: a header of 100 k tensors builds its
    entries in one C pass (``map(tuple.__new__, ...)``), 6x faster than a dataclass per entry
    (docs/benchmarks.md, planning sixth round)."""

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
    def torch_dtype(self) -> "torch.dtype":
        return DTYPES[self.dtype][0]  # imports torch (tensor-making code only)

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class ShardHeader:
    """A parsed and validated shard header."""

    file: str
    path: "Path | str"   # a local Path, or an object's URI (s3://...)
    identity: FileIdentity
    header_bytes: int
    data_start: int
    tensors: Mapping[str, TensorEntry]
    metadata: Mapping[str, str]
    #: BLAKE2b of the header's JSON bytes: another file with these bytes and this size has
    #: exactly these entries (planning/rebase.py); empty when not computed
    digest: bytes = b""


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


def _loads(raw: str) -> object:
    """Strict JSON: no duplicate keys, no NaN/Infinity."""
    return json.loads(raw, object_pairs_hook=_no_duplicates, parse_constant=_no_constants)


def _loads_fast(raw: bytes) -> Optional[object]:
    """The JSON value of the UTF-8 ``raw`` without the per-object duplicate-key hook, or None
    when this fast parse cannot be trusted (then the caller parses with :func:`_loads`). Only
    text with no backslash qualifies: without escapes no string holds a ``"``, so every ``"``
    delimits a string token, and the caller's count (:func:`_strings`) proves that no key was
    lost to a duplicate. NaN / Infinity are refused by both parsers; invalid UTF-8 gives None
    (the caller's decode reports it). orjson parses bytes ~1.3x faster than a str."""
    if b"\\" in raw:
        return None
    try:
        if _orjson is not None:
            return _orjson.loads(raw)
        # decoded first: json.loads would also accept UTF-16 / 32 bytes
        return json.loads(raw.decode("utf-8"), parse_constant=_no_constants)
    except (ValueError, RecursionError, TypeError):  # UnicodeDecodeError is a ValueError
        return None  # the strict parse reports it (with its own message)


def _strings(value: object) -> int:
    """The string tokens (keys and string values) a JSON text holds for ``value``. A text
    without escapes has exactly ``text.count('"') / 2`` of them, so fewer here = a key (and
    its value) lost to a duplicate."""
    if type(value) is str:
        return 1
    if type(value) is dict:
        values = value.values()
        if set(map(type, values)) <= {str}:  # a flat string map (the index's weight_map)
            return 2 * len(value)
        return len(value) + sum(_strings(v) for v in values if type(v) in (dict, list, str))
    if type(value) is list:
        return sum(_strings(v) for v in value if type(v) in (dict, list, str))
    return 0


def loads_checked(raw: bytes) -> object:
    """UTF-8 JSON parsed as headers are: the fast parse when it provably saw every key (no
    duplicate hidden), else the strict one (duplicates and non-finite constants refused; the
    decode raises UnicodeDecodeError when ``raw`` is not UTF-8)."""
    obj = _loads_fast(raw)
    if obj is None or raw.count(b'"') != 2 * _strings(obj):
        obj = _loads(raw.decode("utf-8"))  # escapes or a duplicate key: the strict parse decides
    return obj


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
        n = header_length(name, head, st.st_size, max_header_bytes)
        raw = os.pread(fd, n, 8)
    finally:
        os.close(fd)
    if len(raw) != n:
        raise CheckpointError("file shrank while its header was read", file=name)
    return header_from_bytes(name, path, FileIdentity.of(st), st.st_size, head, raw,
                             max_tensors)


def header_length(name: str, head: bytes, size: int,
                  max_header_bytes: int = MAX_HEADER_BYTES) -> int:
    """The header length the first 8 bytes of a ``size``-byte shard declare, checked."""
    if len(head) < 8:
        raise CheckpointError(f"not a safetensors file: {size} bytes, too short for the "
                              f"8-byte header length{_sniff(head)}", file=name)
    (n,) = struct.unpack("<Q", head[:8])
    if n > max_header_bytes:
        raise CheckpointError(f"not a safetensors file: header length {n} exceeds the "
                              f"{max_header_bytes}-byte limit{_sniff(head)}", file=name)
    if 8 + n > size:
        raise CheckpointError(f"truncated: header of {n} bytes does not fit in the "
                              f"{size}-byte file{_sniff(head)}", file=name)
    return int(n)


def header_from_bytes(name: str, path: "Path | str", identity: FileIdentity, size: int,
                      head: bytes, raw: bytes, max_tensors: int = MAX_TENSORS) -> ShardHeader:
    """The validated header of a ``size``-byte shard from its first bytes ``head`` (at least
    the 8-byte length) and its header JSON ``raw``: shared by local files and objects."""
    n = len(raw)
    if not raw.lstrip().startswith(b"{"):
        raise CheckpointError(f"not a safetensors file: header is not a JSON object{_sniff(head + raw)}",
                              file=name)
    # every tensor entry is a JSON object, so "{" bytes bound the tensor count from above
    # (escapes cannot hide a "{"); checked before paying for a JSON parse
    if raw.count(b"{") - 1 > max_tensors:
        raise CheckpointError(f"header has room for more than {max_tensors} tensors "
                              f"({raw.count(b'{') - 1} JSON objects): refusing to parse it",
                              file=name)
    data_start = 8 + n
    data_len = size - data_start
    fast = _fast_header(name, raw, data_start, data_len, max_tensors)  # no decode: UTF-8
    if fast is not None:  # is checked by orjson (invalid: None, and the decode below says so)
        return ShardHeader(name, path, identity, n, data_start, *fast, header_digest(raw))
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"header is not valid UTF-8 ({exc.reason} at byte {exc.start})",
                              file=name) from exc
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
    return ShardHeader(name, path, identity, n, data_start, tensors, metadata,
                       header_digest(raw))


def header_digest(raw: bytes) -> bytes:
    """``ShardHeader.digest`` of a header's JSON bytes (16 bytes of BLAKE2b: ~0.1 ms for a
    header of thousands of tensors)."""
    return hashlib.blake2b(raw, digest_size=16).digest()


def _metadata(file: str, metadata: object) -> dict:
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or not all(
            _is_text(k) and _is_text(v) for k, v in metadata.items()):
        raise CheckpointError("__metadata__ must map strings to strings", file=file)
    return metadata


#: dtype code -> bytes per element (the fast path's lookup)
_ITEMSIZE = dict(ITEMSIZE)
#: a TensorEntry from its six fields as one tuple (no per-field ``__init__`` call)
_make_entry = partial(tuple.__new__, TensorEntry)


def _fast_header(file: str, raw: bytes, data_start: int, data_len: int, max_tensors: int
                 ) -> Optional[tuple[dict[str, TensorEntry], dict]]:
    """The entries and metadata of a well-formed header, parsed without per-object Python
    hooks and checked in whole-header passes; None when anything is unusual (escapes, a duplicate
    key, any entry the strict checks would refuse), and then ``parse_header`` parses the
    header again strictly, so every error keeps its precise message. Accepts exactly what the
    strict path accepts, with the same entries (tests/planning/test_plan_equivalence.py, the fuzzer)."""
    obj = _loads_fast(raw)  # the UTF-8 bytes (orjson refuses invalid UTF-8: None)
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
    tensors = _bulk_entries(file, obj, data_start, data_len)
    if tensors is None:
        return None
    # every '"' delimits a string (no escapes): equal counts = no key was lost to a duplicate
    # (a tensor: its name, 3 entry keys, the dtype; metadata: its key, then keys and values)
    if raw.count(b'"') != 2 * (5 * len(obj) + had_metadata + 2 * len(metadata)):
        return None
    return tensors, metadata


def _bulk_entries(file: str, obj: dict, data_start: int, data_len: int
                  ) -> Optional[dict[str, TensorEntry]]:
    """The entries of a header object (metadata removed), every check of :func:`_entry` and
    :func:`_check_tiling` done as whole-header passes at C speed (``map``, ``set``, list
    compares) instead of per entry; None when any entry is unusual (a dim of 2**63 or more
    included), and the caller parses strictly."""
    names, infos = list(obj), list(obj.values())
    if not infos:
        return {} if data_len == 0 else None
    if set(map(type, infos)) != {dict} or set(map(len, infos)) != {3} \
            or not all(names) or not "".join(names).isascii():
        return None
    try:  # three keys each, these three present: exactly the entry keys
        dtypes = list(map(itemgetter("dtype"), infos))
        shapes = list(map(itemgetter("shape"), infos))
        offsets = list(map(itemgetter("data_offsets"), infos))
    except KeyError:
        return None
    if set(map(type, dtypes)) != {str} or set(map(type, shapes)) != {list} \
            or set(map(type, offsets)) != {list} or set(map(len, offsets)) != {2} \
            or max(map(len, shapes)) > 8:
        return None
    sizes = list(map(_ITEMSIZE.get, dtypes))
    if None in sizes:
        return None
    dims = list(chain.from_iterable(shapes))
    if dims and (set(map(type, dims)) != {int} or min(dims) < 0 or max(dims) >= _MAX_SIZE):
        return None
    flat = list(chain.from_iterable(offsets))
    if set(map(type, flat)) != {int}:
        return None
    begins, ends = flat[0::2], flat[1::2]
    if min(begins) < 0 or max(ends) > data_len or not all(map(le, begins, ends)) \
            or list(map(mul, map(math.prod, shapes), sizes)) != list(map(sub, ends, begins)):
        return None
    if begins[0] != 0 or begins[1:] != ends[:-1] or ends[-1] != data_len:  # not in order:
        spans = sorted(zip(begins, ends))  # tiled = contiguous from 0 to the end, sorted
        if spans[0][0] != 0 or spans[-1][1] != data_len or \
                [b for b, _ in spans[1:]] != [e for _, e in spans[:-1]]:
            return None
    at = repeat(data_start)
    return dict(zip(names, map(_make_entry, zip(  # the entries in one C pass
        names, repeat(file), dtypes, map(tuple, shapes), map(add, at, begins), map(add, at, ends)))))


def _entry(file: str, tname: str, info: object, data_start: int, data_len: int) -> TensorEntry:
    def bad(msg: str) -> CheckpointError:
        return CheckpointError(msg, file=file, tensor=tname)

    if not tname or not (tname.isascii() or _is_text(tname)):
        raise CheckpointError("tensor name is empty or not valid Unicode", file=file,
                              tensor=ascii(tname))
    if type(info) is not dict or len(info) != 3 or not _ENTRY_KEYS.issuperset(info):
        raise bad("entry must be an object with exactly dtype, shape and data_offsets")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if type(dtype) is not str or dtype not in ITEMSIZE:
        raise bad(f"unknown dtype {dtype!r} (known: {', '.join(ITEMSIZE)})")
    if type(shape) is not list or not _nonnegative_ints(shape):
        raise bad(f"shape must be a list of non-negative integers, got {_short(shape)}")
    if (type(offsets) is not list or len(offsets) != 2 or not _nonnegative_ints(offsets)
            or offsets[0] > offsets[1]):
        raise bad(f"data_offsets must be two integers 0 <= begin <= end, got {_short(offsets)}")
    begin, end = offsets
    span = _span_bytes(shape, ITEMSIZE[dtype])
    if span is None:
        raise bad(f"size overflow: shape {_short(shape)} x {ITEMSIZE[dtype]} bytes does not fit "
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

