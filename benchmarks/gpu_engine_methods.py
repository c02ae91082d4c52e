"""Engine-shaped GPU methods: checkpoint -> an engine's GPU parameters.

The parameters already sit on the GPU (allocated and touched before the clock, as an engine
builds its model first); each method streams the stage's tensors and ``param.copy_(tensor)``
each one, which is what vLLM's ``default_weight_loader`` does per tensor. Planning, headers,
staging and every copy are inside the clock. Run by benchmarks/gpu_field.py
(``python -m benchmarks.gpu_field --methods engine_pploader,engine_vllm_default,...``).

- ``engine_pploader``: ``plan_stage`` + ``iter_stage_weights(device=cuda)`` (the windowed
  device stream), staging started when the "loader is created" (before the parameters are
  allocated, as in an engine's start-up), so its page-locking overlaps the model build;
- ``engine_pploader_cold_ring``: the same with the staging made inside the clock;
  ``engine_pploader_built``: with a 2 s model build (the staging finishes page-locking
  before the load; each pploader row records whether it had: ``ring_ready_before_clock_s``);
- ``engine_pploader_w256m`` / ``_w1g`` / ``_w2g`` / ``_w4g`` / ``_w32g``: other device budgets;
  ``engine_pploader_windowed``: the windowed stream the continuous one replaced (two windows
  of 2 GiB, each a whole backend run), for comparison in one run;
- ``engine_pploader_vllm``: what pploader's vLLM load format calls on a GPU worker: its
  ``load_model`` starts the staging and plans the stage on a background thread before the
  model build (the parameters), then ``integrations/placed.stage_weights`` onto the device;
- ``engine_vllm_default``: vLLM's default shape: ``safe_open`` every shard, ``get_tensor``
  every name, ``copy_`` when the stage owns it (pageable host -> device);
- ``engine_pploader_sglang``: what pploader's SGLang load format calls on a GPU rank
  (``engine_core.load_engine_stage`` with SGLang's split and the staging started when the
  loader was made, the model's ``load_weights`` a ``copy_`` per tensor);
- ``engine_sglang_default``: SGLang's default shape (``DefaultModelLoader``'s buffered
  multi-thread iterator: 8 threads ``safe_open`` + ``get_tensor`` whole shards, 9 in flight,
  every name yielded, ``copy_`` when the stage owns it);
- ``engine_dcp``: ``torch.distributed.checkpoint.load`` with torch's
  ``HuggingFaceStorageReader(thread_count=8)`` into the parameters (no process group);
- ``engine_fastsafetensors`` / ``engine_runai``: those libraries' readers into the parameters
  (when their packages are importable);
- ``engine_load_stage`` / ``engine_dcp_pploader``: ``plan_stage`` + ``load_stage(device=cuda)``
  and ``dcp.load`` with ``PPLoaderStorageReader`` made inside the clock, each exactly as the
  docs show (``pploader.start_staging`` at start-up, before the parameters); ``_built``: a 2 s
  model build after it; ``_nostart``: without ``start_staging`` (the DCP reader starts it
  itself when made). Each row records the staging slots page-locked when the clock started.
  The DCP rows (torch's reader and pploader's alike) import ``torch.distributed.checkpoint``
  before the clock, as the job's own start-up does: that import alone takes about 2 s on
  these hosts, is the same for every reader, and measured inside the clock it hid the
  readers' difference (3.15 vs 2.33 GB/s in the entry-point run at d58e32e).
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable, Optional

import torch

from pploader.io.transfer.direct import DEFAULT_DEVICE_WINDOW_BYTES
from pploader.bench.gpu_methods import DTYPES, Ctx, Method, m_fastsafetensors

__all__ = ["ENGINE_METHODS", "ENGINE_OPTIONAL", "ENGINE_ENV"]


def _sync(device: str) -> None:
    """Wait for the device's copies (a no-op on CPU, where the rows run in the unit tests)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _params(ctx: Ctx) -> dict[str, torch.Tensor]:
    """The engine's parameters: one device tensor per stage tensor, touched (zeroed)."""
    out = {name: torch.empty(shape, dtype=DTYPES[dt], device=ctx.device)
           for name, (_f, _s, _e, dt, shape) in ctx.tensors.items()}
    for t in out.values():
        t.zero_()
    _sync(ctx.device)
    return out


