"""``sgl_kernel.mamba``: the Python entry points SGLang's GDN backend imports on CPU.

Importing it (SGLang does, from its GDN backend, only on a CPU host) also selects SGLang's
CPU branch of the gated RMSNorm after the GDN core (``layernorm_gated.RMSNorm``). SGLang
takes that branch only on an AMX CPU; elsewhere it falls to a Triton kernel that asks CUDA
for the device's SM count, which fails on a CPU-only host. The branch it selects calls
``fused_rmsnorm_gated_cpu``, provided by this stand-in.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from . import gdn


def causal_conv1d_fn_cpu(mixed_qkv_transposed: torch.Tensor, conv_weights: torch.Tensor,
                         bias: Optional[torch.Tensor], activation: Optional[str],
                         conv_states: torch.Tensor, has_initial_state: torch.Tensor,
                         cache_indices: torch.Tensor, query_start_loc: torch.Tensor,
                         seq_lens_cpu: Any = None, **_: Any) -> torch.Tensor:
    return gdn.causal_conv1d_fwd(mixed_qkv_transposed, conv_weights, bias, conv_states,
                                 query_start_loc, cache_indices, has_initial_state,
                                 activation in ("silu", "swish"))


def causal_conv1d_update_cpu(mixed_qkv: torch.Tensor, conv_states: torch.Tensor,
                             conv_weights: torch.Tensor, bias: Optional[torch.Tensor],
                             activation: Optional[str], conv_state_indices: torch.Tensor,
                             **kwargs: Any) -> torch.Tensor:
    if kwargs.get("intermediate_conv_window") is not None:
        raise NotImplementedError("causal_conv1d_update_cpu: speculative verify windows are "
                                  "not in the test stand-in")
    return gdn.causal_conv1d_step(mixed_qkv, conv_states, conv_weights, bias,
                                  activation in ("silu", "swish"), conv_state_indices)


def chunk_gated_delta_rule_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               g: torch.Tensor, beta: torch.Tensor,
                               initial_state: torch.Tensor, cu_seqlens: torch.Tensor,
                               head_first: bool, use_qk_l2norm_in_kernel: bool,
                               initial_state_indices: torch.Tensor) -> tuple[Any, ...]:
    if head_first:
        raise NotImplementedError("chunk_gated_delta_rule_cpu: head_first layout")
    out, final = gdn.chunk_gated_delta_rule(q, k, v, g, beta, initial_state, cu_seqlens,
                                            use_qk_l2norm_in_kernel, initial_state_indices)
    return out, final, None


def _select_cpu_gated_norm() -> None:
    from sglang.kernels.ops.attention.fla import layernorm_gated
    layernorm_gated._use_cpu = True   # type: ignore[attr-defined]


_select_cpu_gated_norm()
