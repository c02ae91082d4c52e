"""What crosses a pipeline-stage boundary of a transformers model, and how it travels.

A stage boundary sits between decoder layers ``end_layer - 1`` (the last one this stage runs)
and ``end_layer`` (the first one of the next stage). What the next stage needs is exactly
what layer ``end_layer`` would have received in a whole-model run: the positional and keyword
arguments the parent module's layer loop hands it (hidden states, but also whatever state a
model threads through its layers: hyper-connection streams, DSA top-k indices, RWKV's
recurrent state, XLNet's two streams...), plus the output of layer ``end_layer - 1``, which
the next stage's pass-through layers return so that the loop code between layers sees a
real layer output (its structure and, for the last pass-through, its values).

:class:`StageBoundary` holds both, flattened into a JSON layout (nesting of tuples, lists,
dicts and scalars, tensor slots) and a list of tensors (each tensor once, by identity).
Objects that are neither (a cache object, a module) are not sent: the receiving stage takes
its own value at the same place (``{"local": type}``). Also carried: a tensor that is a slice
of a pre-loop tensor as its whole base plus the view geometry; a mapping object (not a dict)
by its items, refilled into the receiver's own object; a namedtuple by its fields.

On the wire (:func:`send_boundary` / :func:`recv_boundary`, through ``Comm.send``/``recv``):
an int64 pair (layout bytes, payload bytes), the UTF-8 layout, then all tensors' bytes in one
uint8 buffer. Nothing is unpickled.

:class:`StageRun` is the per-forward state of the decoder-layer hooks that capture a boundary
(before layer ``end_layer``), inject one (at ``start_layer``) and refuse layer orders a
pipeline cannot reproduce.
"""
from __future__ import annotations

import collections
import functools
import json
import typing
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..errors import PPLoaderError
from ..planning.partition import StageWindow

if typing.TYPE_CHECKING:  # pragma: no cover
    from ..distributed.comm import Comm

__all__ = ["StageBoundary", "StageRun", "StageDone", "send_boundary", "recv_boundary"]

_SCALARS = (type(None), bool, int, float, str)


@dataclass(frozen=True)
class StageBoundary:
    """The state handed from one pipeline stage to the next (see the module docstring)."""

    layout: str                      # JSON: {"layer", "args", "kwargs", "output"} + tensor specs
    tensors: tuple[torch.Tensor, ...]

    @classmethod
    def capture(cls, layer: int, args: Optional[tuple], kwargs: Optional[dict], output: Any
                ) -> "StageBoundary":
        """Flatten layer ``layer``'s inputs and the previous layer's ``output``.

        ``args`` / ``kwargs`` None: the forward ran no later layer (the layer loop skipped
        them all, as Mllama's text-only pass skips its cross-attention layers); only the
        output travels and the receiving stage must not run a layer either."""
        slots: dict[int, int] = {}
        tensors: list[torch.Tensor] = []
        tree = {"args": None if args is None else _encode(list(args), slots, tensors),
                "kwargs": None if kwargs is None else _encode(dict(kwargs), slots, tensors),
                "output": _encode(output, slots, tensors)}
        specs = [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors]
        layout = json.dumps({"layer": layer, "tensors": specs, **tree})
        return cls(layout, tuple(tensors))

    @property
    def layer(self) -> int:
        """The first layer of the receiving stage."""
        return int(json.loads(self.layout)["layer"])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def inputs(self, local_args: tuple, local_kwargs: dict) -> tuple[tuple, dict]:
        """The captured (args, kwargs); objects that were not sent come from the local call."""
        tree = json.loads(self.layout)
        if tree["args"] is None:
            raise PPLoaderError(f"stage boundary: layer {tree['layer']} runs here, but the "
                                "previous stage's forward ran no layer after its own: the "
                                "model skips layers differently on each stage")
        args = _decode(tree["args"], self.tensors, list(local_args), "args")
        kwargs = _decode(tree["kwargs"], self.tensors, dict(local_kwargs), "kwargs")
        return tuple(args), kwargs

    def output(self) -> Any:
        """The previous stage's last layer output (what this stage's pass-throughs return)."""
        return _decode(json.loads(self.layout)["output"], self.tensors, _MISSING, "output")


class _Missing:
    pass


_MISSING = _Missing()


def _whole_base(t: torch.Tensor) -> Optional[torch.Tensor]:
    """The tensor ``t`` is a view of, where that base is contiguous from its storage's start
    (so the view is ``base.as_strided(size, stride, offset)`` of any contiguous copy)."""
    base = t._base
    if base is None or not base.is_contiguous() or base.storage_offset() != 0:
        return None
    return base


def _slot(t: torch.Tensor, slots: dict[int, int], tensors: list[torch.Tensor]) -> int:
    if id(t) not in slots:
        slots[id(t)] = len(tensors)
        tensors.append(t)
    return slots[id(t)]


