"""The acceptance sweep (tests/generic_sweep.py) on a representative subset of architectures
no hand-written family covers, plus real 2-rank torchrun loads.

Each case: a tiny transformers checkpoint, ``pploader plan --pp 2``, a 2-rank PP load (and
PP=2 x EP=2 for MoE) bitwise equal to ``safe_open`` with every tensor owned by exactly one
stage, and the PP=2 forward built from the loaded stages equal to transformers' logits. The
full sweep over every causal-LM architecture is ``python tests/generic_sweep.py`` (its table
is in docs/families.md).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import generic_sweep
from helpers import reference_tensors, run, torchrun_cmd

#: model type -> what it stands for (none has a hand-written family)
SUBSET = {
    "gemma2": "sliding / full attention alternating, soft-capping",
    "gpt_oss": "MoE, stacked 3-D experts with biases, attention sinks, sliding window",
    "qwen2_moe": "MoE, per-expert tensors + shared expert",
    "granitemoe": "MoE, 3-D experts renamed on save (input_linear / output_linear)",
    "olmo2": "q/k norms over the full projection width (replicated under TP, as vLLM)",
    "starcoder2": "dense with biases, plain MLP",
    "gpt2": "GPT-2 layout: transformer.h, learned positions on the first stage",
    "bart": "decoder of an encoder-decoder: layernorm_embedding registered after the layers",
    "lfm2": "hybrid: short convolutions + attention (conv layers: cache kind short_conv)",
    "zamba2": "hybrid Mamba2 + shared attention blocks",
    "mamba2": "pure SSM",
    "gemma4_text": "per-layer inputs sliced per layer from one pre-loop tensor",
    "gemma3n_text": "KV sharing across the boundary (KVSharingDict), AltUp streams",
    "gemma4": "multimodal wrapper indexing the (zero) embedding's pad row on a later stage",
    "zaya": "parameters held by the text model itself, used before the layer loop",
    "reformer": "namedtuple layer outputs, reversible two-stream layers",
}


@pytest.fixture(scope="module")
def quiet() -> None:
    import logging
    import transformers
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("transformers").setLevel(logging.ERROR)


#: run in the default suite (a few seconds each); the others are marked slow
DEFAULT = {"gemma2", "gpt_oss", "qwen2_moe", "lfm2", "mamba2", "bart", "gemma4_text"}


def _case(t: str) -> object:
    return pytest.param(t, marks=[] if t in DEFAULT else [pytest.mark.slow])


@pytest.mark.parametrize("model_type", [_case(t) for t in sorted(SUBSET)])
def test_sweep_case(model_type: str, tmp_path: Path, quiet: None) -> None:
    arch = generic_sweep.causal_lm_types()[model_type]
    row = generic_sweep.check(model_type, arch, tmp_path)
    assert row["result"] == "exact", row
    assert row["family"] == f"generic:{model_type}"
    assert row["forward"] == "bit-identical" or row["forward"].startswith("close"), row
    if row["experts"]:
        assert "PP=2xEP=2" in row["loads"]


@pytest.mark.slow
@pytest.mark.parametrize("model_type,pools", [("gemma2", True), ("gpt_oss", True),
                                              ("lfm2", False)])
def test_torchrun_two_rank_load_bitwise(model_type: str, pools: bool, tmp_path: Path,
                                        quiet: None) -> None:
    """``pploader load`` under torchrun (2 ranks, PP=2): each rank's tensors equal safe_open's;
    together they are the whole checkpoint (a tied embedding also on the last rank)."""
    from safetensors.torch import load_file
    arch = generic_sweep.causal_lm_types()[model_type]
    model_dir = tmp_path / "model"
    generic_sweep._checkpoint(model_type, arch, model_dir)
    out = tmp_path / "loaded"
    args = ["load", "--model", str(model_dir), "--pp", "2", "--timeout", "60",
            "--save-loaded", str(out)] + ([] if pools else ["--no-pools"])
    proc = run(torchrun_cmd(2, *args), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = reference_tensors(model_dir)
    seen: set[str] = set()
    for rank in range(2):
        loaded = load_file(str(out / f"rank-{rank}.safetensors"))
        assert loaded, rank
        for name, tensor in loaded.items():
            assert torch.equal(tensor.reshape(-1).view(torch.uint8),
                               ref[name].reshape(-1).view(torch.uint8)), (rank, name)
        seen |= set(loaded)
    assert seen == set(ref)


#: architectures only the shrink's nested-config handling reaches (a few seconds each)
NESTED = {
    "qwen3_5": "composite config: Qwen3_5ForCausalLM is built from (and saves) its text_config",
    "dbrx": "attn_config / ffn_config sub-configs",
    "fuyu": "vision embedding registered after the LM and run first, through a helper method",
    "gemma3": "ForConditionalGeneration: vision tower + projector on the first stage",
    "mllama": "text_config; cross-attention layers a text-only pass skips, at the boundary",
}
#: model type -> a name fragment of tensors that must be planned by the first stage only
FIRST_STAGE = {"fuyu": "vision_embed_tokens", "gemma3": "vision_tower"}


@pytest.mark.parametrize("model_type", sorted(NESTED))
def test_sweep_nested_config(model_type: str, tmp_path: Path, quiet: None) -> None:
    from pploader.planning.checkpoint import open_checkpoint
    from pploader.planning.plan import plan_all
    from pploader.planning.spec import load_spec
    arch = generic_sweep.causal_lm_types()[model_type]
    row = generic_sweep.check(model_type, arch, tmp_path)
    assert row["result"] == "exact", row
    assert row["forward"] == "bit-identical" or row["forward"].startswith("close"), row
    if model_type == "qwen3_5":  # the text config's model_type: the hand-written family
        assert row["family"] == "qwen3_5", row
    fragment = FIRST_STAGE.get(model_type)
    if fragment:
        plans = plan_all(load_spec(tmp_path / model_type), open_checkpoint(tmp_path / model_type),
                         2, 1, 1)
        owned = [{n for n in p.tensors if fragment in n} for p in plans]
        assert owned[0] and not owned[1], owned


def test_shrink_keeps_layer_patterns() -> None:
    """The shrink keeps each per-layer pattern (not just the first layers) and renumbers the
    layer-indexed entries consistently; widths of other configs shrink with the text width."""
    gemma4 = generic_sweep.tiny_config("gemma4_text")
    assert gemma4.num_hidden_layers == generic_sweep.LAYERS
    assert set(gemma4.layer_types) == {"sliding_attention", "full_attention"}
    full = {i for i, t in enumerate(gemma4.layer_types) if t == "full_attention"}
    overrides = gemma4.to_dict()["per_layer_config"]  # head_dim overrides follow them, wider
    assert {int(k) for k in overrides} == full
    assert all(v["head_dim"] > gemma4.to_dict()["head_dim"] for v in overrides.values())
    dots3 = generic_sweep.tiny_config("dots3_note")
    assert dots3.vision_config.adapter_out_dim == dots3.text_config.hidden_size == 64
    import transformers
    qwen = generic_sweep.model_config(generic_sweep.tiny_config("qwen3_5"),
                                      transformers.Qwen3_5ForCausalLM)
    assert type(qwen).__name__ == "Qwen3_5TextConfig" and qwen.vocab_size == 128


@pytest.mark.parametrize("model_type", ["zamba", "zamba2"])
def test_shared_block_planned_for_every_stage(model_type: str, tmp_path: Path, quiet: None,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Zamba's shared transformer block: stored once (layer 2), tied into every later hybrid
    layer. At PP=4 (one layer per stage) the stage of layer 3 reads layer 2's tensors under
    its own names; the independent check (the module tree's needs per layer) agrees, and a
    transformers stage built from the plan has no parameter left unloaded. Without the
    shared reads the strict accounting refuses, and the independent check would fail."""
    from pploader import PlanError
    from pploader.integrations.hf import build_stage
    from pploader.planning.checkpoint import open_checkpoint
    from pploader.planning.plan import plan_all
    from pploader.planning.roles import CheckpointRoles
    from pploader.planning.spec import load_spec
    from pploader.planning.topology import Topology
    arch = generic_sweep.causal_lm_types()[model_type]
    model = generic_sweep._checkpoint(model_type, arch, tmp_path / "m")
    spec, index = load_spec(tmp_path / "m"), open_checkpoint(tmp_path / "m")
    shared = spec.for_checkpoint(index.weight_map).family.shared
    assert shared and all(t.startswith("model.layers.3.") and s.startswith("model.layers.2.")
                          for t, s, _ in shared)
    generic_sweep.exactness_check(model, spec, index, 4)
    last = plan_all(spec, index, 4)[3]
    borrowed = {(i.name, i.target) for i in last.items if i.name != i.target}
    assert {(s, t) for t, s, _ in shared} <= borrowed
    for rank in range(4):  # transformers' own loader: strict, no parameter left on meta
        build_stage(tmp_path / "m", Topology(4, rank=rank))
    monkeypatch.setattr(CheckpointRoles, "shared_reads", lambda self, w, e: [])
    with pytest.raises(PlanError, match="tied copy of model.layers.2"):
        plan_all(load_spec(tmp_path / "m"), open_checkpoint(tmp_path / "m"), 4)
    with pytest.raises(AssertionError, match="needs but does not load"):
        import pploader.planning.plan as plan_mod
        monkeypatch.setattr(plan_mod, "check_expected", lambda *a, **k: None)
        generic_sweep.exactness_check(model, load_spec(tmp_path / "m"),
                                      open_checkpoint(tmp_path / "m"), 4)


