"""The one place where pploader keeps state that must travel with an ``nn.Module``.

Three things cannot live in an object the caller holds, because code that never sees
pploader's return values depends on them: the *not-ready* mark (the module's own ``forward``
must refuse to run after a write failed midway), the *derived* parameters that
``bind_derived`` binds from a module's ``process_weights_after_loading`` (the writers must
skip them), and an engine integration's load state (vLLM's loader returns nothing to the
caller; its in-engine reload finds the model only). They are kept here, in one typed registry
keyed weakly by the module: nothing is written into the module's ``__dict__``, and a module
that is garbage collected takes its entry with it.

Everything else a load produces is returned to the caller (``BindResult.record``, a
``LoadRecord``, is what ``reload_from_disk`` and ``load_layerwise`` take).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["ModuleState", "module_state", "find_module_state"]


@dataclass
class ModuleState:
    """pploader's state for one module.

    ``not_ready``: why the module must not run (None = ready); ``not_ready_hook``: the
    forward pre-hook enforcing it; ``derived``: derived parameter name -> its source
    parameter's name (``bind_derived``), for this module's own parameters;
    ``engine_load``: what an engine integration loaded into this model
    (integrations/vllm.py: its ``LoadState``, read by the in-engine reload)."""

    not_ready: Optional[str] = None
    not_ready_hook: Optional[RemovableHandle] = None
    derived: dict[str, str] = field(default_factory=dict)
    engine_load: Any = None


_STATES: "weakref.WeakKeyDictionary[nn.Module, ModuleState]" = weakref.WeakKeyDictionary()


def module_state(module: nn.Module) -> ModuleState:
    """``module``'s state, created empty on first use."""
    state = _STATES.get(module)
    if state is None:
        state = _STATES[module] = ModuleState()
    return state


def find_module_state(module: nn.Module) -> Optional[ModuleState]:
    """``module``'s state, or None if pploader never recorded any (creates nothing)."""
    return _STATES.get(module)
