"""The SGLang load format inside real SGLang CPU engines, against SGLang's default loader.

Marked ``sglang``: skipped unless this interpreter has sglang (run ``.ci/sglang-suite.sh``,
which makes the pinned venv). The engines start in one subprocess (tests/sglang/engine.py),
one after another (each start is 1.5-2 minutes on a 2-core box), so the engines are few and
each serves several checks; the tests below read its results. The NEXTN engine has its own
subprocess (``-k nextn``); the hybrid and ZAYA engines are in test_sglang_models.py. A
pipeline split changes no
arithmetic (each stage runs the same layers on the hidden states it is handed), so runs that
differ from a default-loader run only in their PP split are compared with that run; TP
changes the reductions and has its own default-loader run.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from engine_suite import engine_marks, loads as _loads
from engine_suite import metadata_bytes as _metadata_bytes
from engine_suite import LLAMA, PROMPTS, run_engines
from sglang_checks import check_bytes as _check_bytes
from sglang_checks import checkpoint_tensors as _checkpoint_tensors

pytestmark = engine_marks("sglang")

HERE = Path(__file__).resolve().parent
QWEN2_TIED = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 256,
              "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
              "num_key_value_heads": 4, "vocab_size": 2048, "max_position_embeddings": 256,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu",
              "tie_word_embeddings": True, "use_sliding_window": False, "dtype": "bfloat16",
              "bos_token_id": 1, "eos_token_id": 2}
QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
             "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
             "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
             "head_dim": 32, "vocab_size": 2048, "num_experts": 8, "num_experts_per_tok": 2,
             "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
             "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
             "hidden_act": "silu", "tie_word_embeddings": False, "dtype": "bfloat16",
             "bos_token_id": 1, "eos_token_id": 2}

#: GLM-4.5-style MoE with one NextN (MTP) layer (checkpoint layer 3): SGLang's
#: Glm4MoeForCausalLMNextN is its draft model
GLM_MTP = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
           "dtype": "bfloat16", "vocab_size": 2048, "hidden_size": 256,
           "intermediate_size": 512, "moe_intermediate_size": 128, "num_hidden_layers": 3,
           "first_k_dense_replace": 1, "num_attention_heads": 8, "num_key_value_heads": 4,
           "head_dim": 32, "partial_rotary_factor": 0.5, "attention_bias": True,
           "use_qk_norm": False, "n_routed_experts": 8, "n_shared_experts": 1,
           "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
           "routed_scaling_factor": 1.0, "norm_topk_prob": True, "num_nextn_predict_layers": 1,
           "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "max_position_embeddings": 256, "tie_word_embeddings": False, "bos_token_id": 1,
           "eos_token_id": 2}
NEXTN = {"speculative_algorithm": "NEXTN", "speculative_num_steps": 1,
         "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 2}


def _runs(d: dict[str, Path]) -> list[dict[str, Any]]:
    pp = "pploader"
    return [
        # the plugin's name; then SGLang's update_weights_from_disk: three bad checkpoints
        # (each defect in a shard of one stage only), then a good one
        {"name": "pp2", "model": str(d["llama1"]), "load_format": pp, "pp": 2,
         "reloads": [str(d["llama2_truncated"]), str(d["llama2_wrong_shape"]),
                     str(d["llama2_corrupt"]), str(d["llama2"])]},
        {"name": "pp2-default", "model": str(d["llama1"]), "load_format": "auto", "pp": 2,
         "reloads": [str(d["llama2"])]},
        # the class itself as load_format, SGLang's partition variable: an odd split
        {"name": "pp2-odd", "model": str(d["llama1"]), "load_format": "pploader-class",
         "pp": 2, "env": {"SGLANG_PP_LAYER_PARTITION": "1,3"}},
        # cold: the checkpoint's pages dropped first (each rank's pages read ahead)
        {"name": "tp2", "model": str(d["llama1"]), "load_format": pp, "tp": 2, "evict": True},
        {"name": "tp2-default", "model": str(d["llama1"]), "load_format": "auto", "tp": 2},
        {"name": "pp2tp2", "model": str(d["llama1"]), "load_format": pp, "pp": 2, "tp": 2},
        # tied word embeddings: SGLang's Qwen2 builds its own head on the last stage
        {"name": "tied-pp2", "model": str(d["qwen2_tied"]), "load_format": pp, "pp": 2},
        {"name": "tied-pp2-default", "model": str(d["qwen2_tied"]), "load_format": "auto",
         "pp": 2},
        {"name": "moe-pp2", "model": str(d["moe"]), "load_format": pp, "pp": 2},
        {"name": "moe-pp2-default", "model": str(d["moe"]), "load_format": "auto", "pp": 2},
        # python -m sglang.launch_server --load-format pploader --pp-size 2
        {"name": "server", "server": True, "model": str(d["llama1"]), "load_format": pp,
         "pp": 2, "prompt": " ".join(f"t{i}" for i in PROMPTS[0])},
    ]


def _add_tokenizer(model_dir: Path, vocab_size: int) -> None:
    """A word-level tokenizer beside the weights (``t<id>`` is token ``id``), so the
    OpenAI-compatible server takes a text prompt and answers text that names the ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)},
                                       unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # no special tokens: they would be matched inside words ("t2" in "t200")
    PreTrainedTokenizerFast(tokenizer_object=words).save_pretrained(str(model_dir))


