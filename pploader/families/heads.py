"""Whether attention heads split over a TP size the way serving engines require.

Query heads must divide by TP (each rank owns whole heads, none replicated); KV heads either
divide by TP or, when fewer than TP, TP divides by them (each KV head replicated on
``tp / kv_heads`` ranks). The shard rules alone would replicate query heads when there are
fewer than TP ranks, which no engine runs; this check refuses it with a message about heads.
"""
from __future__ import annotations


from ..errors import PlanError
from .base import SpecView


__all__ = ["check_tp_heads", "ATTENTION_KINDS", "unit_share", "ceil_share", "UnitSplitError"]


class UnitSplitError(ValueError):
    """Whole units (heads, groups) that a TP size cannot share: ``reason`` says which way."""

    def __init__(self, units: int, tp_size: int, reason: str) -> None:
        super().__init__(f"{units} units {reason} over tp={tp_size}")
        self.units, self.tp_size, self.reason = units, tp_size, reason


def unit_share(units: int, tp_size: int, tp_rank: int = 0) -> tuple[int, int]:
    """``(first, count)`` of the whole units (heads, groups) TP rank ``tp_rank`` holds, by the
    engines' rule, the one place it is coded (weights: planning/shard.py; cache sizes:
    cache/geometry.py; heads: :func:`check_tp_heads`): an even split when there are at least
    ``tp_size`` units, else one unit replicated on ``tp_size / units`` consecutive ranks.
    Raises :class:`UnitSplitError` (``reason`` "do not divide" / "cannot be replicated
    evenly") otherwise."""
    if units >= tp_size:
        if units % tp_size:
            raise UnitSplitError(units, tp_size, "do not divide")
        per = units // tp_size
        return tp_rank * per, per
    if units <= 0 or tp_size % units:
        raise UnitSplitError(units, tp_size, "cannot be replicated evenly")
    return tp_rank * units // tp_size, 1


def ceil_share(units: int, tp_size: int, tp_rank: int = 0) -> tuple[int, int]:
    """``(first, count)`` of the units TP rank ``tp_rank`` holds under the engines' uneven
    split, for the tensors an engine splits that way (``ShardRule.ceil``): ``ceil(units /
    tp)`` units a rank, the last ranks fewer, possibly none. vLLM's gpt-oss MXFP4 loader
    (``_load_weights_mxfp4``): ``cdiv(intermediate_size // 32, tp)`` blocks a rank, rank r
    from ``r * per`` to ``min((r + 1) * per, blocks)`` (90 blocks over 8: 12 x 7 + 6); the
    engine pads its own parameter to ``per``, so a rank's bytes are only its blocks."""
    if units <= 0 or tp_size <= 0 or not 0 <= tp_rank < tp_size:
        raise UnitSplitError(units, tp_size, "cannot be split")
    per = -(-units // tp_size)
    first = min(tp_rank * per, units)
    return first, min(per, units - first)

#: layer kinds with query / key-value heads split over TP (MLA: query heads only)
ATTENTION_KINDS = ("full_attention", "sliding_attention", "chunked_attention",
                   "hybrid_attention_mamba2", "mla")


def check_tp_heads(spec: SpecView, tp_size: int) -> None:
    """Raise PlanError when ``tp_size`` cannot split the model's attention heads."""
    if tp_size <= 1:
        return
    kinds = set(spec.layer_kinds)
    if not kinds & set(ATTENTION_KINDS) or spec.config.get("num_attention_heads") is None:
        return
    q = spec.num_heads
    if q % tp_size:
        divisors = [d for d in range(1, q + 1) if q % d == 0]
        raise PlanError(f"--tp {tp_size} does not divide the {q} query heads "
                        f"(num_attention_heads): engines give every TP rank whole heads; "
                        f"use --tp in {divisors}", file="config.json")
    if kinds & (set(ATTENTION_KINDS) - {"mla"}):  # MLA splits query heads only
        kv = spec.num_kv_heads
        try:
            unit_share(kv, tp_size)
        except UnitSplitError:
            raise PlanError(f"--tp {tp_size} and the {kv} KV heads (num_key_value_heads): KV heads "
                            "must divide by TP, or TP by them (each then replicated); use a TP "
                            f"that divides {q} and is a divisor or multiple of {kv}",
                            file="config.json") from None