def _encode(obj: Any, slots: dict[int, int], tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        base = _whole_base(obj)
        if base is not None:  # a slice of a tensor computed before the loop (Gemma 3n / 4's
            # per-layer inputs): the whole base travels, later layers' slices are taken from it
            return {"t": _slot(base, slots, tensors),
                    "view": [list(obj.shape), list(obj.stride()), obj.storage_offset()]}
        return {"t": _slot(obj, slots, tensors)}
    if isinstance(obj, _SCALARS):
        return {"v": obj}
    if isinstance(obj, (tuple, list)) and type(obj) in (tuple, list):
        return {type(obj).__name__: [_encode(x, slots, tensors) for x in obj]}
    fields = getattr(obj, "_fields", None)
    if isinstance(obj, tuple) and isinstance(fields, tuple) \
            and all(isinstance(f, str) for f in fields):
        # a namedtuple layer output (Reformer's ReformerOutput): fields by name
        return {"namedtuple": [[f, _encode(x, slots, tensors)] for f, x in zip(fields, obj)],
                "type": type(obj).__name__}
    if type(obj) is dict and all(isinstance(k, (str, int)) for k in obj):
        return {"dict": [[k, _encode(v, slots, tensors)] for k, v in obj.items()]}
    if isinstance(obj, MutableMapping) and all(isinstance(k, (str, int)) for k in obj):
        # a mapping object threaded through the layers and filled by them (Gemma's
        # KVSharingDict: K/V of earlier layers reused by later ones): its contents travel and
        # fill the receiving stage's own object in place, which its later layers then receive
        return {"mapping": [[k, _encode(v, slots, tensors)] for k, v in obj.items()],
                "type": type(obj).__name__}
    return {"local": type(obj).__name__}


def _decode(node: Any, tensors: tuple[torch.Tensor, ...], local: Any, where: str) -> Any:
    if "t" in node:
        if "view" in node:
            size, stride, offset = node["view"]
            return tensors[node["t"]].as_strided(size, stride, offset)
        return tensors[node["t"]]
    if "v" in node:
        return node["v"]
    if "tuple" in node or "list" in node:
        items = node.get("tuple", node.get("list"))
        seq = local if isinstance(local, (tuple, list)) else ()
        out = [_decode(x, tensors, seq[i] if i < len(seq) else _MISSING, f"{where}[{i}]")
               for i, x in enumerate(items)]
        return tuple(out) if "tuple" in node else out
    if "dict" in node:
        mapping = local if isinstance(local, dict) else {}
        return {k: _decode(v, tensors, mapping.get(k, _MISSING), f"{where}[{k!r}]")
                for k, v in node["dict"]}
    if "namedtuple" in node:
        fields = [f for f, _ in node["namedtuple"]]
        cls = type(local) if isinstance(local, tuple) and getattr(local, "_fields", None) \
            == tuple(fields) else _namedtuple(node["type"], tuple(fields))
        return cls(*(_decode(v, tensors, getattr(local, f, _MISSING), f"{where}.{f}")
                     for f, v in node["namedtuple"]))
    if "mapping" in node:
        if not isinstance(local, MutableMapping) or type(local).__name__ != node["type"]:
            raise PPLoaderError(f"stage boundary: {where} is a {node['type']} mapping; the "
                                f"receiving stage has a {type(local).__name__} there")
        items = {k: _decode(v, tensors, _MISSING, f"{where}[{k!r}]") for k, v in node["mapping"]}
        local.clear()
        local.update(items)
        return local
    if local is _MISSING:
        raise PPLoaderError(f"stage boundary: {where} is a {node['local']} object, which is not "
                            "sent between stages and has no local counterpart")
    return local


@functools.lru_cache(maxsize=None)
def _namedtuple(name: str, fields: tuple[str, ...]) -> type:
    """A namedtuple class like the sender's (same name and fields: attribute and index access
    work); built here, never imported by a received name."""
    return collections.namedtuple(name, fields)  # type: ignore[misc]


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with every tensor in its tuples / lists / dicts replaced by ``fn(tensor)``."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if type(obj) in (tuple, list):
        return type(obj)(map_tensors(x, fn) for x in obj)
    if type(obj) is dict:
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    return obj


def pair_tensors(local: Any, received: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(local, received) tensor pairs at the same places of two like-shaped structures."""
    if isinstance(local, torch.Tensor) and isinstance(received, torch.Tensor):
        return [(local, received)]
    if type(local) in (tuple, list) and type(received) in (tuple, list):
        return [p for a, b in zip(local, received) for p in pair_tensors(a, b)]
    if type(local) is dict and type(received) is dict:
        return [p for k in local if k in received for p in pair_tensors(local[k], received[k])]
    return []


class StageDone(Exception):
    """Raised before the next stage's first layer: the rest of the model is not run here."""

    def __init__(self, boundary: StageBoundary) -> None:
        super().__init__("stage done")
        self.boundary = boundary


class StageRun:
    """Per-forward bookkeeping of the layer hooks of one stage."""

    def __init__(self, window: StageWindow, boundary: Optional[StageBoundary], rank: int) -> None:
        self.window, self.boundary, self.rank = window, boundary, rank
        self.ran_owned = False
        self.last_output: Any = None
        # local tensor id -> (local tensor, received tensor): the captured value replaces the
        # locally computed one wherever later layers receive the same object
        self.received: Optional[dict[int, tuple[torch.Tensor, torch.Tensor]]] = None
        # local base id -> (local base, received base): for slices of a pre-loop tensor
        self.received_bases: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _error(self, message: str) -> PPLoaderError:
        w = self.window
        return PPLoaderError(f"stage {w.pp_rank} (layers {w.start_layer}-{w.end_layer - 1}): "
                             f"{message}", rank=self.rank)

    def before(self, idx: int, _module: nn.Module, args: tuple, kwargs: dict
               ) -> Optional[tuple[tuple, dict]]:
        w = self.window
        if idx < w.start_layer:
            if self.ran_owned:
                raise self._error(f"layer {idx} runs again after layer {w.start_layer}: the "
                                  "model revisits its layers, a pipeline boundary at layer "
                                  f"{w.start_layer} cannot reproduce it")
            return None
        if idx >= w.end_layer:
            # past end_layer: the loop skipped the layers between (Mllama's cross-attention
            # layers in a text-only pass); the receiving stage skips them too
            if not self.ran_owned:
                raise self._error(f"layer {idx} runs before this stage's layers are done")
            raise StageDone(StageBoundary.capture(idx, args, kwargs, self.last_output))
        self.ran_owned = True
        if self.boundary is None:
            return None
        if self.received is None:
            if idx != self.boundary.layer:
                raise self._error(f"the first layer run is {idx}, but the previous stage "
                                  f"stopped before layer {self.boundary.layer}")
            new_args, new_kwargs = self.boundary.inputs(args, kwargs)
            pairs = [(a, b) for a, b in pair_tensors((args, kwargs), (new_args, new_kwargs))
                     if a is not b]
            self.received = {id(a): (a, b) for a, b in pairs}
            for a, b in pairs:  # slices of one pre-loop tensor: later slices come from its copy
                local_base, got_base = _whole_base(a), b._base
                if local_base is not None and got_base is not None \
                        and local_base.shape == got_base.shape:
                    self.received_bases[id(local_base)] = (local_base, got_base)
            return new_args, new_kwargs
        received, bases = self.received, self.received_bases

        def swap(t: torch.Tensor) -> torch.Tensor:
            hit = received.get(id(t))
            if hit is not None and hit[0] is t:
                return hit[1]
            base = _whole_base(t)
            hit = bases.get(id(base)) if base is not None else None
            if hit is not None and hit[0] is base:
                return hit[1].as_strided(t.shape, t.stride(), t.storage_offset())
            return t
        return map_tensors(args, swap), map_tensors(kwargs, swap)

    def after(self, _idx: int, _module: nn.Module, _args: tuple, output: Any) -> None:
        self.last_output = output


def send_boundary(comm: "Comm", boundary: StageBoundary, dst: int, device: torch.device) -> None:
    """Send ``boundary`` to rank ``dst`` (three point-to-point messages)."""
    layout = torch.frombuffer(bytearray(boundary.layout.encode()), dtype=torch.uint8).to(device)
    parts = [t.detach().to(device).contiguous().reshape(-1).view(torch.uint8)
             for t in boundary.tensors]
    payload = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)
    comm.send(torch.tensor([layout.numel(), payload.numel()], dtype=torch.int64, device=device),
              dst)
    comm.send(layout, dst)
    if payload.numel():
        comm.send(payload, dst)


def recv_boundary(comm: "Comm", src: int, device: torch.device) -> StageBoundary:
    """Receive a :class:`StageBoundary` sent by :func:`send_boundary` from rank ``src``."""
    sizes = torch.empty(2, dtype=torch.int64, device=device)
    comm.recv(sizes, src)
    layout_bytes, payload_bytes = (int(x) for x in sizes.tolist())
    layout = torch.empty(layout_bytes, dtype=torch.uint8, device=device)
    comm.recv(layout, src)
    payload = torch.empty(payload_bytes, dtype=torch.uint8, device=device)
    if payload_bytes:
        comm.recv(payload, src)
    text = layout.cpu().numpy().tobytes().decode()
    tensors, offset = [], 0
    for dtype_name, shape in json.loads(text)["tensors"]:
        dtype = getattr(torch, dtype_name)
        numel = 1
        for size in shape:
            numel *= size
        tensor = torch.empty(shape, dtype=dtype, device=device)
        nbytes = numel * tensor.element_size()
        # a copy into a tensor of its own (not a view: slices sent with their base are re-cut
        # from it, see _whole_base); a slice at an odd offset cannot be viewed as a wider dtype
        tensor.reshape(-1).view(torch.uint8).copy_(payload[offset:offset + nbytes])
        tensors.append(tensor)
        offset += nbytes
    if offset != payload_bytes:
        raise PPLoaderError(f"stage boundary from rank {src}: layout names {offset} bytes, "
                            f"payload has {payload_bytes}")
    return StageBoundary(text, tuple(tensors))
