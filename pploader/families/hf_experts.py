"""Experts of a decoder layer built on ``meta``, for ``hf_meta.derive``: the count an expert
module declares (JetMoE's ``ParallelExperts``, DBRX's ``ExpertGLU``, LongCat-Flash's routed
count next to its zero-compute experts), the regex of expert ids below that count, and which
stacked experts split their fused gate/up output in halves (their TP split)."""
from __future__ import annotations

from typing import Any

__all__ = ["COUNT_ATTRS", "declared_experts", "routed_count", "ids_below", "halved_experts",
           "STACKED_FP8_TYPES"]

#: model types whose stacked experts in transformers' naming may be stored as transformers'
#: fine-grained FP8 (``mlp.experts.gate_up_proj`` + ``gate_up_proj_scale_inv``; families/base.py
#: ``QuantNaming.stacked``) because vLLM 0.32 loads them: the MoE block sits at
#: ``mlp.experts`` as in transformers, built by ``FusedMoEFactory`` with the default
#: gate_proj / up_proj / down_proj names, and the model loads through ``AutoWeightsLoader``
#: down to ``RoutedExperts.load_weights`` (models/olmoe.py, models/qwen2_moe.py). Other
#: types' stacked quantized experts are refused naming the tensor.
STACKED_FP8_TYPES = frozenset({"olmoe", "qwen2_moe"})


#: attributes expert modules declare their expert count under (JetMoE's ParallelExperts,
#: DBRX's ExpertGLU)
COUNT_ATTRS = ("num_experts", "moe_num_experts", "num_local_experts")


def routed_count(module: Any, big: list[int]) -> int:
    """The expert count of a module stacking experts on dim 0 of its >= 3-d parameters: their
    common dim 0, or, where they differ, the routed count the module declares when it is the
    smallest (LongCat-Flash: ``gate_up_proj`` ``[E + Z, ...]`` also holds rows of its ``Z``
    zero-compute identity experts, ``down_proj`` ``[E, ...]`` only the ``E`` routed ones,
    which engines split; ``num_routed_experts``). 0 when neither."""
    if not big:
        return 0
    if len(set(big)) == 1:
        return big[0]
    declared = [getattr(module, a, None) for a in ("num_routed_experts",) + COUNT_ATTRS]
    return next((v for v in declared if isinstance(v, int) and v == min(big)), 0)


def declared_experts(layer: Any) -> tuple[int, dict[str, int]]:
    """Stacked experts of modules not named ``experts`` that declare their expert count
    ``E`` (``COUNT_ATTRS``): their own parameters with dim 0 = E and >= 3 dims (JetMoE's
    ``input_linear.weight`` ``[E, 2I, H]``), or 2-d with the experts flattened into dim 0
    (``E x rows``, DBRX's ``experts.mlp.w1`` ``[E x I, H]``). A router (``[E, H]``, 2-d with
    dim 0 = E) is neither."""
    count, keys = 0, {}
    for path, module in layer.named_modules():
        declared = [getattr(module, a, None) for a in COUNT_ATTRS]
        num = next((int(v) for v in declared if isinstance(v, int) and v > 1), 0)
        if not num:
            continue
        for name, p in module.named_parameters(recurse=False):
            stacked = (p.dim() >= 3 and p.shape[0] == num) or (
                p.dim() == 2 and p.shape[0] > num and p.shape[0] % num == 0)
            if stacked:
                if count and count != num:
                    return 0, {}  # two different declared counts: not guessed
                count = num
                keys[f"{path}.{name}" if path else name] = -1
    return count, keys


def ids_below(n: int) -> str:
    """A regex matching exactly the decimal numbers ``0 .. n - 1`` (no leading zeros)."""
    top = str(n - 1)
    alts = ["[0-9]"] if len(top) > 1 else []
    alts += [f"[1-9][0-9]{{{k - 1}}}" for k in range(2, len(top))]
    for i, digit in enumerate(top):
        low = 1 if i == 0 and len(top) > 1 else 0
        if int(digit) > low:
            rest = len(top) - i - 1
            alts.append(top[:i] + f"[{low}-{int(digit) - 1}]" + (f"[0-9]{{{rest}}}" if rest else ""))
    return "|".join(alts + [top])


def halved_experts(layer: Any) -> set[str]:
    """``{path.gate_up_proj, path.down_proj}`` of the stacked-expert modules of ``layer`` whose
    code splits the fused gate/up output in halves, gate first (``chunk(2, dim=-1)`` in its
    ``forward`` or gate function: transformers' experts but gpt-oss's, which interleaves), so
    a TP split of the intermediate dim takes the same rows of each half; and likewise
    ``{path.gate_up_proj.weight, path.gate_up_proj.bias, path.down_proj.weight}`` of an MLP
    whose fused gate/up is a linear layer (GLM / GLM-4's ``mlp.gate_up_proj``: vLLM's
    ``MergedColumnParallelLinear``)."""
    import inspect
    out = set()
    for path, module in layer.named_modules():
        own = dict(module.named_parameters(recurse=False))
        gate_up, down = own.get("gate_up_proj"), own.get("down_proj")
        linear = False
        if gate_up is None and down is None:  # an MLP of two linear layers
            gu, dn = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
            gate_up, down = getattr(gu, "weight", None), getattr(dn, "weight", None)
            linear = True
        if gate_up is None or down is None or gate_up.dim() != down.dim() or \
                gate_up.dim() != (2 if linear else 3):
            continue
        code = []
        for attr in ("forward", "_apply_gate"):
            fn = getattr(type(module), attr, None)
            try:
                code.append(inspect.getsource(fn) if fn is not None else "")
            except (OSError, TypeError):
                continue
        text = "\n".join(code)
        if "chunk(2, dim=-1)" in text and "::2]" not in text:
            out |= {f"{path}.gate_up_proj.weight", f"{path}.gate_up_proj.bias",
                    f"{path}.down_proj.weight"} if linear else \
                {f"{path}.gate_up_proj", f"{path}.down_proj"}
    return out
