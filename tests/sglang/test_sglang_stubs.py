"""The SGLang suite's plain-torch stand-ins against transformers' own torch references: the
gated-delta-net CPU ops (tests/sglang/stubs/sgl_kernel/gdn.py) against Qwen3.5
(``modeling_qwen3_5``: the chunked gated delta rule, causal conv1d, the gated RMSNorm), and
the shared-expert gate (``triton_ops.py``) against Qwen3.5-MoE's sparse block. No engine: the
hybrid engine tests compare loaders, both on these stand-ins, so this is what says the
stand-ins compute the layers' math."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch

HERE = Path(__file__).resolve().parent


def _gdn() -> ModuleType:
    """The stand-in module by file (not through ``sgl_kernel``: that would register its
    ops on ``torch.ops`` in this process)."""
    spec = importlib.util.spec_from_file_location("_gdn_stub",
                                                  HERE / "stubs" / "sgl_kernel" / "gdn.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def ref() -> ModuleType:
    return pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")


def test_prefill_then_decode_follow_the_gated_delta_rule(ref: ModuleType) -> None:
    """Two sequences back to back (pool slots 3 and 1, one resuming a state): the prefill's
    outputs and the final states written to the pool equal transformers' chunked rule per
    sequence; one decode step each (gating fused in) equals the rule over the longer
    sequence. GQA: 4 value heads on 2 key heads."""
    gdn = _gdn()
    torch.manual_seed(0)
    hk, hv, dk, dv, lens = 2, 4, 16, 8, (5, 7)
    total = sum(lens)
    q, k = torch.randn(1, total + 2, hk, dk), torch.randn(1, total + 2, hk, dk)
    v = torch.randn(1, total + 2, hv, dv)
    A_log, dt_bias = torch.randn(hv) * 0.5, torch.randn(hv)
    a, b = torch.randn(total + 2, hv), torch.randn(total + 2, hv)
    g, beta = gdn.gdn_gating(A_log, a, b, dt_bias)
    assert torch.all(g <= 0) and torch.all((beta > 0) & (beta < 1))
    pool = torch.zeros(5, hv, dv, dk)
    start1 = torch.randn(hv, dv, dk) * 0.1
    pool[1] = start1
    slots, cu = torch.tensor([3, 1]), torch.tensor([0, lens[0], total])
    out, finals = gdn.chunk_gated_delta_rule(q[:, :total], k[:, :total], v[:, :total],
                                             g[:, :total], beta[:, :total], pool, cu, True,
                                             slots)
    for i, (s, e) in enumerate([(0, lens[0]), (lens[0], total)]):
        init = None if i == 0 else start1.transpose(-1, -2).unsqueeze(0)
        want, state = ref.torch_chunk_gated_delta_rule(
            q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], initial_state=init,
            output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(out[:, s:e], want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(pool[int(slots[i])], state[0].transpose(-1, -2),
                                   atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(finals[i], state[0].transpose(-1, -2), atol=1e-4, rtol=1e-4)
    # one decode token per sequence (tokens total, total + 1), the gating inside the op
    step = gdn.sigmoid_gating_delta_rule_update(
        A_log, dt_bias, q[:, total:], k[:, total:], v[:, total:], a[total:], b[total:], pool,
        slots, torch.tensor([0, 1, 2]), True)
    for i, (s, e) in enumerate([(0, lens[0]), (lens[0], total)]):
        idx = list(range(s, e)) + [total + i]
        init = None if i == 0 else start1.transpose(-1, -2).unsqueeze(0)
        want, _ = ref.torch_chunk_gated_delta_rule(
            q[:, idx], k[:, idx], v[:, idx], g[:, idx], beta[:, idx], initial_state=init,
            output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(step[0, i], want[0, -1], atol=1e-4, rtol=1e-4)


def test_causal_conv1d_prefill_then_update_keep_the_conv_state(ref: ModuleType) -> None:
    """Varlen prefill (one sequence shorter than the kernel) then two decode steps: each
    output equals transformers' causal conv1d over the whole sequence so far (SiLU), and the
    state is the last ``width - 1`` inputs."""
    gdn = _gdn()
    torch.manual_seed(1)
    dim, width, lens = 6, 4, (2, 6)
    total = sum(lens)
    x = torch.randn(dim, total + 4)
    weight, bias = torch.randn(dim, width), torch.randn(dim)
    states = torch.zeros(4, dim, width - 1)
    slots = torch.tensor([2, 0])
    out = gdn.causal_conv1d_fwd(x[:, :total], weight, bias, states,
                                torch.tensor([0, lens[0], total]), slots,
                                torch.tensor([False, False]), True)
    seqs = [x[:, :lens[0]], x[:, lens[0]:total]]
    for i, seq in enumerate(seqs):
        s = 0 if i == 0 else lens[0]
        want = ref.causal_conv1d_fn(seq.unsqueeze(0), weight, bias, activation="silu")[0]
        torch.testing.assert_close(out[:, s:s + seq.shape[1]], want)
    for t in range(2):
        new = x[:, total + 2 * t: total + 2 * t + 2].T.contiguous()   # [batch 2, dim]
        got = gdn.causal_conv1d_step(new, states, weight, bias, True, slots)
        for i in range(2):
            seqs[i] = torch.cat([seqs[i], new[i:i + 1].T], dim=1)
            want = ref.causal_conv1d_fn(seqs[i].unsqueeze(0), weight, bias,
                                        activation="silu")[0, :, -1]
            torch.testing.assert_close(got[i], want)
            tail = torch.nn.functional.pad(seqs[i], (width - 1, 0))[:, -(width - 1):]
            torch.testing.assert_close(states[int(slots[i])], tail)


def test_gated_norm_and_projection_split(ref: ModuleType) -> None:
    """The gated RMSNorm equals transformers' Qwen3_5RMSNormGated; the contiguous
    ``[q | k | v | z]`` / ``[b | a]`` split gives ``cat(q, k, v)``, ``z`` per value head."""
    gdn = _gdn()
    torch.manual_seed(2)
    x, z = torch.randn(10, 16), torch.randn(10, 16)
    norm = ref.Qwen3_5RMSNormGated(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16))
        torch.testing.assert_close(gdn.rmsnorm_gated(x, norm.weight, z, 1e-6), norm(x, z))
    qkvz, ba = torch.randn(3, 2 * 2 * 4 + 2 * 4 * 2), torch.randn(3, 8)
    mixed, zz, bb, aa = gdn.qkvzba_split_reshape_cat_contiguous(qkvz, ba, 2, 4, 4, 2)
    assert torch.equal(mixed, qkvz[:, :24]) and torch.equal(zz.reshape(3, 8), qkvz[:, 24:])
    assert torch.equal(bb, ba[:, :4]) and torch.equal(aa, ba[:, 4:])


def test_shared_expert_gate_is_transformers_qwen3_5_moe_block() -> None:
    """The stand-in for SGLang's Triton shared-expert gate (stubs/sgl_kernel/triton_ops.py),
    added to a routed output as SGLang's Qwen2-MoE block calls it, equals transformers'
    Qwen3.5-MoE sparse block (its shared expert through ``sigmoid(shared_expert_gate(h))``,
    plus the experts' output)."""
    moe = pytest.importorskip("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
    spec = importlib.util.spec_from_file_location(
        "_triton_ops_stub", HERE / "stubs" / "sgl_kernel" / "triton_ops.py")
    assert spec is not None and spec.loader is not None
    ops = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ops)
    torch.manual_seed(0)
    config = Qwen3_5MoeTextConfig(hidden_size=32, moe_intermediate_size=16,
                                  shared_expert_intermediate_size=16, num_experts=4,
                                  num_experts_per_tok=2)
    block = moe.Qwen3_5MoeSparseMoeBlock(config).eval()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    h = torch.randn(5, 32)
    with torch.no_grad():
        want = block(h[None])[0]
        _, weights, experts = block.gate(h)
        routed = block.experts(h, experts, weights).contiguous()
        shared = block.shared_expert(h).contiguous()
        ops.launch_fused_gate_sigmoid_mul(h, block.shared_expert_gate.weight.squeeze(0)
                                          .contiguous(), shared, routed, do_add=True)
    torch.testing.assert_close(routed, want, rtol=1e-5, atol=1e-5)
