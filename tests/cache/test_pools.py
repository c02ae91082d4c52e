"""Per-stage KV / Mamba cache pools: geometry per layer kind, coverage over stages, sizing,
allocators, cache-aware partitions. Expected numbers are written by hand from the configs.
Through `pploader plan` and a real load: test_pools_cli.py."""
from __future__ import annotations

import importlib
import math
from typing import Callable, Mapping, Sequence

import pytest
import torch

from family_table import BF16, BY_FAMILY, F32, ROWS, TINY_ROWS, Geometry, Row
from helpers import tiny_config
from pploader import ConfigError, PlanError
from pploader.planning.partition import even_windows
from pploader.planning.spec import spec_from_config
from pploader.families import FAMILIES, Family
from pploader.families.base import LAYER_KINDS, Layout
from pploader.cache.geometry import KIND_CACHES, CacheDtypes, layer_cache, model_cache
from pploader.planning.partition import StageWindow, balanced_windows
from pploader.cache.pools import (CachePools, PageAllocator, PoolError, SlotAllocator,
                                  layer_cache_bytes, pipeline_capacity, size_for_target, size_pools,
                                  stage_geometry, budget_from_memory)
from pploader.planning.spec import ModelSpec



def toy_spec(config: Mapping, kinds: Sequence[str]) -> ModelSpec:
    """A ModelSpec whose layer kinds we state ourselves (independent of families/)."""
    fam = Family(name="toy", architectures=("Toy",),
                 layout=lambda c: Layout(len(kinds), tuple(kinds)))
    return spec_from_config({**config, "dtype": config.get("dtype", "bfloat16")}, family=fam)


# ---- hand configs and numbers by hand: the family table (tests/family_table.py) -------------
#: family -> (config, layer kinds, {tp: {kind: (kv bytes/token, {state: shape})}})
CASES: dict[str, Geometry] = {r.family: r.geometry for r in ROWS if r.geometry is not None}
#: the fields each real family reads its layer kinds from (pploader/families), so that the same
#: hand configs also go through the real family code: kinds must come out as written above
REAL: dict[str, Mapping] = {r.family: r.real_fields for r in ROWS if r.geometry is not None}
_FAMILY_NAMES = {f.name for f in FAMILIES}


@pytest.mark.parametrize("name,tp,real", [(n, tp, real) for n, c in CASES.items() for tp in c[2]
                                          for real in (False, True)])
def test_layer_geometry_equals_hand_numbers(name: str, tp: int, real: bool) -> None:
    """Toy family (kinds stated here) and the real family (kinds read by families/)."""
    config, kinds, expected = CASES[name]
    if real:
        assert name in _FAMILY_NAMES
        spec = spec_from_config({**config, **REAL[name], "dtype": "bfloat16"})
        assert spec.family.name == name and spec.layer_kinds == kinds
    else:
        spec = toy_spec(config, kinds)
    for layer, kind in enumerate(kinds):
        kv_bytes, states = expected[tp][kind]
        c = layer_cache(spec, layer, tp)
        assert c.kind == kind and c.kv_bytes_per_token == kv_bytes
        assert {s.name: s.shape for s in c.states} == states
        conv = {s.name: s.dtype for s in c.states}
        # defaults: conv in the model dtype, ssm / temporal float32 (kept by name: no torch)
        assert all(d == ("bfloat16" if n == "conv" else "float32") for n, d in conv.items())
        assert c.state_bytes_per_request == sum(
            math.prod(shape) * (BF16 if n == "conv" else F32) for n, shape in states.items())
        if c.kv is not None:
            assert c.kv.page_shape(5, 16) == (5, 16, c.kv.heads, c.kv.head_dim)


