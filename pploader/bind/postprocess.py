"""Post-processing after weights land, derived parameters, and a model's ready state.

Protocol: a module may define ``process_weights_after_loading()``; pploader calls it once the
module's weights are complete (after ``load_stage_into``, after each ``reload_from_disk`` and
after each layer of ``load_layerwise``). It must be re-runnable: reload writes the raw
checkpoint values into the *same* source parameters and calls it again.

So a post-process must keep its sources: derive with :func:`bind_derived`, which writes the
derived values into the source's own storage when they fit (both names then point to one
Parameter) and otherwise keeps one separate Parameter that later runs update in place. A
post-process that deletes, replaces or reshapes a source makes the next reload fail before
any write (``reload_from_disk`` checks every destination against what was loaded).
"""
from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

import torch
from torch import nn

from ..errors import NotReadyError, PlanError
from .module_state import find_module_state, module_state

__all__ = ["PostProcessed", "bind_derived", "derived_names", "run_post_processing",
           "is_ready", "not_ready_reason", "ensure_ready", "mark_not_ready", "mark_ready"]


@runtime_checkable
class PostProcessed(Protocol):
    """A module that re-derives state from its freshly written weights."""

    def process_weights_after_loading(self) -> None: ...


def _broadcasts(shape: torch.Size, to: torch.Size) -> bool:
    try:
        return tuple(torch.broadcast_shapes(shape, to)) == tuple(to)
    except RuntimeError:
        return False


def _derived(module: nn.Module) -> dict[str, str]:
    """The derived names of ``module`` (bind/module_state.py: kept with the module)."""
    return module_state(module).derived


def bind_derived(module: nn.Module, name: str, source: str,
                 values: torch.Tensor) -> nn.Parameter:
    """Bind ``values`` (derived from parameter ``source`` of ``module``) to ``module.<name>``.

    When ``values`` broadcasts to the source's shape and has its dtype, they are written into
    the source's storage in place and ``name`` becomes a second name of the same Parameter
    (no new memory; the source then holds derived values until the next reload rewrites it).
    Otherwise ``name`` is a separate Parameter, created once and updated in place on later
    calls, so its ``data_ptr`` stays stable across reloads.
    """
    src = module._parameters.get(source)
    if src is None:
        raise PlanError(f"bind_derived: {type(module).__name__} has no parameter {source!r} "
                        "(was it deleted by an earlier post-process?)", tensor=source)
    existing = module._parameters.get(name)
    if (existing is None and name in module.__dict__) or name in module._buffers:
        raise PlanError(f"bind_derived: {name!r} is already a plain attribute or buffer of "
                        f"{type(module).__name__}", tensor=name)
    with torch.no_grad():
        if values.dtype == src.dtype and _broadcasts(values.shape, src.shape):
            if existing is not None and existing is not src:
                raise PlanError(f"bind_derived: {name!r} is bound to a separate tensor but the "
                                f"derived values now fit {source!r}: derive them the same way "
                                "every time", tensor=name)
            if values.device == src.device and \
                    values.untyped_storage().data_ptr() == src.untyped_storage().data_ptr():
                values = values.clone()  # a view of the source: copy before overwriting it
            src.copy_(values)
            if existing is None:
                module.register_parameter(name, src)
            _derived(module)[name] = source
            return src
        if existing is not None:
            if existing is src:
                raise PlanError(f"bind_derived: {name!r} aliases {source!r} but the derived "
                                f"values are now {tuple(values.shape)} {values.dtype}",
                                tensor=name)
            if existing.shape != values.shape or existing.dtype != values.dtype:
                raise PlanError(f"bind_derived: {name!r} is {tuple(existing.shape)} "
                                f"{existing.dtype} but the derived values are "
                                f"{tuple(values.shape)} {values.dtype}; a re-run must derive "
                                "the same shape and dtype", tensor=name)
            existing.copy_(values)
            return existing
        param = nn.Parameter(values.detach().to(src.device).clone(), requires_grad=False)
        module.register_parameter(name, param)
        _derived(module)[name] = source
        return param


def derived_names(model: nn.Module) -> set[str]:
    """Qualified names of every derived parameter bound with :func:`bind_derived`."""
    out = set()
    for prefix, mod in model.named_modules():
        state = find_module_state(mod)
        for name in (state.derived if state is not None else ()):
            out.add(f"{prefix}.{name}" if prefix else name)
    return out


def run_post_processing(model: nn.Module, *, under: Optional[str] = None,
                        exclude: frozenset[str] = frozenset()) -> list[str]:
    """Call ``process_weights_after_loading()`` on each submodule that defines it, in
    ``named_modules()`` order; ``under`` limits it to one subtree (a layer). Returns the
    qualified names of the modules processed."""
    done = []
    with torch.no_grad():
        for prefix, mod in model.named_modules():
            if under is not None and not (prefix == under or prefix.startswith(under + ".")):
                continue
            if prefix in exclude or not isinstance(mod, PostProcessed):
                continue
            mod.process_weights_after_loading()
            done.append(prefix)
    return done


# ---- ready state -------------------------------------------------------------------------

def _raise_not_ready(module: nn.Module, args: tuple) -> None:
    reason = not_ready_reason(module)
    if reason is not None:
        raise NotReadyError(reason)


def mark_not_ready(model: nn.Module, reason: str) -> None:
    """Mark ``model`` unusable: ``forward`` raises NotReadyError(reason) until restored."""
    state = module_state(model)
    state.not_ready = reason
    if state.not_ready_hook is None:
        state.not_ready_hook = model.register_forward_pre_hook(_raise_not_ready)


def mark_ready(model: nn.Module) -> None:
    """Clear a not-ready mark (done by a successful reload)."""
    state = find_module_state(model)
    if state is None:
        return
    state.not_ready = None
    if state.not_ready_hook is not None:
        state.not_ready_hook.remove()
        state.not_ready_hook = None


def not_ready_reason(model: nn.Module) -> Optional[str]:
    """Why ``model`` is marked not ready (None: ready)."""
    state = find_module_state(model)
    return state.not_ready if state is not None else None


def is_ready(model: nn.Module) -> bool:
    """False after a reload failed midway (the weights may mix two checkpoints)."""
    return not_ready_reason(model) is None


def ensure_ready(model: nn.Module) -> None:
    """Raise NotReadyError when ``model`` is marked not ready."""
    reason = not_ready_reason(model)
    if reason is not None:
        raise NotReadyError(reason)
