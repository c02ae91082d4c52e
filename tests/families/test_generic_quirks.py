"""Real-world checkpoint quirks (docs/families.md, "Quirks") and the generic family's edges.

- llama ``attention_bias`` / ``mlp_bias``: the hand-written family plans them exactly (template =
  what transformers writes), TP splits q/k/v/gate/up biases, replicates o/down biases;
- a tied config whose checkpoint also stores ``lm_head.weight``: the stored head is read as the
  head (transformers does the same when the two differ), not the embedding;
- stray ``rotary_emb.inv_freq`` buffers: known, never read, logged;
- the generic family: TP rules derived for known projections equal the hand-written ones, TP
  refused (naming the tensor) where a split is ambiguous; layer kinds from ``layer_types``;
  transformers imported only when the generic family is used.
"""
from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from helpers import ROOT, reference_tensors
from test_generic import assert_same_plans
from pploader import ConfigError, PlanError
from pploader.io.read import Reader
from pploader.planning.checkpoint import open_checkpoint
from pploader.planning.plan import plan_all
from pploader.planning.spec import load_spec, spec_from_config
from pploader.families import generic, generic_tp

TINY = dict(vocab_size=128, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, intermediate_size=64, num_hidden_layers=4, max_position_embeddings=64,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _save(model_type: str, out: Path, **kw: object) -> torch.nn.Module:
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(model_type, **{**TINY, "dtype": "float32", **kw})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(out, max_shard_size="20KB")
    return model


def _load_all(path: Path, pp: int, tp: int = 1) -> dict[int, dict[str, torch.Tensor]]:
    spec, index = load_spec(path), open_checkpoint(path)
    return {p.topology.rank: dict(Reader(p)) for p in plan_all(spec, index, pp, tp)}


def _logits(path: Path, model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    from pploader.integrations.hf import build_stage
    from pploader.planning.topology import Topology
    stages = [build_stage(path, Topology(2, rank=r)) for r in range(2)]
    ids = torch.arange(7).unsqueeze(0)
    with torch.no_grad():
        got = stages[1].forward(ids, stages[0].forward(ids))
        want = model(input_ids=ids, use_cache=False).logits
    return got, want


@pytest.mark.slow
def test_llama_optional_biases(tmp_path: Path) -> None:
    model = _save("llama", tmp_path, attention_bias=True, mlp_bias=True)
    spec, index = load_spec(tmp_path), open_checkpoint(tmp_path)
    assert spec.family.name == "llama"
    template = {n: tuple(s) for n, s in spec.family.template(spec).items()}
    assert template == {n: index.entry(n).shape for n in index.weight_map}
    assert "model.layers.0.mlp.down_proj.bias" in template
    assert "model.layers.0.self_attn.o_proj.bias" in template
    ref = reference_tensors(tmp_path)
    for tensors in _load_all(tmp_path, 2).values():
        for name, t in tensors.items():
            assert torch.equal(t, ref[name])
    tp = {i.name: i.shape for p in plan_all(spec, index, 1, 2) if p.topology.tp_rank == 1
          for i in p.items}
    assert tp["model.layers.0.self_attn.q_proj.bias"] == (16,)      # by heads
    assert tp["model.layers.0.mlp.up_proj.bias"] == (32,)           # column
    assert tp["model.layers.0.self_attn.o_proj.bias"] == (32,)      # replicated
    assert tp["model.layers.0.mlp.down_proj.bias"] == (32,)         # replicated
    got, want = _logits(tmp_path, model)
    assert torch.equal(got, want)
    assert_same_plans(tmp_path, tp=2)  # the generic family derives the same splits


def _add_tensors(path: Path, tensors: dict[str, torch.Tensor], fname: str) -> None:
    save_file(tensors, str(path / fname), metadata={"format": "pt"})
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"].update({n: fname for n in tensors})
    index_path.write_text(json.dumps(index))


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen3", "olmo2"])  # hand-written and generic
def test_tied_config_with_stored_head_reads_the_head(tmp_path: Path, model_type: str) -> None:
    import transformers
    model = _save(model_type, tmp_path, tie_word_embeddings=True)
    head = torch.randn(128, 32, generator=torch.Generator().manual_seed(3))
    _add_tensors(tmp_path, {"lm_head.weight": head}, "head.safetensors")
    spec, index = load_spec(tmp_path), open_checkpoint(tmp_path)
    assert spec.tie_word_embeddings and not spec.for_checkpoint(index.weight_map).tie_word_embeddings
    last = [p for p in plan_all(spec, index, 2) if p.window.has_head][0]
    heads = [i for i in last.items if i.target == "lm_head.weight"]
    assert [(i.name, i.file) for i in heads] == [("lm_head.weight", "head.safetensors")]
    assert not any(i.name == "model.embed_tokens.weight" for i in last.items)
    assert torch.equal(_load_all(tmp_path, 2)[1]["lm_head.weight"], head)
    # transformers reads the stored head too (it unties when the copies differ)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert torch.equal(reloaded.lm_head.weight, head)
    got, want = _logits(tmp_path, reloaded.eval())
    assert torch.equal(got, want)
    del model


@pytest.mark.slow
def test_stray_inv_freq_skipped_with_a_note(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                            ) -> None:
    _save("llama", tmp_path)
    strays = {"model.rotary_emb.inv_freq": torch.ones(4),
              "model.layers.1.self_attn.rotary_emb.inv_freq": torch.ones(4)}
    _add_tensors(tmp_path, strays, "old.safetensors")
    spec, index = load_spec(tmp_path), open_checkpoint(tmp_path)
    with caplog.at_level(logging.INFO, logger="pploader.families.base"):
        plans = plan_all(spec, index, 2)
    assert not any(i.name in strays for p in plans for i in p.items)
    assert not any(i.file == "old.safetensors" for p in plans for i in p.items)
    assert "model.rotary_emb.inv_freq" in caplog.text and "not a parameter" in caplog.text
    # any other stray is still refused
    _add_tensors(tmp_path, {"model.layers.1.self_attn.rotary_emb.cos": torch.ones(4)},
                 "old2.safetensors")
    with pytest.raises(PlanError, match="rotary_emb.cos"):
        plan_all(load_spec(tmp_path), open_checkpoint(tmp_path), 2)


@pytest.mark.slow
@pytest.mark.parametrize("model_type,extra", [
    ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)),
    ("qwen3", {})])