def test_dtypes_are_configurable_and_kinds_are_all_known() -> None:
    config, kinds, _ = CASES["nemotron_h"]
    spec = toy_spec(config, kinds)
    c = layer_cache(spec, 0, 1, CacheDtypes(conv=torch.float32, ssm=torch.bfloat16))
    assert [(s.name, s.dtype) for s in c.states] == [("conv", "float32"), ("ssm", "bfloat16")]
    # a torch dtype and its name are the same choice
    assert CacheDtypes(conv=torch.float32, ssm=torch.bfloat16) == \
        CacheDtypes.of(conv="float32", ssm="torch.bfloat16")
    assert c.state_bytes_per_request == 128 * 3 * F32 + 8 * 8 * 16 * BF16
    spec16 = toy_spec({**config, "mamba_ssm_cache_dtype": "float16"}, kinds)
    assert layer_cache(spec16, 0).states[1].dtype == "float16"  # nemotron's config key
    kv8 = layer_cache(toy_spec(*CASES["llama"][:2]), 0, 1, CacheDtypes(kv=torch.float8_e4m3fn))
    assert kv8.kv_bytes_per_token == 2 * 2 * 16 * 1
    assert set(LAYER_KINDS) - {"unknown"} <= set(KIND_CACHES)  # unknown: refused by design


def test_cache_sizes_come_from_the_family() -> None:
    """geometry.py reads no config key: a family declaring no mamba2 sizes gets a clear error
    even when the config has every mamba2 key; the hand-written family's own reader is used."""
    from pploader.families.cache_dims import CacheDims
    config, kinds, _ = CASES["nemotron_h"]
    fam = Family(name="attention-only", architectures=("Toy",), cache_dims=CacheDims(),
                 layout=lambda c: Layout(len(kinds), tuple(kinds)))
    spec = spec_from_config({**config, "dtype": "bfloat16"}, family=fam)
    with pytest.raises(ConfigError, match="declares no mamba2 sizes"):
        layer_cache(spec, 0)
    assert layer_cache(spec, 2).kv is not None  # GQA needs only the head counts
    bamba = spec_from_config(tiny_config("tiny-bamba"))
    assert bamba.family.cache_dims.mamba2 is not None
    assert bamba.family.cache_dims.of_mamba2(bamba).d_state == 16


def test_geometry_errors_are_clear() -> None:
    config, kinds, _ = CASES["nemotron_h"]
    with pytest.raises(PlanError, match="mamba heads = 8 is not divisible by tp=3"):
        layer_cache(toy_spec(config, kinds), 0, 3)
    with pytest.raises(PlanError, match="2 kv heads cannot be replicated evenly over tp=3"):
        layer_cache(toy_spec(config, kinds), 2, 3)
    bad = {k: v for k, v in config.items() if k != "ssm_state_size"}
    with pytest.raises(ConfigError, match="mamba2.d_state: config.json lacks ssm_state_size / "
                                          "mamba_d_state"):
        layer_cache(toy_spec(bad, kinds), 0)


# ---- the same geometry, checked against transformers' own mixers (independent source) --------
_HF = {r.family: r.hf_mixer for r in ROWS if r.hf_mixer is not None}  # config, mixer classes


def _hf_class(dotted: str) -> type:
    module, cls = dotted.split(".")
    kind = "configuration" if cls.endswith("Config") else "modeling"
    return getattr(importlib.import_module(f"transformers.models.{module}.{kind}_{module}"), cls)


def hf_state_shapes(family: str, config: Mapping) -> dict[str, tuple[int, ...]]:
    """Per-request state shapes (tp=1) read off the transformers mixer built from ``config``."""
    cfg_cls, mixer_cls = (_hf_class(x) for x in _HF[family])
    keep = {k: v for k, v in config.items() if k not in ("layer_types", "layers_block_type")}
    m = mixer_cls(cfg_cls(**keep), 0)
    k = m.conv_kernel_size
    if family == "jamba":
        return {"conv": (m.intermediate_size, k - 1), "ssm": tuple(m.A_log.shape)}
    if family.startswith("qwen3"):
        return {"conv": (m.conv_dim, k - 1), "temporal": (m.num_v_heads, m.head_v_dim, m.head_k_dim)}
    return {"conv": (m.conv_dim, k - 1), "ssm": (m.num_heads, m.head_dim, m.ssm_state_size)}


