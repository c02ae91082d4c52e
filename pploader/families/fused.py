"""Fused and stacked module parameters, declared as data (vLLM's ``stacked_params_mapping``).

A serving stack often keeps q/k/v in one ``qkv_proj``, gate/up in one ``gate_up_proj`` and all
of a layer's experts in stacked ``w13`` / ``w2`` tensors, while checkpoints store the pieces
separately. A family lists its fusions in ``Family.fused_targets``; ``pploader.bind.place`` writes
each piece straight into its slice of the fused destination (no concatenation buffer).

Templates are layer-relative component names. ``{e}`` matches an expert id; any other
``{name}`` matches one name segment (no dots) and carries over to the target. When ``{e}``
appears in the parts but not in the target, the target is *stacked*: local expert ``e`` lands
at index ``e - first_local_expert`` of its leading dim. A one-part fusion is a rename: a tensor
stored already fused (3-D experts) fills the whole target. Families declare theirs with the
helpers below (``qkv``, ``gate_up``, ``expert_fusions``, ``stacked_renames``); docs/families.md
lists them per family.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

__all__ = ["FusedTarget", "FusedMatch", "QKV", "GATE_UP", "qkv", "gate_up", "expert_fusions",
           "stacked_renames", "match_fused"]

_FIELD = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


@dataclass(frozen=True)
class FusedTarget:
    """Checkpoint components whose pieces sit one after another along ``dim`` of ``target``.

    ``parts`` are in slice order; every piece is taken as the rank holds it (already TP- or
    EP-sliced), so offsets follow the plan's shapes, e.g. local q, then local k, then local v.
    ``dim`` is a dim of the piece (of one expert's piece for stacked targets).
    """

    target: str
    parts: tuple[str, ...]
    dim: int = 0

    def __post_init__(self) -> None:
        if not self.parts:
            raise ValueError(f"fused target {self.target!r} declares no parts")
        names = [set(_FIELD.findall(p)) for p in self.parts]
        if any(n != names[0] for n in names):
            raise ValueError(f"parts of {self.target!r} use different placeholders: {self.parts}")
        if not set(_FIELD.findall(self.target)) <= names[0]:
            raise ValueError(f"target {self.target!r} uses a placeholder its parts lack")

    @property
    def stacked(self) -> bool:
        """True when per-expert pieces stack on a new leading dim of the target."""
        return "{e}" in self.parts[0] and "{e}" not in self.target

    def part_name(self, index: int, values: dict[str, str]) -> str:
        """Component name of part ``index`` for placeholder ``values`` (for messages)."""
        return self.parts[index].format(**values)

    def target_name(self, values: dict[str, str]) -> str:
        return self.target.format(**values)


@dataclass(frozen=True)
class FusedMatch:
    """A component recognised as part ``part`` of ``fusion`` with placeholder ``values``."""

    fusion: FusedTarget
    part: int
    values: tuple[tuple[str, str], ...]

    @property
    def expert(self) -> Optional[int]:
        return int(dict(self.values)["e"]) if self.fusion.stacked else None

    @property
    def target(self) -> str:
        return self.fusion.target_name(dict(self.values))

    @property
    def group(self) -> tuple[str, tuple[tuple[str, str], ...]]:
        """Pieces with the same group fill one fused tensor (one expert's row if stacked)."""
        return (self.fusion.target, self.values)


@lru_cache(maxsize=None)
def _regex(template: str) -> "re.Pattern[str]":
    out, pos = [], 0
    for m in _FIELD.finditer(template):
        out.append(re.escape(template[pos:m.start()]))
        name = m.group(1)
        out.append(rf"(?P<{name}>\d+)" if name == "e" else rf"(?P<{name}>[^.]+)")
        pos = m.end()
    out.append(re.escape(template[pos:]))
    return re.compile("".join(out))


def match_fused(fusions: tuple[FusedTarget, ...], component: str) -> Optional[FusedMatch]:
    """The first fusion part that fully matches ``component`` (None = not fused)."""
    for fusion in fusions:
        for i, part in enumerate(fusion.parts):
            m = _regex(part).fullmatch(component)
            if m is not None:
                return FusedMatch(fusion, i, tuple(sorted(m.groupdict().items())))
    return None


def qkv(prefix: str = "self_attn.") -> FusedTarget:
    """q/k/v projections (weights, biases, per-tensor scales) -> one ``{prefix}qkv_proj``
    (vLLM QKVParallelLinear layout: local q, then local k, then local v on dim 0)."""
    return FusedTarget(prefix + "qkv_proj.{p}",
                       tuple(f"{prefix}{n}_proj.{{p}}" for n in ("q", "k", "v")))


def gate_up(prefix: str = "mlp.", gate: str = "gate_proj", up: str = "up_proj",
            target: str = "gate_up_proj") -> FusedTarget:
    """A gated MLP's gate and up projections -> one ``{prefix}gate_up_proj`` (vLLM
    MergedColumnParallelLinear layout: local gate rows, then local up rows)."""
    return FusedTarget(f"{prefix}{target}.{{p}}", (f"{prefix}{gate}.{{p}}", f"{prefix}{up}.{{p}}"))


#: q/k/v projections (weights and biases) -> one ``qkv_proj`` (vLLM QKVParallelLinear layout).
QKV = qkv()

#: gate/up projections -> one ``gate_up_proj`` (vLLM MergedColumnParallelLinear layout).
GATE_UP = gate_up()


def expert_fusions(prefix: str = "mlp.experts.", gate: Optional[str] = "gate_proj",
                   up: str = "up_proj", down: str = "down_proj"
                   ) -> tuple[FusedTarget, FusedTarget]:
    """Per-expert gate/up -> stacked ``w13_weight`` [E_local, 2I, H]; down -> ``w2_weight``
    [E_local, H, I] (vLLM FusedMoE naming). ``gate=None``: ungated experts (NemotronH), whose
    ``w13_weight`` [E_local, I, H] holds the up projection alone (vLLM maps it to w1)."""
    parts = ((gate,) if gate else ()) + (up,)
    return (FusedTarget(prefix + "w13_weight",
                        tuple(f"{prefix}{{e}}.{name}.weight" for name in parts)),
            FusedTarget(prefix + "w2_weight", (prefix + "{e}." + down + ".weight",)))


def stacked_renames(gate_up_source: str, down_source: str, prefix: str = "mlp.experts."
                    ) -> tuple[FusedTarget, FusedTarget]:
    """Experts already stacked on disk (3-D [E, 2I, H] = [gate; up] on dim 1, and [E, H, I]):
    the same layout as ``w13_weight`` / ``w2_weight``, so each is a one-part fusion (a rename)
    whose local piece (this rank's experts and TP slice) fills the whole target."""
    return (FusedTarget(prefix + "w13_weight", (gate_up_source,)),
            FusedTarget(prefix + "w2_weight", (down_source,)))
