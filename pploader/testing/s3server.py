"""A local S3-compatible server for tests and benchmarks: moto's server behind a counting,
fault-injecting WSGI layer, in its own process (so a test can kill it mid-load).

    python -m pploader.testing.s3server [--host 127.0.0.1] [--port 0]

prints ``PORT <n>`` once listening. Besides S3 it answers control requests under
``/__pploader__/``:

- ``counts``: JSON ``{access_key_id: {"requests", "gets", "get_bytes", "data_gets"}}`` —
  every request and the response body bytes of every GET, per client access key (a test gives
  each rank its own key, so bytes fetched are counted per rank on the server side);
  ``data_gets``: ranged GETs starting past byte 8 (not a header's length or a whole object);
- ``reset``: zero the counts;
- ``fail?status=503&n=3``: answer the next ``n`` object GETs with ``status`` (an S3 error body);
- ``delay?seconds=0.2``: sleep this long before each object GET (a slow store);
- ``cut?n=2``: send only the first half of the next ``n`` tensor-data GET bodies, then drop the
  connection (a stream cut short mid-body);
- ``deny?keys=K1,K2``: refuse requests signed with these access keys (403
  ``InvalidAccessKeyId``, as S3 answers an unknown key; moto itself accepts any key).

Test-only: the core never imports it (tests/cli/test_layout.py).
"""
from __future__ import annotations

import argparse
import json
import logging
import re
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional
from urllib.parse import parse_qs

__all__ = ["CountingApp", "S3Server", "start_server", "main"]

_AKID = re.compile(r"Credential=([^/,\s]+)/")
_RANGE = re.compile(r"bytes=(\d+)-")
_CONTROL = "/__pploader__/"
_ERROR_BODY = ('<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
               '<Message>injected by the test server</Message></Error>')
_CODES = {500: "InternalError", 503: "SlowDown", 429: "SlowDown", 403: "AccessDenied"}


class CountingApp:
    """WSGI middleware around moto: per-key request / GET byte counts, injected failures."""

    def __init__(self, app: Callable) -> None:
        self.app = app
        self.lock = threading.Lock()
        self.counts: dict[str, dict[str, int]] = {}
        self.fail_status, self.fail_left, self.delay_s = 503, 0, 0.0
        self.denied: set[str] = set()
        self.cut_left = 0

    def _control(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        what = environ.get("PATH_INFO", "")[len(_CONTROL):]
        query = {k: v[0] for k, v in parse_qs(environ.get("QUERY_STRING", "")).items()}
        with self.lock:
            if what == "reset":
                self.counts.clear()
            elif what == "fail":
                self.fail_status, self.fail_left = int(query.get("status", 503)), int(query["n"])
            elif what == "delay":
                self.delay_s = float(query["seconds"])
            elif what == "cut":
                self.cut_left = int(query["n"])
            elif what == "deny":
                self.denied = set(filter(None, query.get("keys", "").split(",")))
            body = json.dumps(self.counts).encode()
        start_response("200 OK", [("Content-Type", "application/json"),
                                  ("Content-Length", str(len(body)))])
        return [body]

    def __call__(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path.startswith(_CONTROL):
            return self._control(environ, start_response)
        found = _AKID.search(environ.get("HTTP_AUTHORIZATION", ""))
        key = found.group(1) if found else "anonymous"
        is_get = environ.get("REQUEST_METHOD") == "GET" and path.count("/") >= 2 \
            and not environ.get("QUERY_STRING")
        with self.lock:
            row = self.counts.setdefault(key, {"requests": 0, "gets": 0, "get_bytes": 0,
                                               "data_gets": 0})
            row["requests"] += 1
            found_range = _RANGE.match(environ.get("HTTP_RANGE", ""))
            data = bool(is_get and found_range and int(found_range.group(1)) > 8)
            row["data_gets"] += data  # past a header's length and start: tensor bytes
            cut = data and self.cut_left > 0
            if cut:
                self.cut_left -= 1
            fail = is_get and self.fail_left > 0
            if fail:
                self.fail_left -= 1
            denied = key in self.denied
            status = 403 if denied else self.fail_status
            delay = self.delay_s if is_get else 0.0
        if fail or denied:
            code = "InvalidAccessKeyId" if denied else _CODES.get(status, "Error")
            body = _ERROR_BODY.format(code=code).encode()
            start_response(f"{status} Injected", [
                ("Content-Type", "application/xml"), ("Content-Length", str(len(body)))])
            return [body]
        if delay:
            time.sleep(delay)
        if environ.get("REQUEST_METHOD") != "GET":
            return self.app(environ, start_response)  # type: ignore[no-any-return]
        return self._counted(key, self.app(environ, start_response), cut)

    def _counted(self, key: str, body: Iterable[bytes], cut: bool = False) -> Iterable[bytes]:
        try:
            for chunk in body:
                if cut:  # half the body, then the connection drops (werkzeug closes it)
                    with self.lock:
                        self.counts[key]["get_bytes"] += len(chunk) // 2
                    yield chunk[:len(chunk) // 2]
                    raise ConnectionAbortedError("body cut short by the test server")
                with self.lock:
                    row = self.counts[key]
                    row["get_bytes"] += len(chunk)
                yield chunk
        finally:
            close = getattr(body, "close", None)
            if close is not None:
                close()
        with self.lock:
            self.counts[key]["gets"] += 1


def serve(host: str, port: int, on_ready: Callable[[int], None]) -> None:
    """Serve moto (S3) behind :class:`CountingApp` forever; ``on_ready(port)`` once listening."""
    from moto.moto_server.werkzeug_app import (DomainDispatcherApplication, MotoRequestHandler,
                                               create_backend_app)
    from werkzeug.serving import make_server
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request
    app = CountingApp(DomainDispatcherApplication(create_backend_app))
    server = make_server(host, port, app, threaded=True, request_handler=MotoRequestHandler)
    on_ready(server.server_address[1])
    server.serve_forever()


@dataclass
class S3Server:
    """A running server process (:func:`start_server`)."""

    proc: subprocess.Popen
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def control(self, what: str) -> Any:
        with urllib.request.urlopen(f"{self.url}{_CONTROL}{what}", timeout=30) as resp:
            return json.loads(resp.read())

    def counts(self) -> dict[str, dict[str, int]]:
        return self.control("counts")  # type: ignore[no-any-return]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)

    def __enter__(self) -> "S3Server":
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


def start_server(host: str = "127.0.0.1", startup_s: float = 60.0) -> S3Server:
    """Start the server in a child process; returns once it listens."""
    proc = subprocess.Popen([sys.executable, "-m", "pploader.testing.s3server", "--host", host,
                             "--port", "0"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + startup_s
    line: Optional[str] = None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("PORT ") or not line:
            break
    if not line or not line.startswith("PORT "):
        proc.kill()
        raise RuntimeError(f"the S3 test server did not start (exit {proc.poll()})")
    return S3Server(proc, host, int(line.split()[1]))


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args(argv)

    def ready(port: int) -> None:
        print(f"PORT {port}", flush=True)
    serve(args.host, args.port, ready)


if __name__ == "__main__":
    main()
