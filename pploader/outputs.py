"""Where pploader writes: the one output policy of every command that writes files.

pploader never deletes or overwrites a file it did not create. Every output directory
(``make-tiny OUT``, ``convert DST``, ``load --save-loaded DIR``, ``bench --dir``, the demo's
``OUT``) goes through :func:`claim_output` before anything is read or written:

- it must be a local path (``s3://`` and other URLs are refused, never a local ``s3:`` folder),
  not empty, not the model directory nor inside it;
- it must be new, empty, or marked as pploader's own by a ``.pploader-output`` marker file
  that lists the files pploader wrote there; ``force`` (or ``reuse``) replaces only those files,
  everything else in the directory is kept.

Files are written under temporary names and renamed into place only on success
(:func:`staged_output`, :func:`publish_files`), so a failure, Ctrl-C or SIGTERM leaves nothing
partial. Temporary paths in progress are registered here so that the command line's signal
watcher can remove them before the process exits (:func:`discard_pending`).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

from .errors import UsageError

__all__ = ["MARKER", "TEMP_PREFIX", "OutputDir", "claim_output", "staged_output", "probe_writable",
           "publish_files", "begin_file", "commit_file", "retire_stale", "abandon",
           "own_entries", "release_entries",
           "discard_pending", "pending", "is_url", "FILE_MODE", "DIR_MODE"]

#: the file that marks a directory as pploader's output (JSON: command, files)
MARKER = ".pploader-output"

#: prefix of every temporary name pploader writes (hidden; ignored when a directory is checked)
TEMP_PREFIX = ".pploader-tmp-"

#: modes of the files and directories pploader publishes (as `cp` / `mkdir` would make them)
FILE_MODE = 0o644
DIR_MODE = 0o755

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:/")


def is_url(path: object) -> bool:
    """``s3://bucket/x``, ``S3://``, ``file:/x``: a URL, not a local path."""
    return bool(_URL.match(str(path)))


@dataclass(frozen=True)
class OutputDir:
    """An output directory that passed :func:`claim_output`.

    ``path`` is absolute with symlinks resolved; ``shown`` is what the user wrote;
    ``existed``: the directory was there (empty or pploader's); ``owned``: the files an
    earlier pploader output listed in its marker (the only ones a new output may replace)."""
    path: Path
    shown: str
    flag: str
    command: str
    existed: bool
    owned: tuple[str, ...] = ()


