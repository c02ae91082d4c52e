"""s3:// model paths against a real S3-compatible server on localhost (moto behind a counting
layer, conftest.py): bitwise-equal loads, bytes fetched counted on the server, bad input,
retries, a server killed mid-load, an object rewritten mid-load."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

from s3_helpers import aws_env, upload
from helpers import pploader_cmd, reference_tensors, run, run_ranks, torchrun_cmd
from pploader import Topology, load_stage, plan_stage
from pploader.errors import CheckpointError, ConfigError, ReadError
from pploader.io.backend import ReadOptions
from pploader.io.registry import open_backend, select_backend
from pploader.planning.header import ObjectIdentity
from pploader.storage.s3 import clear_clients
from pploader.testing.s3server import S3Server, start_server

URI = "s3://models/tiny"


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _rank_load(rank: int, world: int, uri: str, local: str, pp: int, tp: int, case: str) -> dict:
    """One gloo rank: plan + load from S3 (signed with the rank's own access key, so the server
    counts its bytes) and from local disk; the tensors of both and the plan's numbers."""
    from pploader.distributed.comm import Comm
    topo = Topology(pp, tp, rank=rank)
    comm = Comm(topo, timeout_s=60)
    os.environ["AWS_ACCESS_KEY_ID"] = f"{case}-{rank}"
    staged = plan_stage(uri, topo)
    comm.agree(None)
    remote = load_stage(staged, cancel=comm.watch_failures(), comm=comm)  # as `load` does
    disk = load_stage(plan_stage(local, topo))
    comm.agree(None)
    comm.close()
    return {"remote": {k: _bytes(v) for k, v in remote.state_dict.items()},
            "disk": {k: _bytes(v) for k, v in disk.state_dict.items()},
            "ideal": staged.plan.ideal_bytes, "read": remote.stats.read_bytes,
            # every header planning fetched: 8-byte length + the header
            "headers": sum(8 + staged.index.header(f).header_bytes
                           for f in staged.index.opened_files()),
            "same_items": staged.plan.items == disk.plan.items}


@pytest.mark.slow
@pytest.mark.parametrize("pp,tp", [(2, 1), (2, 2)])
def test_stage_loads_from_s3_equal_disk_and_fetch_only_their_bytes(
        s3: S3Server, tiny_llama: Path, pp: int, tp: int) -> None:
    case = f"pp{pp}tp{tp}"
    results = run_ranks(_rank_load, pp * tp, URI, str(tiny_llama), pp, tp, case)
    counts = s3.counts()
    meta = sum((tiny_llama / n).stat().st_size
               for n in ("config.json", "model.safetensors.index.json"))
    for rank, res in enumerate(results):
        assert res["same_items"]  # the same byte ranges planned as from disk
        assert res["remote"] == res["disk"] and res["remote"]
        fetched = counts[f"{case}-{rank}"]["get_bytes"]  # everything the rank fetched
        # its headers: config + index + each fetched shard header + the prefix listing (one
        # XML page)
        headers = meta + res["headers"] + 8192
        assert res["read"] <= 1.02 * res["ideal"], (rank, res["read"], res["ideal"])
        assert res["read"] <= fetched <= 1.02 * res["ideal"] + headers, (rank, fetched, res)
        print(f"{case} rank {rank}: fetched {fetched} B (server), ideal {res['ideal']}, "
              f"read {res['read']}, metadata bound {headers}")


def test_plan_and_files_cli_take_s3_paths(s3: S3Server, tiny_llama: Path) -> None:
    for args in (["plan", "--pp", "2", "--tp", "2", "--json"],
                 ["files", "--pp", "2", "--json"]):
        remote = run(pploader_cmd(*args, "--model", URI))
        local = run(pploader_cmd(*args, "--model", str(tiny_llama)))
        assert remote.returncode == 0, remote.stderr
        got, want = json.loads(remote.stdout), json.loads(local.stdout)
        got.pop("model", None), want.pop("model", None)
        assert got == want


@pytest.mark.slow
def test_torchrun_cli_load_from_s3_saves_the_same_tensors(s3: S3Server, tiny_llama: Path,
                                                          tmp_path: Path) -> None:
    out = run(torchrun_cmd(2, "load", "--model", URI, "--pp", "2", "--tp", "1", "--json",
                           "--save-loaded", str(tmp_path)), timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout[out.stdout.index("{"):])
    assert [r["read_bytes"] == r["ideal_bytes"] for r in doc["ranks"]] == [True, True]
    from safetensors.torch import load_file
    ref = reference_tensors(tiny_llama)
    saved = {**load_file(tmp_path / "rank-0.safetensors"),
             **load_file(tmp_path / "rank-1.safetensors")}
    assert set(saved) == set(ref)
    assert all(torch.equal(saved[k].view(torch.uint8), ref[k].view(torch.uint8)) for k in ref)