def test_generic_tp_rules_equal_hand_written(tmp_path: Path, model_type: str, extra: dict) -> None:
    _save(model_type, tmp_path, **extra)
    assert_same_plans(tmp_path, tp=2)


@pytest.mark.slow
def test_generic_refuses_ambiguous_tp_naming_the_tensor(tmp_path: Path) -> None:
    _save("phi3", tmp_path)  # fused qkv_proj / gate_up_proj: no unambiguous split
    index = open_checkpoint(tmp_path)
    assert load_spec(tmp_path).family.name == "phi3"  # the hand-written family splits them
    config = json.loads((tmp_path / "config.json").read_text())
    spec = spec_from_config(config, family=generic.family_for(config))
    assert spec.family.name == "generic:phi3"
    plan_all(spec, index, 2)  # PP is fine
    with pytest.raises(PlanError, match=r"tensor parallelism refused.*(qkv|gate_up)_proj") as err:
        plan_all(spec, index, 2, 2)
    assert re.fullmatch(r"model\.layers\.\d+\.(self_attn\.qkv|mlp\.gate_up)_proj\.weight",
                        err.value.tensor or ""), err.value.tensor


@pytest.mark.slow
def test_generic_layer_kinds_and_pools(tmp_path: Path) -> None:
    from pploader.cache.geometry import layer_cache
    _save("gemma2", tmp_path, sliding_window=16)
    spec = load_spec(tmp_path)
    assert spec.family.name == "generic:gemma2"
    assert spec.layer_kinds == ("sliding_attention", "full_attention") * 2
    sliding, full = layer_cache(spec, 0, 1), layer_cache(spec, 1, 1)
    assert sliding.kv is not None and sliding.window == 16  # window-sized KV pages
    assert full.kv is not None and full.window is None


