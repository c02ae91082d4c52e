"""Plain-torch stand-ins for the CPU ops SGLang's Qwen3.5 (gated delta net) path calls.

Each is written from the op's documented math (the Triton kernels of the same names in
SGLang and the causal-conv1d / flash-linear-attention rules they implement), small and
unoptimised: a causal depthwise conv1d with a per-request conv state, the gated delta rule
(recurrent form; chunking changes no arithmetic beyond rounding) with a per-request state,
and the norms / gates around them. Test-only: both loaders run the same ones, so a token
difference between loaders is the loader's. State layouts are SGLang's pools': conv state
``[slot, dim, width - 1]``, recurrent state ``[slot, v_heads, v_dim, k_dim]``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def _spans(cu_seqlens: Optional[torch.Tensor], total: int) -> list[tuple[int, int]]:
    if cu_seqlens is None:
        return [(0, total)]
    ends = [int(x) for x in cu_seqlens.tolist()]
    return list(zip(ends[:-1], ends[1:]))


def causal_conv1d_fwd(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                      conv_states: Optional[torch.Tensor], query_start_loc: Optional[torch.Tensor],
                      cache_indices: Optional[torch.Tensor],
                      has_initial_state: Optional[torch.Tensor], silu: bool) -> torch.Tensor:
    """Varlen causal depthwise conv: ``x`` is ``[dim, tokens]`` (sequences back to back);
    ``out[:, t] = bias + sum_j weight[:, j] * x'[:, t - (W-1) + j]`` with ``x'`` the sequence
    behind its conv state (zeros when it has none), then SiLU if asked. Each sequence's
    last ``W - 1`` inputs become its slot's conv state."""
    width = weight.shape[1]
    out = torch.empty_like(x)
    for i, (start, end) in enumerate(_spans(query_start_loc, x.shape[1])):
        seq = x[:, start:end].float()
        slot = int(cache_indices[i]) if cache_indices is not None else -1
        if conv_states is not None and slot >= 0 and has_initial_state is not None \
                and bool(has_initial_state[i]):
            prev = conv_states[slot].float()
        else:
            prev = seq.new_zeros(seq.shape[0], width - 1)
        full = torch.cat([prev, seq], dim=1)
        y = F.conv1d(full.unsqueeze(0), weight.float().unsqueeze(1),
                     None if bias is None else bias.float(), groups=seq.shape[0])[0]
        if silu:
            y = F.silu(y)
        out[:, start:end] = y.to(x.dtype)
        if conv_states is not None and slot >= 0:
            conv_states[slot] = full[:, -(width - 1):].to(conv_states.dtype)
    return out


def causal_conv1d_step(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                       bias: Optional[torch.Tensor], silu: bool,
                       conv_state_indices: Optional[torch.Tensor]) -> torch.Tensor:
    """Decode: ``x`` ``[batch, dim]`` (or ``[batch, dim, steps]``), one new token per
    request per step; the output is the conv over (state, token), the state shifts left by
    one and takes the token."""
    squeeze = x.dim() == 2
    xs = x.unsqueeze(-1) if squeeze else x
    out = torch.empty_like(xs)
    for i in range(xs.shape[0]):
        slot = int(conv_state_indices[i]) if conv_state_indices is not None else i
        if slot < 0:
            out[i] = 0
            continue
        for t in range(xs.shape[2]):
            full = torch.cat([conv_state[slot].float(), xs[i, :, t:t + 1].float()], dim=1)
            y = (full * weight.float()).sum(dim=1)
            if bias is not None:
                y = y + bias.float()
            out[i, :, t] = (F.silu(y) if silu else y).to(x.dtype)
            conv_state[slot] = full[:, 1:].to(conv_state.dtype)
    return out.squeeze(-1) if squeeze else out


