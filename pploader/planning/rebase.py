"""A stage plan moved to another checkpoint of the same layout, without planning again.

A plan is a pure function of config.json, the weight map and the shard headers (plus the
topology and options, which a reload keeps). Weight updates (RL steps, fine-tune snapshots)
write new checkpoints of exactly the served layout, so a reload checks that layout and, when
equal, takes the served plan with the new files' paths and identities. The check reads
config.json, the weight map and, per shard the plan reads, its size and header bytes, compared
by digest with the header the plan was made from (``ShardHeader.digest``; nothing is parsed).
Anything different returns None, and the caller plans afresh. The identities are the new
files', so a file that changes between this check and its read is still refused by the reader
(``io.backend.check_identity``).
"""
from __future__ import annotations

import logging
import os
import struct
from dataclasses import replace
from pathlib import Path
from typing import Optional, Sequence

from ..errors import PPLoaderError
from .checkpoint import open_checkpoint
from .header import FileIdentity, ShardHeader, header_digest
from .spec import read_config
from .stage import StagePlan

logger = logging.getLogger(__name__)

__all__ = ["rebase_stage"]


def rebase_stage(staged: StagePlan, model_dir: os.PathLike | str, *,
                 allowed_roots: Sequence[str] = ()) -> Optional[StagePlan]:
    """``staged`` moved onto ``model_dir`` when its config.json, weight map and the header of
    every shard the plan reads equal the planned ones; None otherwise (or on any error
    reading them: the caller's fresh planning then reports it properly)."""
    if staged.index.storage is not None:  # object stores: planned afresh (ETags, not inodes)
        return None
    try:
        if read_config(model_dir, allowed_roots=allowed_roots) != dict(staged.spec.full_config):
            return None
        index = open_checkpoint(model_dir, allowed_roots=allowed_roots)
        if dict(index.weight_map) != dict(staged.index.weight_map):
            return None
        planned = set(staged.index.opened_files())  # the headers the plan was made from
        paths: dict[str, str] = {}
        identities = {}
        for file in staged.plan.paths:
            # never re-read an "old" header: the served directory may have been rewritten
            if file not in index.paths or file not in planned:
                return None
            old = staged.index.header(file)
            identity = _same_header(index.paths[file], old)
            if identity is None:
                return None
            index.adopt(replace(old, path=index.paths[file], identity=identity))
            paths[file], identities[file] = str(index.paths[file]), identity
    except (PPLoaderError, OSError, ValueError) as exc:
        logger.debug("not reusing the plan for %s: %s", model_dir, exc)
        return None
    plan = replace(staged.plan, model=str(index.root), paths=paths, identities=identities)
    return replace(staged, index=index, plan=plan)


def _same_header(path: "Path | str", old: ShardHeader) -> Optional[FileIdentity]:
    """The identity of the file at ``path`` when its size and header bytes are ``old``'s."""
    if not old.digest:
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        st = os.fstat(fd)
        if st.st_size != old.identity.size:
            return None
        head = os.pread(fd, 8, 0)
        if len(head) != 8 or struct.unpack("<Q", head)[0] != old.header_bytes:
            return None
        if header_digest(os.pread(fd, old.header_bytes, 8)) != old.digest:
            return None
        return FileIdentity.of(st)
    finally:
        os.close(fd)
