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
from s3_helpers import PREFIX, aws_env, upload  # noqa: E402,F401


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
