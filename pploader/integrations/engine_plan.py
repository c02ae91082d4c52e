"""An engine's view of one stage, from pploader's plans (no engine import: testable anywhere).

Where a serving engine's stage differs from ``plan_stage``'s:

* **Expert parallelism** (vLLM's ``enable_expert_parallel``): the engine's EP group is its TP
  group (times DP); each EP rank holds its *local experts whole* and splits the rest of the
  stage over TP. pploader's own ``--ep`` is a separate grid axis, so the engine's view is
  composed from two plans: the non-expert tensors of the TP plan, and the local experts' whole
  tensors from a TP=1 plan of the same stage. Stacked (3-D) expert tensors are read whole
  there; the engine slices its experts out.
* **Names**: engines consume checkpoint names (``ReadItem.name``), not pploader's targets. The
  one place they differ is the tied head of a last stage: pploader reads the embedding as
  ``lm_head.weight``; vLLM builds the tied head on its last stage from
  ``model.embed_tokens.weight`` (an alias of ``lm_head.weight``). :func:`engine_names` hands
  that tensor under both names; a loader takes the one its model holds.
* **A stored head under a tied config**: vLLM skips ``lm_head.weight`` as an alias and needs
  the embedding on the last stage; the embedding (its first-stage item, same TP rank) is read
  instead of the unused stored head.
* **An MTP / NextN draft** (:func:`engine_draft`): the engine's draft worker loads one MTP layer
  of the checkpoint under its checkpoint names, whole (its loaders split TP), less the
  components it shares from the target model.
"""
from __future__ import annotations

from dataclasses import replace
from typing import AbstractSet, Optional, Sequence

from ..errors import PlanError
from ..planning.checkpoint import open_checkpoint
from ..planning.plan import ReadItem, plan_mtp
from ..planning.spec import load_spec
from ..planning.topology import Topology
from ..stage import StagePlan, plan_stage

__all__ = ["engine_stage", "engine_names", "expert_of", "linear_experts",
           "round_robin_experts", "engine_draft"]


def linear_experts(num_experts: int, ep_size: int, ep_rank: int) -> frozenset[int]:
    """vLLM's ``linear`` placement (``determine_expert_map``): contiguous blocks, the first
    ``num_experts % ep_size`` ranks one more (pploader's ``local_experts`` does the same)."""
    base, extra = divmod(num_experts, ep_size)
    start = ep_rank * base + min(ep_rank, extra)
    return frozenset(range(start, start + base + (ep_rank < extra)))


def round_robin_experts(num_experts: int, ep_size: int, ep_rank: int) -> frozenset[int]:
    """vLLM's ``round_robin`` placement: experts ``ep_rank, ep_rank + ep_size, ...``."""
    return frozenset(range(ep_rank, num_experts, ep_size))


def expert_of(staged: StagePlan, item: ReadItem) -> tuple[Optional[int], bool]:
    """(expert id of a per-expert tensor or None, True for a stacked 3-D expert tensor)."""
    spec = staged.spec
    role = spec.family.classify(item.name, spec.num_layers, spec.num_mtp_layers)
    if role is None:
        return None, False
    return role.expert, role.fused_experts


def _order(staged: StagePlan, items: Sequence[ReadItem]) -> tuple[ReadItem, ...]:
    """File by file, by offset (the order ``plan_rank`` reads in)."""
    files = {f: n for n, f in enumerate(sorted({i.file for i in items}))}
    return tuple(sorted(items, key=lambda i: (files[i.file], i.ranges[0][0] if i.ranges
                                              else -1, i.target)))


def _with_items(base: StagePlan, items: Sequence[ReadItem], *others: StagePlan) -> StagePlan:
    paths, ids = dict(base.plan.paths), dict(base.plan.identities)
    for other in others:
        paths.update(other.plan.paths)
        ids.update(other.plan.identities)
    items = _order(base, items)
    plan = replace(base.plan, items=items, paths=paths, identities=ids, redistribute=None,
                   tensors=tuple(sorted({i.name for i in items})))
    return replace(base, plan=plan)


