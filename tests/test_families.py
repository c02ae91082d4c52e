"""Model families on checkpoints written by transformers' own ``save_pretrained``.

For every family (and both expert namings: per-expert, the default, and fused 3-D experts,
``save_original_format=False``): the family template equals the checkpoint's names and
shapes; for PP 1-4 x EP 1-2 every tensor is planned by exactly one stage, no rank plans a byte
of another stage's layer or of a non-local expert, and a real load through ``Reader`` is
bitwise equal to ``safe_open``. The expectations below come from the names themselves (layer
and expert ids parsed by the test), not from the family code under test.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch
from safetensors.torch import save_file

from helpers import CONFIGS, make_model, reference_tensors
from pploader import ConfigError, PlanError
from pploader.io.read import Reader
from pploader.planning.checkpoint import CheckpointIndex, open_checkpoint
from pploader.planning.plan import RankPlan, plan_all
from pploader.planning.spec import load_spec, spec_from_config
from pploader.families import supported_architectures

COMMON = dict(vocab_size=128, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, intermediate_size=64, max_position_embeddings=64)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=16)
GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
           linear_value_head_dim=8, linear_conv_kernel_dim=4)
MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8,
              mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8)

#: case -> (model_type, config overrides, has a fused-expert naming)
CASES: dict[str, tuple[str, dict[str, Any], bool]] = {
    "llama": ("llama", dict(num_hidden_layers=4), False),
    "qwen3_tied": ("qwen3", dict(num_hidden_layers=4, tie_word_embeddings=True), False),
    "qwen3_moe": ("qwen3_moe", dict(num_hidden_layers=4, num_experts=4, mlp_only_layers=[1],
                                    **MOE), True),
    "mixtral_bf16": ("mixtral", dict(num_hidden_layers=4, num_local_experts=4,
                                     num_experts_per_tok=2, dtype="bfloat16"), True),
    "deepseek_v3": ("deepseek_v3", dict(
        num_hidden_layers=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, n_group=2, topk_group=1, num_nextn_predict_layers=2,
        **MOE), True),
    "qwen3_next": ("qwen3_next", dict(num_hidden_layers=4, num_experts=4, mlp_only_layers=[2],
                                      shared_expert_intermediate_size=16, **MOE, **GDN), True),
    "qwen3_5": ("qwen3_5_text", dict(num_hidden_layers=4, **GDN), False),
    "qwen3_5_moe": ("qwen3_5_moe_text", dict(num_hidden_layers=4, num_experts=4,
                                             shared_expert_intermediate_size=16, **MOE, **GDN),
                    True),
    "qwen3_5_moe_vl": ("qwen3_5_moe", {}, True),
    "jamba": ("jamba", dict(num_hidden_layers=4, num_experts=4, num_experts_per_tok=2,
                            attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                            expert_layer_offset=1, mamba_d_state=4, mamba_d_conv=4,
                            mamba_expand=2, mamba_dt_rank=4), True),
    "nemotron_h": ("nemotron_h", dict(
        layers_block_type=["mamba", "attention", "moe", "mlp", "mamba"], n_routed_experts=4,
        n_shared_experts=1, moe_intermediate_size=16, moe_shared_expert_intermediate_size=16,
        num_experts_per_tok=2, mamba_num_heads=4, mamba_head_dim=8, n_groups=2,
        ssm_state_size=8, chunk_size=8), True),
    "bamba": ("bamba", dict(num_hidden_layers=4, attn_layer_indices=[1, 3], **MAMBA2), False),
    "falcon_h1": ("falcon_h1", dict(num_hidden_layers=4, mamba_d_ssm=64, **MAMBA2), False),
    "granitemoehybrid_tied": ("granitemoehybrid", dict(
        num_hidden_layers=4, layer_types=["mamba", "attention", "mamba", "attention"],
        num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=32,
        tie_word_embeddings=True, **MAMBA2), True),
}
VARIANTS = [(c, "original") for c in CASES] + [(c, "fused") for c, v in CASES.items() if v[2]]
IDS = [f"{c}-{f}" for c, f in VARIANTS]


def _vl_model() -> torch.nn.Module:
    from transformers.models.qwen3_5_moe import (Qwen3_5MoeConfig,
                                                 Qwen3_5MoeForConditionalGeneration)
    text = dict(COMMON, num_hidden_layers=4, num_experts=4, shared_expert_intermediate_size=16,
                layer_types=["linear_attention", "full_attention"] * 2, dtype="float32",
                **MOE, **GDN)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=32,
                  patch_size=4, num_position_embeddings=16, temporal_patch_size=2,
                  spatial_merge_size=2)
    return Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(text_config=text,
                                                               vision_config=vision))


def _build(case: str) -> torch.nn.Module:
    import transformers
    transformers.logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    if case == "qwen3_5_moe_vl":
        return _vl_model()
    model_type, overrides, _ = CASES[case]
    kw = {**COMMON, "dtype": "float32", **overrides}
    config = transformers.AutoConfig.for_model(model_type, **kw)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, kw["dtype"]))


def _append_mtp(model_dir: Path, num_layers: int, num_mtp: int) -> None:
    """Add DeepSeek-style MTP layers ``num_layers + k`` (transformers does not save them): a
    copy of the last decoder layer's tensors plus enorm/hnorm/eh_proj/shared_head/embed_tokens,
    in a shard of their own, registered in the index."""
    index_path = model_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    ref = reference_tensors(model_dir)
    hidden = ref["model.norm.weight"].shape[0]
    vocab = ref["model.embed_tokens.weight"].shape[0]
    last = f"model.layers.{num_layers - 1}."
    gen = torch.Generator().manual_seed(1)
    for k in range(num_mtp):
        prefix = f"model.layers.{num_layers + k}."
        tensors = {prefix + n[len(last):]: torch.randn(t.shape, generator=gen)
                   for n, t in ref.items() if n.startswith(last)}
        for name, shape in {"enorm.weight": (hidden,), "hnorm.weight": (hidden,),
                            "eh_proj.weight": (hidden, 2 * hidden),
                            "shared_head.norm.weight": (hidden,),
                            "shared_head.head.weight": (vocab, hidden),
                            "embed_tokens.weight": (vocab, hidden)}.items():
            tensors[prefix + name] = torch.randn(shape, generator=gen)
        fname = f"model-mtp-{k}.safetensors"
        save_file(tensors, str(model_dir / fname), metadata={"format": "pt"})
        index["weight_map"].update({n: fname for n in tensors})
    index_path.write_text(json.dumps(index))


class Checkpoints:
    """Each family's tiny checkpoint, built by transformers on first use, once per session."""

    def __init__(self, root: Path) -> None:
        self.root, self.dirs = root, {}

    def __call__(self, case: str, fmt: str) -> Path:
        key = (case, fmt)
        if key not in self.dirs:
            model = _build(case)
            for f in ("original", "fused") if CASES[case][2] else ("original",):
                out = self.root / f"{case}-{f}"
                model.save_pretrained(out, save_original_format=f == "original",
                                      max_shard_size="40KB")
                if case == "deepseek_v3":
                    _append_mtp(out, CASES[case][1]["num_hidden_layers"], 2)
                self.dirs[(case, f)] = out
        return self.dirs[key]


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    return Checkpoints(tmp_path_factory.mktemp("families"))