@pytest.mark.parametrize("family", sorted(set(CASES) & set(_HF)))
def test_hand_configs_agree_with_transformers_mixers(family: str) -> None:
    config, kinds, _ = CASES[family]
    spec = toy_spec(config, kinds)
    layer = next(i for i, k in enumerate(kinds) if KIND_CACHES[k][-1] not in ("gqa", "mla"))
    got = {s.name: s.shape for s in layer_cache(spec, layer).states}
    assert got == hf_state_shapes(family, {**config, "num_hidden_layers": len(kinds)})


@pytest.mark.parametrize("row", TINY_ROWS, ids=[r.family for r in TINY_ROWS])
def test_bundled_tiny_configs_agree_with_transformers(row: Row) -> None:
    spec = spec_from_config(tiny_config(row.tiny))  # type: ignore[arg-type]
    caches = model_cache(spec)
    for c in caches:
        if c.kv is not None and c.kv.parts == ("k", "v"):
            assert c.kv.heads * c.kv.head_dim == spec.num_kv_heads * spec.head_dim
        if c.kv is not None and c.kv.parts == ("latent",):
            assert c.kv.head_dim == spec.int("kv_lora_rank") + spec.int("qk_rope_head_dim")
    stateful = [c for c in caches if c.states]
    if row.hf_mixer is not None:
        assert stateful, f"{row.family}: no state layers found"
        assert {s.name: s.shape for s in stateful[0].states} == \
            hf_state_shapes(row.family, dict(spec.config))
    else:
        assert not stateful


# ---- stages: coverage, per-stage bytes, allocation -------------------------------------------
def _pattern(n: int, rule: Callable[[int], str]) -> tuple[str, ...]:
    return tuple(rule(i) for i in range(n))


MODELS: dict[str, tuple[dict, tuple[str, ...]]] = {
    "jamba16": (CASES["jamba"][0], _pattern(16, lambda i: "full_attention" if i % 8 == 4
                                           else "mamba1")),
    "qwen3_next8": (CASES["qwen3_next"][0], _pattern(8, lambda i: "full_attention" if i % 4 == 3
                                                    else "gdn")),
    "nemotron_h10": (CASES["nemotron_h"][0], ("mamba2", "mlp", "mamba2", "mlp", "full_attention",
                                              "mlp", "mamba2", "mlp", "mamba2", "mlp")),
    "falcon_h1_4": (CASES["falcon_h1"][0], ("hybrid_attention_mamba2",) * 4),
    "deepseek_v3_8": (CASES["deepseek_v3"][0], ("mla",) * 8),
}
JAMBA32 = (CASES["jamba"][0], _pattern(32, lambda i: "full_attention" if i % 8 == 4 else "mamba1"))


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("tp", [1, 2])
def test_stages_cover_every_layer_once_and_allocate_what_they_report(model: str, tp: int) -> None:
    spec = toy_spec(*MODELS[model])
    every = model_cache(spec, tp)
    for pp in range(1, 5):
        attn, state = [], []
        for w in even_windows(spec.num_layers, pp):
            geom = stage_geometry(spec, w, tp)
            own = every[w.start_layer:w.end_layer]
            assert all(w.owns(layer) for layer in geom.attention_layers + geom.state_layers)
            assert geom.kv_bytes_per_token == sum(c.kv_bytes_per_token for c in own)
            assert geom.state_bytes_per_request == sum(c.state_bytes_per_request for c in own)
            attn += geom.attention_layers
            state += geom.state_layers
            cap = size_pools(geom, 96 * 1024, page_size=4)
            assert cap.pool_bytes <= cap.budget_bytes
            pools = CachePools(geom, cap, device="cpu")
            assert sorted(pools.kv) == list(geom.attention_layers)
            assert sorted(pools.states) == list(geom.state_layers)
            assert pools.kv_allocated_bytes == cap.kv_pool_bytes == \
                cap.num_pages * cap.page_size * geom.kv_bytes_per_token
            assert pools.state_allocated_bytes == cap.state_pool_bytes == \
                (cap.max_requests or 0) * geom.state_bytes_per_request
            rep = pools.report()
            assert rep["kv_allocated_bytes"] + rep["state_allocated_bytes"] == \
                rep["capacity"]["pool_bytes"]
        # every cached layer exactly once over the stages, nothing else
        assert attn == [c.layer for c in every if c.kv is not None]
        assert state == [c.layer for c in every if c.states]


