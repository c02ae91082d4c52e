"""Parameters a transformers model uses from more than one place, for the generic family.

- tied copies ``save_pretrained`` drops (``all_tied_weights_keys``, or the same parameter
  object under several names), the output head's tie aside: Zamba's shared transformer block,
  stored once (the first hybrid layer) and tied into every later hybrid layer. A stage using a
  copy must read its source (``Family.shared``, planning/roles.py ``shared_reads``);
- tensors stored outside the decoder layers but run inside the forward's loop over them
  (``for layer in self.layers: ... self.shared(...)``): needed by every stage;
- entries of per-layer lists inside a tied block that a layer does not run (Zamba2's LoRA
  adapters, one per hybrid layer, all stored in the block's first layer): ``Family.unrun``,
  read only by the stage of the layer that runs each, as a tied copy's source.

Read from the meta model (``hf_meta._derive`` calls these), with the two meta-model readers they
share with it (``first_uses``: an attribute's first use in a forward; ``revert_one``: a
parameter's saved name); nothing here reads weights.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

from ..errors import ConfigError

__all__ = ["tied_copies", "saved_pairs", "saved_names", "unrun_entries", "loop_uses",
           "first_uses", "revert_one"]


def tied_copies(model: Any, tied: list[tuple[str, str]], state: dict, every_key: list[str],
                lp: str, order: Mapping[str, str], head_key: Optional[str]
                ) -> list[tuple[str, str, str]]:
    """(target, source, where the target is used) of every tied copy save_pretrained drops,
    the output head's tie aside (``tie_word_embeddings``: the planner's declared replica).
    Zamba's shared transformer block is such a copy in every hybrid layer after the first:
    a stage holding one of those layers needs the source's bytes under the copy's name."""
    ids: dict[int, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if n in state:
            ids.setdefault(id(p), n)
    for n, b in model.named_buffers(remove_duplicate=False):
        if n in state:
            ids.setdefault(id(b), n)
    objects = dict(model.named_parameters(remove_duplicate=False))
    objects.update(dict(model.named_buffers(remove_duplicate=False)))
    first_layer_pos = next((i for i, k in enumerate(every_key) if k.startswith(lp)),
                           len(every_key))
    out = []
    for target, source in tied:
        if target == head_key:
            continue
        if not source or source not in state:  # tied by identity: the stored name of the object
            source = ids.get(id(objects.get(target)), "")
        if not source:
            raise ConfigError(f"{target} is a tied copy save_pretrained drops, but the stored "
                              "tensor it is tied to cannot be found: its stage could not be "
                              "planned exactly", file="config.json")
        if target.startswith(lp):
            where = "layer"
        else:
            where = next((v for m, v in order.items() if target.startswith(m + ".")),
                         "first" if every_key.index(target) < first_layer_pos else "last")
        out.append((target, source, where))
    return out


def saved_pairs(fmt: str, model: Any, state: dict, pairs: list[tuple[str, str, str]]
                ) -> tuple[tuple[str, str, str], ...]:
    """``pairs`` in the names of the naming ``fmt`` (the target spelled as that naming would
    store it, from the source's tensor)."""
    out = []
    for target, source, where in pairs:
        if fmt == "transformers":
            out.append((target, source, where))
            continue
        src = list(revert_one(model, source, state[source]))
        tgt = list(revert_one(model, target, state[source]))
        if len(src) != len(tgt):
            raise ConfigError(f"tied copy {target} of {source}: the checkpoint spells them as "
                              f"{len(tgt)} and {len(src)} tensors", file="config.json")
        out.extend(zip(tgt, src, [where] * len(src)))
    return tuple(out)


def saved_names(fmt: str, model: Any, state: dict, names: list[str]) -> tuple[str, ...]:
    """``names`` (state-dict keys) as the naming ``fmt`` stores them."""
    if fmt == "transformers":
        return tuple(names)
    return tuple(n for key in names for n in revert_one(model, key, state[key]))


def unrun_entries(model: Any, layers_path: str) -> Callable[[str], bool]:
    """Whether a state-dict key is an entry of a per-layer list that its layer does not run:
    a ``ModuleList`` named ``*_adapter_list`` under a module mapping layer ids to list
    positions (``layer_dic``). Zamba2's shared transformer block holds one LoRA adapter per
    hybrid layer (``gate_up_proj_adapter_list.{k}``, ``linear_{q,k,v}_adapter_list.{k}``)
    and runs entry ``layer_dic[layer_idx]`` only: the block stored in its first hybrid layer
    holds the adapters of every hybrid layer that ties to it."""
    from torch import nn
    layers = model.get_submodule(layers_path)
    prefixes: dict[int, tuple[str, ...]] = {}
    for i, layer in enumerate(layers):
        found = []
        for path, module in layer.named_modules(remove_duplicate=False):
            dic = getattr(module, "layer_dic", None)
            if not isinstance(dic, dict) or i not in dic:
                continue
            for name, child in module.named_children():
                if isinstance(child, nn.ModuleList) and name.endswith("_adapter_list"):
                    found += [f"{layers_path}.{i}.{path}.{name}.{k}." for k in range(len(child))
                              if k != dic[i]]
        if found:
            prefixes[i] = tuple(found)
    lp = layers_path + "."

    def idle(key: str) -> bool:
        if not prefixes or not key.startswith(lp):
            return False
        idx = key[len(lp):].partition(".")[0]
        found = prefixes.get(int(idx)) if idx.isdecimal() else None
        return found is not None and key.startswith(found)
    return idle


def loop_uses(model: Any, layers_path: str) -> set[str]:
    """Paths of the children (and own parameters / buffers) of the module holding the decoder
    layers that its ``forward`` uses inside the loop over them (``for layer in self.layers:
    ... self.shared(...)``): run by every layer, so needed on every stage. Read from the source
    like ``forward_order``; helpers called in the loop count with what they use."""
    import ast
    import inspect
    import textwrap
    parent_path, _, layers_name = layers_path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    cls = type(parent)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError, AttributeError):
        return set()
    used: set[str] = set()
    for loop in ast.walk(tree):
        if not isinstance(loop, ast.For) or not any(
                isinstance(n, ast.Attribute) and n.attr == layers_name
                for n in ast.walk(loop.iter)):
            continue
        for stmt in loop.body:
            for node in ast.walk(stmt):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                        and node.value.id == "self":
                    used.add(node.attr)
                    if inspect.isfunction(inspect.getattr_static(cls, node.attr, None)):
                        used.update(first_uses(cls, node.attr, 1))
    prefix = parent_path + "." if parent_path else ""
    own = [n for n, _ in parent.named_children()]
    own += [n for n, _ in parent.named_parameters(recurse=False)]
    own += [n for n, _ in parent.named_buffers(recurse=False)]
    return {prefix + n for n in own if n in used and n != layers_name}


