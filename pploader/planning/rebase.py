"""A stage plan moved to another checkpoint of the same layout, without planning again.

A plan is a pure function of config.json, the weight map and the shard headers (plus the
topology and options, which a reload keeps). Weight updates (RL steps, fine-tune snapshots)
write new checkpoints of exactly the served layout, so a reload checks that layout (config,
weight map, every header of the stage's shards: a few KiB per shard) and, when equal, takes the
served plan with the new files' paths and identities. Anything different returns None, and
the caller plans afresh. The identities are the new files', so a file that changes between
this check and its read is still refused by the reader (``io.backend.check_identity``).
"""
from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Optional, Sequence

from ..errors import PPLoaderError
from .checkpoint import open_checkpoint
from .spec import read_config
from .stage import StagePlan

logger = logging.getLogger(__name__)

__all__ = ["rebase_stage"]


def rebase_stage(staged: StagePlan, model_dir: os.PathLike | str, *,
                 allowed_roots: Sequence[str] = ()) -> Optional[StagePlan]:
    """``staged`` moved onto ``model_dir`` when its config.json, weight map and the headers
    of every shard the plan reads equal the planned ones; None otherwise (or on any error
    reading them: the caller's fresh planning then reports it properly)."""
    if staged.index.storage is not None:  # object stores: planned afresh (ETags, not inodes)
        return None
    try:
        if read_config(model_dir, allowed_roots=allowed_roots) != dict(staged.spec.full_config):
            return None
        index = open_checkpoint(model_dir, allowed_roots=allowed_roots)
        if dict(index.weight_map) != dict(staged.index.weight_map):
            return None
        files = tuple(staged.plan.paths)
        planned = set(staged.index.opened_files())  # the headers the plan was made from
        if any(f not in index.paths or f not in planned for f in files):
            return None   # never re-read "old" headers: the directory may be rewritten
        paths: dict[str, str] = {}
        identities = {}
        for file in files:
            old, new = staged.index.header(file), index.header(file)
            if new.data_start != old.data_start or new.tensors != old.tensors:
                return None
            paths[file], identities[file] = str(new.path), new.identity
    except (PPLoaderError, OSError, ValueError) as exc:
        logger.debug("not reusing the plan for %s: %s", model_dir, exc)
        return None
    plan = replace(staged.plan, model=str(index.root), paths=paths, identities=identities)
    return replace(staged, index=index, plan=plan)