def engine_stage(model_dir: str, topology: Topology, partition: Sequence[int], *,
                 local_experts: Optional[AbstractSet[int]] = None, tied_last: bool = True,
                 range_cost_bytes: int = 0) -> StagePlan:
    """This worker's stage as the engine holds it (module docstring). ``topology``: pploader's
    (pp, tp) place of the worker (ep 1; the engine's EP rides on TP); ``local_experts``: the
    experts the engine holds on this rank under expert parallelism (None: no EP)."""
    # engines read their own bytes directly: no TP exchange planned (nor its chooser built)
    staged = plan_stage(model_dir, topology, partition=list(partition),
                        range_cost_bytes=range_cost_bytes, exchange_cost=None)
    items = list(staged.plan.items)
    others: list[StagePlan] = []
    if local_experts is not None:
        if not staged.spec.num_experts:
            raise PlanError(f"the engine runs expert parallelism but {staged.spec.architecture} "
                            "has no experts", rank=topology.rank)
        bad = sorted(e for e in local_experts if not 0 <= e < staged.spec.num_experts)
        if bad:
            raise PlanError(f"the engine places experts {bad} on this rank; the checkpoint has "
                            f"{staged.spec.num_experts}", rank=topology.rank)
        whole = plan_stage(model_dir, Topology(topology.pp_size, 1, 1, topology.pp_rank),
                           partition=list(partition), range_cost_bytes=range_cost_bytes)
        others.append(whole)

        def is_expert(item: ReadItem) -> bool:
            expert, fused = expert_of(whole, item)
            return expert is not None or fused

        def local(item: ReadItem) -> bool:
            expert, fused = expert_of(whole, item)
            return fused or expert in local_experts
        items = [i for i in items if not is_expert(i)] + \
            [i for i in whole.plan.items if is_expert(i) and local(i)]
    window, spec = staged.plan.window, staged.spec
    # the config's flag, as the engine reads it (the planning spec drops it when the
    # checkpoint stores a head: pploader then serves that head; a tied engine ignores it)
    tied = load_spec(model_dir).tie_word_embeddings
    if tied_last and tied and window.has_head and not window.has_embed:
        embeds = [i for i in items if _role(staged, i) == "embed"]
        if not embeds:  # the checkpoint stores a head the tied model ignores: read the embed
            first = plan_stage(model_dir, Topology(topology.pp_size, topology.tp_size, 1,
                                                   topology.tp_rank),
                               partition=list(partition), range_cost_bytes=range_cost_bytes)
            embeds = [i for i in first.plan.items if _role(first, i) == "embed"]
            if not embeds:
                raise PlanError("tied word embeddings but the checkpoint holds no embedding "
                                "for the engine's tied head", rank=topology.rank)
            head = spec.family.head_name()
            items = [i for i in items if i.name != head] + \
                [i._replace(target=head or i.target) for i in embeds]
            others.append(first)
    if others:
        return _with_items(staged, items, *others)
    return staged


def _role(staged: StagePlan, item: ReadItem) -> Optional[str]:
    spec = staged.spec
    role = spec.family.classify(item.name, spec.num_layers, spec.num_mtp_layers)
    return role.role if role is not None else None


def engine_names(staged: StagePlan, item: ReadItem) -> tuple[str, ...]:
    """The names the engine's loaders are handed ``item``'s tensor under: its checkpoint name,
    plus pploader's target where that differs (the tied head: ``model.embed_tokens.weight``
    and ``lm_head.weight``, one tensor)."""
    return (item.name,) if item.target == item.name else (item.name, item.target)


def engine_draft(model_dir: str, mtp_layer: int, *,
                 shared: AbstractSet[str] = frozenset()) -> StagePlan:
    """A draft worker's plan: MTP layer ``mtp_layer`` of the checkpoint (``plan_mtp``: that
    layer's tensors only, checked strictly), each tensor whole and handed under its checkpoint
    name (the engine's draft model maps the names and splits TP itself). ``shared``: MTP
    components the engine takes from the target model instead (the family names them, e.g.
    ``generic_mtp.TARGET_SHARED``), never read."""
    spec, index = load_spec(model_dir), open_checkpoint(model_dir)
    plan = plan_mtp(spec, index, mtp_layer)
    items = []
    for item in plan.items:
        role = spec.family.classify(item.name, spec.num_layers, spec.num_mtp_layers)
        if role is not None and role.component in shared:
            continue
        items.append(item._replace(target=item.name))
    if not items:
        raise PlanError(f"MTP layer {mtp_layer} of {model_dir} holds only components the "
                        f"engine shares from the target ({sorted(shared)}): nothing to load")
    return _with_items(StagePlan(spec, index, plan), items)
