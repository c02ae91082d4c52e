"""S3-compatible object storage through boto3 (the ``pploader[s3]`` extra).

Why boto3: it reads the whole standard AWS configuration itself (environment, shared config and
credentials files, profiles, SSO, ``AWS_ENDPOINT_URL``), so pploader never reads the environment
for it; its retry mode ``standard`` retries 5xx, throttling and timeouts with capped
exponential backoff; and a ranged GET's body can be read straight into the reader's buffers
(``readinto``, no intermediate copy). obstore moved the same bytes at the same speed and client
CPU on the local test server (docs/benchmarks.md, "Object storage"), without the shared config
files.

Every ranged GET names the ETag it expects (``If-Match``) and is checked against the planned size
and ETag, so an object rewritten during a load is never read. Errors name the object's URI,
never a credential.
"""
from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence

from .objects import ObjectInfo

__all__ = ["S3Options", "S3Storage", "ObjectStoreError", "split_uri", "client_for",
           "clear_clients"]

logger = logging.getLogger(__name__)


class Cancel(Protocol):
    """Anything with ``is_set()`` (a ``threading.Event``): stop before the next request."""

    def is_set(self) -> bool: ...


class ObjectStoreError(Exception):
    """A request failed for good. ``kind``: ``missing`` (no such key), ``bucket`` (no such
    bucket), ``denied`` (credentials / permissions), ``changed`` (ETag or size differ from the
    plan), ``unreachable`` (connection, timeouts, 5xx after the retries), ``short`` (the store
    kept ending response bodies early, retries making no progress), ``cancelled``."""

    def __init__(self, message: str, *, uri: str, kind: str) -> None:
        super().__init__(message)
        self.uri, self.kind, self.detail = uri, kind, message

    @property
    def input_error(self) -> bool:
        """A mistake in the input (wrong path, credentials): refused before loading."""
        return self.kind in ("missing", "bucket", "denied")


@dataclass(frozen=True)
class S3Options:
    """How requests are made. ``max_attempts``: tries per request (botocore's ``standard``
    retries for 5xx / throttling / timeouts, and pploader's for a body cut short: there, tries
    in a row that brought no new bytes; a retry that made progress is not counted), the backoff
    capped at ``max_backoff_s``; ``connect_timeout_s`` / ``read_timeout_s``: per try;
    ``max_connections``: the client's pool (the backend's requests in flight)."""

    max_attempts: int = 5
    max_backoff_s: float = 4.0
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 30.0
    max_connections: int = 32