@pytest.mark.parametrize("model_type", ["mamba", "falcon_mamba", "mamba2", "zamba2"])
def test_ssm_cache_geometry_from_the_layers_parameters(model_type: str, quiet: None) -> None:
    """Configs naming SSM sizes under keys the config-key readers do not know (Mamba's
    ``state_size`` / ``intermediate_size``, Mamba2's ``num_heads``): the generic family sizes
    the cache from each mixer's own parameter shapes. Each layer's conv / ssm state equals
    the one transformers' own cache holds after a forward (conv: pploader keeps kernel - 1),
    and a layer has KV pages exactly where transformers caches keys (Zamba2's hybrid layer 3,
    whose shared block is a tied copy, included)."""
    import json
    import transformers
    from pploader.cache.geometry import model_cache
    from pploader.planning.spec import spec_from_config
    arch = generic_sweep.causal_lm_types()[model_type]
    config = generic_sweep.model_config(generic_sweep.tiny_config(model_type),
                                        getattr(transformers, arch))
    raw = json.loads(config.to_json_string())
    spec = spec_from_config({**raw, "architectures": [arch], "dtype": "float32"})
    model = getattr(transformers, arch)._from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(input_ids=torch.arange(5).unsqueeze(0), use_cache=True)
    cache = getattr(out, "past_key_values", None) or getattr(out, "cache")
    checked = 0
    for layer, ours in enumerate(model_cache(spec, 1)):
        theirs = cache.layers[layer]
        keys = getattr(theirs, "keys", None)  # attention beside the mixer (Zamba2's hybrid
        assert (ours.kv is None) == (keys is None), (layer, ours.kind)  # layers, tied ones too)
        if keys is not None:
            assert (ours.kv.heads, ours.kv.head_dim) == (keys.shape[1], keys.shape[3]), layer
        if not ours.states:
            continue
        (conv,), (ssm,) = theirs.conv_states.values(), theirs.recurrent_states.values()
        got = {s.name: s.shape for s in ours.states}
        assert got["conv"] == (conv.shape[1], conv.shape[2] - 1), (layer, got, conv.shape)
        assert got["ssm"] == tuple(ssm.shape[1:]), (layer, got, ssm.shape)
        checked += 1
    assert checked >= 3