def prep_engine(ctx: Ctx) -> dict:
    """Parameters allocated before the clock (the engine's model build)."""
    return {"params": _params(ctx)}


def prep_engine_staged(ctx: Ctx) -> dict:
    """The loader is created first (its staging starts page-locking in the background),
    then the engine builds its model (the parameters), then the clock starts."""
    from pploader.io.backend import ReadOptions
    from pploader.io.registry import prepare_staging
    ring = prepare_staging(ctx.device, ReadOptions())
    return {"ring": ring, "params": _params(ctx)}


def _prep_engine_queue(threads: int, slot_bytes: int) -> Callable[[Ctx], dict]:
    """Staging of ``threads`` readers x 2 slots of ``slot_bytes``, page-locked before the
    clock: requests of ``slot_bytes``, ``threads x slot_bytes`` in flight (the disk queue's
    depth, issue 28's cold comparison)."""
    def prep(ctx: Ctx) -> dict:
        from pploader.io.pinned_ring import PinnedRing
        ring = PinnedRing(threads, slot_bytes, lazy=False, device=ctx.device)
        return {"ring": ring, "params": _params(ctx)}
    return prep


def _copied(ctx: Ctx, params: dict[str, torch.Tensor], copied: int, extra: dict) -> tuple:
    _sync(ctx.device)
    if copied != len(params):
        raise RuntimeError(f"{copied} tensors copied, the stage has {len(params)}")
    return params, extra


def _engine_pploader_window(window_bytes: int) -> Method:
    def run(ctx: Ctx, prep: dict) -> tuple[dict, dict]:
        return m_engine_pploader(ctx, prep, window_bytes)
    return run


def m_engine_pploader(ctx: Ctx, prep: dict, window_bytes: Optional[int] = None
                      ) -> tuple[dict, dict]:
    """plan_stage + iter_stage_weights(device=cuda): device tensors, one D2D copy_ each."""
    from pploader import Topology, iter_stage_weights, plan_stage
    params = prep["params"]
    base = torch.cuda.memory_allocated(ctx.device)
    torch.cuda.reset_peak_memory_stats(ctx.device)
    ready_s = _ring_ready_s(prep)
    t0 = time.perf_counter()
    staged = plan_stage(ctx.ckdir, Topology(ctx.pp, rank=ctx.stage))
    t1 = time.perf_counter()
    copied = 0
    for name, tensor in iter_stage_weights(staged, device=ctx.device, ring=prep.get("ring"),
                                           device_window_bytes=window_bytes):
        params[name].copy_(tensor)
        copied += 1
    extra = {"logical_bytes": staged.plan.read_bytes, "plan_s": t1 - t0,
             "api": "plan_stage + iter_stage_weights(device=cuda) -> param.copy_",
             "extra_device_bytes": torch.cuda.max_memory_allocated(ctx.device) - base,
             "window_bytes": window_bytes or DEFAULT_DEVICE_WINDOW_BYTES,
             "ring_ready_before_clock_s": ready_s}
    return _copied(ctx, params, copied, extra)