def split_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> (``bucket``, ``some/prefix``) (no trailing slash)."""
    if not uri.startswith("s3://"):
        raise ValueError(f"not an s3:// URI: {uri}")
    bucket, _, prefix = uri[5:].partition("/")
    if not bucket:
        raise ObjectStoreError("no bucket in the URI (use s3://bucket/prefix)", uri=uri,
                               kind="bucket")
    return bucket, prefix.strip("/")


#: one client per options in a process (making one costs ~0.5 s: botocore loads the service
#: model and resolves credentials), shared by planning and the backend; boto3 clients are
#: thread-safe
_CLIENTS: dict[S3Options, Any] = {}
_CLIENTS_LOCK = threading.Lock()


def client_for(options: S3Options) -> Any:
    """The process's boto3 S3 client for ``options`` (made on first use; boto3 reads the AWS
    environment and config files then, see :func:`clear_clients`)."""
    with _CLIENTS_LOCK:  # creation is not thread-safe
        made = _CLIENTS.get(options)
        if made is None:
            made = _CLIENTS[options] = _client(options)
        return made


def clear_clients() -> None:
    """Forget the cached clients: the next request makes new ones, reading the AWS
    configuration again (credentials rotated by hand, tests)."""
    with _CLIENTS_LOCK:
        _CLIENTS.clear()


def _client(options: S3Options) -> Any:
    try:
        import boto3
        from botocore.config import Config
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ObjectStoreError("s3:// paths need boto3: pip install 'pploader[s3]'",
                               uri="s3://", kind="denied") from exc
    config = Config(retries={"mode": "standard", "max_attempts": options.max_attempts},
                    connect_timeout=options.connect_timeout_s,
                    read_timeout=options.read_timeout_s,
                    max_pool_connections=options.max_connections)
    return boto3.session.Session().client("s3", config=config)


class S3Storage:
    """One ``s3://bucket/prefix`` (see :class:`pploader.storage.ObjectStorage`)."""

    def __init__(self, bucket: str, prefix: str, options: S3Options = S3Options()) -> None:
        self.bucket, self.prefix, self.options = bucket, prefix, options
        self.root = f"s3://{bucket}/{prefix}".rstrip("/")

    @classmethod
    def from_uri(cls, uri: str, options: S3Options = S3Options()) -> "S3Storage":
        return cls(*split_uri(uri), options)

    @property
    def client(self) -> Any:
        return client_for(self.options)

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def uri(self, name: str) -> str:
        return f"{self.root}/{name}"

    def list(self) -> dict[str, ObjectInfo]:
        """Every object directly under the prefix: ``{name: ObjectInfo}``."""
        base = self.key("")
        found: dict[str, ObjectInfo] = {}
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=base, Delimiter="/")
            for page in pages:
                for obj in page.get("Contents", ()):
                    found[obj["Key"][len(base):]] = ObjectInfo(int(obj["Size"]),
                                                               obj.get("ETag", ""))
        except Exception as exc:  # noqa: BLE001 - classified (botocore's types)
            raise self._error(exc, self.root + "/") from None
        return found

    def read(self, name: str, start: int, length: int,
             etag: Optional[str] = None) -> tuple[bytes, ObjectInfo]:
        """Up to ``length`` bytes from ``start`` and the object's info (size, ETag)."""
        def once() -> tuple[bytes, ObjectInfo]:
            resp = self._get(name, start, length, etag)
            return resp["Body"].read(), self._info(resp, name)
        return self._retrying(name, once)

    def read_into(self, name: str, start: int, views: Sequence[memoryview],
                  info: ObjectInfo, cancel: Optional["Cancel"] = None) -> int:
        """One ranged GET filling ``views`` in order; a body cut short is resumed from where
        it stopped (bounded retries). Returns the bytes fetched (== the views' total)."""
        total = sum(v.nbytes for v in views)
        done = [0]  # bytes in place so far (kept across a retry)

        def rest() -> int:
            while done[0] < total:
                if cancel is not None and cancel.is_set():
                    raise ObjectStoreError("cancelled: another rank failed", uri=self.uri(name),
                                           kind="cancelled")
                resp = self._get(name, start + done[0], total - done[0], info.etag)
                got = self._info(resp, name)
                if got != info:
                    raise ObjectStoreError(self._changed(info, got), uri=self.uri(name),
                                           kind="changed")
                raw = resp["Body"]._raw_stream  # urllib3 response: readinto, no extra copy
                try:
                    _fill(raw, views, done, total)
                finally:
                    raw.release_conn()
            return total
        return self._retrying(name, rest, lambda: done[0])

    def _get(self, name: str, start: int, length: int, etag: Optional[str]) -> Any:
        kw = {"IfMatch": etag} if etag else {}
        return self.client.get_object(Bucket=self.bucket, Key=self.key(name),
                                      Range=f"bytes={start}-{start + length - 1}", **kw)

    def _info(self, resp: Any, name: str) -> ObjectInfo:
        total = str(resp.get("ContentRange", "")).rpartition("/")[2]
        size = int(total) if total.isdigit() else int(resp.get("ContentLength", 0))
        return ObjectInfo(size, resp.get("ETag", ""))

    @staticmethod
    def _changed(then: ObjectInfo, now: ObjectInfo) -> str:
        return (f"object changed during load (planned size {then.size}, ETag {then.etag}; now "
                f"size {now.size}, ETag {now.etag}): publish new checkpoints under a new prefix")

    def _retrying(self, name: str, attempt: Any, progress: Any = lambda: 0) -> Any:
        """``attempt()`` with pploader's bounded backoff for failures botocore does not retry
        (a body cut short, a connection reset mid-stream); botocore already retried the
        request itself. ``progress()``: bytes in place so far; a failed try that moved it is
        not counted (a store that cuts every body short still finishes, a stalled one fails
        after ``max_attempts`` tries in a row without a new byte)."""
        tries = max(1, self.options.max_attempts)
        failed, seen = 0, progress()
        while True:
            try:
                return attempt()
            except ObjectStoreError:
                raise
            except Exception as exc:  # noqa: BLE001 - classified (botocore's types)
                now = progress()
                failed = 1 if now > seen else failed + 1
                seen = now
                err = self._error(exc, self.uri(name), failed)
                if err.kind not in ("unreachable", "short") or failed >= tries or \
                        not _mid_stream(exc):
                    raise err from None
                pause = min(self.options.max_backoff_s, 0.1 * 2 ** (failed - 1)) * \
                    random.uniform(0.5, 1)
                logger.warning("%s: %s; retrying in %.1f s (%d/%d without progress)",
                               self.uri(name), err.detail, pause, failed, tries - 1)
                time.sleep(pause)

    def _error(self, exc: Exception, uri: str, tries: int = 0) -> ObjectStoreError:
        """A botocore / urllib3 failure as an :class:`ObjectStoreError` naming ``uri``
        (``tries``: pploader's tries in a row without progress, for a body cut short)."""
        from botocore.exceptions import ClientError, NoCredentialsError, PartialCredentialsError
        if isinstance(exc, ClientError):
            err = exc.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if code == "NoSuchBucket":
                return ObjectStoreError(f"bucket {self.bucket!r} does not exist (or is not "
                                        "visible at this endpoint)", uri=uri, kind="bucket")
            if code in ("NoSuchKey", "404", "NotFound") or status == 404:
                return ObjectStoreError("object does not exist: check the model path (s3://"
                                        "bucket/prefix holding config.json and the shards)",
                                        uri=uri, kind="missing")
            if status == 403 or code in ("AccessDenied", "InvalidAccessKeyId",
                                         "SignatureDoesNotMatch", "ExpiredToken"):
                return ObjectStoreError(f"access denied ({code or status}): check the AWS "
                                        "credentials, profile and the bucket's permissions",
                                        uri=uri, kind="denied")
            if status == 412 or code == "PreconditionFailed":
                return ObjectStoreError("object changed during load (its ETag is no longer the "
                                        "planned one): publish new checkpoints under a new "
                                        "prefix", uri=uri, kind="changed")
            if status == 416 or code == "InvalidRange":
                return ObjectStoreError("object is shorter than planned (rewritten or "
                                        "truncated?)", uri=uri, kind="changed")
            return ObjectStoreError(f"request failed after {self.options.max_attempts} "
                                    f"attempt(s): {code or 'HTTP'} {status}", uri=uri,
                                    kind="unreachable")
        if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
            return ObjectStoreError("no AWS credentials found (environment, ~/.aws/credentials, "
                                    "profile or instance role)", uri=uri, kind="denied")
        if _cut_short(exc):
            return ObjectStoreError(f"the object store stopped a response body early ({exc}); "
                                    f"{tries or 1} tr{'ies' if tries > 1 else 'y'} in a row "
                                    "brought no new bytes", uri=uri, kind="short")
        return ObjectStoreError(f"cannot reach the object store after "
                                f"{self.options.max_attempts} attempt(s): "
                                f"{type(exc).__name__}", uri=uri, kind="unreachable")