@pytest.mark.slow
@pytest.mark.parametrize("model_type,exit_code", [("xlstm", 2), ("mamba2", 0)])
def test_default_load_pools_succeed_or_refused_before_reading(
        model_type: str, exit_code: int, tmp_path: Path, quiet: None) -> None:
    """Default ``pploader load`` (pools on): a model whose cache geometry is derived loads
    (mamba2: sized from the mixers' parameters); one with a layer kind pploader cannot size
    (xLSTM's mLSTM) is refused in the planning step, exit 2 naming --no-pools,
    and loads with --no-pools."""
    arch = generic_sweep.causal_lm_types()[model_type]
    model_dir = tmp_path / "model"
    generic_sweep._checkpoint(model_type, arch, model_dir)
    args = [sys.executable, "-m", "pploader", "load", "--model", str(model_dir), "--pp", "1",
            "--timeout", "60"]  # one process: the launcher-less single-rank load
    proc = run(args, timeout=300)
    assert proc.returncode == exit_code, proc.stderr[-3000:]
    if exit_code == 2:
        assert "--no-pools" in proc.stderr and "cache pools cannot be sized" in proc.stderr
        assert "read" not in proc.stdout  # no per-rank read table: nothing was loaded
        proc = run(args + ["--no-pools"], timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    else:
        assert "cache pools" in proc.stdout


def test_zamba2_two_shared_blocks_every_stage_gets_its_weights(tmp_path: Path,
                                                               quiet: None) -> None:
    """Zamba2 with two shared blocks cycling over four hybrid layers (0, 2, 3, 5: layer 3
    ties to 0, layer 5 to 2): exact at PP 2, 3 and 6 under the independent check, and every
    stage transformers builds from the plan holds exactly from_pretrained's weights, except
    the other hybrid layers' adapters its layers hold but never run (zeros, not read)."""
    import transformers
    from pploader.integrations.hf import build_stage
    from pploader.planning.checkpoint import open_checkpoint
    from pploader.planning.spec import load_spec
    from pploader.planning.topology import Topology
    config = generic_sweep.model_config(generic_sweep.tiny_config("zamba2"),
                                        transformers.Zamba2ForCausalLM)
    config.num_hidden_layers, config.num_mem_blocks = 6, 2
    config.layers_block_type = ["hybrid", "linear_attention", "hybrid", "hybrid",
                                "linear_attention", "hybrid"]
    config.hybrid_layer_ids = [0, 2, 3, 5]
    config.architectures = ["Zamba2ForCausalLM"]
    torch.manual_seed(0)
    model = transformers.Zamba2ForCausalLM._from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    spec, index = load_spec(tmp_path), open_checkpoint(tmp_path)
    pairs = {(t.split(".")[2], s.split(".")[2])
             for t, s, _ in spec.for_checkpoint(index.weight_map).family.shared}
    assert pairs == {("3", "0"), ("5", "2")}
    for pp in (2, 3, 6):
        generic_sweep.exactness_check(model, spec, index, pp)
    ref = transformers.Zamba2ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    want = ref.state_dict()
    for rank in range(3):
        got = build_stage(tmp_path, Topology(3, rank=rank)).model.state_dict()
        idle = {k for k in got if k.startswith(tuple(
            p + "." for p in generic_sweep.unrun_adapters(model)))}
        assert idle and all(not got[k].any() for k in idle), rank
        assert all(torch.equal(v, want[k]) for k, v in got.items()
                   if not v.is_meta and k not in idle), rank