@pytest.fixture(scope="session")
def references() -> Callable[[Path], dict[str, torch.Tensor]]:
    cache: dict[Path, dict[str, torch.Tensor]] = {}

    def get(path: Path) -> dict[str, torch.Tensor]:
        if path not in cache:
            cache[path] = reference_tensors(path)
        return cache[path]
    return get


# ---- what a name is, parsed by the test -------------------------------------------------------

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")
_FUSED = re.compile(r"(\.experts\.(gate_up_proj|up_proj|down_proj)|"
                    r"block_sparse_moe\.(input|output)_linear\.weight)$")
_FIRST = re.compile(r"(embed_tokens|embeddings)\.weight$|\.visual\.")


def _layer(name: str) -> Optional[int]:
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def _is_embed(name: str) -> bool:
    return _layer(name) is None and bool(re.search(r"(embed_tokens|embeddings)\.weight$", name))


def _stage_of(name: str, windows: list[tuple[int, int]]) -> int:
    layer = _layer(name)
    if layer is None:
        return 0 if _FIRST.search(name) else len(windows) - 1
    return next(s for s, (a, b) in enumerate(windows) if a <= layer < b)


def _local(expert: int, num_experts: int, ep: int, ep_rank: int) -> bool:
    return ep_rank * num_experts // ep <= expert < (ep_rank + 1) * num_experts // ep


