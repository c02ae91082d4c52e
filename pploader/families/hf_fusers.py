"""The linears vLLM's transformers backend fuses, per module class (for ``hf_tp_plan``).

Before it applies the model's ``base_model_tp_plan``, vLLM 0.32's backend
(``model_executor/models/transformers/fuser.py``, ``fusers/``) traces each module class's
forward with ``torch.fx`` and rewrites the forward's source to merge sibling projections,
whatever the plan says: q / k / v into a ``QKVParallelLinear`` (split by heads, a KV head
copied when there are fewer than TP) with the projection after them row-parallel; a GLU's
gate / up (or any single group of linears reading the module's input) into a
``MergedColumnParallelLinear`` (each piece split evenly on its rows), a GLU's down projection
row-parallel; MLA's ``q_a_proj`` / ``kv_a_proj_with_mqa`` into one unsplit linear, its
``q_b_proj`` / ``kv_b_proj`` column- and ``o_proj`` row-parallel. A fusion is skipped when the
trace stops early or the source rewrite is unsafe (an input rebound between the calls, a
projection called twice...), so only the trace decides; its outcome is not derived here but
recorded, per class, in :data:`FUSIONS` (vLLM's own detection run on the meta model:
``tests/vllm/fuser_truth.py --classes``, checked by ``tests/vllm/test_vllm_fuser_truth.py``),
with the per-instance shape checks vLLM makes before fusing reproduced in :func:`fused_splits`.

Recorded with vLLM 0.32 and transformers 5.19, the newest transformers vLLM 0.32 accepts
(``<5.20``): the decisions follow that version's forwards (5.24's attention takes a ``cache``
argument that stops vLLM 0.32's trace before q / k / v). A module class absent from the table
keeps ``hf_tp_plan``'s own rules and refusals. The architectures of :data:`NOT_BUILT` have no
model class in the transformers vLLM 0.32 accepts, so no vLLM release defines their split;
those :func:`unbuilt_layers` finds (a decoder layer none of whose modules calls transformers'
attention interface, from which vLLM builds each layer's attention) it refuses to build at all.
"""
from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any, Mapping, Optional

__all__ = ["FUSIONS", "NOT_BUILT", "fused_splits", "unbuilt_layers"]

#: roles: a piece of a ``QKVParallelLinear`` (by heads), of a ``MergedColumnParallelLinear``
#: (GLU when the class is in :data:`GLU`), a linear the fusion makes column- / row-parallel,
#: or one it holds whole (MLA's merged down projection, ``disable_tp``)
QKV, MERGED, COL, ROW, WHOLE_ROLE = "qkv", "merged", "col", "row", "whole"

#: module class -> the role of each linear child vLLM 0.32's fusers give it; ``{}``: traced,
#: left unfused (its linears take the plan's style, replicated where it names none)
FUSIONS: dict[str, dict[str, str]] = {
    # DiffLlama
    "DiffLlamaAttention": {"q_proj": QKV, "k_proj": QKV, "v_proj": QKV, "o_proj": ROW},
    "DiffLlamaMLP": {"gate_proj": MERGED, "up_proj": MERGED, "down_proj": ROW},
    # MiniMax (the lightning-attention layers' qkv_proj / output_gate / out_proj whole)
    "MiniMaxAttention": {"q_proj": QKV, "k_proj": QKV, "v_proj": QKV, "o_proj": ROW},
    "MiniMaxLightningAttention": {},
    # AXK2 (MLA; ``q_gate_proj`` is the checkpoint's ``q_b_proj``; ``o_proj``, whose output
    # is not the forward's, takes the plan's rowwise)
    "AXK2Attention": {"q_a_proj": WHOLE_ROLE, "kv_a_proj_with_mqa": WHOLE_ROLE,
                      "q_gate_proj": COL, "kv_b_proj": COL},
    "AXK2Indexer": {},
    "AXK2GateMLP": {},
    "AXK2MLP": {"gate_proj": MERGED, "up_proj": MERGED, "down_proj": ROW},
    # Phi-4-multimodal: the text layers by the plan, the towers' attention fused
    "Phi4MultimodalAttention": {},
    "Phi4MultimodalMLP": {},
    "Phi4MultimodalAudioAttention": {"q_proj": QKV, "k_proj": QKV, "v_proj": QKV,
                                     "o_proj": ROW},
    "Phi4MultimodalAudioEmbedding": {},
    "Phi4MultimodalAudioMLP": {},
    "Phi4MultimodalImageEmbedding": {},
    "Phi4MultimodalVisionAttention": {"q_proj": QKV, "k_proj": QKV, "v_proj": QKV,
                                      "out_proj": ROW},
    "Phi4MultimodalVisionMLP": {},
    # the transformers-backend models planned before the table (the same splits)
    "DogeAttention": {"q_proj": QKV, "k_proj": QKV, "v_proj": QKV},
    "DogeMLP": {"gate_proj": MERGED, "up_proj": MERGED, "down_proj": ROW},
    "FlexOlmoAttention": {"q_proj": QKV, "k_proj": QKV, "v_proj": QKV, "o_proj": ROW},
    "AriaTextAttention": {"q_proj": QKV, "k_proj": QKV, "v_proj": QKV, "o_proj": ROW},
    "AriaSharedExpertsMLP": {"gate_proj": MERGED, "up_proj": MERGED, "down_proj": ROW},
    "GPTNeoXAttention": {},
    "GPTNeoXMLP": {},
}