def test_unknown_layer_kind_has_no_pool() -> None:
    from pploader.families.generic import _kind
    assert _kind({"conv.in_proj.weight": (3, 4), "conv.conv.weight": (4, 1, 3)}, "conv") \
        == "unknown"  # not LFM2's whole short-conv block (in_proj, conv, out_proj)
    assert _kind({"conv.in_proj.weight": (12, 4), "conv.conv.weight": (4, 1, 3),
                  "conv.out_proj.weight": (4, 4)}, "conv") == "short_conv"
    assert _kind({"attn.forget_gate.A_log": (4,), "attn.conv1d.weight": (12, 1, 4),
                  "attn.q_proj.weight": (4, 4)}, None) == "unknown"  # A_log not a Mamba's
    assert _kind({"self_attn.q_proj.weight": (4, 4)}, "sliding_attention") == "sliding_attention"
    assert _kind({"mixer.A_log": (4,), "mixer.conv1d.weight": (4, 1, 3)}, None) == "mamba2"
    assert _kind({"mlp.up_proj.weight": (4, 4)}, "moe") == "mlp"


def test_not_a_transformers_architecture_is_refused_clearly() -> None:
    with pytest.raises(ConfigError) as err:
        spec_from_config({"architectures": ["NoSuchForCausalLM"], "model_type": "llama",
                          "dtype": "float32"})
    assert "NoSuchForCausalLM" in str(err.value) and "generic family" in str(err.value)
    with pytest.raises(ConfigError, match="model_type"):
        generic.family_for({"architectures": ["LlamaForCausalLM"], "model_type": "no_such"})