def test_library_api_and_backend_choice(s3: S3Server, tiny_llama: Path) -> None:
    staged = plan_stage(URI, Topology(2, rank=1))
    plan = staged.plan
    assert all(p.startswith(URI + "/") for p in plan.paths.values())
    assert all(isinstance(i, ObjectIdentity) and i.etag for i in plan.identities.values())
    assert type(open_backend(plan)).__name__ == "ObjectStoreBackend"
    with pytest.raises(ValueError, match="reads file storage, not s3"):
        open_backend(plan, name="threaded")
    assert select_backend("cpu").name == "threaded"  # local files keep their default
    ref = reference_tensors(tiny_llama)
    # a small window: many batches, each fetched while the previous one is handed out
    got = dict(open_backend(plan, "cpu", ReadOptions(window_bytes=plan.largest_item_bytes,
                                                     threads=3)))
    for item in plan.items:
        assert torch.equal(got[item.target].view(torch.uint8), ref[item.name].view(torch.uint8))


def test_missing_key_bucket_and_wrong_credentials(s3: S3Server) -> None:
    with pytest.raises(ConfigError, match=r"s3://models/nothing-here/config.json.*does not "
                       "exist"):
        plan_stage("s3://models/nothing-here", Topology(1))
    with pytest.raises(ConfigError, match="bucket 'no-such-bucket' does not exist"):
        plan_stage("s3://no-such-bucket/tiny", Topology(1))
    s3.control("deny?keys=wrong-key")
    try:
        os.environ["AWS_ACCESS_KEY_ID"] = "wrong-key"
        clear_clients()  # the next client reads the (wrong) key
        with pytest.raises(ConfigError, match="access denied") as err:
            plan_stage(URI, Topology(1))
        assert "not-a-secret" not in str(err.value) and "wrong-key" not in str(err.value)
    finally:
        os.environ["AWS_ACCESS_KEY_ID"] = "tests"
        clear_clients()
        s3.control("deny?keys=")
    # an index naming a shard that is not in the bucket: refused when a plan needs it
    import boto3
    boto3.session.Session().client("s3").copy_object(
        Bucket="models", Key="partial/model.safetensors.index.json",
        CopySource={"Bucket": "models", "Key": "tiny/model.safetensors.index.json"})
    boto3.session.Session().client("s3").copy_object(
        Bucket="models", Key="partial/config.json",
        CopySource={"Bucket": "models", "Key": "tiny/config.json"})
    with pytest.raises(CheckpointError, match="are missing"):
        plan_stage("s3://models/partial", Topology(1))


def test_bad_shard_in_the_bucket_is_refused_like_a_local_one(s3: S3Server,
                                                           tiny_llama: Path) -> None:
    import boto3
    upload(s3, tiny_llama, prefix="lfs")
    client = boto3.session.Session().client("s3")
    shard = sorted(tiny_llama.glob("*.safetensors"))[0].name
    client.put_object(Bucket="models", Key=f"lfs/{shard}",
                      Body=b"version https://git-lfs.github.com/spec/v1\noid sha256:0\n")
    with pytest.raises(CheckpointError, match=f"{shard}.*git-LFS pointer"):
        plan_stage("s3://models/lfs", Topology(1))


def test_503_burst_is_retried(s3: S3Server, tiny_llama: Path) -> None:
    ref = reference_tensors(tiny_llama)
    s3.control("fail?status=503&n=3")  # the config, the listing's neighbour GETs, headers...
    staged = plan_stage(URI, Topology(1))
    s3.control("fail?status=503&n=4")  # ... and the first data requests
    result = load_stage(staged)
    for item, t in zip(staged.plan.items, result.state_dict.values()):
        assert torch.equal(t.view(torch.uint8), ref[item.name].view(torch.uint8))
    s3.control("fail?status=503&n=1000")  # a store that stays down: a clear error
    try:
        with pytest.raises(ReadError, match=r"s3://models/tiny/.*request failed after 5"):
            load_stage(staged)
    finally:
        s3.control("fail?status=503&n=0")


