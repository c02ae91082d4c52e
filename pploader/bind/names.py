"""Checkpoint names <-> module names: a prefix swap plus ordered prefix / substring / suffix
rules (what vLLM's ``WeightsMapper`` does for its models), invertible where it must be.

``load_stage_into``, ``reload_from_disk`` and ``load_layerwise`` map every checkpoint name
with ``to_module``; ``to_checkpoint`` goes back, to tell which stage a module tensor
belongs to. A rule whose ``new`` is ``None`` drops the names it matches (never read, never
reported unexpected).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping, Optional, TypeVar

__all__ = ["NameRule", "NameMap", "RULE_KINDS"]

T = TypeVar("T")

#: Where a rule matches: at the start, anywhere (first occurrence), at the end.
RULE_KINDS = ("prefix", "substr", "suffix")


@dataclass(frozen=True)
class NameRule:
    """Replace ``old`` by ``new`` where ``kind`` says (``new=None``: drop the name)."""

    kind: str
    old: str
    new: Optional[str]

    def __post_init__(self) -> None:
        if self.kind not in RULE_KINDS:
            raise ValueError(f"NameRule kind {self.kind!r}: use one of {', '.join(RULE_KINDS)}")
        if not self.old:
            raise ValueError(f"NameRule({self.kind!r}, '', ...): the matched text is empty")

    def matches(self, name: str) -> bool:
        if self.kind == "prefix":
            return name.startswith(self.old)
        if self.kind == "suffix":
            return name.endswith(self.old)
        return self.old in name

    def apply(self, name: str) -> Optional[str]:
        """``name`` rewritten (unchanged when the rule does not match; None: dropped)."""
        if not self.matches(name):
            return name
        if self.new is None:
            return None
        return _swap(self.kind, name, self.old, self.new)

    def invert(self, name: str) -> str:
        """The name this rule would have rewritten into ``name`` (best effort; the caller
        checks the round trip)."""
        if self.new is None or not _has(self.kind, name, self.new):
            return name
        return _swap(self.kind, name, self.new, self.old)


def _has(kind: str, name: str, text: str) -> bool:
    if kind == "prefix":
        return name.startswith(text)
    if kind == "suffix":
        return name.endswith(text)
    return text in name


def _swap(kind: str, name: str, old: str, new: str) -> str:
    if kind == "prefix":
        return new + name[len(old):]
    if kind == "suffix":
        return name[: len(name) - len(old)] + new
    return name.replace(old, new, 1)


@dataclass(frozen=True)
class NameMap:
    """Checkpoint names -> module names.

    ``checkpoint_prefix`` is swapped for ``module_prefix`` first (``NameMap("model.", "")`` for
    a bare ``LlamaModel``; a name without the prefix has no module tensor), then every rule
    of ``rules`` in order, each rewriting the name it matches once. Build rules with
    :meth:`of` (vLLM ``WeightsMapper`` style dicts) or pass :class:`NameRule` values.
    """

    checkpoint_prefix: str = ""
    module_prefix: str = ""
    rules: tuple[NameRule, ...] = ()

    @classmethod
    def of(cls, *, substr: Optional[Mapping[str, Optional[str]]] = None,
           prefix: Optional[Mapping[str, Optional[str]]] = None,
           suffix: Optional[Mapping[str, Optional[str]]] = None) -> "NameMap":
        """Rules from ``{old: new}`` dicts, applied substrings first, then prefixes, then
        suffixes, each dict in its order (as vLLM's ``WeightsMapper`` applies them)."""
        rules = [NameRule(kind, old, new) for kind, table in
                 (("substr", substr or {}), ("prefix", prefix or {}), ("suffix", suffix or {}))
                 for old, new in table.items()]
        return cls(rules=tuple(rules))

    def _forward(self, name: str) -> tuple[Optional[str], bool]:
        """(module name or None, whether a drop rule removed it)."""
        if not name.startswith(self.checkpoint_prefix):
            return None, False
        out = self.module_prefix + name[len(self.checkpoint_prefix):]
        for rule in self.rules:
            mapped = rule.apply(out)
            if mapped is None:
                return None, True
            out = mapped
        return out, False

    def to_module(self, name: str) -> Optional[str]:
        """The module name of checkpoint tensor ``name`` (None: no module tensor / dropped)."""
        return self._forward(name)[0]

    def drops(self, name: str) -> bool:
        """Whether a rule with ``new=None`` removes checkpoint name ``name``."""
        return self._forward(name)[1]

    def to_checkpoint(self, name: str) -> Optional[str]:
        """The checkpoint name that maps to module name ``name`` (None when none does).

        Rules are undone last to first; a rule that may or may not have fired gives two
        candidates, and the one whose forward mapping is ``name`` wins."""
        candidates = [name]
        for rule in reversed(self.rules):
            candidates = list(dict.fromkeys(c for cand in candidates
                                            for c in (rule.invert(cand), cand)))[:64]
        for cand in candidates:
            if cand.startswith(self.module_prefix):
                ck = self.checkpoint_prefix + cand[len(self.module_prefix):]
                if self.to_module(ck) == name:
                    return ck
        return None

    def apply(self, weights: Iterable[tuple[str, T]]) -> Iterator[tuple[str, T]]:
        """Rename a ``(checkpoint name, tensor)`` stream to module names; names with no
        module name (dropped, or outside ``checkpoint_prefix``) are left out."""
        for name, tensor in weights:
            mapped = self.to_module(name)
            if mapped is not None:
                yield mapped, tensor