def _allowed_range(plan: RankPlan, index: CheckpointIndex, name: str,
                   num_experts: int) -> tuple[int, int]:
    """Bytes a rank may read for ``name``: the tensor, or its local experts' slab if fused."""
    entry = index.entry(name)
    if _FUSED.search(name) and plan.topology.ep_size > 1:
        a = plan.topology.ep_rank * num_experts // plan.topology.ep_size
        b = (plan.topology.ep_rank + 1) * num_experts // plan.topology.ep_size
        slab = entry.nbytes // num_experts
        return entry.start + a * slab, entry.start + b * slab
    return entry.start, entry.end


def _layouts(num_layers: int, moe: bool) -> list[tuple[int, int]]:
    return [(pp, ep) for pp in range(1, min(4, num_layers) + 1) for ep in ((1, 2) if moe else (1,))]


# ---- tests ------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("case,fmt", VARIANTS, ids=IDS)
def test_template_equals_checkpoint(checkpoints: Checkpoints, case: str, fmt: str) -> None:
    path = checkpoints(case, fmt)
    spec, index = load_spec(path), open_checkpoint(path)
    resolved = spec.for_checkpoint(index.weight_map)
    assert resolved.family.format == ("transformers" if fmt == "fused" else "original")
    template = resolved.family.template(resolved)
    have = {n: index.entry(n).shape for n in index.weight_map}
    assert sorted(set(template) - set(have)) == []
    assert sorted(set(have) - set(template)) == []
    assert {n: tuple(s) for n, s in template.items()} == have
    if fmt == "fused":  # the fused naming really stacks experts
        assert any(_FUSED.search(n) for n in have) and not any(_EXPERT.search(n) for n in have)
    elif spec.num_experts and case != "granitemoehybrid_tied":
        assert any(_EXPERT.search(n) for n in have)


