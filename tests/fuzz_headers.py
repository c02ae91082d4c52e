"""Header fuzzer: generated and mutated safetensors files through pploader's strict parser.

Every input must end in one of two ways: a ShardHeader whose entries tile the file exactly
(and, for a sample, agree with safetensors' own reader), or a CheckpointError. Any other
exception is a bug; so is an accepted file that breaks the invariants. Such inputs are written
to ``--crash-dir`` and counted, and the run exits 1.

    python -m tests.fuzz_headers --count 100000 --seed 1     # the long run (docs/reliability.md)
    python -m tests.fuzz_headers --count 3000                # what CI runs (tests/planning/test_fuzz.py)

Cases: valid files (random names incl. unicode, every dtype, 0-d / empty shapes, metadata,
whitespace padding), JSON-level mutations (bad dtypes, shapes, offsets, extra/missing keys,
duplicate keys, non-object entries, bad metadata, huge numbers, deep nesting, lone surrogates,
NaN) and byte-level mutations (bit flips, truncation, insertion, deletion, appended bytes,
length prefix off by one / random / huge, LFS pointer and HTML in place of the header).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import struct
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from pploader.planning.checkpoint import DTYPES, ShardHeader, parse_header
from pploader.errors import CheckpointError

__all__ = ["FuzzResult", "run_fuzz", "make_case", "check_accepted", "main"]

_CODES = list(DTYPES)
_NAME_CHARS = "abcxyz0123456789._-/ éß漢🙂"


@dataclass
class FuzzResult:
    """What one fuzz run saw."""

    count: int = 0
    accepted: int = 0
    rejected: int = 0
    differential_checked: int = 0
    crashes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    kinds: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.crashes


# ---- generation ---------------------------------------------------------------------------


def _name(rng: random.Random) -> str:
    return "".join(rng.choice(_NAME_CHARS) for _ in range(rng.randint(1, 12)))


def _valid_obj(rng: random.Random) -> tuple[dict, int]:
    """A valid header object (tensors + maybe metadata) and its data length."""
    entries: dict[str, dict] = {}
    offset = 0
    for _ in range(rng.randint(0, 6)):
        name = _name(rng)
        while name in entries or name == "__metadata__":
            name += "x"
        dtype = rng.choice(_CODES)
        shape = [rng.randint(0, 4) for _ in range(rng.randint(0, 3))]
        nbytes = math.prod(shape) * DTYPES[dtype][1]
        entries[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    items = list(entries.items())
    rng.shuffle(items)  # key order is independent of byte order
    obj: dict[str, Any] = dict(items)
    if rng.random() < 0.5:
        meta = {"format": "pt"}
        if rng.random() < 0.5:
            meta[_name(rng)] = _name(rng)
        obj["__metadata__"] = meta
    return obj, offset


_NEST = "@@nest@@"


def _encode(rng: random.Random, obj: Any, patch: Optional[tuple[str, Any]] = None) -> bytes:
    """JSON bytes of ``obj``; ``patch`` = ("dup", key) repeats a key, ("nest", depth) turns the
    placeholder into ``depth`` nested arrays (too deep for json.dumps itself)."""
    text = json.dumps(obj, ensure_ascii=rng.random() < 0.5,
                      separators=rng.choice([(",", ":"), (", ", ": ")]))
    if patch is not None and patch[0] == "dup" and isinstance(obj, dict) and patch[1] in obj:
        extra = json.dumps({patch[1]: obj[patch[1]]})[1:-1]
        text = text[:-1] + ("," if len(obj) else "") + extra + "}"
    if patch is not None and patch[0] == "nest":
        text = text.replace(json.dumps(_NEST), "[" * patch[1] + "]" * patch[1])
    raw = text.encode("utf-8", "surrogatepass")
    if rng.random() < 0.3:  # the reference writer pads the header with spaces to 8 bytes
        raw += b" " * (-len(raw) % 8)
    return raw


_BAD_DTYPES = ["F7", "", "f32", "BF16 ", 3, None, ["F32"], {"F32": 1}, "F8_E4M3FN", "C64"]
_BAD_SHAPES = [[-1], [1.5], "3", [2 ** 63], [2 ** 64], [2 ** 62, 2 ** 62], [True], [[2]], None,
               {}, [1] * 70, [0, 2 ** 70], [10 ** 30], [float("nan")]]


def _struct_mutation(rng: random.Random, obj: dict
                     ) -> tuple[Any, Optional[tuple[str, Any]], str]:
    """Mutate a header object; returns (object, encoding patch, kind)."""
    names = [k for k in obj if k != "__metadata__"]
    kind = rng.choice(["dtype", "shape", "offsets", "keys", "entry", "metadata", "swap",
                       "drop", "dup", "toplevel", "nest", "name", "number", "nan"])
    if not names and kind in ("dtype", "shape", "offsets", "keys", "entry", "swap", "drop",
                              "dup", "name", "nan"):
        kind = "metadata"
    pick = rng.choice(names) if names else None
    entry = obj.get(pick) if pick is not None else None
    patch: Optional[tuple[str, Any]] = None
    if kind == "dtype":
        entry["dtype"] = rng.choice(_BAD_DTYPES + _CODES)
    elif kind == "shape":
        entry["shape"] = rng.choice(_BAD_SHAPES + [[rng.randint(0, 9)] * rng.randint(0, 4)])
    elif kind == "offsets":
        b, e = entry["data_offsets"]
        entry["data_offsets"] = rng.choice([[b, e + 1], [e, b], [b - 1, e], [b], [b, e, 0],
                                            [-1, 0], [2 ** 64, 2 ** 64 + 1], "0,1",
                                            [float(b), float(e)], None, [b + 1, e + 1],
                                            [b, e - 1], [0, 0]])
    elif kind == "keys":
        if rng.random() < 0.5:
            entry.pop(rng.choice(list(entry)))
        else:
            entry[rng.choice(["extra", "Dtype", "offsets"])] = 1
    elif kind == "entry":
        obj[pick] = rng.choice([1, [], "x", None, True, [entry]])
    elif kind == "metadata":
        obj["__metadata__"] = rng.choice(["", 1, [], {"k": 1}, {"k": None}, {"k": {"a": "b"}},
                                          None, {"k": "v"}, {"\ud800": "x"}, False, 0])
    elif kind == "swap" and len(names) > 1:
        a, b = rng.sample(names, 2)
        obj[a]["data_offsets"], obj[b]["data_offsets"] = obj[b]["data_offsets"], \
            obj[a]["data_offsets"]
    elif kind == "drop":
        obj.pop(pick)
    elif kind == "dup":
        patch = ("dup", pick)
    elif kind == "toplevel":
        return rng.choice([[], 1, "x", None, [obj], True]), None, "struct-" + kind
    elif kind == "nest":
        obj[_name(rng) + "n"] = _NEST
        patch = ("nest", rng.choice([10, 100, 1000, 5000, 100_000]))
    elif kind == "name":
        obj[rng.choice(["", "\ud800", "\udfff", "a\x00b", "\\", "__metadata__"])] = obj.pop(pick)
    elif kind == "number":
        obj["__metadata__"] = {"n": str(10 ** 50)}
        if names:
            obj[pick]["data_offsets"] = [10 ** 100, 10 ** 100]
    elif kind == "nan":
        entry["shape"] = [float(rng.choice(["nan", "inf", "-inf"]))]
    return obj, patch, "struct-" + kind


def _byte_mutation(rng: random.Random, blob: bytearray) -> str:
    kind = rng.choice(["flip", "byte", "truncate", "append", "insert", "delete", "length",
                       "text"])
    n = len(blob)
    if kind == "flip" and n:
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(n)
            blob[i] ^= 1 << rng.randrange(8)
    elif kind == "byte" and n:
        blob[rng.randrange(n)] = rng.choice([0, 0xFF, ord("{"), ord('"'), ord("\\"), 0x80,
                                             ord("]"), ord(","), rng.randrange(256)])
    elif kind == "truncate":
        del blob[rng.randint(0, n):]
    elif kind == "append":
        blob += rng.randbytes(rng.randint(1, 64))
    elif kind == "insert":
        i = rng.randint(8, max(8, n)) if n >= 8 else 0
        blob[i:i] = rng.randbytes(rng.randint(1, 16))
    elif kind == "delete" and n > 8:
        i = rng.randrange(8, n)
        del blob[i:i + rng.randint(1, 16)]
    elif kind == "length" and n >= 8:
        (cur,) = struct.unpack("<Q", bytes(blob[:8]))
        blob[:8] = struct.pack("<Q", rng.choice([cur + 1, max(cur - 1, 0), 0, 2 ** 64 - 1,
                                                 n, n - 8, rng.randrange(2 ** 64),
                                                 100 * 1024 * 1024 + 1, 100 * 1024 * 1024]))
    elif kind == "text":
        blob[:] = rng.choice([b"version https://git-lfs.github.com/spec/v1\noid sha256:0\n",
                              b"<!DOCTYPE html><html></html>", b"", b"{}", b"\x02\0\0\0\0\0\0\0{}",
                              b"\x00" * 16])
    return "bytes-" + kind


def make_case(rng: random.Random) -> tuple[bytes, str]:
    """One fuzz input (the whole file) and the kind of mutation that made it."""
    obj, data_len = _valid_obj(rng)
    roll = rng.random()
    kind, patch = "valid", None
    if 0.1 <= roll < 0.6 or roll >= 0.9:
        obj, patch, kind = _struct_mutation(rng, obj)
    header = _encode(rng, obj, patch)
    blob = bytearray(struct.pack("<Q", len(header)) + header + rng.randbytes(data_len))
    if roll >= 0.6:
        kind = _byte_mutation(rng, blob) if kind == "valid" else kind + "+" + \
            _byte_mutation(rng, blob)
    return bytes(blob), kind


# ---- checking -----------------------------------------------------------------------------


def check_accepted(hdr: ShardHeader, size: int) -> Optional[str]:
    """Why an accepted header is wrong (None when it satisfies every invariant)."""
    if hdr.data_start != 8 + hdr.header_bytes:
        return "data_start != 8 + header length"
    cursor = hdr.data_start
    for e in sorted(hdr.tensors.values(), key=lambda e: (e.start, e.end)):
        if e.start != cursor:
            return f"{e.name!r} does not start where the previous tensor ends"
        if e.nbytes != math.prod(e.shape) * e.itemsize or any(d < 0 for d in e.shape):
            return f"{e.name!r} span != numel x itemsize"
        if e.dtype not in DTYPES or not e.name:
            return f"{e.name!r} bad dtype or name"
        cursor = e.end
    if cursor != size:
        return "entries do not end at the end of the file"
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in hdr.metadata.items()):
        return "metadata not str -> str"
    return None


def _differential(path: Path, hdr: ShardHeader) -> Optional[str]:
    """What safetensors' own reader disagrees on (it must accept whatever we accept)."""
    from safetensors import safe_open
    try:
        with safe_open(str(path), "numpy") as fh:
            keys = set(fh.keys())
            if keys != set(hdr.tensors):
                return f"keys differ: reference {sorted(keys)[:5]} vs ours {sorted(hdr.tensors)[:5]}"
            for name, e in hdr.tensors.items():
                s = fh.get_slice(name)
                if tuple(s.get_shape()) != e.shape or s.get_dtype() != e.dtype:
                    return f"{name!r}: reference {s.get_shape()} {s.get_dtype()}"
            if (fh.metadata() or {}) != dict(hdr.metadata):
                return "metadata differs"
    except Exception as exc:  # noqa: BLE001 - a disagreement to report, not a crash
        return f"reference rejects what we accept: {type(exc).__name__}: {exc}"
    return None