#: classes whose merged pair is a GLU (vLLM's ``GLUFuser``: gate and up of equal widths)
GLU = frozenset({"DiffLlamaMLP", "AXK2MLP", "DogeMLP", "AriaSharedExpertsMLP"})

#: architecture -> its model type, absent from transformers 5.19 (vLLM 0.32 requires <5.20)
NOT_BUILT: Mapping[str, str] = {"DoryForCausalLM": "dory", "FlintForCausalLM": "flint",
                                "Lfm3ForCausalLM": "lfm3"}


def fused_splits(module: Any, linears: Mapping[str, Any],
                 head_dim: Optional[int]) -> Optional[dict[str, str]]:
    """How vLLM's fusers hold the linear children ``linears`` of ``module``: name ->
    ``heads:<head_dim>`` / ``dim0`` / ``dim1`` / ``whole`` for those a fusion takes; ``None``
    when the class is not in :data:`FUSIONS` (or its children differ from those recorded).
    A group that fails vLLM's per-instance check is left to the plan, as vLLM leaves it."""
    roles = FUSIONS.get(type(module).__name__)
    if roles is None or not set(roles) <= set(linears):
        return None
    out: dict[str, str] = {}
    qkv = [n for n, r in roles.items() if r == QKV]
    merged = [n for n, r in roles.items() if r == MERGED]
    hd = getattr(module, "head_dim", None) or head_dim
    if qkv and _qkv_ok([linears[n] for n in qkv], hd):
        out.update({n: f"heads:{hd}" for n in qkv})
    if merged and _merged_ok([linears[n] for n in merged], type(module).__name__ in GLU):
        out.update({n: "dim0" for n in merged})
    fused = bool(out) or not (qkv or merged)  # MLA: no per-instance check (use_mla)
    for name, role in roles.items():
        if fused and role in (COL, ROW, WHOLE_ROLE):
            out[name] = {COL: "dim0", ROW: "dim1", WHOLE_ROLE: "whole"}[role]
    return out


def _qkv_ok(lins: list[Any], hd: Optional[int]) -> bool:
    """vLLM's ``QKVFuser.validate``: one input width and bias, equal k / v widths, q and k
    whole heads."""
    q, k, v = lins
    return (isinstance(hd, int) and hd > 0 and q.in_features == k.in_features == v.in_features
            and len({lin.bias is None for lin in lins}) == 1
            and k.out_features == v.out_features
            and q.out_features % hd == 0 and k.out_features % hd == 0)


def _merged_ok(lins: list[Any], glu: bool) -> bool:
    """vLLM's ``MergedColumnParallelFuser.validate`` (the TP divisibility aside: the planner
    refuses a width TP does not divide) and, for a GLU, equal gate / up widths."""
    return (len({lin.in_features for lin in lins}) == 1
            and len({lin.bias is None for lin in lins}) == 1
            and (not glu or len({lin.out_features for lin in lins}) == 1))


def unbuilt_layers(model: Any, num_layers: int) -> list[tuple[int, str]]:
    """The decoder layers (index, class of a module of that ``layer_idx`` or ``"?"``) vLLM's
    transformers backend cannot build, among the modules of ``model`` (the decoder layers'
    list: a tower's attention does not count, vLLM dispatches only the text config's to its
    own attention): no module with that ``layer_idx`` whose forward calls,
    exactly once, a function it took from transformers' ``ALL_ATTENTION_FUNCTIONS`` (vLLM then
    refuses the model: "does not dispatch through the Transformers attention interface")."""
    served: set[int] = set()
    seen: dict[int, str] = {}
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if not isinstance(idx, int) or isinstance(idx, bool):
            continue
        seen.setdefault(idx, type(module).__name__)
        cls = type(module)
        if cls not in _INTERFACE:
            _INTERFACE[cls] = _calls_interface(cls)
        if _INTERFACE[cls]:
            served.add(idx)
    return [(i, seen.get(i, "?")) for i in range(num_layers) if i not in served]


#: module class -> whether its forward calls the attention interface (sources parsed once)
_INTERFACE: dict[type, bool] = {}


def _calls_interface(cls: Any) -> bool:
    """Whether ``cls.forward`` calls one attention function looked up in
    ``ALL_ATTENTION_FUNCTIONS`` (by ``.get_interface(...)``, an attribute or a subscript)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(getattr(cls, "forward")))))
    except (AttributeError, OSError, SyntaxError, TypeError):
        return False

    def lookup(node: Any) -> bool:
        node = node.func if isinstance(node, ast.Call) else node
        return isinstance(node, (ast.Attribute, ast.Subscript)) and \
            isinstance(node.value, ast.Name) and node.value.id == "ALL_ATTENTION_FUNCTIONS"

    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and lookup(node.value):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and lookup(node.value) and \
                isinstance(node.target, ast.Name):
            names.add(node.target.id)
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Name) and n.func.id in names]
    return len(calls) == 1
