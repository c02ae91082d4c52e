"""Plain-torch stand-ins for SGLang's own Triton kernels that its CPU path still calls (tests
only; installed by the ``sgl_kernel`` stand-in, so in every engine process).

``fused_gate_sigmoid_mul_add`` (``sglang.kernels.ops.elementwise.elementwise``): a Qwen2 /
Qwen3.5-MoE block with a gated shared expert calls it on a CPU without AMX, where Triton has
no driver. Written from the kernel of the same name: per token, ``sigmoid(h . w)`` times the
shared expert's output, in fp32, added to the routed output when ``do_add``. The module's
``_launch_fused_gate_sigmoid_mul`` is replaced as the module is imported (its public
functions look it up at call time)."""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any, Optional, Sequence

import torch

ELEMENTWISE = "sglang.kernels.ops.elementwise.elementwise"


def launch_fused_gate_sigmoid_mul(hidden_states: torch.Tensor, gate_weight: torch.Tensor,
                                  shared_output: torch.Tensor, output: torch.Tensor, *,
                                  do_add: bool) -> None:
    gate = torch.sigmoid((hidden_states.float() * gate_weight.float()).sum(-1, keepdim=True))
    result = gate * shared_output.float()
    if do_add:
        result += output.float()
    output.copy_(result.to(output.dtype))


def _patch(module: ModuleType) -> None:
    module._launch_fused_gate_sigmoid_mul = launch_fused_gate_sigmoid_mul  # type: ignore


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds the module as usual, then patches it once executed."""

    def find_spec(self, name: str, path: Optional[Sequence[str]],
                  target: Optional[ModuleType] = None) -> Any:
        if name != ELEMENTWISE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        run = spec.loader.exec_module

        def exec_and_patch(module: ModuleType) -> None:
            run(module)
            _patch(module)
        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def install() -> None:
    if ELEMENTWISE in sys.modules:
        _patch(sys.modules[ELEMENTWISE])
    elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