def run_fuzz(count: int, *, seed: int = 0, workdir: Optional[Path] = None,
             diff_every: int = 1, crash_dir: Optional[Path] = None,
             on_case: Optional[Callable[[int], None]] = None) -> FuzzResult:
    """Run ``count`` cases; see the module docstring for what counts as a failure."""
    rng = random.Random(seed)
    result = FuzzResult()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=workdir or _fast_tmp()) as tmp:
        path = Path(tmp) / "case.safetensors"
        for i in range(count):
            blob, kind = make_case(rng)
            key = kind.split("+")[0]
            result.kinds[key] = result.kinds.get(key, 0) + 1
            path.write_bytes(blob)
            problem = None
            try:
                hdr = parse_header(path)
            except CheckpointError:
                result.rejected += 1
            except Exception as exc:  # noqa: BLE001 - exactly what the fuzzer hunts
                problem = f"{type(exc).__name__}: {exc}"
            else:
                result.accepted += 1
                problem = check_accepted(hdr, len(blob))
                if problem is None and diff_every and result.accepted % diff_every == 0:
                    result.differential_checked += 1
                    problem = _differential(path, hdr)
            if problem is not None:
                result.crashes.append(f"case {i} ({kind}): {problem[:300]}")
                if crash_dir is not None:
                    crash_dir.mkdir(parents=True, exist_ok=True)
                    (crash_dir / f"case-{seed}-{i}.safetensors").write_bytes(blob)
            result.count += 1
            if on_case is not None:
                on_case(i)
    result.seconds = time.perf_counter() - start
    return result


def _fast_tmp() -> Optional[str]:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--diff-every", type=int, default=1,
                        help="compare every N-th accepted file with safetensors' reader (0: off)")
    parser.add_argument("--crash-dir", type=Path, default=Path("fuzz-crashes"))
    args = parser.parse_args(argv)
    result = run_fuzz(args.count, seed=args.seed, diff_every=args.diff_every,
                      crash_dir=args.crash_dir)
    out = asdict(result)
    out["crashes"] = result.crashes[:20]
    out["crash_count"] = len(result.crashes)
    out["cases_per_second"] = round(result.count / result.seconds) if result.seconds else None
    print(json.dumps(out, indent=1, sort_keys=True))
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
