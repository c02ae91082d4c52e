"""Which parameters an engine's ``load_weights`` wrote: for models that return nothing.

SGLang's models mostly return no set of loaded names, so the strict check after a load
(``engine_core.check_all_loaded``) needs another witness. :func:`tracking_writes` records a
parameter as written when, during the block,

- its ``weight_loader`` is called (the parameter's own attribute, SGLang's read-only property
  slot ``_weight_loader``, or the engine's default loader for a parameter without one);
- an in-place torch operation writes into its storage, seen by a ``TorchFunctionMode`` on the
  loading thread (about 1.6 us per torch call on the CPU). This covers the writes that pass
  no parameter loader: a module's own ``weight_loader`` called directly (ZAYA's
  ``load_weights`` calls its ``FusedMoE``'s), ``param.data.copy_(...)`` or
  ``param.data[rows] = ...`` in ``load_weights`` itself (gpt-oss's attention sinks).

Everything is put back when the block ends.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["tracking_writes"]

_MISSING = object()


@contextlib.contextmanager
def tracking_writes(model: nn.Module, default_loader: Callable[..., Any]) -> Iterator[set[str]]:
    """The names of ``model``'s parameters written inside the block (the set fills as the
    block runs); ``default_loader``: the engine's loader for a parameter without its own."""
    written: set[str] = set()
    undo: list[Callable[[], None]] = []
    try:
        _wrap_parameter_loaders(model, default_loader, written, undo)
        with _StorageWrites(model, written):
            yield written
    finally:
        for restore in reversed(undo):
            restore()


def _restorer(owner: Any, slot: str, own: Any) -> Callable[[], None]:
    """Put ``owner``'s ``slot`` back: the attribute it had, or none (``_MISSING``)."""
    def restore() -> None:
        if own is _MISSING:
            owner.__dict__.pop(slot, None)
        else:
            setattr(owner, slot, own)
    return restore


def _wrap_parameter_loaders(model: nn.Module, default_loader: Callable[..., Any],
                            written: set[str], undo: list[Callable[[], None]]) -> None:
    for name, param in model.named_parameters():
        own = param.__dict__.get("weight_loader", _MISSING)
        slot = "weight_loader"
        if own is _MISSING and isinstance(getattr(type(param), "weight_loader", None), property):
            slot = "_weight_loader"   # SGLang's parameter classes: a read-only property
            own = param.__dict__.get(slot, _MISSING)
        inner = getattr(param, slot, default_loader)

        def tracked(p: Any, *args: Any, _name: str = name, _inner: Any = inner,
                    **kwargs: Any) -> Any:
            written.add(_name)
            return _inner(p, *args, **kwargs)
        setattr(param, slot, tracked)
        undo.append(_restorer(param, slot, own))


class _StorageWrites(TorchFunctionMode):
    """Records the parameters whose storage an in-place torch operation (a method whose name
    ends in ``_``, or ``__setitem__``) writes into."""

    def __init__(self, model: nn.Module, written: set[str]) -> None:
        super().__init__()
        self._written = written
        self._by_storage: dict[tuple[str, int], list[str]] = {}
        for name, param in model.named_parameters():
            key = _storage_key(param)
            if key is not None:
                self._by_storage.setdefault(key, []).append(name)
        self._inplace: dict[Any, bool] = {}

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        inplace = self._inplace.get(func)
        if inplace is None:
            name = getattr(func, "__name__", "")
            inplace = self._inplace[func] = name == "__setitem__" or (
                name.endswith("_") and not name.startswith("_"))
        if inplace and args and isinstance(args[0], torch.Tensor):
            key = _storage_key(args[0])
            if key is not None and key in self._by_storage:
                self._written.update(self._by_storage[key])
        return func(*args, **(kwargs or {}))


def _storage_key(tensor: torch.Tensor) -> Optional[tuple[str, int]]:
    """(device, storage address); None for what has no storage of its own to write (empty,
    meta, or a tensor subclass without one)."""
    if not tensor.numel() or tensor.device.type == "meta":
        return None
    try:
        return str(tensor.device), tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
