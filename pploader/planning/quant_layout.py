"""How a quantized weight is stored, as data: the stored weight and its companions, each a
list of stored dims that run along the logical weight's outputs or inputs.

Families' templates and TP rules speak of the *logical* weight ``[..., N, K]`` (N outputs,
K inputs; leading dims = stacked experts). A scheme stores it as tensors whose trailing dims
each follow one logical dim with a ``block`` of logical values per stored entry: a pack of
int4 values in an int32 (8), a scale group (128), an FP8 scale block, or one entry for the
whole dim. AWQ stores ``qweight [K, N/8]`` (transposed, packed on the outputs), GPTQ
``qweight [K/8, N]`` (packed on the inputs), compressed-tensors ``weight_packed [N, K/8]``.

Sharding follows the weight: the TP selection is computed on the logical shape, then mapped
to each stored tensor dim by dim (intervals / block; leading expert dims pass through; a
dim with one entry, or marked unsplit, is replicated). A split that cuts a block, a packed
word or a scale group is a PlanError naming tensor, shape, dim, tp and block: the engines
refuse such a TP size too (vLLM: "the input size is not aligned with the quantized weight
shape"; output sizes not a multiple of the pack factor).
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, replace
from typing import Callable, Optional

from ..errors import PlanError
from ..families.base import QuantNaming
from .shard import Interval, Selection

__all__ = ["Axis", "Companion", "QuantScheme", "blocks", "OUT", "IN"]

OUT, IN = 0, 1  # the logical weight's dims: outputs (N, rows) and inputs (K, columns)


@dataclass(frozen=True)
class Axis:
    """One stored dim: it runs along logical dim ``of`` (OUT / IN), one entry per ``block``
    logical values (None: one entry for the whole dim, replicated). ``split`` False: every
    TP rank holds the whole dim, after checking that the split keeps whole blocks (GPTQ's
    and compressed-tensors' act-order scales on row-parallel layers: vLLM's
    ``marlin_repeat_scales_on_all_ranks``)."""

    of: int
    block: Optional[int] = 1
    split: bool = True


def blocks(rows: Optional[int], cols: Optional[int]) -> tuple[Axis, Axis]:
    """``[N / rows, K / cols]``: a tensor laid out like the weight, one entry per block."""
    return (Axis(OUT, rows), Axis(IN, cols))


PLAIN = blocks(1, 1)  # a weight stored as is: [N, K]


@dataclass(frozen=True)
class Companion:
    """A stored tensor of a quantized weight (the weight itself, its scales, zero points,
    group indices...): ``axes`` its trailing dims (None: a scalar per weight, per expert of
    a stacked one), then ``tail`` fixed dims held whole (compressed-tensors' ``weight_shape``
    [2])."""

    suffix: str
    dtype: str
    axes: Optional[tuple[Axis, ...]] = None
    tail: tuple[int, ...] = ()

    def shape(self, logical: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of this tensor for a weight of logical shape ``[..., N, K]``."""
        lead = tuple(logical[:-2])
        if self.axes is None:
            return lead + self.tail
        return lead + tuple(1 if a.block is None else -(-logical[len(lead) + a.of] // a.block)
                            for a in self.axes) + self.tail


@dataclass(frozen=True)
class QuantScheme:
    """One quantization method as data: the stored weight (its suffix, dtype and packing)
    and its companions. ``naming`` is the family's companion naming with the stored
    weight's suffix (``quant.quant_scheme`` sets it): names are never cut here."""

    name: str                          # "fp8-block", "awq", "gptq", "wna16", "nvfp4"...
    weight: Companion                  # the quantized weight as stored (suffix "weight",
    companions: tuple[Companion, ...]  # "qweight", "weight_packed"; dtype; axes)
    ignore: tuple[str, ...] = ()       # config's modules kept unquantized (names, globs, re:)
    naming: QuantNaming = QuantNaming()

    @property
    def weight_dtype(self) -> str:
        return self.weight.dtype

    @property
    def weight_dtypes(self) -> frozenset[str]:
        """Every stored dtype a quantized weight of this scheme may have."""
        return frozenset((self.weight.dtype,))

    #: True for per-weight schemes (compressed-tensors config groups, planning/quant_groups.py)
    mixed = False

    # ---- per weight (one scheme here; planning/quant_groups.py resolves several) ---------
    def resolve(self, name: str) -> "Optional[QuantScheme]":
        """The scheme of the weight (or companion) ``name``: this one."""
        return self

    def naming_of(self, weight: str) -> QuantNaming:
        """The naming of stored weight ``weight``'s companions."""
        return self.naming

    def stored_scheme(self, name: str, ndim: int,
                      dtype_of: Callable[[str], Optional[str]]) -> "Optional[QuantScheme]":
        """The scheme logical weight ``name`` is stored under (None: stored plain), from the
        stored dtype of each name (``dtype_of``; None when absent)."""
        stored = self.naming.stored(name)
        return self if self.is_quantized(stored, dtype_of(stored), ndim) else None

    def with_naming(self, family: QuantNaming) -> "QuantScheme":
        """This scheme with the family's companion naming, its weight stored under the
        scheme's suffix."""
        naming = family if self.weight.suffix == "weight" else replace(
            family, weight=self.weight.suffix, logical=family.weight)
        return self if self.naming == naming else replace(self, naming=naming)

    # ---- names ---------------------------------------------------------------------------
    def companion_names(self, weight: str) -> dict[str, Companion]:
        """``{name: companion}`` of a quantized weight stored as ``weight`` (none when the
        family stores them elsewhere: ``QuantNaming.external``)."""
        if not self.naming.has_companions(weight):
            return {}
        return {self.naming.companion(weight, c.suffix): c for c in self.companions}

    def weight_of(self, name: str, exists: Optional[Callable[[str], bool]] = None
                  ) -> Optional[tuple[str, Companion]]:
        """``(stored weight name, companion)`` when ``name`` is a companion's name, else None
        (``exists``: which stored weights the checkpoint holds, for schemes that differ per
        weight; unused here)."""
        found = self.naming.weight_of(name, [c.suffix for c in self.companions])
        if found is None:
            return None
        return found[0], next(c for c in self.companions if c.suffix == found[1])

    def is_quantized(self, name: str, dtype: Optional[str], ndim: int) -> bool:
        """A stored weight (named like one, >= 2 dims) in the scheme's dtype."""
        return dtype == self.weight.dtype and ndim >= 2 and self.naming.is_weight(name)

    def ignored(self, name: str) -> bool:
        """True when the config's ignore list names the module of weight ``name`` (logical
        or stored name)."""
        module = self.naming.module_of(name)
        for pat in self.ignore:
            if pat.startswith("re:"):
                if re.fullmatch(pat[3:], module) or re.fullmatch(pat[3:], name):
                    return True
            elif any(ch in pat for ch in "*?["):
                if fnmatch.fnmatchcase(module, pat) or fnmatch.fnmatchcase(name, pat):
                    return True
            elif module == pat or module.endswith("." + pat) or name == pat:
                return True
        return False

    # ---- shapes --------------------------------------------------------------------------
    def logical_shape(self, stored: tuple[int, ...]) -> tuple[int, ...]:
        """``[..., N, K]`` of a weight stored with shape ``stored``."""
        axes = self.weight.axes or PLAIN
        lead = len(stored) - len(axes)
        out = [0, 0]
        for a, n in zip(axes, stored[lead:]):
            out[a.of] = n * (a.block or 1)
        return tuple(stored[:lead]) + tuple(out)

    def stored_shape(self, logical: tuple[int, ...], name: str = "") -> tuple[int, ...]:
        """The stored weight's shape for logical ``[..., N, K]`` (every pack whole)."""
        for a in self.weight.axes or PLAIN:
            size = logical[len(logical) - 2 + a.of]
            if a.block and size % a.block:
                raise PlanError(f"{self.name}: {('outputs', 'inputs')[a.of]} {size} of "
                                f"{list(logical)} are not a multiple of the packing ({a.block} "
                                "values per stored element)", tensor=name)
        return self.weight.shape(logical)

    # ---- selections ----------------------------------------------------------------------
    def weight_selection(self, sel: Selection, logical: tuple[int, ...], name: str,
                         tp_size: int) -> Selection:
        """The stored weight's selection for a logical selection (checks every companion's
        blocks too: a split that cuts a scale group is refused on the weight)."""
        for c in self.companions:
            self.companion_selection(c, sel, logical, name, tp_size)
        stored = list(self.weight.shape(logical))
        return self.companion_selection(self.weight, sel, logical, name, tp_size,
                                        f"a packed word of {self.weight.suffix} {stored}")

    def companion_selection(self, c: Companion, sel: Selection, logical: tuple[int, ...],
                            name: str, tp_size: int, what: str = "") -> Selection:
        """The selection of stored tensor ``c`` matching the weight's logical ``sel``."""
        lead = len(logical) - 2
        dims = [(d, iv) for d, iv in sel.dims if d < lead]  # expert dims pass through
        pad = sel.pad_rows if lead > 0 else 0  # a padded leading dim passes through too
        logical_dims = dict(sel.dims)
        for at, a in enumerate(c.axes or ()):
            intervals = logical_dims.get(lead + a.of)
            if intervals is None or a.block is None:
                continue  # whole dim / one entry for it: replicated along it
            where = what or f"the {a.block}-element blocks of {c.suffix} {list(c.shape(logical))}"
            mapped = tuple(_blockwise(intervals, logical[lead + a.of], a.block, self, name,
                                      logical, lead + a.of, tp_size, where))
            if not a.split:
                continue  # checked, then held whole (act-order scales)
            dims.append((lead + at, mapped))
            if a.of == OUT and lead == 0 and sel.pad_rows:
                if at != 0:
                    raise PlanError(f"a padded (vocabulary) split of {self.name} weight "
                                    f"{list(logical)}, stored transposed as {c.suffix} "
                                    f"{list(c.shape(logical))}, is not supported (tp={tp_size})",
                                    tensor=name)
                rows = sum(n for _, n in intervals)  # padded rows: whole padded blocks
                pad = -(-(rows + sel.pad_rows) // a.block) - -(-rows // a.block)
        return Selection(tuple(sorted(dims)), pad)


def _blockwise(intervals: tuple[Interval, ...], size: int, block: int, scheme: QuantScheme,
               name: str, logical: tuple[int, ...], dim: int, tp_size: int,
               what: str) -> list[Interval]:
    """Intervals in units of ``block``; an interval must start on a block boundary and end on
    one (or at the end of the dim, where the last block may be partial)."""
    out = []
    side = ("outputs", "inputs")[dim - len(logical) + 2] if dim >= len(logical) - 2 else "experts"
    for start, n in intervals:
        if start % block or (n % block and start + n != size):
            raise PlanError(
                f"TP split cuts a quantization block: shape {list(logical)} split on dim {dim} "
                f"({side}) over tp={tp_size} gives a rank the slice [{start}, {start + n}), "
                f"which cuts {what} (block {block}, {scheme.name}); use a tp whose slices are "
                f"multiples of {block}", tensor=name)
        out.append((start // block, -(-n // block)))
    return out
