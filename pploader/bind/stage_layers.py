"""Placeholders for the layers another stage owns, and a stage's full-length layer list.

An engine's stage module usually keeps the model's full layer list, so that layer ``i`` is
``layers[i]`` and checkpoint names map one to one, with a parameter-free placeholder where
another stage owns the layer (vLLM and SGLang call theirs ``PPMissingLayer``).
``make_stage_layers`` builds such a list for a window; ``load_stage_into`` treats
placeholders as outside the stage, and refuses a placeholder at a layer the stage owns (the
module was built for another window).
"""
from __future__ import annotations

import re
from typing import Any, Callable, Optional, Union

from torch import nn

from ..planning.partition import StageWindow

__all__ = ["MissingLayer", "make_stage_layers", "is_placeholder", "placeholder_layers",
           "placeholder_problems"]

#: Class names of the engines' own placeholders, recognised without importing the engine.
ENGINE_PLACEHOLDERS = ("PPMissingLayer",)


class MissingLayer(nn.Module):
    """A layer another pipeline stage owns: no parameters, no buffers.

    Calling it is a bug in the stage's forward (it ran a layer outside its window), so it
    raises naming the layer, unless ``passthrough=True``: then it returns its first input
    unchanged (for stand-ins such as an embedding or norm the stage skips by design).
    """

    def __init__(self, layer: Optional[int] = None, *, passthrough: bool = False) -> None:
        super().__init__()
        self.layer = layer
        self.passthrough = passthrough

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.passthrough:
            if args:
                return args[0]
            if kwargs:
                return next(iter(kwargs.values()))
            return None
        which = "a layer" if self.layer is None else f"layer {self.layer}"
        raise RuntimeError(f"{which} is a MissingLayer placeholder: another pipeline stage owns "
                           "it, so this stage must not run it (check the forward's layer range)")

    def extra_repr(self) -> str:
        return "" if self.layer is None else f"layer={self.layer}"


def make_stage_layers(num_layers: int,
                      window: Union[StageWindow, tuple[int, int]],
                      build_layer: Callable[[int], nn.Module]) -> nn.ModuleList:
    """All ``num_layers`` layers: ``build_layer(i)`` for ``i`` in the window
    (``StageWindow`` or ``(start_layer, end_layer)``), a :class:`MissingLayer` elsewhere.
    Checkpoint name ``...layers.{i}...`` then maps to ``layers[i]`` unchanged."""
    start, end = (window.start_layer, window.end_layer) if isinstance(window, StageWindow) \
        else window
    if not 0 <= start <= end <= num_layers:
        raise ValueError(f"window [{start}, {end}) is not inside the model's {num_layers} layers")
    return nn.ModuleList(build_layer(i) if start <= i < end else MissingLayer(i)
                         for i in range(num_layers))


def is_placeholder(module: nn.Module) -> bool:
    """A :class:`MissingLayer`, or an engine's own placeholder (``PPMissingLayer``)."""
    return isinstance(module, MissingLayer) or type(module).__name__ in ENGINE_PLACEHOLDERS


_TRAILING_INDEX = re.compile(r"(?:^|\.)(\d+)$")


def placeholder_layers(module: nn.Module) -> dict[str, Optional[int]]:
    """Every placeholder in ``module`` by path, with the layer it stands for (its ``layer``
    attribute, else the path's trailing index, e.g. ``model.layers.5``; None if neither)."""
    out: dict[str, Optional[int]] = {}
    for path, sub in module.named_modules():
        if not path or not is_placeholder(sub):
            continue
        layer = getattr(sub, "layer", None)
        if not isinstance(layer, int):
            match = _TRAILING_INDEX.search(path)
            layer = int(match.group(1)) if match else None
        out[path] = layer
    return out


def placeholder_problems(module: nn.Module, window: StageWindow) -> list[str]:
    """A message per placeholder standing at a layer ``window`` owns (pure)."""
    return [f"{path} is a placeholder ({type(module.get_submodule(path)).__name__}) but stage "
            f"{window.pp_rank} owns layer {layer} (layers {window.start_layer}-"
            f"{window.end_layer - 1}): the module was built for another window"
            for path, layer in placeholder_layers(module).items()
            if layer is not None and window.owns(layer)]