def first_uses(cls: type, method: str, depth: int,
                calls: bool = False) -> dict[str, tuple[int, int]]:
    """``{attribute: (line, column)}`` of each ``self.<attribute>`` first use (with ``calls``:
    first direct call ``self.<attribute>(...)``) in ``cls.<method>``; attributes used inside a
    called ``self.<helper>(...)`` count at the call."""
    import ast
    import inspect
    import textwrap
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(getattr(cls, method))))
    except (OSError, TypeError, SyntaxError, AttributeError):
        return {}
    first_use: dict[str, tuple[int, int]] = {}
    for node in ast.walk(tree):
        if calls:
            node = node.func if isinstance(node, ast.Call) else None  # type: ignore[assignment]
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id == "self":
            pos = (node.lineno, node.col_offset)
            found = {node.attr: pos}
            if depth > 0 and node.attr != method and inspect.isfunction(
                    inspect.getattr_static(cls, node.attr, None)):
                found.update({k: pos for k in first_uses(cls, node.attr, depth - 1)})
            for name, at in found.items():
                first_use[name] = min(first_use.get(name, at), at)
    return first_use


def revert_one(model: Any, key: str, tensor: Any) -> dict:
    from transformers.core_model_loading import revert_weight_conversion
    try:
        return dict(revert_weight_conversion(model, {key: tensor}))
    except Exception as exc:  # noqa: BLE001 - a many-to-one conversion: not derivable per key
        raise ConfigError(f"cannot derive the saved name of {key}: transformers' checkpoint "
                          f"conversion needs several tensors at once ({type(exc).__name__})",
                          file="config.json") from None