@pytest.mark.slow
@pytest.mark.parametrize("case,fmt", VARIANTS, ids=IDS)
def test_stages_partition_checkpoint_and_load_bitwise(checkpoints: Checkpoints, references: Any,
                                                      case: str, fmt: str) -> None:
    path = checkpoints(case, fmt)
    spec, index = load_spec(path), open_checkpoint(path)
    ref = references(path)
    n, e = spec.num_layers, spec.num_experts
    mtp = {name for name in index.weight_map if (_layer(name) or 0) >= n}
    assert bool(mtp) == (case == "deepseek_v3") == bool(spec.num_mtp_layers)
    for pp, ep in _layouts(n, bool(e)):
        plans = plan_all(spec, index, pp, 1, ep)
        windows = [(p.window.start_layer, p.window.end_layer) for p in plans[::ep]]
        where = f"pp={pp} ep={ep}"
        # every tensor by exactly one stage (the tied embedding also by the last); union = all
        stage_sets: list[set[str]] = [set() for _ in range(pp)]
        for plan in plans:
            stage_sets[plan.topology.pp_rank] |= set(plan.tensors)
        union = set().union(*stage_sets)
        assert union == set(index.weight_map) - mtp, where
        for name in union:
            holders = [s for s in range(pp) if name in stage_sets[s]]
            expect = {_stage_of(name, windows)}
            if spec.tie_word_embeddings and _is_embed(name):
                expect.add(pp - 1)
            assert set(holders) == expect, (where, name, holders)
        for plan in plans:
            t = plan.topology
            for name in plan.tensors:  # EP: per-expert tensors only on their EP rank
                m = _EXPERT.search(name)
                if m is not None:
                    assert _local(int(m.group(1)), e, ep, t.ep_rank), (where, t.rank, name)
            if ep > 1:  # every local per-expert tensor of the stage's layers is there
                for name in index.weight_map:
                    m = _EXPERT.search(name)
                    if (m and name not in mtp and _stage_of(name, windows) == t.pp_rank
                            and _local(int(m.group(1)), e, ep, t.ep_rank)):
                        assert name in plan.tensors, (where, t.rank, name)
            # no byte outside the tensor (or, fused, outside the local experts' slab)
            for item in plan.items:
                lo, hi = _allowed_range(plan, index, item.name, e)
                for off, length in item.ranges:
                    assert lo <= off and off + length <= hi, (where, t.rank, item.name)
            # a real load equals safe_open (fused experts: the local slice)
            reader = Reader(plan)
            got = dict(reader)
            assert reader.stats.read_bytes == plan.read_bytes == plan.ideal_bytes, where
            assert len(got) == len(plan.items)
            for item in plan.items:
                want = ref[item.name]
                if _FUSED.search(item.name) and ep > 1:
                    want = want[t.ep_rank * e // ep:(t.ep_rank + 1) * e // ep]
                assert got[item.target].dtype == want.dtype
                assert torch.equal(got[item.target].view(torch.uint8),
                                   want.contiguous().view(torch.uint8)), (where, item.name)
            if spec.tie_word_embeddings and plan.window.has_head:  # PP=1: one read, tied
                assert any(_is_embed(i.name) and i.target != i.name
                           for i in plan.items) != plan.window.has_embed


@pytest.mark.slow
@pytest.mark.parametrize("case,fmt", VARIANTS, ids=IDS)
def test_tp2_plans_build(checkpoints: Checkpoints, case: str, fmt: str) -> None:
    """TP=2 (x EP=2 for MoE) plans every family without error; split tensors halve."""
    path = checkpoints(case, fmt)
    spec, index = load_spec(path), open_checkpoint(path)
    ep = 2 if spec.num_experts else 1
    plans = plan_all(spec, index, 2, 2, ep)
    assert len(plans) == 4 * ep
    for plan in plans:
        split = [i for i in plan.items if i.shape != index.entry(i.name).shape]
        assert split, plan.topology.describe()
        assert plan.ideal_bytes < sum(index.entry(i.name).nbytes for i in plan.items)


def test_unknown_architecture_lists_supported() -> None:
    with pytest.raises(ConfigError) as err:
        spec_from_config({"architectures": ["NoSuchForCausalLM"], "dtype": "float32"})
    text = str(err.value)
    assert "NoSuchForCausalLM" in text and "docs/families.md" in text
    for arch in ("DeepseekV3ForCausalLM", "Qwen3_5MoeForConditionalGeneration",
                 "NemotronHForCausalLM", "JambaForCausalLM", "GraniteMoeHybridForCausalLM"):
        assert arch in text and arch in supported_architectures()


def _layout_of(config: dict) -> tuple[tuple[str, ...], frozenset[int], int, int]:
    spec = spec_from_config(dict(config, dtype="float32"))
    return spec.layer_kinds, spec.moe_layers, spec.num_experts, spec.num_mtp_layers


def test_layouts_from_config_fields() -> None:
    """Layer kinds and MoE placement come from each family's own config fields."""
    jamba = _layout_of({"architectures": ["JambaForCausalLM"], "num_hidden_layers": 8,
                        "attn_layer_period": 4, "attn_layer_offset": 2, "expert_layer_period": 2,
                        "expert_layer_offset": 1, "num_experts": 16})
    assert jamba[0] == ("mamba1",) * 2 + ("full_attention",) + ("mamba1",) * 3 + (
        "full_attention",) + ("mamba1",)
    assert jamba[1] == {1, 3, 5, 7} and jamba[2] == 16
    nemo = _layout_of({"architectures": ["NemotronHForCausalLM"],
                       "hybrid_override_pattern": "M-M*E", "n_routed_experts": 8})
    assert nemo[0] == ("mamba2", "mlp", "mamba2", "full_attention", "mlp")
    assert nemo[1] == {4} and nemo[2] == 8
    qnext = _layout_of({"architectures": ["Qwen3NextForCausalLM"], "num_hidden_layers": 8,
                        "num_experts": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert qnext[0] == ("gdn", "gdn", "gdn", "full_attention") * 2
    assert qnext[1] == {1, 5, 7}
    ds = _layout_of({"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 5,
                     "first_k_dense_replace": 3, "n_routed_experts": 8,
                     "num_nextn_predict_layers": 1})
    assert ds == (("mla",) * 5, frozenset({3, 4}), 8, 1)
    bamba = _layout_of({"architectures": ["BambaForCausalLM"], "num_hidden_layers": 4,
                        "attn_layer_indices": [2]})
    assert bamba[0] == ("mamba2", "mamba2", "full_attention", "mamba2") and not bamba[1]
    falcon = _layout_of({"architectures": ["FalconH1ForCausalLM"], "num_hidden_layers": 2})
    assert falcon[0] == ("hybrid_attention_mamba2",) * 2
    granite = _layout_of({"architectures": ["GraniteMoeHybridForCausalLM"], "num_hidden_layers": 2,
                          "layer_types": ["mamba", "attention"], "num_local_experts": 0})
    assert granite == (("mamba2", "full_attention"), frozenset(), 0, 0)
    vl = spec_from_config({"architectures": ["Qwen3_5MoeForConditionalGeneration"],
                           "dtype": "bfloat16", "text_config": {
                               "num_hidden_layers": 2, "num_experts": 4,
                               "layer_types": ["linear_attention", "full_attention"]}})
    assert vl.layer_kinds == ("gdn", "full_attention") and vl.moe_layers == {0, 1}
    with pytest.raises(ConfigError, match="unknown block types"):
        _layout_of({"architectures": ["Qwen3_5ForCausalLM"], "num_hidden_layers": 1,
                    "layer_types": ["sliding_attention"]})


@pytest.mark.slow
def test_mixed_namings_fail_strictly(checkpoints: Checkpoints, tmp_path: Path) -> None:
    """A fused checkpoint with one stray per-expert tensor is not silently accepted."""
    src = checkpoints("qwen3_moe", "fused")
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    save_file({"model.layers.0.mlp.experts.0.up_proj.weight": torch.zeros(16, 32)},
              str(tmp_path / "extra.safetensors"))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.mlp.experts.0.up_proj.weight"] = "extra.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(PlanError, match="not expected"):
        plan_all(load_spec(tmp_path), open_checkpoint(tmp_path), 1)


BUNDLED = sorted(p.stem for p in CONFIGS.glob("tiny-*.json"))


@pytest.mark.slow
@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_tiny_config_matches_transformers(name: str, tmp_path: Path) -> None:
    """Each bundled tiny config's template (what ``make-tiny`` writes) has the exact names and
    shapes transformers writes for that config (DeepSeek: plus the MTP layers it drops)."""
    import transformers
    transformers.logging.set_verbosity_error()
    raw = json.loads((CONFIGS / f"{name}.json").read_text())
    raw.pop("pploader_tiny")
    spec = spec_from_config(raw)
    kwargs = {k: v for k, v in raw.items() if k not in ("architectures", "model_type")}
    config = transformers.AutoConfig.for_model(raw["model_type"], **kwargs)
    getattr(transformers, raw["architectures"][0])(config).save_pretrained(tmp_path)
    index = open_checkpoint(tmp_path)
    have = {n: index.entry(n).shape for n in index.weight_map}
    template = {n: tuple(s) for n, s in spec.family.template(spec).items()
                if (_layer(n) or 0) < spec.num_layers}
    assert template == have
    mtp = {n for n in spec.family.template(spec) if (_layer(n) or 0) >= spec.num_layers}
    assert bool(mtp) == bool(spec.num_mtp_layers)


def test_bundled_demo_plans_pp4_ep2(tmp_path: Path) -> None:
    """The demo model (tiny-qwen3_5_moe: GDN + full attention, routed + shared experts) plans
    at PP=4 x EP=2 with every rank reading only its own layers and experts."""
    raw = json.loads((CONFIGS / "tiny-qwen3_5_moe.json").read_text())
    raw.pop("pploader_tiny")
    path = make_model(tmp_path, raw, shard_bytes=200_000)
    spec, index = load_spec(path), open_checkpoint(path)
    assert set(spec.layer_kinds) == {"gdn", "full_attention"} and spec.num_experts >= 4
    assert spec.num_layers == 8 and len(spec.moe_layers) == 8
    for plan in plan_all(spec, index, 4, 1, 2):
        experts = {int(m.group(1)) for n in plan.tensors if (m := _EXPERT.search(n))}
        assert experts == set(range(*plan.experts))
        layers = {_layer(n) for n in plan.tensors} - {None}
        assert layers == set(range(plan.window.start_layer, plan.window.end_layer))
        assert any("shared_expert." in n for n in plan.tensors)


# ---- TP shard rules against reference slicing written here -----------------------------------

def _halves(t: torch.Tensor, r: int, dim: int = 0) -> torch.Tensor:
    return t.chunk(2, dim)[r]


def _segments(t: torch.Tensor, r: int, sizes: list[int], replicate: tuple[int, ...] = (),
              dim: int = 0) -> torch.Tensor:
    """Each segment halved on its own (or, when listed in ``replicate``, kept whole)."""
    parts = t.split(sizes, dim)
    return torch.cat([p if i in replicate else _halves(p, r, dim) for i, p in enumerate(parts)],
                     dim)


#: bundled tiny config -> {component suffix: reference slice of TP rank r of 2}
_TP_REFERENCE: dict[str, dict[str, Callable[[torch.Tensor, int], torch.Tensor]]] = {
    # Mamba2, 8 heads x 16, 1 group x 16 state (< tp: B and C replicated), d_inner 128
    "tiny-bamba": {
        "mamba.in_proj.weight": lambda t, r: _segments(t, r, [128, 128, 16, 16, 8], (2, 3)),
        "mamba.conv1d.weight": lambda t, r: _segments(t, r, [128, 16, 16], (1, 2)),
        "mamba.conv1d.bias": lambda t, r: _segments(t, r, [128, 16, 16], (1, 2)),
        "mamba.A_log": _halves, "mamba.D": _halves, "mamba.dt_bias": _halves,
        "mamba.norm.weight": _halves, "mamba.out_proj.weight": lambda t, r: _halves(t, r, 1),
        "self_attn.k_proj.weight": _halves, "feed_forward.down_proj.weight":
            lambda t, r: _halves(t, r, 1), "input_layernorm.weight": lambda t, r: t},
    # Mamba2 with 2 groups: B and C split by group
    "tiny-nemotron_h": {
        "mixer.in_proj.weight": lambda t, r: _segments(t, r, [128, 128, 32, 32, 8]),
        "mixer.conv1d.weight": lambda t, r: _segments(t, r, [128, 32, 32]),
        "mixer.experts.3.up_proj.weight": _halves,
        "mixer.experts.3.down_proj.weight": lambda t, r: _halves(t, r, 1)},
    # GDN, Qwen3.5 naming: [q; k; v] blocks (2 k heads x 16, 4 v heads x 16)
    "tiny-qwen3_5": {
        "linear_attn.in_proj_qkv.weight": lambda t, r: _segments(t, r, [32, 32, 64]),
        "linear_attn.conv1d.weight": lambda t, r: _segments(t, r, [32, 32, 64]),
        "linear_attn.in_proj_z.weight": _halves, "linear_attn.in_proj_b.weight": _halves,
        "linear_attn.A_log": _halves, "linear_attn.norm.weight": lambda t, r: t,
        "linear_attn.out_proj.weight": lambda t, r: _halves(t, r, 1),
        "self_attn.q_proj.weight": _halves, "self_attn.o_proj.weight":
            lambda t, r: _halves(t, r, 1)},
    # GDN, Qwen3-Next naming: qkvz / ba interleaved per key-head group -> whole groups
    "tiny-qwen3_next": {
        "linear_attn.in_proj_qkvz.weight": _halves, "linear_attn.in_proj_ba.weight": _halves,
        "mlp.shared_expert_gate.weight": lambda t, r: t, "mlp.gate.weight": lambda t, r: t},
    # MLA: low-rank inputs replicated, per-head projections split
    "tiny-deepseek_v3": {
        "self_attn.q_a_proj.weight": lambda t, r: t, "self_attn.kv_a_proj_with_mqa.weight":
            lambda t, r: t, "self_attn.q_b_proj.weight": _halves,
        "self_attn.kv_b_proj.weight": _halves, "self_attn.o_proj.weight":
            lambda t, r: _halves(t, r, 1), "mlp.shared_experts.gate_proj.weight": _halves},
    # Mamba1: in_proj = [x; z], x_proj row-parallel
    "tiny-jamba": {
        "mamba.in_proj.weight": lambda t, r: _segments(t, r, [128, 128]),
        "mamba.x_proj.weight": lambda t, r: _halves(t, r, 1), "mamba.dt_proj.weight": _halves,
        "mamba.A_log": _halves, "mamba.dt_layernorm.weight": lambda t, r: t},
    # GraniteMoeHybrid fused experts: input_linear [E, 2I, H] = [gate; up] on dim 1
    "tiny-granitemoehybrid": {
        "block_sparse_moe.input_linear.weight": lambda t, r: _segments(t, r, [32, 32], dim=1),
        "block_sparse_moe.output_linear.weight": lambda t, r: _halves(t, r, 2),
        "shared_mlp.input_linear.weight": lambda t, r: _segments(t, r, [64, 64]),
        "shared_mlp.output_linear.weight": lambda t, r: _halves(t, r, 1)},
}


@pytest.mark.parametrize("name", sorted(_TP_REFERENCE))
def test_tp2_shards_equal_reference_slices(name: str, tmp_path: Path) -> None:
    raw = json.loads((CONFIGS / f"{name}.json").read_text())
    raw.pop("pploader_tiny")
    path = make_model(tmp_path, raw, shard_bytes=200_000)
    spec, index, ref = load_spec(path), open_checkpoint(path), reference_tensors(path)
    checked: set[str] = set()
    for plan in plan_all(spec, index, 1, 2, 1):
        got = dict(Reader(plan))
        for item in plan.items:
            for suffix, slicer in _TP_REFERENCE[name].items():
                if item.name.endswith("." + suffix):
                    want = slicer(ref[item.name], plan.topology.tp_rank)
                    assert torch.equal(got[item.target], want), (item.name, plan.topology.rank)
                    checked.add(suffix)
    assert checked == set(_TP_REFERENCE[name])


@pytest.mark.slow
def test_tp2_fused_gate_up_reference_slices(checkpoints: Checkpoints, references: Any) -> None:
    """transformers' fused experts: gate_up_proj [E, 2I, H] = [gate; up] halves on dim 1,
    down_proj [E, H, I] halves on dim 2; with EP=2 on top, the rank's expert block too."""
    path = checkpoints("qwen3_moe", "fused")
    spec, index, ref = load_spec(path), open_checkpoint(path), references(path)
    for plan in plan_all(spec, index, 1, 2, 2):
        got = dict(Reader(plan))
        t = plan.topology
        e0, e1 = plan.experts
        for item in plan.items:
            full = ref[item.name][e0:e1]
            if item.name.endswith("experts.gate_up_proj"):
                assert torch.equal(got[item.target], _segments(full, t.tp_rank, [16, 16], dim=1))
            elif item.name.endswith("experts.down_proj"):
                assert torch.equal(got[item.target], _halves(full, t.tp_rank, 2))


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["original", "fused"])
def test_deepseek_mtp_draft_with_ep(checkpoints: Checkpoints, references: Any, fmt: str) -> None:
    """The appended MTP layers of a transformers-written DeepSeek-V3 (both namings): plan_mtp
    with EP=2 streams layer k renamed to layer 0, only the rank's experts (fused: its slab)."""
    from pploader import Topology
    from pploader.planning.plan import plan_mtp
    path = checkpoints("deepseek_v3", fmt)
    spec, index, ref = load_spec(path), open_checkpoint(path), references(path)
    n, e = spec.num_layers, spec.num_experts
    for k in range(spec.num_mtp_layers):
        union: set[str] = set()
        for rank in range(2):
            plan = plan_mtp(spec, index, k, Topology(1, 1, 2, rank))
            got = dict(Reader(plan))
            for item in plan.items:
                assert _layer(item.name) == n + k
                assert item.target == item.name.replace(f"layers.{n + k}.", "layers.0.")
                m = _EXPERT.search(item.name)
                assert m is None or _local(int(m.group(1)), e, 2, rank)
                want = ref[item.name]
                if _FUSED.search(item.name):
                    want = want[rank * e // 2:(rank + 1) * e // 2]
                assert torch.equal(got[item.target], want), item.name
            union |= set(plan.tensors)
        assert union == {name for name in index.weight_map if _layer(name) == n + k}