def m_engine_pploader_windowed(ctx: Ctx, prep: dict) -> tuple[dict, dict]:
    """The windowed device stream (io/transfer/direct.py ``_windowed``, what a backend
    without a stream of its own gets) with the pinned backend, 4 GiB: the pre-issue-28-round-7
    default, measured beside the continuous stream."""
    from pploader import Topology, plan_stage
    from pploader.io.backend import ReadOptions
    from pploader.io.transfer.direct import DirectTransfer
    params = prep["params"]
    base = torch.cuda.memory_allocated(ctx.device)
    torch.cuda.reset_peak_memory_stats(ctx.device)
    t0 = time.perf_counter()
    staged = plan_stage(ctx.ckdir, Topology(ctx.pp, rank=ctx.stage))
    ring = prep.get("ring")
    if ring is not None:
        ring.stop_preparing()
    reader = DirectTransfer(staged, torch.device(ctx.device), ReadOptions(ring=ring,
                                                            device_window_bytes=4 << 30))
    t1 = time.perf_counter()
    copied = 0
    for name, tensor in reader._windowed():
        params[name].copy_(tensor)
        copied += 1
    return _copied(ctx, params, copied, {
        "logical_bytes": staged.plan.read_bytes, "plan_s": t1 - t0,
        "extra_device_bytes": torch.cuda.max_memory_allocated(ctx.device) - base,
        "window_bytes": 4 << 30, "api": "DirectTransfer._windowed (2 x 2 GiB) -> param.copy_"})


def prep_engine_built(ctx: Ctx) -> dict:
    """:func:`prep_engine_staged` in an engine whose model build takes 2 s (vLLM's for an
    8B model on a GPU: ~1-3 s): the staging's page-locking has that long to finish."""
    prep = prep_engine_staged(ctx)
    time.sleep(2.0)
    return prep


def _ring_ready_s(prep: dict) -> Optional[float]:
    """How long the staging's background page-locking took, when it finished before the
    clock started; None when it had not (the load's readers lock the rest)."""
    ring = prep.get("ring")
    seconds = getattr(ring, "prepare_seconds", 0.0) if ring is not None else 0.0
    return float(seconds) if seconds else None


def prep_engine_format(ctx: Ctx) -> dict:
    """What the vLLM format's ``load_model`` does before vLLM builds the model: its modules
    are imported (vLLM imports them when it registers the plugin, at engine start), the
    staging starts page-locking (``early_staging``) and the stage is planned on a
    background thread (``start_early_plan``, with vLLM's layer split); then the parameters
    (the model build) and the clock."""
    from pploader import Topology
    from pploader.integrations import placed  # noqa: F401
    from pploader.integrations.engine_core import start_early_plan
    from pploader.io.backend import ReadOptions
    from pploader.io.registry import prepare_staging
    from pploader.planning.partition import engine_layer_counts

    def place(num_layers: int) -> tuple[Topology, tuple[int, ...]]:
        return Topology(ctx.pp, rank=ctx.stage), \
            tuple(engine_layer_counts("vllm", num_layers, ctx.pp))
    ring = prepare_staging(ctx.device, ReadOptions())
    early = start_early_plan(ctx.ckdir, "placed", 0, place)
    return {"ring": ring, "early_plan": early, "params": _params(ctx)}


def prep_engine_format_reserved(ctx: Ctx) -> dict:
    """:func:`prep_engine_format`, then the device window's bytes allocated once and freed
    before the clock: the caching allocator holds a free segment the stream's per-item
    tensors are carved from (no cudaMalloc inside the load). An experiment."""
    prep = prep_engine_format(ctx)
    block = torch.empty(DEFAULT_DEVICE_WINDOW_BYTES, dtype=torch.uint8, device=ctx.device)
    del block
    return prep