def _read_marker(folder: Path) -> Optional[tuple[str, ...]]:
    """The files listed by ``folder``'s marker; None when it has no valid marker."""
    try:
        doc = json.loads((folder / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    files = doc.get("files") if isinstance(doc, dict) else None
    if doc.get("by") != "pploader" or not isinstance(files, list) or not all(
            isinstance(f, str) and f and "/" not in f and f not in (".", "..") for f in files):
        return None
    return tuple(files)


def _own_entries(names: Iterable[str]) -> list[str]:
    """The entries of a directory that are not pploader's marker or temporaries."""
    return sorted(n for n in names if n != MARKER and not n.startswith(TEMP_PREFIX))


def claim_output(path: os.PathLike | str, flag: str, *, command: str, force: bool = False,
                 reuse: bool = False, models: Sequence[os.PathLike | str] = (),
                 expect: Sequence[str] = ()) -> OutputDir:
    """Check that pploader may write the output directory ``path`` (named ``flag`` in errors),
    before anything is written; a :class:`UsageError` (exit 2) naming the fix otherwise.

    ``force``: an earlier pploader output there may be replaced (its listed files only);
    ``reuse``: the same without asking (``--save-loaded``, ``bench --dir``). ``models``: the
    model directories the output must stay out of. ``expect``: names the command will write
    (one that exists there and is not pploader's is refused). Nothing is created here."""
    text = os.fspath(path)
    if not str(text).strip():
        raise UsageError(f"{flag} {text!r}: empty path; give a directory")
    if is_url(text):
        raise UsageError(f"{flag} {text}: pploader writes only to a local directory, not to a "
                         "URL (s3:// outputs are not supported); give a local path")
    out = Path(os.path.realpath(text))
    for model in models:
        if is_url(model) or not str(model).strip():
            continue
        root = Path(os.path.realpath(model))
        if out == root or root in out.parents:
            where = "is the model directory" if out == root else "is inside the model directory"
            raise UsageError(f"{flag} {text} {where} {model}; give a directory outside it")
    if out.exists() and not out.is_dir():
        raise UsageError(f"{flag} {text}: exists and is not a directory; give a new directory")
    owned: tuple[str, ...] = ()
    if out.is_dir():
        try:
            held = _own_entries(os.listdir(out))
        except OSError as exc:
            raise UsageError(f"{flag} {text}: cannot list it ({exc.strerror}); give a new "
                             "directory") from None
        marked = _read_marker(out)
        if held and marked is None:
            raise UsageError(f"{flag} {text}: not empty and not written by pploader (holds "
                             f"{len(held)} entries, e.g. {held[0]}); pploader writes only into a "
                             "new or empty directory or one it made: give another directory")
        if held and not (force or reuse):
            raise UsageError(f"{flag} {text}: not empty (an earlier pploader output); give a new "
                             "directory or pass --force to replace pploader's files in it")
        owned = marked or ()
        taken = sorted(n for n in expect if os.path.lexists(out / n) and n not in owned)
        if taken:
            raise UsageError(f"{flag} {text}: {taken[0]} there is not pploader's (not in its "
                             f"{MARKER}) and would be replaced; move it or give another "
                             "directory")
    _check_writable(out, flag, text)
    return OutputDir(out, text, flag, command, out.is_dir(), owned)


def _check_writable(out: Path, flag: str, text: str) -> None:
    """The directory (or its nearest existing parent) takes new files: probed now with a
    temporary file, so a mistake is found before any byte is read."""
    probe = next((p for p in [out, *out.parents] if p.exists()), Path("/"))
    if not probe.is_dir():
        raise UsageError(f"{flag} {text}: {probe} is not a directory; give another path")
    try:
        probe_writable(probe)
    except OSError as exc:
        raise UsageError(f"{flag} {text}: cannot write there ({exc.strerror or exc}); give a "
                         "writable directory") from None


def probe_writable(folder: Path) -> None:
    """Create and remove a temporary file in ``folder`` (OSError when it cannot), under the
    lock the signal watcher's cleanup takes, so a signal never strands the probe."""
    with _lock, tempfile.NamedTemporaryFile(dir=folder, prefix=TEMP_PREFIX + "probe-"):
        pass


# ---- temporaries in progress (removed by the signal watcher) --------------------------------

_lock = threading.RLock()
_pending: set[Path] = set()
_made_dirs: list[Path] = []  # made by begin_file (outermost first), removed when left empty


def pending() -> tuple[Path, ...]:
    """The temporary paths being written now (for tests and the signal watcher)."""
    with _lock:
        return tuple(sorted(_pending))


def _remove(path: Path) -> None:
    for _ in range(5):  # a writer may add a file between rmtree's listing and its rmdir
        if not os.path.lexists(path):
            return
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                path.unlink()
        if os.path.lexists(path):
            time.sleep(0.01)


def discard_pending() -> None:
    """Remove every temporary path in progress (after a signal, just before the process
    exits). Holds the lock, so a publication in progress finishes first."""
    with _lock:
        for path in list(_pending):
            _remove(path)
        _pending.clear()
        _undo_parents(_made_dirs)  # the directories made for them, when left empty
        _made_dirs.clear()


@contextlib.contextmanager
def _registered(path: Path) -> Iterator[Path]:
    with _lock:
        _pending.add(path)
    try:
        yield path
    except BaseException:
        with _lock:
            _remove(path)
            _pending.discard(path)
        raise
    with _lock:
        _pending.discard(path)


def _missing_parents(out: Path) -> list[Path]:
    return [p for p in out.parents if not p.exists()][::-1]


def _undo_parents(made: list[Path]) -> None:
    for parent in reversed(made):
        with contextlib.suppress(OSError):
            parent.rmdir()


def _write_marker(folder: Path, target: OutputDir, files: Sequence[str],
                  extra: Sequence[str] = ()) -> None:
    """Write ``folder``'s marker (atomically) listing ``files`` plus ``extra``."""
    doc = {"by": "pploader", "command": target.command,
           "files": sorted(set(files) | set(extra))}
    tmp = folder / f"{TEMP_PREFIX}{MARKER.lstrip('.')}-{os.getpid()}"
    tmp.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    os.chmod(tmp, FILE_MODE)
    os.replace(tmp, folder / MARKER)


@contextlib.contextmanager
def staged_output(target: OutputDir, last: Sequence[str] = ()) -> Iterator[Path]:
    """A temporary directory to write the whole output into; on success its files are
    published to ``target`` (:func:`publish_files`, ``last`` renamed last), on any failure or
    signal it is removed, with the parents it made. A new ``target`` appears in one rename."""
    out = target.path
    made = _missing_parents(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    base = out if out.is_dir() else out.parent  # inside an existing one: same file system
    with _lock:
        _made_dirs.extend(made)  # removed, when left empty, by a signal's discard_pending
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{out.name}-", dir=base))
        with _registered(tmp):
            yield tmp
            with _lock:
                publish_files(target, tmp, last=last)
                _made_dirs.clear()  # they hold the output now
    except BaseException:
        with _lock:
            _undo_parents(made)
            _made_dirs.clear()
        raise


def publish_files(target: OutputDir, tmp: Path, last: Sequence[str] = ()) -> list[str]:
    """Move every file written in ``tmp`` into ``target`` and mark it pploader's.

    A new (or vanished) ``target``: ``tmp`` itself is renamed to it, the marker inside.
    An existing one: re-checked (still empty or pploader's), the marker first lists old and
    new files (so a crash leaves nothing pploader cannot later replace), the old listed files
    are removed, the new ones renamed in (``last`` at the end: config and index after the
    shards they name), then the marker lists the new files only. ``tmp`` is removed."""
    names = sorted(p.name for p in tmp.iterdir())
    out = target.path
    for path in tmp.iterdir():
        os.chmod(path, FILE_MODE)
    if not out.exists():
        _write_marker(tmp, target, names)
        os.chmod(tmp, DIR_MODE)
        os.rename(tmp, out)
        return names
    again = claim_output(out, target.flag, command=target.command, reuse=True, expect=names)
    _write_marker(out, target, names, again.owned)
    for old in again.owned:
        if old not in names:
            with contextlib.suppress(FileNotFoundError):
                (out / old).unlink()
    for name in sorted(names, key=lambda n: (n in last, last.index(n) if n in last else 0, n)):
        os.replace(tmp / name, out / name)
    _write_marker(out, target, names)
    tmp.rmdir()
    return names


def begin_file(target: OutputDir, name: str) -> Path:
    """A temporary path in ``target`` (made if needed) to write the file ``name`` into,
    registered for removal on a signal; :func:`commit_file` publishes it, :func:`abandon`
    removes it."""
    made = _missing_parents(target.path) + ([] if target.path.exists() else [target.path])
    target.path.mkdir(parents=True, exist_ok=True)
    tmp = target.path / f"{TEMP_PREFIX}{name}-{os.getpid()}"
    with _lock:
        _pending.add(tmp)
        _made_dirs.extend(made)
    return tmp


def commit_file(target: OutputDir, tmp: Path, name: str, all_names: Sequence[str]) -> None:
    """Rename a staged file to ``name`` and mark ``target`` as pploader's, listing
    ``all_names`` (every file of this output, e.g. one per rank)."""
    with _lock:
        owned = set(target.owned) | set(_read_marker(target.path) or ())
        if os.path.lexists(target.path / name) and name not in owned:
            raise UsageError(f"{target.flag} {target.shown}: {name} there is not pploader's "
                             f"(not in its {MARKER}); move it or give another directory")
        os.chmod(tmp, FILE_MODE)
        _write_marker(target.path, target, all_names, target.owned)
        os.replace(tmp, target.path / name)
        _pending.discard(tmp)
        _made_dirs.clear()  # published: they hold pploader's output now


def retire_stale(target: OutputDir, keep: Sequence[str]) -> None:
    """Remove the files of an earlier output listed in its marker and not in ``keep``, then
    list ``keep`` only."""
    with _lock:
        for old in target.owned:
            if old not in keep:
                with contextlib.suppress(FileNotFoundError):
                    (target.path / old).unlink()
        _write_marker(target.path, target, keep)


def abandon(target: OutputDir, tmp: Optional[Path]) -> None:
    """A failed job: remove this process's temporary file and, when nothing else is left in
    it and it was made by this job, the output directory."""
    with _lock:
        if tmp is not None:
            _remove(tmp)
            _pending.discard(tmp)
        _undo_parents(_made_dirs)  # what this process made, when left empty
        _made_dirs.clear()
        if not target.existed:
            with contextlib.suppress(OSError):
                target.path.rmdir()


def own_entries(target: OutputDir, names: Sequence[str]) -> None:
    """Make ``target`` and list ``names`` in its marker before they are written (entries a
    command fills in place over several steps, e.g. ``bench --dir``'s checkpoints)."""
    with _lock:
        target.path.mkdir(parents=True, exist_ok=True)
        _write_marker(target.path, target, names, _read_marker(target.path) or target.owned)


def release_entries(target: OutputDir, names: Sequence[str]) -> None:
    """Remove the entries ``names`` pploader wrote in ``target`` (and ``target`` itself when
    this command made it and nothing else is left)."""
    with _lock:
        for name in names:
            _remove(target.path / name)
        left = [n for n in (_read_marker(target.path) or ()) if n not in names]
        if not left and not target.existed and not _own_entries(os.listdir(target.path)):
            _remove(target.path / MARKER)
            with contextlib.suppress(OSError):
                target.path.rmdir()
        elif target.path.is_dir():
            _write_marker(target.path, target, left)
