"""Opening a model directory: shard paths kept inside the allowed roots, missing shards listed,
the ``CheckpointIndex`` built (planning/index.py; headers parsed on demand, planning/header.py);
``s3://`` through planning/remote.py.

Re-exports the header names (``DTYPES``, ``TensorEntry``, ``parse_header`` ...) and the index's
so callers keep one import for "the checkpoint".
"""
from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Sequence

from ..errors import CheckpointError
from .gcpause import without_gc
from ..storage import is_remote
from .header import (DTYPES, MAX_HEADER_BYTES, MAX_TENSORS, FileIdentity, ObjectIdentity,
                     ShardHeader, TensorEntry, dtype_code, parse_header)
from .index import INDEX_NAME, CheckpointIndex, _refuse_not_regular, index_from_headers, read_index

__all__ = ["DTYPES", "MAX_HEADER_BYTES", "MAX_TENSORS", "TensorEntry", "ShardHeader",
           "CheckpointIndex", "parse_header", "open_checkpoint", "FileIdentity", "ObjectIdentity",
           "dtype_code", "INDEX_NAME", "read_index"]


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
