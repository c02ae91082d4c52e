"""A real S3-compatible server (moto, pploader/testing/s3server.py) on localhost, started once
per module, with the tiny checkpoint uploaded to ``s3://models/tiny``."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest

pytest.importorskip("boto3")
pytest.importorskip("moto")

from pploader.storage.s3 import clear_clients  # noqa: E402
from pploader.testing.s3server import S3Server, start_server  # noqa: E402

BUCKET, PREFIX = "models", "tiny"


def aws_env(url: str, key: str = "tests") -> dict[str, str]:
    """The standard AWS environment a client reads (no shared config files of this machine)."""
    return {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": key,
            "AWS_SECRET_ACCESS_KEY": "not-a-secret", "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}


def upload(server: S3Server, model: Path, bucket: str = BUCKET, prefix: str = PREFIX) -> str:
    """Put every file of ``model`` under ``s3://bucket/prefix``; returns that URI."""
    import boto3
    client = boto3.session.Session().client("s3")
    try:
        client.create_bucket(Bucket=bucket)
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass
    for f in sorted(model.iterdir()):
        client.upload_file(str(f), bucket, f"{prefix}/{f.name}")
    return f"s3://{bucket}/{prefix}"


@pytest.fixture(scope="module")
def s3(tiny_llama: Path) -> Iterator[S3Server]:
    """The server, the AWS environment pointing at it, and s3://models/tiny uploaded."""
    saved = dict(os.environ)
    server = start_server()
    try:
        os.environ.update(aws_env(server.url))
        clear_clients()  # clients are cached per process: none made for another server
        upload(server, tiny_llama)
        yield server
    finally:
        server.kill()
        os.environ.clear()
        os.environ.update(saved)
        clear_clients()
