"""StageWindow: which decoder layers each PP rank owns (even, explicit, balanced, or exactly
the split a serving engine makes: vLLM's or SGLang's)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

from ..errors import PlanError

__all__ = ["StageWindow", "even_windows", "explicit_windows", "balanced_windows",
           "parse_partition", "windows_from_sizes", "stage_costs", "ENGINES",
           "ENGINE_PARTITION_ENV", "EngineSplit", "engine_layer_counts", "engine_windows",
           "get_pp_indices", "check_engine_window"]


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


# ---- the engines' own splits --------------------------------------------------------------

#: Engines whose layer split pploader reproduces exactly.
ENGINES = ("vllm", "sglang")

#: The variable each engine reads for an explicit split ("4,4,5,3"). Library code never reads
#: it: the CLI (or your launcher) passes its text as ``layer_partition``.
ENGINE_PARTITION_ENV = {"vllm": "VLLM_PP_LAYER_PARTITION", "sglang": "SGLANG_PP_LAYER_PARTITION"}


@dataclass(frozen=True)
class EngineSplit:
    """A ``partition`` value: the windows ``engine`` gives its stages, from its default formula
    or, when ``layer_partition`` is set, from that text (the engine's partition variable)."""

    engine: str
    layer_partition: Optional[str] = None

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise PlanError(f"unknown engine {self.engine!r}: use one of {', '.join(ENGINES)}")

    def __str__(self) -> str:
        if self.layer_partition is None:
            return self.engine
        return f"{self.engine} ({ENGINE_PARTITION_ENV[self.engine]}={self.layer_partition})"


def _engine_partition_counts(engine: str, text: str, num_layers: int, pp: int) -> list[int]:
    """Layer counts from an engine partition variable's text, checked as the engine checks
    it (count = pp, sum = layers); negative counts are refused too."""
    var = ENGINE_PARTITION_ENV[engine]
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise PlanError(f"{var}={text!r}: expected comma-separated layer counts "
                        "such as 8,8,9,7") from None
    if len(counts) != pp:
        raise PlanError(f"{var}={text!r} has {len(counts)} stages but pp is {pp}")
    if any(n < 0 for n in counts):
        raise PlanError(f"{var}={text!r}: a stage cannot have a negative layer count")
    if sum(counts) != num_layers:
        raise PlanError(f"{var}={text!r} sums to {sum(counts)} but the model has "
                        f"{num_layers} layers")
    return counts


def engine_layer_counts(engine: str, num_layers: int, pp: int,
                        layer_partition: Optional[str] = None) -> list[int]:
    """Layers per stage as ``engine`` splits ``num_layers`` over ``pp`` stages.

    - vLLM: ``num_layers // pp`` each; the remainder ``r`` goes one layer each to the ``r``
      stages just before the last one (stages ``pp-1-r .. pp-2``): the last stage, which also
      runs the norm and head, never gets an extra layer.
    - SGLang: ``num_layers // pp`` each; the last ``r`` stages get one layer more.

    ``layer_partition``: the text of the engine's partition variable (``ENGINE_PARTITION_ENV``),
    which replaces the formula. With fewer layers than stages the engines give some stages no
    layer at all; so does this function (such a stage still holds its embedding or head).
    """
    if engine not in ENGINES:
        raise PlanError(f"unknown engine {engine!r}: use one of {', '.join(ENGINES)}")
    if pp < 1 or num_layers < 1:
        raise PlanError(f"cannot split {num_layers} layers into {pp} stages")
    if layer_partition is not None:
        return _engine_partition_counts(engine, layer_partition, num_layers, pp)
    base, extra = divmod(num_layers, pp)
    counts = [base] * pp
    lucky = range(pp - 1 - extra, pp - 1) if engine == "vllm" else range(pp - extra, pp)
    for stage in lucky:
        counts[stage] += 1
    return counts


def engine_windows(engine: str, num_layers: int, pp: int,
                   layer_partition: Optional[str] = None) -> tuple[StageWindow, ...]:
    """Every stage's window exactly as ``engine`` makes it (see :func:`engine_layer_counts`)."""
    return windows_from_sizes(engine_layer_counts(engine, num_layers, pp, layer_partition))


def get_pp_indices(num_layers: int, pp_rank: int, pp_size: int, *, style: str = "vllm",
                   partition: Union[str, Sequence[int], None] = None) -> tuple[int, int]:
    """``(start_layer, end_layer)`` of stage ``pp_rank``, as the engine ``style`` computes it
    (the signature of the engines' own ``get_pp_indices``, without their environment read).

    ``partition``: explicit layer counts (a sequence, or the text of the engine's partition
    variable such as ``"15,16,15,15"``) instead of the engine's formula.

    A split that leaves any stage without a layer (fewer layers than stages, or a 0 in the
    partition) is refused (PlanError), as pploader refuses to plan one: the engine would
    build a stage with nothing to run (:func:`engine_layer_counts` still reports it)."""
    from ..arguments import OPTIONS, check_choice
    from ..errors import ArgumentError
    for name, value, low in (("num_layers", num_layers, 1), ("pp_rank", pp_rank, 0),
                             ("pp_size", pp_size, 1)):
        OPTIONS["node" if low == 0 else "pp"].check(value, label=name, required=True)
    check_choice("style", style, ENGINES)
    if partition is not None and not isinstance(partition, str) and (
            not isinstance(partition, (list, tuple, range))
            or not all(isinstance(n, int) and not isinstance(n, bool) for n in partition)):
        raise ArgumentError(f"partition={partition!r}: give layer counts (a sequence of "
                            "integers, or their text such as '15,16,15,15')",
                            argument="partition")
    if not 0 <= pp_rank < pp_size:
        raise PlanError(f"pp_rank {pp_rank} is not in [0, {pp_size})")
    text = partition if partition is None or isinstance(partition, str) \
        else ",".join(str(n) for n in partition)
    counts = engine_layer_counts(style, num_layers, pp_size, text)
    if 0 in counts:
        empty = counts.index(0)
        raise PlanError(f"{style}'s split of {num_layers} layers over {pp_size} stages "
                        f"{counts} gives stage {empty} no layer: use at most {num_layers} "
                        "stages" + (", and layer counts of 1 or more" if text else ""))
    window = windows_from_sizes(counts)[pp_rank]
    return window.start_layer, window.end_layer


def check_engine_window(window: StageWindow, start_layer: int, end_layer: int, *,
                        engine: str = "the engine") -> None:
    """Raise PlanError unless the engine's stage ``[start_layer, end_layer)`` is pploader's
    ``window``: an engine's ``load_weights`` skips layers outside its window silently, so a
    disagreement would leave layers unloaded instead of failing."""
    from ..arguments import check_type
    check_type("window", window, StageWindow, "a StageWindow (StagePlan.plan.window)",
               optional=False)
    if (window.start_layer, window.end_layer) != (start_layer, end_layer):
        raise PlanError(
            f"stage {window.pp_rank}: {engine} built layers [{start_layer}, {end_layer}) but "
            f"pploader planned [{window.start_layer}, {window.end_layer}); plan with the "
            "engine's split (partition=\"vllm\" / \"sglang\", or EngineSplit with its partition "
            "variable's text)")
