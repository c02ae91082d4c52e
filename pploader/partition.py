"""StageWindow: which decoder layers each PP rank owns (even, explicit or balanced)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .errors import PlanError

__all__ = ["StageWindow", "even_windows", "explicit_windows", "balanced_windows",
           "parse_partition", "windows_from_sizes", "stage_costs"]


@dataclass(frozen=True)
class StageWindow:
    """Layers ``[start_layer, end_layer)`` of one stage, plus its global tensors."""

    pp_rank: int
    start_layer: int
    end_layer: int
    has_embed: bool
    has_head: bool

    @property
    def num_layers(self) -> int:
        return self.end_layer - self.start_layer

    def owns(self, layer: int) -> bool:
        return self.start_layer <= layer < self.end_layer


def windows_from_sizes(sizes: Sequence[int]) -> tuple[StageWindow, ...]:
    out, start = [], 0
    for i, n in enumerate(sizes):
        out.append(StageWindow(i, start, start + n, i == 0, i == len(sizes) - 1))
        start += n
    return tuple(out)


def even_windows(num_layers: int, pp: int) -> tuple[StageWindow, ...]:
    """Even split. The remainder goes one layer each to the middle stages, from the
    second-to-last backwards, then to stage 0, then to the last stage: the first and last
    stages already carry the embedding and the head."""
    if pp < 1 or pp > num_layers:
        raise PlanError(f"cannot split {num_layers} layers into {pp} stages "
                        f"(each stage needs at least one layer): use --pp {num_layers} or fewer")
    sizes = [num_layers // pp] * pp
    order = list(range(pp - 2, 0, -1)) + [0, pp - 1] if pp > 1 else [0]
    for i in order[: num_layers % pp]:
        sizes[i] += 1
    return windows_from_sizes(sizes)


def parse_partition(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        raise PlanError(f"--partition must be comma-separated layer counts, got {text!r}") from None
    return sizes


def explicit_windows(sizes: Sequence[int], num_layers: int, pp: int) -> tuple[StageWindow, ...]:
    if len(sizes) != pp:
        raise PlanError(f"partition {list(sizes)} has {len(sizes)} stages but pp is {pp}: give "
                        f"{pp} layer counts, or --pp {len(sizes)}")
    if any(n < 1 for n in sizes):
        raise PlanError(f"partition {list(sizes)}: every stage needs at least one layer; give "
                        "counts of 1 or more")
    if sum(sizes) != num_layers:
        raise PlanError(f"partition {list(sizes)} sums to {sum(sizes)} but the model has "
                        f"{num_layers} layers: give counts that sum to {num_layers}, or "
                        "--partition even")
    return windows_from_sizes(sizes)


def balanced_windows(layer_costs: Sequence[float], pp: int, *, first_extra: float = 0.0,
                     last_extra: float = 0.0) -> tuple[StageWindow, ...]:
    """Contiguous split minimising the largest stage cost (exact DP, O(pp * L^2)).

    Costs are usually weight bytes per layer (+ cache bytes at a target load); the first
    stage also pays ``first_extra`` (embedding), the last ``last_extra`` (norm + head).
    Ties prefer the split closest to even.
    """
    n = len(layer_costs)
    if pp < 1 or pp > n:
        raise PlanError(f"cannot split {n} layers into {pp} stages: use --pp {n} or fewer")
    prefix = [0.0]
    for c in layer_costs:
        prefix.append(prefix[-1] + float(c))

    def cost(stage: int, a: int, b: int) -> float:
        extra = (first_extra if stage == 0 else 0.0) + (last_extra if stage == pp - 1 else 0.0)
        return prefix[b] - prefix[a] + extra

    inf = float("inf")
    # best[s][j]: (max cost, deviation from even) splitting the first j layers into s stages
    best = [[(inf, inf)] * (n + 1) for _ in range(pp + 1)]
    cut = [[0] * (n + 1) for _ in range(pp + 1)]
    best[0][0] = (0.0, 0.0)
    target = n / pp
    for s in range(1, pp + 1):
        for j in range(s, n - (pp - s) + 1):
            for i in range(s - 1, j):
                prev = best[s - 1][i]
                if prev[0] == inf:
                    continue
                cand = (max(prev[0], cost(s - 1, i, j)), prev[1] + abs((j - i) - target))
                if cand < best[s][j]:
                    best[s][j], cut[s][j] = cand, i
    sizes, j = [], n
    for s in range(pp, 0, -1):
        i = cut[s][j]
        sizes.append(j - i)
        j = i
    return windows_from_sizes(sizes[::-1])


def stage_costs(windows: Sequence[StageWindow], layer_costs: Sequence[float], *,
                first_extra: float = 0.0, last_extra: float = 0.0) -> list[float]:
    """Each stage's cost under ``windows`` (what ``balanced_windows`` minimises the max of);
    compare ``max / mean`` of even and balanced windows with it."""
    return [float(sum(layer_costs[w.start_layer:w.end_layer]))
            + (first_extra if w.has_embed else 0.0) + (last_extra if w.has_head else 0.0)
            for w in windows]