def gdn_gating(A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor,
               beta: float = 1.0, threshold: float = 20.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``; ``[1, T, H]`` fp32."""
    g = -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float(), beta=beta,
                                               threshold=threshold)
    return g.unsqueeze(0), torch.sigmoid(b.float()).unsqueeze(0)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, state: torch.Tensor, l2norm: bool
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: q, k ``[T, Hk, K]``, v ``[T, Hv, V]``, g, beta ``[T, Hv]``, state
    ``[Hv, V, K]`` (fp32). Per token and value head ``h`` (key head ``h // (Hv/Hk)``):
    ``S *= exp(g)``, ``S += beta * (v - S k) k^T``, ``o = S q * K^-0.5``."""
    group = v.shape[1] // q.shape[1]
    q = q.float().repeat_interleave(group, dim=1)
    k = k.float().repeat_interleave(group, dim=1)
    if l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * q.shape[-1] ** -0.5
    out = v.new_empty(v.shape, dtype=torch.float32)
    s = state.float().clone()
    for t in range(q.shape[0]):
        s = s * torch.exp(g[t].float())[:, None, None]
        kv = torch.einsum("hvk,hk->hv", s, k[t])
        u = (v[t].float() - kv) * beta[t].float()[:, None]
        s = s + torch.einsum("hv,hk->hvk", u, k[t])
        out[t] = torch.einsum("hvk,hk->hv", s, q[t])
    return out, s


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, initial_state: torch.Tensor,
                           cu_seqlens: Optional[torch.Tensor], use_qk_l2norm_in_kernel: bool,
                           initial_state_indices: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill: ``q``/``k``/``v`` ``[1, T, H, D]``, ``g``/``beta`` ``[1, T, Hv]``; sequence
    ``i`` starts from pool slot ``initial_state_indices[i]`` (SGLang zeroes a new
    request's slot) and its final state is written back there."""
    out = torch.empty_like(v)
    finals = []
    for i, (start, end) in enumerate(_spans(cu_seqlens, q.shape[1])):
        slot = int(initial_state_indices[i])
        o, s = _delta_rule(q[0, start:end], k[0, start:end], v[0, start:end],
                           g[0, start:end], beta[0, start:end], initial_state[slot],
                           use_qk_l2norm_in_kernel)
        out[0, start:end] = o.to(out.dtype)
        initial_state[slot] = s.to(initial_state.dtype)
        finals.append(s)
    return out, torch.stack(finals)


def sigmoid_gating_delta_rule_update(
        A_log: torch.Tensor, dt_bias: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
        v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, initial_state_source: torch.Tensor,
        initial_state_indices: torch.Tensor, cu_seqlens: Optional[torch.Tensor],
        use_qk_l2norm_in_kernel: bool, softplus_beta: float = 1.0,
        softplus_threshold: float = 20.0) -> torch.Tensor:
    """Decode: the gating (as ``gdn_gating``) fused with the recurrent rule, state read from
    and written back to the pool; ``a``/``b`` ``[T, Hv]``, output ``[1, T, Hv, V]``."""
    g, beta = gdn_gating(A_log, a, b, dt_bias, softplus_beta, softplus_threshold)
    out = torch.empty_like(v)
    for i, (start, end) in enumerate(_spans(cu_seqlens, q.shape[1])):
        slot = int(initial_state_indices[i])
        if slot < 0:
            out[0, start:end] = 0
            continue
        o, s = _delta_rule(q[0, start:end], k[0, start:end], v[0, start:end],
                           g[0, start:end], beta[0, start:end], initial_state_source[slot],
                           use_qk_l2norm_in_kernel)
        out[0, start:end] = o.to(out.dtype)
        initial_state_source[slot] = s.to(initial_state_source.dtype)
    return out


def _gemma_rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


def qk_gemma_rmsnorm(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                     k_weight: torch.Tensor, eps: float, head_dim: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma RMSNorm (``x * rsqrt(mean x^2 + eps) * (1 + w)``) of each q and k head."""
    return (_gemma_rms(q.reshape(-1, head_dim), q_weight, eps),
            _gemma_rms(k.reshape(-1, head_dim), k_weight, eps))


def qk_gemma_rmsnorm_with_gate(q_gate: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                               k_weight: torch.Tensor, eps: float, head_dim: int,
                               num_heads: int) -> tuple[torch.Tensor, ...]:
    """Qwen3.5's gated q: each head's ``[q | gate]`` split, q and k normed as above, the
    gate returned as is (``[T, heads, head_dim]``)."""
    tokens = q_gate.shape[0]
    q, gate = torch.chunk(q_gate.reshape(tokens, num_heads, 2 * head_dim), 2, dim=-1)
    qn, kn = qk_gemma_rmsnorm(q, k, q_weight, k_weight, eps, head_dim)
    return qn, kn, gate.contiguous()


def sigmoid_mul_(x: torch.Tensor, gate: torch.Tensor) -> None:
    """In place: ``x *= sigmoid(gate)`` (gate viewed as ``x``'s shape)."""
    x.copy_((x.float() * torch.sigmoid(gate.reshape(x.shape).float())).to(x.dtype))


def qkvzba_split_reshape_cat_contiguous(mixed_qkvz: torch.Tensor, mixed_ba: torch.Tensor,
                                        num_heads_qk: int, num_heads_v: int, head_qk: int,
                                        head_v: int) -> tuple[torch.Tensor, ...]:
    """Qwen3.5's contiguous projections ``[q | k | v | z]`` and ``[b | a]``: returns
    ``cat(q, k, v)``, ``z`` as ``[T, Hv, V]``, ``b``, ``a``."""
    kd, vd = num_heads_qk * head_qk, num_heads_v * head_v
    q, k, v, z = mixed_qkvz.split([kd, kd, vd, vd], dim=-1)
    b, a = mixed_ba.split([num_heads_v, num_heads_v], dim=-1)
    return (torch.cat([q, k, v], dim=-1), z.reshape(z.shape[0], num_heads_v, head_v),
            b.contiguous(), a.contiguous())


def rmsnorm_gated(x: torch.Tensor, weight: torch.Tensor, z: Optional[torch.Tensor],
                  eps: float) -> torch.Tensor:
    """Norm before gate: ``rmsnorm(x) * weight * silu(z)`` over the last dim."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()
    if z is not None:
        y = y * F.silu(z.reshape(x.shape).float())
    return y.to(x.dtype)
