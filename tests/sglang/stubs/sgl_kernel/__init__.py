"""A stand-in for ``sgl_kernel`` in SGLang's CPU engine, for the tests only.

SGLang's CPU kernels are not on PyPI (the wheel there is the CUDA build), and a llama on CPU
calls one of them: ``assign_req_to_token_pool_cpu``. It is written here in plain torch from
the Triton kernel of the same name in SGLang (``mem_cache/allocation.py``); speculative
decoding's KV pool also calls ``copy_all_layer_kv_cache_cpu`` (from the Triton kernel in
``kernels/ops/kvcache/cache_move.py``). Qwen3.5's gated delta net on CPU calls more
(``torch.ops.sgl_kernel.*_cpu`` and ``sgl_kernel.mamba``): plain-torch versions in ``gdn``,
registered below on the ``torch.ops.sgl_kernel`` namespace. SGLang imports other names at
module level; each is a function that raises when called, so a test never runs on something
this module only pretends to provide (a ``torch.ops.sgl_kernel`` name not registered here
raises AttributeError, so SGLang's AMX probe stays off). ``triton_ops``: plain-torch
versions of SGLang's own Triton kernels that its CPU path still calls (the MoE shared-expert
gate).
"""
from __future__ import annotations

from typing import Any

import ctypes

import torch


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """Request ``i``'s token slots ``[start_i, end_i)`` take the next ``end_i - start_i``
    entries of ``out_cache_loc`` (the requests' new slots, back to back)."""
    out = 0
    for i in range(int(req_pool_indices.shape[0])):
        start, end = int(start_offset[i]), int(end_offset[i])
        row = req_to_token[int(req_pool_indices[i])]
        row[start:end] = out_cache_loc[out:out + end - start].to(row.dtype)
        out += end - start


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor,
                                tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
    """In every layer's buffer (base address ``data_ptrs[b]``, ``strides[b]`` bytes a slot),
    slot ``src_loc[i]``'s bytes are copied to slot ``tgt_loc[i]``."""
    for base, stride in zip(data_ptrs.tolist(), strides.tolist()):
        for src, tgt in zip(src_loc.tolist(), tgt_loc.tolist()):
            ctypes.memmove(base + tgt * stride, base + src * stride, stride)


def _register_torch_ops() -> None:
    """The ops SGLang looks up as ``torch.ops.sgl_kernel.<name>`` for Qwen3.5 on CPU."""
    from . import gdn
    ops = {
        "fused_gdn_gating_cpu": gdn.gdn_gating,
        "fused_sigmoid_gating_delta_rule_update_cpu": gdn.sigmoid_gating_delta_rule_update,
        "fused_sigmoid_mul_cpu": gdn.sigmoid_mul_,
        "fused_qk_gemma_rmsnorm_cpu": gdn.qk_gemma_rmsnorm,
        "fused_qk_gemma_rmsnorm_with_gate_cpu": gdn.qk_gemma_rmsnorm_with_gate,
        "fused_qkvzba_split_reshape_cat_contiguous_cpu":
            gdn.qkvzba_split_reshape_cat_contiguous,
        "fused_rmsnorm_gated_cpu": gdn.rmsnorm_gated,
    }
    namespace = torch.ops.sgl_kernel
    for name, fn in ops.items():
        setattr(namespace, name, fn)


_register_torch_ops()

from . import triton_ops  # noqa: E402 - SGLang's own Triton kernels its CPU path calls
triton_ops.install()


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"sgl_kernel.{name}: not provided by the test stand-in "
                                  "(tests/sglang/stubs/sgl_kernel)")
    missing.__name__ = name
    return missing
