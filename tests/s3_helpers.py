"""Shared helpers of the object-storage tests (tests/storage/): the AWS environment a client
reads, and uploading a checkpoint directory to the local S3 server."""
from __future__ import annotations

import os
from pathlib import Path

from pploader.testing.s3server import S3Server

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