def _mid_stream(exc: Exception) -> bool:
    """A failure while a response body was streaming (retried by pploader, not botocore)."""
    from botocore.exceptions import ClientError, EndpointConnectionError
    return not isinstance(exc, (ClientError, EndpointConnectionError))


class BodyCutShort(ConnectionError):
    """A response body ended before its last byte (the connection closed or was reset)."""


def _cut_short(exc: BaseException) -> bool:
    """A body that ended early: ours, botocore's or urllib3's (an incomplete read)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:  # urllib3 wraps the cause
        seen.add(id(exc))
        if isinstance(exc, BodyCutShort) or type(exc).__name__ in (
                "IncompleteRead", "IncompleteReadError", "ResponseStreamingError") or \
                "IncompleteRead" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return False


def _fill(raw: Any, views: Sequence[memoryview], done: list[int], total: int) -> None:
    """Read ``raw`` into ``views``, their first ``done[0]`` bytes already filled; ``done[0]``
    grows as bytes land, so a body cut short is resumed from there by the caller."""
    skip = done[0]
    for view in views:
        if skip >= view.nbytes:
            skip -= view.nbytes
            continue
        part, skip = view[skip:], 0
        pos = 0
        while pos < part.nbytes:
            try:
                n = raw.readinto(part[pos:])
            except Exception as exc:  # noqa: BLE001 - urllib3's ProtocolError, a reset, ...
                raise BodyCutShort(f"{done[0]} of {total} bytes arrived, then "
                                   f"{type(exc).__name__}: {exc}") from exc
            if not n:
                raise BodyCutShort(f"{done[0]} of {total} bytes arrived")
            pos += n
            done[0] += n
