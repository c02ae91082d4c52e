"""Start SGLang CPU engines one after another in this process and record what they did.

Run as a subprocess: ``python tests/sglang/engine.py SPEC.json OUT.json``. SPEC: ``{"prompts":
[[ids]], "max_tokens": n, "runs": [{"name", "model", "load_format", "pp"?, "tp"?, "env"?:
{VAR: value} (set while the engine starts: SGLANG_PP_LAYER_PARTITION), "extra"?: loader
config, "engine"?: {Engine kwargs}, "evict"?: bool, "reloads"?: [dir, ...], "report_dir"?:
where the ranks write their reports (default: a fresh temporary directory), "logprobs"?:
bool (also record each greedy token's log-probability)}]}``.
``load_format`` ``"pploader"`` is the plugin's name (the ``sglang.srt.plugins`` entry point),
``"pploader-class"`` the loader class itself. ``evict``: drop the checkpoint's pages from the
page cache first (a cold load). ``reloads``: ``Engine.update_weights_from_disk(dir,
load_format)``, each followed by a generate. ``server``: instead of an engine, ``python -m
sglang.launch_server --load-format <load_format>`` answering one ``/v1/completions`` request
for ``"prompt"`` (text: the checkpoint carries a tokenizer).
OUT: per run the greedy tokens, each rank's pploader report (``report_dir``), the seconds the
engine took to start and, per reload, SGLang's answer, the tokens after it and the reports.
"""
from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE.parent))   # last: tests/sglang must not shadow the real sglang
from engine_suite import engine_main, evict  # noqa: E402 - tests/ put on the path first
#: SGLang's CPU engine on a 2-core box (issue 39): one OMP thread per rank, a missing NCCL
#: library (the CUDA build's pynccl would otherwise break the PP group on CPU)
ENV = {"SGLANG_USE_CPU_ENGINE": "1", "SGLANG_CPU_OMP_THREADS_BIND": "0|1|0|1",
       "SGLANG_NCCL_SO_PATH": "/nonexistent/libnccl.so", "OMP_NUM_THREADS": "1",
       "TOKENIZERS_PARALLELISM": "false", "SGLANG_PLUGINS": "pploader"}


def _threads_bind(world: int) -> str:
    return "|".join(str(r % max(1, os.cpu_count() or 1)) for r in range(world))


def engine(run: dict[str, Any], report_dir: str) -> Any:
    import sglang
    fmt: Any = run["load_format"]
    if fmt == "pploader-class":
        from pploader.integrations.sglang import PPLoaderModelLoader
        fmt = PPLoaderModelLoader
    pp, tp = run.get("pp", 1), run.get("tp", 1)
    os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = _threads_bind(pp * tp)
    kwargs: dict[str, Any] = dict(
        model_path=run["model"], load_format=fmt, pp_size=pp, tp_size=tp,
        device="cpu", skip_tokenizer_init=True, disable_overlap_schedule=True,
        max_total_tokens=512, max_running_requests=4, chunked_prefill_size=-1,
        disable_cuda_graph=True, disable_radix_cache=True, random_seed=0,
        dtype=run.get("dtype", "bfloat16"), mem_fraction_static=0.5, log_level="error")
    if str(run["load_format"]).startswith("pploader"):
        kwargs["model_loader_extra_config"] = json.dumps(
            dict(run.get("extra", {}), report_dir=report_dir))
    kwargs.update(run.get("engine", {}))
    return sglang.Engine(**kwargs)


def generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    return generate_logprobs(llm, prompts, max_tokens, False)[0]


def generate_logprobs(llm: Any, prompts: list[list[int]], max_tokens: int, logprobs: bool
                      ) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy tokens and (``logprobs``) each chosen token's log-probability."""
    params = {"temperature": 0.0, "max_new_tokens": max_tokens, "ignore_eos": True}
    outs = llm.generate(input_ids=prompts, sampling_params=params, return_logprob=logprobs)
    probs = [[float(x[0]) for x in o["meta_info"]["output_token_logprobs"]] if logprobs
             else [] for o in outs]
    return [list(o["output_ids"]) for o in outs], probs


def reports(report_dir: str) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in
            sorted(Path(report_dir).glob("rank*.json"), key=lambda p: int(p.stem[4:]))]