def test_object_rewritten_mid_load_fails(tmp_path: Path, s3: S3Server, tiny_llama: Path) -> None:
    uri = upload(s3, tiny_llama, prefix="rewritten")
    staged = plan_stage(uri, Topology(1))
    plan = staged.plan
    stream = iter(open_backend(plan, "cpu", ReadOptions(window_bytes=plan.largest_item_bytes)))
    next(stream)
    for f in tiny_llama.glob("*.safetensors"):  # same sizes, other bytes: a new ETag each
        data = bytearray(f.read_bytes())
        data[-1] ^= 0xFF
        (tmp_path / f.name).write_bytes(bytes(data))
    upload(s3, tmp_path, prefix="rewritten")
    with pytest.raises(ReadError, match="object changed during load"):
        for _ in stream:
            pass
    with pytest.raises(ReadError, match="object changed during load"):  # the old plan again
        load_stage(staged)


@pytest.mark.slow
def test_server_killed_mid_load_fails_every_rank(tiny_llama: Path) -> None:
    with start_server() as server:
        env = aws_env(server.url)
        saved = dict(os.environ)
        os.environ.update(env)
        try:
            uri = upload(server, tiny_llama, prefix="dying")
        finally:
            os.environ.clear()
            os.environ.update(saved)
        server.control("delay?seconds=1")
        cmd = torchrun_cmd(2, "load", "--model", uri, "--pp", "2", "--timeout", "40")
        started = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=dict(os.environ, **env, OMP_NUM_THREADS="1"))
        while time.monotonic() - started < 120:  # planned, agreed, tensor GETs under way
            if sum(c["data_gets"] for c in server.counts().values()) >= 1:
                break
            time.sleep(0.1)
        server.kill()
        killed = time.monotonic()
        out, _ = proc.communicate(timeout=120)
        took = time.monotonic() - killed
    assert proc.returncode == 1, out
    assert "cannot reach the object store" in out, out
    assert took < 40, took  # within --timeout of the server's death
    print(out[-3000:], f"\nexited {took:.1f} s after the kill")


def test_body_cut_short_is_resumed(s3: S3Server, tiny_llama: Path,
                                   caplog: pytest.LogCaptureFixture) -> None:
    ref = reference_tensors(tiny_llama)
    staged = plan_stage(URI, Topology(1))
    s3.control("cut?n=2")
    with caplog.at_level(logging.WARNING, logger="pploader.storage.s3"):
        result = load_stage(staged)
    assert caplog.text.count("retrying") >= 2, caplog.text
    for item, t in zip(staged.plan.items, result.state_dict.values()):
        assert torch.equal(t.view(torch.uint8), ref[item.name].view(torch.uint8))
    assert result.stats.read_bytes == staged.plan.read_bytes  # each byte counted once


@pytest.mark.gpu
def test_s3_load_onto_cuda_equals_disk(s3: S3Server, tiny_llama: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ref = reference_tensors(tiny_llama)
    for rank in range(2):
        staged = plan_stage(URI, Topology(2, rank=rank))
        result = load_stage(staged, device="cuda")
        for item, t in zip(staged.plan.items, result.state_dict.values()):
            assert t.device.type == "cuda"
            assert torch.equal(t.cpu().view(torch.uint8), ref[item.name].view(torch.uint8))


def test_store_halving_every_body_is_read_while_each_try_progresses(
        s3: S3Server, tiny_llama: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A store that sends half of each body: 9 cuts in a row on one request (more than the 5
    tries) still finish, each try having brought new bytes; tries that bring none fail after
    ``max_attempts`` with a message that says the body stopped early (not 'cannot reach')."""
    from pploader.storage.s3 import ObjectStoreError, S3Storage
    storage = S3Storage.from_uri(URI)
    name = sorted(f.name for f in tiny_llama.glob("*.safetensors"))[0]
    want = (tiny_llama / name).read_bytes()[4096:4096 + 8192]
    info = storage.list()[name]
    buf = bytearray(8192)
    s3.control("cut?n=9")
    with caplog.at_level(logging.WARNING, logger="pploader.storage.s3"):
        assert storage.read_into(name, 4096, [memoryview(buf)], info) == 8192
    assert bytes(buf) == want
    assert caplog.text.count("retrying") == 9, caplog.text
    assert "(1/4 without progress)" in caplog.text  # each try progressed: none counted twice
    one = bytearray(1)  # half of one byte is nothing: no try progresses
    s3.control("cut?n=5")
    try:
        with pytest.raises(ObjectStoreError) as info_err:
            storage.read_into(name, 4096, [memoryview(one)], info)
    finally:
        s3.control("cut?n=0")
    err = info_err.value
    assert err.kind == "short", err
    assert "stopped a response body early (0 of 1 bytes arrived" in str(err), err
    assert "5 tries in a row brought no new bytes" in str(err), err
    assert "cannot reach" not in str(err), err