def _side_alloc_stream(method: Method) -> Method:
    """``method`` with the device stream allocating on a stream of its own instead of the
    consumer's (released items then ``record_stream`` the consumer's): the readers' copies
    never wait behind the consumer's queued work. An experiment."""
    def run(ctx: Ctx, prep: dict) -> tuple[dict, dict]:
        from pploader.io import device_stream
        init = device_stream.DeviceStream.__init__

        def patched(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            self._alloc_stream = torch.cuda.Stream(self.device)
        device_stream.DeviceStream.__init__ = patched  # type: ignore[method-assign]
        try:
            return method(ctx, prep)
        finally:
            device_stream.DeviceStream.__init__ = init  # type: ignore[method-assign]
    return run


def _engine_pploader_vllm_window(window_bytes: int) -> Method:
    """:func:`m_engine_pploader_vllm` with another device budget."""
    def run(ctx: Ctx, prep: dict) -> tuple[dict, dict]:
        return m_engine_pploader_vllm(ctx, prep, window_bytes)
    return run


def m_engine_pploader_vllm(ctx: Ctx, prep: dict, window_bytes: Optional[int] = None
                           ) -> tuple[dict, dict]:
    """What pploader's vLLM load format calls on a GPU worker: ``placed.stage_weights`` onto
    the model's device with the staging the loader started at creation, then the engine's
    ``copy_`` per tensor (vLLM itself does not install on the GPU host)."""
    from pploader import Topology, plan_stage
    from pploader.integrations.placed import stage_weights
    from pploader.io.backend import ReadOptions
    params = prep["params"]
    ready_s = _ring_ready_s(prep)
    t0 = time.perf_counter()
    early = prep.get("early_plan")
    staged = early.result() if early is not None else \
        plan_stage(ctx.ckdir, Topology(ctx.pp, rank=ctx.stage), range_cost_bytes=0)
    ring = prep.get("ring")
    if ring is not None:
        ring.stop_preparing()
    reader, weights = stage_weights(staged, "placed", None, ReadOptions(
        ring=ring, device_window_bytes=window_bytes), ctx.device)
    t1 = time.perf_counter()
    copied = 0
    for name, tensor in weights:
        params[name].copy_(tensor)
        copied += 1
    timings = getattr(getattr(reader, "backend", None), "timings", {})
    return _copied(ctx, params, copied, {
        "logical_bytes": reader.stats.read_bytes, "plan_s": t1 - t0,
        "ring_ready_before_clock_s": ready_s,
        "stream_timings": {k: round(v, 4) for k, v in timings.items()},
        "early_plan": early is not None,
        "api": "early plan + placed.stage_weights(device=cuda) -> param.copy_ (vLLM format)"})


def m_engine_vllm_default(ctx: Ctx, prep: dict) -> tuple[dict, dict]:
    """vLLM's default loader's shape: every shard, every name, copy_ the stage's."""
    from safetensors import safe_open
    params, copied = prep["params"], 0
    for f in ctx.all_files:
        with safe_open(ctx.path(f), framework="pt", device="cpu") as sf:
            for name in sf.keys():
                tensor = sf.get_tensor(name)
                if name in params:  # is_pp_missing_parameter: skipped after the read
                    params[name].copy_(tensor)
                    copied += 1
    return _copied(ctx, params, copied, {
        "logical_bytes": sum(os.path.getsize(ctx.path(f)) for f in ctx.all_files),
        "api": "safe_open(every shard).get_tensor(every name) -> param.copy_ (stage's)"})


class _StageModel(torch.nn.Module):
    """The engine's model as the SGLang format sees it: its parameters by checkpoint name and
    a ``load_weights`` that ``copy_``s each tensor it is handed (SGLang's
    ``default_weight_loader``), returning the names written."""

    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.params, self.copied = params, 0

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return iter(self.params.items())

    def load_weights(self, weights: Any) -> set[str]:
        written = set()
        for name, tensor in weights:
            if name in self.params:
                self.params[name].copy_(tensor)
                written.add(name)
                self.copied += 1
        return written


def prep_engine_sglang(ctx: Ctx) -> dict:
    """The SGLang loader is made first (its staging starts page-locking, ``early_staging``),
    then SGLang builds the model (the parameters), then the clock starts."""
    from pploader.integrations import engine_core, placed  # noqa: F401 - imported with the plugin
    from pploader.io.backend import ReadOptions
    from pploader.io.registry import prepare_staging
    ring = prepare_staging(ctx.device, ReadOptions()) \
        if torch.device(ctx.device).type == "cuda" else None
    return {"ring": ring, "params": _params(ctx)}


def m_engine_pploader_sglang(ctx: Ctx, prep: dict) -> tuple[dict, dict]:
    """What pploader's SGLang format calls per rank: ``load_engine_stage`` (plan with SGLang's
    split, the window checked, ``placed.stage_weights`` onto the parameters' device through
    the staging made at loader creation, the model's ``load_weights``, the strict check)."""
    from pploader import Topology
    from pploader.integrations.engine_core import load_engine_stage
    from pploader.planning.partition import engine_layer_counts
    from pploader.planning.spec import load_spec
    params = prep["params"]
    ready_s = _ring_ready_s(prep)
    t0 = time.perf_counter()
    split = engine_layer_counts("sglang", load_spec(ctx.ckdir).num_layers, ctx.pp)
    model = _StageModel(params)
    state = load_engine_stage(model, ctx.ckdir, Topology(ctx.pp, rank=ctx.stage), split,
                              model.load_weights,
                              staging=prep.get("ring"), engine="SGLang")
    return _copied(ctx, params, model.copied, {
        "logical_bytes": state.report["read_bytes"], "load_s": time.perf_counter() - t0,
        "ring_ready_before_clock_s": ready_s, "io_backend": state.io_backend,
        "api": "engine_core.load_engine_stage(sglang split) -> load_weights: param.copy_ "
               "(SGLang format)"})


def m_engine_sglang_default(ctx: Ctx, prep: dict, max_workers: int = 8) -> tuple[dict, dict]:
    """SGLang's default loader's shape: its buffered multi-thread iterator (``max_workers``
    threads each ``safe_open`` + ``get_tensor`` a whole shard, ``max_workers + 1`` shards in
    flight, every name yielded in order), ``copy_`` of the stage's tensors."""
    import collections
    import concurrent.futures
    from safetensors import safe_open

    def load_file(path: str) -> dict[str, torch.Tensor]:
        with safe_open(path, framework="pt", device="cpu") as sf:
            return {k: sf.get_tensor(k) for k in sf.keys()}
    params, copied = prep["params"], 0
    paths = [ctx.path(f) for f in ctx.all_files]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max_workers) as pool:
        pending = collections.deque(pool.submit(load_file, p) for p in paths[:max_workers + 1])
        rest = iter(paths[max_workers + 1:])
        while pending:
            shard = pending.popleft().result()
            following = next(rest, None)
            if following is not None:
                pending.append(pool.submit(load_file, following))
            for name in sorted(shard):
                if name in params:  # the model drops other stages' tensors after the read
                    params[name].copy_(shard[name])
                    copied += 1
            del shard
    return _copied(ctx, params, copied, {
        "logical_bytes": sum(os.path.getsize(p) for p in paths),
        "api": "8 threads safe_open(every shard).get_tensor(every name), 9 shards in flight "
               "-> param.copy_ (stage's) (SGLang default)"})