def test_transformers_imported_only_for_the_generic_family() -> None:
    code = ("import sys, json; import pploader; "
            "from pploader.planning.spec import spec_from_config; "
            "cfg = json.load(open('configs/models/tiny-llama.json')); cfg.pop('pploader_tiny'); "
            "spec_from_config(cfg); print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_hand_written_family_only_for_its_model_type() -> None:
    """transformers reuses classes: exaone saves through LlamaForCausalLM under its own names
    (transformer.h.*), so the llama family must not claim it."""
    import generic_sweep
    config = json.loads(generic_sweep.tiny_config("exaone").to_json_string())
    config.update(architectures=["LlamaForCausalLM"], dtype="float32")
    spec = spec_from_config(config)
    assert spec.family.name == "generic:exaone"
    assert spec.family.layer_prefix == r"transformer\.h\.(\d+)\."
    assert spec_from_config(dict(config, model_type="llama")).family.name == "llama"


def test_integer_buffers_the_model_fixes_are_loaded_as_stored() -> None:
    """An integer tensor is refused in a float model unless the model itself keeps that tensor
    as an integer (``Family.native_dtypes``, from the meta model: DeepSeek-V4's router table
    ``ffn.gate.tid2eid`` is int64 in a float32 model)."""
    from pploader.planning.dtypes import dtype_action
    assert dtype_action("I64", "F32") is None
    assert dtype_action("I64", "F32", native="I64") == "keep"
    assert dtype_action("I32", "F32", native="I64") is None
    from transformers import AutoConfig
    hf = AutoConfig.for_model("deepseek_v4", vocab_size=128, hidden_size=64, num_hidden_layers=2)
    config = {**hf.to_dict(), "architectures": ["DeepseekV4ForCausalLM"]}
    native = generic.family_for(config).native_dtypes
    assert native and set(native.values()) == {"I64"}
    assert any(name.endswith("ffn.gate.tid2eid") for name in native), sorted(native)[:4]


class _LoopParent(torch.nn.Module):
    """A decoder whose loop over its layers also runs a module stored beside them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(8, 4)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(3)])
        self.mixer = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)

    def _mix(self, h: torch.Tensor) -> torch.Tensor:
        return self.mixer(h)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = self._mix(layer(h))  # through a helper: counts as the loop's use
        return self.norm(h)


def test_loop_uses_finds_modules_run_by_every_layer() -> None:
    from pploader.families.hf_meta import loop_uses
    outer = torch.nn.Module()
    outer.model = _LoopParent()
    assert loop_uses(outer, "model.layers") == {"model.mixer"}


def test_tensor_every_layer_uses_is_read_by_every_stage(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """``Family.shared`` with "every" (a tensor stored outside the layers that the layer loop
    runs): each stage reads it; without those reads the strict accounting refuses."""
    import dataclasses
    from pploader.planning.roles import CheckpointRoles
    _save("olmo2", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    fam = generic.family_for(config)
    fam = dataclasses.replace(fam, shared=(("model.norm.weight", "model.norm.weight", "every"),))
    spec, index = spec_from_config(config, family=fam), open_checkpoint(tmp_path)
    plans = plan_all(spec, index, 3)
    assert all("model.norm.weight" in {i.target for i in p.items} for p in plans)
    got = {r: dict(Reader(p))["model.norm.weight"] for r, p in enumerate(plans)}
    assert torch.equal(got[0], got[2]) and torch.equal(got[1], got[2])
    monkeypatch.setattr(CheckpointRoles, "shared_reads", lambda self, w, e: [])
    with pytest.raises(PlanError, match="model.norm.weight, a tensor every layer uses"):
        plan_all(spec_from_config(config, family=fam), open_checkpoint(tmp_path), 3)


@pytest.mark.parametrize("comp,shape,split", [
    ("mlp.gate.weight", (8, 64), None),                      # router: replicated
    ("mlp.gate.e_score_correction_bias", (8,), None),        # routing state
    ("mlp.moe_statics.e_score_correction_bias", (1, 8), None),
    ("mlp.expert_bias", (8,), None),
    ("mlp.shared_expert_gate.weight", (1, 64), None),        # one-output gate
    ("self_attn.layer_scalar", (1,), None),                  # scalar
    ("self_attn.sinks", (8,), 0),                            # per head: split with the heads
    ("self_attn.gate_bias", (8,), "refused"),                # per head, heads == experts: no guess
    ("mlp.experts.down_proj_blocks", (8, 64, 2, 16), "refused"),  # MXFP4: gate/up order unknown
])
def test_generic_tp_rules_for_small_tensors(comp: str, shape: tuple, split: object) -> None:
    """Routers and routing state replicated as engines do; per-head tensors split or refused
    (never replicated because heads happen to equal experts); MXFP4 experts refused."""
    from pploader.families.hf_meta import Naming
    naming = Naming("original", {}, r"model\.layers\.(\d+)\.", (), (), None, (), None, None)
    text = {"hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 8,
            "vocab_size": 128}
    rule = generic_tp._rule(re.escape(comp), comp, shape, naming, text, 8)
    if split == "refused":
        with pytest.raises(PlanError, match="no unambiguous split"):
            rule.segments(type("Spec", (), {"architecture": "X"})())  # type: ignore[misc]
    else:
        assert rule.dim == split and rule.segments is None


def test_config_defaults_from_the_config_class(tmp_path: Path) -> None:
    """A config.json without ``tie_word_embeddings`` whose transformers config class ties by
    default (Gemma-3) is planned tied, as transformers loads it: the last stage reads the
    embedding as its head (not "lm_head.weight missing")."""
    import generic_sweep
    generic_sweep._checkpoint("gemma3_text", "Gemma3ForCausalLM", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("tie_word_embeddings", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec, index = load_spec(tmp_path), open_checkpoint(tmp_path)
    assert spec.tie_word_embeddings and "lm_head.weight" not in index.weight_map
    last = plan_all(spec, index, 2)[1]
    assert ("model.embed_tokens.weight", "lm_head.weight") in {(i.name, i.target)
                                                              for i in last.items}