def serve(run: dict[str, Any], report_dir: str, max_tokens: int) -> dict[str, Any]:
    """The OpenAI-compatible server with ``--load-format``: one completion, then stopped."""
    import socket
    import subprocess
    import urllib.request
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    pp, tp = run.get("pp", 1), run.get("tp", 1)
    env = dict(os.environ, SGLANG_CPU_OMP_THREADS_BIND=_threads_bind(pp * tp))
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", run["model"],
           "--load-format", run["load_format"], "--pp-size", str(pp), "--tp-size", str(tp),
           "--device", "cpu", "--host", "127.0.0.1", "--port", str(port),
           "--disable-overlap-schedule", "--max-total-tokens", "512",
           "--max-running-requests", "4", "--chunked-prefill-size", "-1",
           "--disable-cuda-graph", "--disable-radix-cache", "--random-seed", "0",
           "--mem-fraction-static", "0.5", "--dtype", "bfloat16",
           "--model-loader-extra-config", json.dumps({"report_dir": report_dir})]
    log = open(Path(report_dir) / "server.log", "w")
    # its own process group: the server and the scheduler processes it starts stop together
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    out: dict[str, Any] = {"name": run["name"], "cmd": cmd}
    start = time.perf_counter()
    try:
        while time.perf_counter() - start < 900:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}: "
                                   + (Path(report_dir) / "server.log").read_text()[-4000:])
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                    break
            except OSError:
                time.sleep(2)
        out["start_seconds"] = time.perf_counter() - start
        body = json.dumps({"model": run["model"], "prompt": run["prompt"],
                           "max_tokens": max_tokens, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as resp:
            out["completion"] = json.loads(resp.read())
        out["reports"] = reports(report_dir)
    finally:
        import signal
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    return out


def _flush_late(llm: Any, answer: Any) -> Any:
    """SGLang answers False when the weights were written but the previous generate's request
    was still being retired as it flushed the cache (a race seen on a loaded 2-core box, with
    either loader): flush again until it goes through (None: the answer was not that)."""
    if not (isinstance(answer, list) and answer and answer[0] is False
            and str(answer[1]).startswith("Weights were updated")):
        return None
    for _ in range(60):
        if getattr(llm.flush_cache(), "success", False):
            return True
        time.sleep(0.5)
    return False


def one_run(run: dict[str, Any], prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    if run.get("server"):
        return serve(run, tempfile.mkdtemp(prefix=f"sglang-{run['name']}-"), max_tokens)
    resident = evict(run["model"]) if run.get("evict") else None
    report_dir = run.get("report_dir") or tempfile.mkdtemp(prefix=f"sglang-{run['name']}-")
    saved = {k: os.environ.get(k) for k in run.get("env", {})}
    os.environ.update(run.get("env", {}))
    start = time.perf_counter()
    try:
        llm = engine(run, report_dir)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    out: dict[str, Any] = {"name": run["name"], "start_seconds": time.perf_counter() - start,
                           "resident_before": resident}
    try:
        out["tokens"], out["logprobs"] = generate_logprobs(llm, prompts, max_tokens,
                                                           bool(run.get("logprobs")))
        out["reports"] = reports(report_dir)
        out["reloads"] = []
        for new_dir in run.get("reloads", []):
            step: dict[str, Any] = {"dir": new_dir}
            t0 = time.perf_counter()
            fmt = "pploader" if str(run["load_format"]).startswith("pploader") else "auto"
            try:
                answer = llm.update_weights_from_disk(new_dir, load_format=fmt)
                step["answer"] = list(answer) if isinstance(answer, tuple) else answer
                step["raised"] = None
                step["flushed_late"] = _flush_late(llm, step["answer"])
            except Exception as exc:  # noqa: BLE001 - what the caller of SGLang's API sees
                step["raised"] = f"{type(exc).__name__}: {exc}"
            step["seconds"] = time.perf_counter() - t0
            step["tokens"] = generate(llm, prompts, max_tokens)
            step["reports"] = reports(report_dir)
            out["reloads"].append(step)
    finally:
        llm.shutdown()
        del llm
        gc.collect()
    return out


if __name__ == "__main__":
    # the CPU-op stand-in first on the path, in this process and the schedulers it spawns
    stubs = str(HERE / "stubs")
    sys.path.insert(0, stubs)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [stubs] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    engine_main(one_run, ENV)