def m_engine_dcp(ctx: Ctx, prep: dict) -> tuple[dict, dict]:
    """torch DCP's Hugging Face reader into the parameters (keys = checkpoint names)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    params = prep["params"]
    dcp.load(params, storage_reader=HuggingFaceStorageReader(ctx.ckdir, thread_count=8),
             no_dist=True)
    return _copied(ctx, params, len(params), {
        "logical_bytes": ctx.ideal_bytes,
        "api": "dcp.load(params, HuggingFaceStorageReader(thread_count=8), no_dist)"})


def m_engine_fastsafetensors(ctx: Ctx, prep: dict) -> tuple[dict, dict]:
    """fastsafetensors (O_DIRECT as FASTSAFETENSORS_ODIRECT says) -> param.copy_."""
    params = prep["params"]
    out, info = m_fastsafetensors(ctx, {})
    for name, tensor in out.items():
        params[name].copy_(tensor)
    return _copied(ctx, params, len(out), {**info, "api": info["api"] + " -> param.copy_"})


def m_engine_runai(ctx: Ctx, prep: dict) -> tuple[dict, dict]:
    """runai-model-streamer's SafetensorsStreamer over every shard (as vLLM's runai load
    format streams them), the stage's tensors copy_'d into the parameters."""
    from runai_model_streamer import SafetensorsStreamer
    params, copied = prep["params"], 0
    with SafetensorsStreamer() as streamer:
        streamer.stream_files([ctx.path(f) for f in ctx.all_files])
        for name, tensor in streamer.get_tensors():
            if name in params:
                params[name].copy_(tensor)
                copied += 1
    return _copied(ctx, params, copied, {
        "logical_bytes": sum(os.path.getsize(ctx.path(f)) for f in ctx.all_files),
        "api": "runai SafetensorsStreamer(every shard).get_tensors() -> param.copy_ (stage's)"})


def prep_engine_start(ctx: Ctx) -> dict:
    """What the docs tell a user (docs/integration.md, "the staging policy"):
    ``pploader.start_staging(device)`` at start-up, then the model build (the parameters),
    then the load; ``prep_engine_start_built``: with a 2 s model build."""
    import pploader
    ring = pploader.start_staging(ctx.device)
    return {"ring_started": ring, "params": _params(ctx)}


def prep_dcp_job(ctx: Ctx) -> dict:
    """A DCP job: ``torch.distributed.checkpoint`` imported (the job's code), then the model
    build (the parameters)."""
    import torch.distributed.checkpoint  # noqa: F401 - the job's own import, before the clock
    return prep_engine(ctx)


def prep_dcp_job_start(ctx: Ctx) -> dict:
    """The same after ``pploader.start_staging`` at start-up."""
    import torch.distributed.checkpoint  # noqa: F401 - the job's own import, before the clock
    return prep_engine_start(ctx)


def prep_engine_start_built(ctx: Ctx) -> dict:
    prep = prep_engine_start(ctx)
    time.sleep(2.0)
    return prep


def _ready(prep: dict) -> dict:
    """How much of the process's staging was page-locked when the clock started."""
    ring = prep.get("ring_started")
    if ring is None:
        return {"ready_slots_before_clock": 0}
    return {"ready_slots_before_clock": ring.ready_slots,
            "slots": ring.threads * ring.per_thread}


def _as_documented(device: str) -> str:
    """``"cuda"`` (as the docs write it) when ``device`` is the current GPU, else ``device``."""
    if torch.device(device).type == "cuda" and torch.device(device) == torch.device(
            "cuda", torch.cuda.current_device()):
        return "cuda"
    return device


def m_engine_load_stage(ctx: Ctx, prep: dict) -> tuple[dict, dict]:
    """``plan_stage`` + ``load_stage(device=cuda)`` (owned device tensors), then
    ``param.copy_`` each: the public API exactly as the docs show it."""
    import pploader
    params = prep["params"]
    ready = _ready(prep)
    device = _as_documented(ctx.device)
    t0 = time.perf_counter()
    staged = pploader.plan_stage(ctx.ckdir, pploader.Topology(ctx.pp, rank=ctx.stage))
    res = pploader.load_stage(staged, device=device)
    t1 = time.perf_counter()
    copied = 0
    for item in staged.plan.items:
        params[item.name].copy_(res.state_dict[item.target])
        copied += 1
    return _copied(ctx, params, copied, {
        **ready, "logical_bytes": staged.plan.read_bytes, "load_s": t1 - t0,
        "api": "plan_stage + load_stage(device=cuda) -> param.copy_"})


def m_engine_dcp_pploader(ctx: Ctx, prep: dict) -> tuple[dict, dict]:
    """``dcp.load(params, storage_reader=pploader.PPLoaderStorageReader(model_dir))``, the
    reader made inside the clock, as docs/integration.md ("Torch-native jobs") shows."""
    import torch.distributed.checkpoint as dcp

    import pploader
    params = prep["params"]
    ready = _ready(prep)
    reader = pploader.PPLoaderStorageReader(ctx.ckdir)
    dcp.load(params, storage_reader=reader, no_dist=True)
    return _copied(ctx, params, len(params), {
        **ready, "logical_bytes": reader.read_bytes,
        "api": "dcp.load(params, pploader.PPLoaderStorageReader(model_dir), no_dist)"})


ENGINE_METHODS: dict[str, tuple[Method, Optional[Callable[[Ctx], dict]]]] = {
    # the public entry points exactly as documented (issue 40's rows)
    "engine_load_stage": (m_engine_load_stage, prep_engine_start),
    "engine_load_stage_built": (m_engine_load_stage, prep_engine_start_built),
    "engine_load_stage_nostart": (m_engine_load_stage, prep_engine),
    "engine_dcp_pploader": (m_engine_dcp_pploader, prep_dcp_job_start),
    "engine_dcp_pploader_built": (m_engine_dcp_pploader, prep_engine_start_built),
    "engine_dcp_pploader_nostart": (m_engine_dcp_pploader, prep_dcp_job),
    "engine_pploader": (m_engine_pploader, prep_engine_staged),
    "engine_pploader_cold_ring": (m_engine_pploader, prep_engine),
    "engine_pploader_w256m": (_engine_pploader_window(256 << 20), prep_engine_staged),
    "engine_pploader_w1g": (_engine_pploader_window(1 << 30), prep_engine_staged),
    "engine_pploader_w2g": (_engine_pploader_window(2 << 30), prep_engine_staged),
    "engine_pploader_w4g": (_engine_pploader_window(4 << 30), prep_engine_staged),
    "engine_pploader_windowed": (m_engine_pploader_windowed, prep_engine_staged),
    "engine_pploader_w32g": (_engine_pploader_window(32 << 30), prep_engine_staged),
    "engine_pploader_vllm": (m_engine_pploader_vllm, prep_engine_format),
    "engine_pploader_vllm_w1g": (_engine_pploader_vllm_window(1 << 30), prep_engine_format),
    "engine_pploader_vllm_w4g": (_engine_pploader_vllm_window(4 << 30), prep_engine_format),
    "engine_pploader_vllm_w32g": (_engine_pploader_vllm_window(32 << 30), prep_engine_format),
    "engine_pploader_vllm_reserved": (m_engine_pploader_vllm, prep_engine_format_reserved),
    "engine_pploader_vllm_sidealloc": (_side_alloc_stream(m_engine_pploader_vllm),
                                       prep_engine_format),
    # an engine whose model build takes 2 s: the staging is page-locked before the load
    "engine_pploader_built": (m_engine_pploader, prep_engine_built),
    # in-flight depth: readers x request size (default 16 x 16 MiB)
    "engine_pploader_q16x64m": (m_engine_pploader, _prep_engine_queue(16, 64 << 20)),
    "engine_pploader_q32x32m": (m_engine_pploader, _prep_engine_queue(32, 32 << 20)),
    "engine_pploader_q8x256m": (m_engine_pploader, _prep_engine_queue(8, 256 << 20)),
    "engine_pploader_q64x16m": (m_engine_pploader, _prep_engine_queue(64, 16 << 20)),
    "engine_vllm_default": (m_engine_vllm_default, prep_engine),
    "engine_pploader_sglang": (m_engine_pploader_sglang, prep_engine_sglang),
    "engine_sglang_default": (m_engine_sglang_default, prep_engine),
    "engine_dcp": (m_engine_dcp, prep_dcp_job),
    "engine_fastsafetensors": (m_engine_fastsafetensors, prep_engine),
    "engine_fastsafetensors_odirect": (m_engine_fastsafetensors, prep_engine),
    "engine_runai": (m_engine_runai, prep_engine),
}
ENGINE_OPTIONAL = {"engine_fastsafetensors": "fastsafetensors",
                   "engine_runai": "runai_model_streamer"}
ENGINE_ENV: dict[str, dict[str, Any]] = {
    "engine_fastsafetensors": {"FASTSAFETENSORS_ODIRECT": "0"},
    "engine_fastsafetensors_odirect": {"FASTSAFETENSORS_ODIRECT": "1"}}