def _retype_one_tensor(shard: Path, name: str) -> None:
    """Rewrite ``shard`` with ``name`` stored under its transposed shape (same bytes)."""
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(shard))
    tensors[name] = tensors[name].t().contiguous()
    save_file(tensors, str(shard), metadata={"format": "pt"})


def _shard_of(model_dir: Path, name: str) -> Path:
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    return model_dir / index["weight_map"][name]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from helpers import make_model
    root = tmp_path_factory.mktemp("sglang-ckpts")
    d = {"llama1": make_model(root / "llama1", LLAMA, shard_bytes=1_500_000, seed=1),
         "llama2": make_model(root / "llama2", LLAMA, shard_bytes=1_500_000, seed=2),
         "qwen2_tied": make_model(root / "qwen2_tied", QWEN2_TIED, shard_bytes=1_500_000,
                                  seed=5),
         "moe": make_model(root / "moe", QWEN3_MOE, shard_bytes=1_500_000, seed=6)}
    _add_tokenizer(d["llama1"], LLAMA["vocab_size"])
    # truncated: a shard of the last stage only (layer 3)
    bad = root / "llama2_truncated"
    shutil.copytree(d["llama2"], bad)
    shard = _shard_of(bad, "model.layers.3.mlp.down_proj.weight")
    with open(shard, "r+b") as fh:
        fh.truncate(shard.stat().st_size - 50_000)
    d["llama2_truncated"], d["truncated_shard"] = bad, shard
    # wrong shape: one tensor of the first stage only (layer 0)
    bad = root / "llama2_wrong_shape"
    shutil.copytree(d["llama2"], bad)
    _retype_one_tensor(_shard_of(bad, "model.layers.0.mlp.down_proj.weight"),
                       "model.layers.0.mlp.down_proj.weight")
    d["llama2_wrong_shape"] = bad
    # corrupt: a shard's header overwritten with garbage (layer 1, first stage)
    bad = root / "llama2_corrupt"
    shutil.copytree(d["llama2"], bad)
    shard = _shard_of(bad, "model.layers.1.self_attn.q_proj.weight")
    with open(shard, "r+b") as fh:
        fh.seek(8)
        fh.write(b"\x00not json at all" * 4)
    d["llama2_corrupt"], d["corrupt_shard"] = bad, shard
    return d


@pytest.fixture(scope="module")
def results(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
            ) -> dict[str, dict[str, Any]]:
    return run_engines(HERE / "engine.py", _runs(checkpoints), PROMPTS,
                       tmp_path_factory.mktemp("sglang-runs"), "sglang")


def test_pp2_same_tokens_and_only_stage_bytes(results: dict, checkpoints: dict) -> None:
    """PP=2 through ``--load-format pploader`` (the plugin's name): SGLang's default loader's
    greedy tokens; each rank read only its stage (19 and 20 of the 39 tensors the default
    loader hands each rank), by its count and by rchar."""
    run, ref = results["pp2"], results["pp2-default"]
    assert run["tokens"] == ref["tokens"]
    loads = _loads(run)
    assert [(x["start_layer"], x["end_layer"]) for x in loads] == [(0, 2), (2, 4)]
    assert [x["engine"] for x in loads] == ["SGLang", "SGLang"]
    _check_bytes(run)
    count, total = _checkpoint_tensors(checkpoints["llama1"])
    assert sum(x["items"] for x in loads) == count == 39
    assert [x["items"] for x in loads] == [19, 20]
    for load in loads:
        assert load["read_bytes"] < 0.6 * total, (load, total)
    assert sum(x["read_bytes"] for x in loads) == total