def test_pp4_mamba_pool_is_a_quarter_of_the_whole_models() -> None:
    spec = toy_spec(*MODELS["jamba16"])  # 14 mamba layers + 2 attention layers
    whole = size_for_target(stage_geometry(spec, StageWindow(0, 0, 16, True, True)), 0, 64)
    per_layer = 64 * layer_cache(spec, 0).state_bytes_per_request   # 64 x (384 + 2048) B
    stages = [size_for_target(stage_geometry(spec, w), 0, 64).state_pool_bytes
              for w in even_windows(16, 4)]
    assert sum(stages) == whole.state_pool_bytes == 14 * per_layer
    assert stages == [4 * per_layer, 3 * per_layer, 4 * per_layer, 3 * per_layer]
    for s in stages:  # within one layer of an exact quarter
        assert abs(s - whole.state_pool_bytes / 4) <= per_layer


def test_linear_only_stage_holds_more_requests_than_whole_model_sizing() -> None:
    spec = toy_spec(*MODELS["qwen3_next8"])     # [gdn, gdn, gdn, full] x 2
    budget = 1 << 20
    whole = size_pools(stage_geometry(spec, StageWindow(0, 0, 8, True, True)), budget)
    stage0 = size_pools(stage_geometry(spec, even_windows(8, 4)[0]), budget)  # layers 0, 1
    per_layer = 64 * 3 * BF16 + 4 * 8 * 8 * F32                     # 384 + 1024 = 1408 B
    assert stage_geometry(spec, even_windows(8, 4)[0]).attention_layers == ()
    assert whole.max_requests == (budget // 2) // (6 * per_layer) == 62
    assert stage0.max_requests == budget // (2 * per_layer) == 372
    assert stage0.max_tokens is None                     # no attention layer: no token limit
    # the pipeline is limited by its tightest stage, not by the whole-model arithmetic
    caps = [size_pools(stage_geometry(spec, w), budget) for w in even_windows(8, 4)]
    limits = pipeline_capacity(caps)
    assert limits["max_requests"] == min(c.max_requests for c in caps) > whole.max_requests
    assert limits["max_tokens"] == min(c.max_tokens for c in caps if c.max_tokens is not None)


def test_sizing_split_and_budget_from_memory() -> None:
    spec = toy_spec(*MODELS["falcon_h1_4"])  # every layer: kv 64 B/token + state 4 x ...
    geom = stage_geometry(spec, StageWindow(0, 0, 2, True, False))
    st = 2 * (80 * 3 * BF16 + 6 * 8 * 8 * F32)                      # 2 layers x 2016 B
    assert geom.kv_bytes_per_token == 2 * 64 and geom.state_bytes_per_request == st
    cap = size_pools(geom, 100_000, mamba_ratio=0.25, page_size=16)
    assert cap.max_requests == 25_000 // st == 6
    assert cap.num_pages == 75_000 // (16 * 128) == 36 and cap.max_tokens == 576
    assert budget_from_memory(1000, 0.5, 300) == 200
    with pytest.raises(PlanError, match="no memory left for cache"):
        budget_from_memory(1000, 0.5, 600)
    with pytest.raises(PlanError, match="mamba ratio"):
        size_pools(geom, 100, mamba_ratio=1.5)


# ---- allocators and the layer map ------------------------------------------------------------
def test_allocators_exhaust_and_refuse_double_free() -> None:
    slots = SlotAllocator(2)
    a, b = slots.alloc(), slots.alloc()
    assert (a, b) == (0, 1) and slots.num_free == 0
    with pytest.raises(PoolError, match="request slot pool exhausted: asked for 1, 0 of 2 free"):
        slots.alloc()
    slots.free(a)
    with pytest.raises(PoolError, match=r"cannot free request slot \[0\]: not allocated"):
        slots.free(a)
    with pytest.raises(PoolError, match="out of range"):
        slots.free(7)
    pages = PageAllocator(4, page_size=16)
    got = pages.alloc_tokens(33)                        # 3 pages
    assert len(got) == 3 and pages.num_free == 1
    with pytest.raises(PoolError, match="KV page pool exhausted: asked for 2, 1 of 4 free"):
        pages.alloc_tokens(17)
    assert pages.num_free == 1                          # all or nothing
    pages.free_many(got)
    with pytest.raises(PoolError, match="double free"):
        pages.free_many([got[0], got[0]])
    assert pages.num_free == 4


def test_layer_map_and_out_of_window_errors() -> None:
    spec = toy_spec(*MODELS["jamba16"])
    w = even_windows(16, 4)[1]                          # layers 4..7, layer 4 = attention
    pools = CachePools(stage_geometry(spec, w, 2), size_for_target(stage_geometry(spec, w, 2),
                                                                   32, 3, page_size=8))
    assert (pools.start_layer, pools.end_layer) == (4, 8)
    assert pools.attention_layers == (4,) and pools.state_layers == (5, 6, 7)
    assert pools.locate(4) == {"kv": 0} and pools.locate(6) == {"state": 1}
    k, v = pools.kv_cache(4)
    assert k.shape == v.shape == (4, 8, 1, 8) and k.dtype == torch.bfloat16
    st = pools.state(7)
    assert st["conv"].shape == (3, 32, 3) and st["ssm"].shape == (3, 32, 8)
    assert st["ssm"].dtype == torch.float32
    with pytest.raises(PoolError, match=r"layer 9 is not in this stage's window: stage 1 owns "
                                        r"layers \[4, 8\)"):
        pools.state(9)
    with pytest.raises(PoolError, match=r"layer 3 is not in this stage's window"):
        pools.kv_cache(3)
    with pytest.raises(PoolError, match=r"layer 5 \(mamba1\) has no KV cache"):
        pools.kv_cache(5)
    with pytest.raises(PoolError, match=r"layer 4 \(full_attention\) has no state"):
        pools.state(4)
    st["ssm"].fill_(1.0)
    slot = pools.alloc_request()
    assert float(st["ssm"][slot].abs().sum()) == 0.0    # a new request starts from zero state
    pools.free_request(slot)
    with pytest.raises(PoolError):
        pools.free_request(slot)


# ---- cache-aware balanced partition ----------------------------------------------------------
def _max_over_mean(xs: Sequence[float]) -> float:
    return max(xs) / (sum(xs) / len(xs))


@pytest.mark.parametrize("model,pp,tokens", [("jamba32", 3, 16384), ("deepseek_v3_8", 2, 4096),
                                             ("deepseek_v3_8", 3, 4096)])
def test_cache_aware_balanced_partition_beats_even(model: str, pp: int, tokens: int) -> None:
    """Uneven layers: jamba (MoE every other layer with 4x the weights, attention every 8th
    layer: heavy KV at 16k tokens) and deepseek_v3 (3 dense layers, then MoE layers with 4x the
    weights). The cache at the target load (tokens, 64 requests) is added to the weights."""
    from pploader.planning.partition import stage_costs
    spec = toy_spec(*(JAMBA32 if model == "jamba32" else MODELS[model]))
    n = spec.num_layers
    moe = [i % 2 == 1 for i in range(n)] if model == "jamba32" else [i >= 3 for i in range(n)]
    weights = [(40_000 if model == "jamba32" else 200_000) * (4 if m else 1) for m in moe]
    cache = layer_cache_bytes(spec, tokens, 64)
    if model == "jamba32":   # attention layer: 16384 x 64 B; mamba layer: 64 x (384 + 2048) B
        assert cache[4] == 16384 * 64 and cache[0] == 64 * (384 + 2048)
    else:                    # MLA: 4096 x 80 B on every layer
        assert cache == [4096 * 80] * n
    costs = [w + c for w, c in zip(weights, cache)]
    even = stage_costs(even_windows(n, pp), costs)
    bal = stage_costs(balanced_windows(costs, pp), costs)
    assert sum(even) == sum(bal) == sum(costs)
    assert _max_over_mean(bal) < _max_over_mean(even)


def _template_layer_bytes(spec: ModelSpec) -> tuple[list[int], int, int]:
    """Weight bytes per layer / first / last stage from the real family's tensor template
    (what the checkpoint headers of this config hold)."""
    per, first, last = [0] * spec.num_layers, 0, 0
    for name, shape in spec.family.template(spec).items():
        role = spec.family.classify(name, spec.num_layers, spec.num_mtp_layers)
        nbytes = math.prod(shape) * spec.dtype.itemsize
        if role.placement == "layer":
            per[role.layer] += nbytes
        elif role.placement == "first":
            first += nbytes
        elif role.placement == "last":
            last += nbytes
    return per, first, last


@pytest.mark.parametrize("pp", [3, 5])
def test_real_jamba_cache_aware_balance_beats_even_and_weights_only(pp: int) -> None:
    """The real jamba family: 32 layers, MoE every other layer, attention at 4, 12, 20, 28.
    At 65536 tokens the attention layers' KV outweighs a MoE layer: only a partition that
    weighs cache bytes moves them apart."""
    from pploader.planning.partition import stage_costs
    spec = spec_from_config({**JAMBA32[0], "architectures": ["JambaForCausalLM"],
                             "dtype": "bfloat16", "num_hidden_layers": 32, "num_experts": 16,
                             "intermediate_size": 224, "attn_layer_period": 8,
                             "attn_layer_offset": 4, "expert_layer_period": 2,
                             "expert_layer_offset": 1, "mamba_dt_rank": 4})
    assert spec.layer_kinds == JAMBA32[1]
    per, first, last = _template_layer_bytes(spec)
    costs = [w + c for w, c in zip(per, layer_cache_bytes(spec, 65536, 16))]
    score = {name: _max_over_mean(stage_costs(ws, costs, first_extra=first, last_extra=last))
             for name, ws in (("even", even_windows(32, pp)),
                              ("weights", balanced_windows(per, pp, first_extra=first,
                                                           last_extra=last)),
                              ("cache", balanced_windows(costs, pp, first_extra=first,
                                                         last_extra=last)))}
    assert score["cache"] < score["even"] and score["cache"] < score["weights"]


# ---- the bundled tiny configs, by hand (the table's ``pools``) ------------------------------
TINY: dict[str, tuple[int, dict]] = {r.family: r.pools for r in TINY_ROWS if r.pools is not None}


@pytest.mark.parametrize("family", sorted(TINY))
def test_bundled_tiny_config_by_hand(family: str) -> None:
    spec = spec_from_config(tiny_config(BY_FAMILY[family].tiny))  # type: ignore[arg-type]
    itemsize, expected = TINY[family]
    assert spec.dtype.itemsize == itemsize
    for tp, per_kind in expected.items():
        caches = model_cache(spec, tp)
        assert {c.kind for c in caches} == set(per_kind)
        for c in caches:
            kv_bytes, states = per_kind[c.kind]
            assert c.kv_bytes_per_token == kv_bytes
            assert {s.name: s.shape for s in c.states} == states
            assert c.state_bytes_per_request == sum(
                math.prod(shape) * (itemsize if n == "conv" else F32)
                for n, shape in states.items())


def test_every_bundled_tiny_family_has_hand_numbers() -> None:
    missing = sorted(r.family for r in TINY_ROWS if r.pools is None)
    assert not missing, f"add hand-written cache numbers (Row.pools) for {missing}"
