"""A real S3 API for the tests: moto's threaded server on 127.0.0.1, with every request recorded and faults on call.

:class:`S3Server` is ``moto.server.ThreadedMotoServer`` (moto, flask and flask-cors from PyPI) whose WSGI app is
wrapped in a middleware that

* records each request it sees (method, object path, ``Range``, ``If-Match``, ``If-None-Match``), so a test can
  check what the client really sent (one range per GET, never a multi-range request);
* fails chosen requests with HTTP 500, or holds them past the client's timeout, before moto sees them (the
  client's retries must absorb both);
* adds a fixed latency to every request (the remote-cache benchmark's 20 ms and 100 ms).

:func:`start_s3` starts one with a bucket and sets the environment a client reads (``AWS_ENDPOINT_URL`` and dummy
credentials), or skips the test with one line naming what to install when moto is missing.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest

__all__ = ["S3Server", "Recorded", "Fault", "start_s3", "s3_available", "MISSING"]

MISSING = ("the remote-cache tests need moto's S3 server and the obstore client: "
           "pip install obstore 'moto[s3]' flask flask-cors (scripts/bootstrap installs them)")


def s3_available() -> bool:
    """Whether moto's server, boto3 (moto brings it) and obstore can be imported."""
    try:
        import boto3  # noqa: F401
        import flask  # noqa: F401
        import flask_cors  # noqa: F401
        import moto.server  # noqa: F401
        import obstore  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class Recorded:
    """One request the server saw: method, path (``/bucket/key``), the headers that matter here, the access key id
    its signature names (``None``: unsigned), and the fault injected (``"500"``, ``"hang"``; ``""``: none)."""

    method: str
    path: str
    range: str | None
    if_match: str | None
    if_none_match: str | None
    status: str = ""
    key_id: str | None = None


@dataclass
class Fault:
    """Requests matching ``method`` and a path ending in ``suffix`` get ``kind`` (``"500"`` or ``"hang"``), ``times``
    times (then they pass)."""

    method: str
    suffix: str
    kind: str
    times: int = 1
    hang_s: float = 0.0


def _server_class() -> Any:
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from moto.server import ThreadedMotoServer
    from werkzeug.serving import make_server

    class QuietHandler(MotoRequestHandler):  # type: ignore[misc, valid-type]
        def log_request(self, *args: Any, **kwargs: Any) -> None:  # one line per request would flood the output
            pass

    class Server(ThreadedMotoServer):  # type: ignore[misc, valid-type]
        """ThreadedMotoServer with its app wrapped by :meth:`S3Server._middleware`."""

        def __init__(self, owner: S3Server) -> None:
            super().__init__(ip_address="127.0.0.1", port=0, verbose=False)
            self.owner = owner

        def _server_entry(self) -> None:
            app = DomainDispatcherApplication(create_backend_app)
            self._server = make_server(self._ip_address, self._port, self.owner._middleware(app), True,
                                       request_handler=QuietHandler)
            self._server_ready_event.set()
            self._server.serve_forever()

    return Server


class S3Server:
    """moto's S3 on 127.0.0.1 (a free port), recording requests and injecting faults (see the module docstring)."""

    def __init__(self) -> None:
        self.requests: list[Recorded] = []
        self.faults: list[Fault] = []
        self.latency_s = 0.0
        self._lock = threading.Lock()
        self._server = _server_class()(self)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"

    def stop(self) -> None:
        self._server.stop()

    def boto3(self) -> Any:
        """A boto3 S3 client of this server (to create buckets and put or damage objects behind the library's
        back)."""
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1", aws_access_key_id="test",
                            aws_secret_access_key="test")

    def clear(self) -> None:
        with self._lock:
            self.requests.clear()
            self.faults.clear()

    def fail(self, method: str, suffix: str, kind: str = "500", times: int = 1, hang_s: float = 0.0) -> Fault:
        """Make the next ``times`` requests ``method`` on a path ending in ``suffix`` fail with ``kind``."""
        fault = Fault(method, suffix, kind, times, hang_s)
        with self._lock:
            self.faults.append(fault)
        return fault

    def seen(self, method: str | None = None, suffix: str = "") -> list[Recorded]:
        """The recorded requests (of ``method``, on a path ending in ``suffix``)."""
        with self._lock:
            return [r for r in self.requests
                    if (method is None or r.method == method) and r.path.endswith(suffix)]

    def _fault_for(self, method: str, path: str) -> Fault | None:
        with self._lock:
            for fault in self.faults:
                if fault.times > 0 and fault.method == method and path.endswith(fault.suffix):
                    fault.times -= 1
                    return fault
        return None

    def _middleware(self, app: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
            method, path = environ.get("REQUEST_METHOD", ""), environ.get("PATH_INFO", "")
            fault = self._fault_for(method, path)
            status = fault.kind if fault is not None else ""
            signed = re.search(r"Credential=([^/,\s]+)/", environ.get("HTTP_AUTHORIZATION", ""))
            with self._lock:
                self.requests.append(Recorded(method, path, environ.get("HTTP_RANGE"), environ.get("HTTP_IF_MATCH"),
                                              environ.get("HTTP_IF_NONE_MATCH"), status,
                                              signed.group(1) if signed else None))
            if self.latency_s:
                time.sleep(self.latency_s)
            if fault is not None and fault.kind == "hang":
                time.sleep(fault.hang_s)  # past the client's timeout: it gives up and retries
            if fault is not None and fault.kind == "500":
                start_response("500 Internal Server Error", [("Content-Type", "application/xml")])
                return [b"<?xml version='1.0'?><Error><Code>InternalError</Code><Message>injected</Message></Error>"]
            return app(environ, start_response)

        return wrapped


@contextmanager
def start_s3(bucket: str = "caches") -> Iterator[S3Server]:
    """An :class:`S3Server` with ``bucket`` created, and the environment pointing S3 clients at it (restored after).

    Skips the calling test with one line (:data:`MISSING`) when moto or obstore is not installed.
    """
    if not s3_available():
        pytest.skip(MISSING)
    server = S3Server()
    env = {"AWS_ENDPOINT_URL": server.endpoint, "AWS_ALLOW_HTTP": "true", "AWS_ACCESS_KEY_ID": "test",
           "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        server.boto3().create_bucket(Bucket=bucket)
        yield server
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()