def test_odd_split_from_sglangs_partition_variable(results: dict) -> None:
    """``SGLANG_PP_LAYER_PARTITION=1,3`` with the loader class given as ``load_format``: the
    ranks planned SGLang's windows [0, 1) and [1, 4), read only those, same tokens."""
    run = results["pp2-odd"]
    loads = _loads(run)
    assert [(x["start_layer"], x["end_layer"]) for x in loads] == [(0, 1), (1, 4)]
    assert run["tokens"] == results["pp2-default"]["tokens"]
    _check_bytes(run)


def test_tp2_cold_same_tokens_rank_part(results: dict) -> None:
    """TP=2 from a cold page cache: SGLang's own weight loaders narrow the tensors handed
    whole (views); each rank's own pages only were read ahead; same tokens."""
    run = results["tp2"]
    assert run["resident_before"] == 0
    assert run["tokens"] == results["tp2-default"]["tokens"]
    loads = _loads(run)
    assert [x["tp_rank"] for x in loads] == [0, 1]
    for load in loads:
        assert 0 <= load["readahead_bytes"] <= load["ideal_bytes"], load
    assert sum(x["readahead_bytes"] for x in loads) > 0
    _check_bytes(run, tp=2)


def test_pp2_tp2_same_tokens(results: dict) -> None:
    """PP=2 x TP=2 (four ranks): the TP=2 default-loader run's tokens (the PP split adds no
    arithmetic), each rank its stage's TP part."""
    run = results["pp2tp2"]
    assert run["tokens"] == results["tp2-default"]["tokens"]
    loads = _loads(run)
    assert [(x["pp_rank"], x["tp_rank"]) for x in loads] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    _check_bytes(run, tp=2)


def test_tied_embeddings_pp2(results: dict) -> None:
    """Qwen2 with tie_word_embeddings at PP=2: SGLang builds a head on the last stage and
    loads it from the embedding; that rank reads the embedding once for it."""
    run = results["tied-pp2"]
    assert run["tokens"] == results["tied-pp2-default"]["tokens"]
    first, last = _loads(run)
    _check_bytes(run)
    embed = QWEN2_TIED["vocab_size"] * QWEN2_TIED["hidden_size"] * 2
    assert last["ideal_bytes"] > embed


def test_moe_pp2(results: dict, checkpoints: dict) -> None:
    run = results["moe-pp2"]
    assert run["tokens"] == results["moe-pp2-default"]["tokens"]
    _check_bytes(run)
    _, total = _checkpoint_tensors(checkpoints["moe"])
    assert all(x["read_bytes"] < 0.6 * total for x in _loads(run))


def _refused(step: dict[str, Any]) -> None:
    assert step["raised"] is None, step["raised"]
    ok, message = step["answer"][0], step["answer"][1]
    assert ok is False and "pploader refused the reload" in message, step["answer"]
    for report in step["reports"]:   # every rank, both stages
        assert report["reload_error"]["written"] is False, report


def _switched(step: dict[str, Any]) -> bool:
    """SGLang accepted the reload: True, or "weights were updated" with the cache flushed
    late (tests/sglang/engine.py's ``_flush_late``: a request still retiring, either loader)."""
    assert step["raised"] is None, step["raised"]
    return step["answer"][0] is True or step.get("flushed_late") is True


def test_reload_refuses_bad_checkpoints_on_every_rank_then_switches(
        results: dict, checkpoints: dict) -> None:
    """SGLang's update_weights_from_disk on a pploader engine at PP=2. Each bad checkpoint
    has its defect in one stage's shard only (truncated: last stage; wrong shape, corrupt
    header: first stage), yet both ranks refuse it before writing, the engine keeps serving
    the old weights. The good one then switches the tokens exactly to what SGLang's own
    reload gives, read stage by stage, written in place."""
    run = results["pp2"]
    truncated, wrong_shape, corrupt, good = run["reloads"]
    for step in (truncated, wrong_shape, corrupt):
        _refused(step)
        assert step["tokens"] == run["tokens"]
        for report in step["reports"]:
            assert "reload" not in report
    assert checkpoints["truncated_shard"].name in truncated["answer"][1]
    assert "down_proj" in wrong_shape["answer"][1]
    assert checkpoints["corrupt_shard"].name in corrupt["answer"][1]
    assert _switched(good), good["answer"]
    reference = results["pp2-default"]["reloads"][0]
    assert _switched(reference), reference["answer"]
    assert good["tokens"] == reference["tokens"] != run["tokens"]
    for report in good["reports"]:
        reloaded = report["reload"]
        assert Path(reloaded["model_dir"]).name == checkpoints["llama2"].name
        assert reloaded["data_ptrs_kept"] is True
        assert reloaded["read_bytes"] <= 1.02 * reloaded["ideal_bytes"]
        assert "reload_error" not in report
    assert [r["reload"]["items"] for r in good["reports"]] == [19, 20]


