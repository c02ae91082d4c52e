"""Which files each node (or rank) needs: ``pploader files`` (docs/launch.md, stage-only files).

A rank's plan reads only the shards of its stage, and planning itself needs only those shards'
headers plus ``config.json`` and the index. So a node can hold just the union of its ranks'
shards (and the small metadata files); the rest of the checkpoint may be absent there. Pure:
planning headers only, no torch.distributed.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from .checkpoint import INDEX_NAME, open_checkpoint
from ..errors import TopologyError
from .plan import Partition, RankPlan, plan_all
from .spec import load_spec

__all__ = ["NodeFiles", "node_files", "format_node_files", "FORMATS"]

FORMATS = ("list", "rsync", "include", "sbcast", "json")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


@dataclass(frozen=True)
class NodeFiles:
    """The files one node needs: its ranks' shards + the model's small metadata files."""

    node: int
    ranks: tuple[int, ...]
    shards: tuple[str, ...]          # in file order
    shard_bytes: tuple[int, ...]     # size of each shard on disk (what a copy moves)
    metadata: tuple[str, ...]        # config.json, the index, tokenizer files...
    read_bytes: int                  # planned bytes the node's ranks read from those shards

    @property
    def copy_bytes(self) -> int:
        return sum(self.shard_bytes)

    def all_files(self) -> tuple[str, ...]:
        return self.metadata + self.shards

    def to_json(self) -> dict:
        return {"node": self.node, "ranks": list(self.ranks),
                "files": [{"file": f, "bytes": b} for f, b in zip(self.shards, self.shard_bytes)],
                "metadata": list(self.metadata), "copy_bytes": self.copy_bytes,
                "read_bytes": self.read_bytes}


def node_files(model_dir: os.PathLike | str, pp: int, tp: int = 1, ep: int = 1, *,
               partition: Partition = "even", ranks_per_node: Optional[int] = None,
               nodes: Optional[int] = None, **read_options: Any
               ) -> tuple[list[NodeFiles], tuple[int, ...]]:
    """Per node (ranks ``[k * K, (k + 1) * K)``, K = ``ranks_per_node``, as torchrun and Slurm
    place them), the files it needs; also the stage layer counts (give them to ``load
    --partition`` on a stage-only node: ``balanced`` must read every shard's header).
    ``read_options`` (``range_cost_bytes``, ``exchange_cost``...) go to ``plan_all``, so the
    bytes are those ``load`` reads with the same options."""
    world = pp * tp * ep
    if nodes is not None and ranks_per_node is not None:
        raise TopologyError("give --nodes or --ranks-per-node, not both")
    if nodes is not None:
        if nodes < 1 or world % nodes:
            raise TopologyError(f"{world} ranks (pp {pp} x ep {ep} x tp {tp}) do not split "
                                f"evenly over {nodes} nodes")
        ranks_per_node = world // nodes
    per_node = ranks_per_node or 1
    if per_node < 1 or world % per_node:
        raise TopologyError(f"--ranks-per-node {per_node} does not divide the {world} ranks "
                            f"(pp {pp} x ep {ep} x tp {tp}): give a divisor of {world}, or "
                            "--nodes")
    spec, index = load_spec(model_dir), open_checkpoint(model_dir)
    plans: list[RankPlan] = plan_all(spec, index, pp, tp, ep, partition=partition,
                                     **read_options)
    windows = {p.window.pp_rank: p.window for p in plans}
    if index.storage is not None:  # an object store: names and sizes from one listing
        objects = index.storage.list()
        names: list[str] = list(objects)
        size_of: Callable[[str], int] = lambda f: objects[f].size  # noqa: E731
    else:
        root = Path(model_dir)
        names = [p.name for p in root.iterdir() if p.is_file()]
        size_of = lambda f: Path(index.paths[f]).stat().st_size  # noqa: E731
    metadata = tuple(sorted(n for n in names if not n.endswith(_WEIGHT_SUFFIXES)
                            and not n.startswith(".")))
    if INDEX_NAME not in metadata and INDEX_NAME in names:
        metadata += (INDEX_NAME,)
    order = {f: i for i, f in enumerate(sorted(index.paths))}
    out = []
    for node, start in enumerate(range(0, world, per_node)):
        group = plans[start:start + per_node]
        shards = sorted({f for p in group for f in p.files}, key=order.__getitem__)
        out.append(NodeFiles(node, tuple(p.topology.rank for p in group), tuple(shards),
                             tuple(map(size_of, shards)), metadata,
                             sum(p.planned_read_bytes for p in group)))
    return out, tuple(windows[stage].num_layers for stage in range(pp))


def format_node_files(found: Sequence[NodeFiles], fmt: str, *, model: str = "",
                      layers: Sequence[int] = (), node: Optional[int] = None) -> str:
    """Text for ``pploader files --format``; ``node`` keeps one node's files only."""
    chosen = [n for n in found if node is None or n.node == node]
    if node is not None and not chosen:
        raise TopologyError(f"node {node} does not exist: the layout has {len(found)} node(s)")
    if fmt == "json":
        return json.dumps({"model": model, "partition": list(layers),
                           "nodes": [n.to_json() for n in chosen]}, indent=1)
    lines: list[str] = []
    for n in chosen:
        if fmt in ("list", "rsync", "include") and node is None:
            lines.append(f"# node {n.node}: ranks {n.ranks[0]}-{n.ranks[-1]}, {len(n.shards)} "
                         f"shard(s), {n.copy_bytes / 1e9:.2f} GB to copy, "
                         f"{n.read_bytes / 1e9:.2f} GB read")
        if fmt in ("list", "rsync"):  # rsync: a --files-from list (relative paths)
            lines.extend(n.all_files())
        elif fmt == "include":  # a download tool's include patterns
            lines.append(" ".join(f"--include '{f}'" for f in n.all_files()))
        elif fmt == "sbcast":  # copy commands (sbcast reaches every node of the allocation)
            lines.extend(f"sbcast --force {model}/{f} ${{DEST:?}}/{f}" for f in n.all_files())
        else:
            raise TopologyError(f"unknown format {fmt!r}; known: {', '.join(FORMATS)}")
    return "\n".join(lines)
