"""Object storage: pploader's ``s3`` backend vs RunAI's model streamer (``runai-model-streamer``
+ ``runai-model-streamer-s3``) on the same local S3-compatible server and the same files.

    python -m benchmarks.s3_streamer [--pp 1 2 4] [--layers 8 --hidden 768 --vocab 32000] [--json]
    python -m benchmarks.s3_streamer --clients       # boto3 vs obstore on the same server

Per PP rank, each method runs alone in a fresh process signed with its own access key, so the
server (pploader/testing/s3server.py: moto behind a byte counter) counts what that rank fetched
— config, index, listings and headers included — and the process reports its wall time:

- ``pploader``: ``plan_stage`` + ``load_stage`` of the rank's stage from ``s3://``;
- ``runai-all``: ``SafetensorsStreamer.stream_files`` over every shard, what vLLM's
  ``runai_streamer`` load format does on every rank;
- ``runai-stage``: the same with ``tensor_names=`` the stage's tensors (runai 0.17's filter;
  only the shards holding them), the best use of RunAI for a stage.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

__all__ = ["main", "run_bench"]

METHODS = ("pploader", "runai-all", "runai-stage")


def _env(url: str, key: str) -> dict[str, str]:
    return {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": key,
            "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "AWS_EC2_METADATA_DISABLED": "true", "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0"}


def _child(method: str, uri: str, pp: int, rank: int) -> None:
    """One rank of one method (run in its own process); prints ``RESULT {json}``."""
    import torch
    from pploader import Topology, load_stage, plan_stage
    torch.set_num_threads(1)
    start = time.perf_counter()
    if method == "pploader":
        staged = plan_stage(uri, Topology(pp, rank=rank))
        plan_s = time.perf_counter() - start
        res = load_stage(staged)
        got, ideal = res.stats.read_bytes, staged.plan.ideal_bytes
    else:
        from runai_model_streamer import SafetensorsStreamer
        names: Optional[set[str]] = None
        files = json.loads(os.environ["PPLOADER_BENCH_FILES"])
        ideal = 0
        if method == "runai-stage":  # the stage's tensors (planned outside the clock)
            spec = json.loads(os.environ["PPLOADER_BENCH_STAGE"])
            names, files, ideal = set(spec["tensors"]), spec["files"], spec["ideal"]
        start = time.perf_counter()
        got = 0
        plan_s = None
        with SafetensorsStreamer() as streamer:
            streamer.stream_files([f"{uri}/{f}" for f in files], tensor_names=names)
            for _, t in streamer.get_tensors():
                got += t.numel() * t.element_size()
    wall = time.perf_counter() - start
    print("RESULT " + json.dumps({"wall_s": wall, "tensor_bytes": got, "ideal": ideal,
                                  "plan_s": plan_s if method == "pploader" else None}),
          flush=True)


def _make_checkpoint(out: Path, layers: int, hidden: int, vocab: int) -> Path:
    from pploader.tiny import make_tiny
    cfg = json.loads((Path(__file__).resolve().parents[1] / "tiny_configs" / "tiny-llama.json"
                      ).read_text())
    cfg.pop("pploader_tiny", None)
    cfg.update(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
               num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
               vocab_size=vocab, head_dim=64)
    make_tiny(cfg, out, shard_bytes=64 << 20, seed=0)
    return out


def run_bench(pps: list[int], layers: int, hidden: int, vocab: int = 32000
              ) -> list[dict[str, Any]]:
    """Every (pp, rank, method) row: bytes fetched (server side), wall, ideal bytes."""
    import boto3

    from pploader.testing.s3server import start_server
    from pploader import Topology, plan_stage
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp, start_server() as server:
        model = _make_checkpoint(Path(tmp) / "model", layers, hidden, vocab)
        saved = dict(os.environ)
        os.environ.update(_env(server.url, "upload"))
        try:
            client = boto3.session.Session().client("s3")
            client.create_bucket(Bucket="bench")
            for f in sorted(model.iterdir()):
                client.upload_file(str(f), "bench", f"model/{f.name}")
        finally:
            os.environ.clear()
            os.environ.update(saved)
        uri = "s3://bench/model"
        shards = sorted(p.name for p in model.glob("*.safetensors"))
        total = sum((model / f).stat().st_size for f in shards)
        for pp in pps:
            for rank in range(pp):
                plan = plan_stage(model, Topology(pp, rank=rank)).plan
                stage = {"tensors": list(plan.tensors), "files": list(plan.files),
                         "ideal": plan.ideal_bytes}
                for method in METHODS:
                    key = f"{method}-pp{pp}-r{rank}"
                    env = dict(os.environ, **_env(server.url, key),
                               PPLOADER_BENCH_FILES=json.dumps(shards),
                               PPLOADER_BENCH_STAGE=json.dumps(stage), OMP_NUM_THREADS="1")
                    out = subprocess.run([sys.executable, "-m", "benchmarks.s3_streamer", "--child",
                                          method, uri, str(pp), str(rank)], env=env,
                                         capture_output=True, text=True, timeout=1800)
                    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
                    fetched = server.counts().get(key, {}).get("get_bytes", 0)
                    row = {"pp": pp, "rank": rank, "method": method, "fetched_bytes": fetched,
                           "ideal_bytes": plan.ideal_bytes, "checkpoint_bytes": total}
                    if out.returncode or not line:  # recorded, not hidden: the run goes on
                        errors = [x for x in out.stderr.splitlines() if "Error" in x]
                        rows.append({**row, "failed": (errors or ["no result"])[-1][-300:]})
                        continue
                    res = json.loads(line[-1][7:])
                    rows.append({**row, "wall_s": round(res["wall_s"], 3),
                                 "plan_s": res["plan_s"] and round(res["plan_s"], 3),
                                 "tensor_bytes": res["tensor_bytes"]})
    return rows


def compare_clients(size_mb: int = 256, chunk_mb: int = 16, threads: int = 8,
                    rounds: int = 2) -> list[dict[str, Any]]:
    """boto3 (ranged GET read into the buffer) vs obstore (``get`` with a range, then copied)
    on the same server and object: MB/s and the client's CPU seconds per GB (how the client
    library was chosen, storage/s3.py)."""
    from concurrent.futures import ThreadPoolExecutor

    import boto3
    import obstore
    from obstore.store import S3Store

    from pploader.testing.s3server import start_server
    size, chunk = size_mb << 20, chunk_mb << 20
    data = os.urandom(size)
    rows: list[dict[str, Any]] = []
    with start_server() as server:
        saved = dict(os.environ)
        os.environ.update(_env(server.url, "clients"), AWS_ALLOW_HTTP="true")
        try:
            client = boto3.session.Session().client("s3")
            client.create_bucket(Bucket="clients")
            client.put_object(Bucket="clients", Key="blob", Body=data)
            etag = client.head_object(Bucket="clients", Key="blob")["ETag"]
            store = S3Store("clients")

            def by_boto3(view: memoryview, a: int) -> None:
                raw = client.get_object(Bucket="clients", Key="blob", IfMatch=etag,
                                        Range=f"bytes={a}-{a + chunk - 1}")["Body"]._raw_stream
                got = 0
                while got < chunk:
                    got += raw.readinto(view[a + got:a + chunk])

            def by_obstore(view: memoryview, a: int) -> None:
                got = obstore.get(store, "blob", options={"range": (a, a + chunk),
                                                          "if_match": etag})
                view[a:a + chunk] = got.bytes()
            for _ in range(rounds):
                for name, fetch in (("boto3", by_boto3), ("obstore", by_obstore)):
                    buf = bytearray(size)
                    view = memoryview(buf)
                    cpu, wall = time.process_time(), time.perf_counter()
                    with ThreadPoolExecutor(threads) as pool:
                        list(pool.map(lambda a: fetch(view, a), range(0, size, chunk)))
                    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                    assert buf == data
                    rows.append({"client": name, "MB_s": round(size / wall / 1e6),
                                 "client_cpu_s_per_GB": round(cpu / (size / 1e9), 2)})
        finally:
            os.environ.clear()
            os.environ.update(saved)
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    out = ["| PP | rank | method | fetched MB | ideal MB | fetched / ideal | vs runai-all | "
           "wall s (plan s) |", "|---|---|---|---|---|---|---|---|"]
    base = {(r["pp"], r["rank"]): r["fetched_bytes"] for r in rows if r["method"] == "runai-all"}
    for r in rows:
        ref = base.get((r["pp"], r["rank"])) or 1
        if "failed" in r:
            out.append(f"| {r['pp']} | {r['rank']} | {r['method']} | "
                       f"{r['fetched_bytes'] / 1e6:.1f} | {r['ideal_bytes'] / 1e6:.1f} | – | – | "
                       f"failed: {r['failed']} |")
            continue
        out.append(f"| {r['pp']} | {r['rank']} | {r['method']} | {r['fetched_bytes'] / 1e6:.1f} "
                   f"| {r['ideal_bytes'] / 1e6:.1f} | {r['fetched_bytes'] / r['ideal_bytes']:.3f} "
                   f"| {r['fetched_bytes'] / ref:.3f} | {r['wall_s']:.2f}"
                   + (f" ({r['plan_s']:.2f})" if r.get("plan_s") else "") + " |")
    return "\n".join(out)


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--json", action="store_true")
    p.add_argument("--clients", action="store_true",
                   help="compare the client libraries (boto3 vs obstore) instead")
    p.add_argument("--child", nargs=4, metavar=("METHOD", "URI", "PP", "RANK"),
                   help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        method, uri, pp, rank = args.child
        _child(method, uri, int(pp), int(rank))
        return
    if args.clients:
        print(json.dumps(compare_clients(), indent=1))
        return
    rows = run_bench(args.pp, args.layers, args.hidden, args.vocab)
    print(json.dumps(rows, indent=1) if args.json else _table(rows))


if __name__ == "__main__":
    main()