def test_server_with_load_format_pploader_answers_a_completion(results: dict) -> None:
    """``python -m sglang.launch_server --load-format pploader --pp-size 2`` (the plugin
    makes the name a valid choice and resolves it in every process): /v1/completions on a
    text prompt answers with the default loader's greedy tokens, each rank read its stage."""
    run = results["server"]
    assert "--load-format" in run["cmd"] and "pploader" in run["cmd"]
    text = run["completion"]["choices"][0]["text"]
    assert text.split() == [f"t{i}" for i in results["pp2-default"]["tokens"][0]], text
    loads = _loads(run)
    assert [(x["start_layer"], x["end_layer"]) for x in loads] == [(0, 2), (2, 4)]
    _check_bytes(run)


@pytest.fixture(scope="module")
def nextn(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """SGLang's NEXTN speculative decoding with load format pploader: the scheduler loads the
    target, then its draft worker loads the draft model (its own ``load_model`` call). On
    SGLang 0.5.23's CPU path the engine then stops: its EAGLE worker shares the target's
    embedding and head with ``set_embed_and_head``, which calls ``torch.cuda.synchronize()``.
    So this engine runs alone (SGLang ends its launcher when a scheduler fails) and the test
    reads the report the rank wrote when it loaded."""
    from helpers import make_model
    work = tmp_path_factory.mktemp("sglang-nextn")
    model = make_model(work / "glm_mtp", GLM_MTP, shard_bytes=1_500_000, seed=7)
    report_dir = work / "reports"
    report_dir.mkdir()
    done = run_engines(HERE / "engine.py", [
        {"name": "nextn", "model": str(model), "load_format": "pploader", "engine": NEXTN,
         "report_dir": str(report_dir)}], PROMPTS, work, "sglang", check=False)
    ranks = sorted(report_dir.glob("rank*.json"))
    return {"model": model, "done": done, "log": (work / "engine.log").read_text(),
            "reports": [json.loads(p.read_text()) for p in ranks]}


def test_nextn_draft_worker_reads_only_its_mtp_layer(nextn: dict[str, Any]) -> None:
    """The draft model (Glm4MoeForCausalLMNextN) is handed exactly the MTP layer's tensors
    (checkpoint layer 3) less the embedding and head copies SGLang takes from the target,
    and reads exactly their bytes; the target's stage never reads the MTP layer. SGLang's
    default loader hands the draft every tensor of the checkpoint."""
    from pploader.planning.checkpoint import open_checkpoint
    assert len(nextn["reports"]) == 1, nextn["log"][-4000:]
    report = nextn["reports"][0]
    index = open_checkpoint(nextn["model"])
    layer = GLM_MTP["num_hidden_layers"]
    mtp = {n for n in index.weight_map if n.startswith(f"model.layers.{layer}.")}
    shared = {f"model.layers.{layer}.embed_tokens.weight",
              f"model.layers.{layer}.shared_head.head.weight"}
    draft = report["draft"]
    assert draft["layer"] == layer and draft["mtp_layer"] == 0
    assert set(draft["tensors"]) == mtp - shared
    want = sum(index.entry(n).nbytes for n in mtp - shared)
    assert draft["read_bytes"] == draft["ideal_bytes"] == want
    count, total = _checkpoint_tensors(nextn["model"])
    assert count == len(index.weight_map) and want < 0.5 * total
    assert draft["rchar_bytes"] is not None and \
        draft["rchar_bytes"] <= draft["read_bytes"] - draft["mapped_bytes"] + \
        _metadata_bytes(draft)
    load = report["load"]
    assert (load["start_layer"], load["end_layer"]) == (0, layer)
    assert load["read_bytes"] <= 1.02 * load["ideal_bytes"]
    assert load["ideal_bytes"] + want <= total
    if nextn["done"].get("nextn", {}).get("tokens") is None:   # the CPU path's stop, named
        assert "set_embed_and_head" in nextn["log"], nextn["log"][-4000:]

