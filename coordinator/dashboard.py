"""The run dashboard: a read-only web page and JSON API the coordinator serves on `coordinator.dashboard_port`.

    GET /                      the page (coordinator/static/dashboard.html; it polls the API every 2 s)
    GET /static/<file>         its script, style and the vendored chart library (static/vendor/README.md)
    GET /api/overview?since=N  status, samplers, plan, syncs, dead letters, step rows N.. (dashboard_data.py)
    GET /api/batches?limit=N   the newest N batches of the ledger
    GET /api/batches/<id>      one batch's rollouts, with the trainer's per-token log-ratios (one lookup at a
                               time: another one meanwhile gets 429 with Retry-After)

Read-only: nothing here changes the run. Tokens: with `coordinator.dashboard_token` (read-only) or
`coordinator.auth_token` (the write token) set, every /api/ request needs one of them (`Authorization: Bearer
<token>`). The page sends the `?token=` it was opened with (the launcher's URL carries the dashboard_token only),
keeps it in the tab's sessionStorage and takes it off the address bar at once; the request line is logged with
`token=` redacted. The page and its static files hold no data and need no token.

Requests are answered only for a Host header naming this machine's loopback (localhost, 127.0.0.1, [::1]) or
one of `coordinator.dashboard_hosts` (421 otherwise: a DNS-rebinding page cannot read the run). Every answer
carries Referrer-Policy: no-referrer, nosniff, no-store and a Content-Security-Policy of this origin only.

It binds the coordinator's host: beyond localhost only with a token (the coordinator refuses to start
otherwise). Standard library HTTP server with a bounded pool of `WORKERS` threads (a connection beyond them is
answered 503 at once, or closed under TLS); each connection's TLS handshake and reads run in its worker with
`SOCKET_TIMEOUT_S`, so an idle connection holds one worker for that long at most and never the accept loop.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import socket
import ssl
import threading
from collections.abc import Iterable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from coordinator.dashboard_data import DashboardData
from rlcommon.rpc import BEARER

logger = logging.getLogger(__name__)

__all__ = ["DashboardServer", "host_allowed", "redact"]

STATIC_DIR = Path(__file__).resolve().parent / "static"
STATIC_FILES = {
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
    "vendor/uPlot.iife.min.js": "text/javascript; charset=utf-8",
    "vendor/uPlot.min.css": "text/css; charset=utf-8",
}
"""Every file the page may load; nothing else under static/ (or anywhere) is served."""
_BATCH = re.compile(r"^/api/batches/(\d{1,18})$")
WORKERS = 12
"""Connections served at once; one beyond them is refused at once (503), never queued on a new thread."""
SOCKET_TIMEOUT_S = 10.0
"""A connection's TLS handshake and each read or write of it must finish within this."""
BATCH_RETRY_AFTER_S = 2
"""Retry-After of a batch lookup refused because another one runs."""
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "[::1]"})
SECURITY_HEADERS = {
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; "
                               "form-action 'none'; frame-ancestors 'none'",
}
"""Sent with every answer, errors included."""
_HOST = re.compile(r"(\[[0-9a-f:.]+\]|[a-z0-9_.-]+)(?::\d{1,5})?")
_TOKEN_IN_URL = re.compile(r"(token=)[^&\s\"']*", re.IGNORECASE)


def redact(text: str) -> str:
    """`text` with the value of every `token=` replaced (a request line on its way to a log)."""
    return _TOKEN_IN_URL.sub(r"\1[redacted]", text)


def host_allowed(host_header: str | None, allowed: Iterable[str]) -> bool:
    """Whether a Host header (`name` or `name:port`, `[v6]:port`) names a loopback name or one of `allowed`
    (names, compared without the port: a published port may differ from the bound one)."""
    match = _HOST.fullmatch((host_header or "").strip().lower())
    if match is None:
        return False
    name = match.group(1)
    return name in LOOPBACK_HOSTS or name in {a.strip().lower() for a in allowed}


def _int_arg(query: dict[str, list[str]], name: str, default: int) -> int:
    values = query.get(name)
    if not values:
        return default
    try:
        return int(values[0])
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {values[0]!r}") from None


class Busy(Exception):
    """Another batch lookup runs (429)."""


class _PoolServer(HTTPServer):
    """An HTTPServer whose accept loop only accepts: each connection is served (TLS handshake included) on one
    of `workers` threads with a socket timeout; a connection beyond them is refused at once."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type, *, workers: int, timeout_s: float,
                 tls: ssl.SSLContext | None) -> None:
        super().__init__(address, handler)
        self.tls = tls
        self.timeout_s = timeout_s
        self.free = threading.BoundedSemaphore(workers)
        self.refused = 0
        """Connections refused because every worker was busy (tests read it)."""

    def process_request(self, request: socket.socket, client_address: Any) -> None:
        if not self.free.acquire(blocking=False):
            self.refused += 1
            self._refuse(request)
            return
        threading.Thread(target=self._serve, args=(request, client_address), name="dashboard-request",
                         daemon=True).start()

    def _refuse(self, request: socket.socket) -> None:
        try:
            if self.tls is None:  # under TLS a 503 would need the handshake this refuses to run: closed
                request.settimeout(0.5)
                body = b"dashboard busy: every worker serves a connection; try again\n"
                request.sendall(b"HTTP/1.0 503 Service Unavailable\r\nRetry-After: 1\r\nConnection: close\r\n"
                                b"Content-Type: text/plain\r\nContent-Length: " + str(len(body)).encode()
                                + b"\r\nReferrer-Policy: no-referrer\r\n\r\n" + body)
        except OSError:
            pass
        finally:
            self.shutdown_request(request)

    def _serve(self, request: socket.socket, client_address: Any) -> None:
        conn: socket.socket = request
        try:
            conn.settimeout(self.timeout_s)
            if self.tls is not None:
                conn = self.tls.wrap_socket(request, server_side=True)  # the handshake, under the timeout
            self.finish_request(conn, client_address)
        except (OSError, ssl.SSLError) as err:  # a timeout, a failed handshake, a reset: that client's problem
            logger.debug("dashboard connection from %s dropped: %r", client_address[0], err)
        except Exception:
            logger.exception("dashboard request from %s failed", client_address[0])
        finally:
            self.shutdown_request(conn)
            self.free.release()


class DashboardServer:
    """Serves the page and the API from a background thread; `start()` returns the bound port.

    token: the write token (auth_token), read_token: the dashboard_token; the API accepts either, and
    none is needed when both are unset. hosts: public names served besides the loopback ones."""

    def __init__(self, data: DashboardData, *, host: str, port: int, token: str | None,
                 read_token: str | None = None, hosts: Iterable[str] = (),
                 tls_cert: str | None = None, tls_key: str | None = None, workers: int = WORKERS,
                 timeout_s: float = SOCKET_TIMEOUT_S) -> None:
        self.data = data
        self.tls = (tls_cert, tls_key) if tls_cert else None
        self.host = host
        self.requested_port = port
        self.tokens = [t.encode() for t in (token, read_token) if t]
        self.hosts = tuple(hosts)
        self.workers = workers
        self.timeout_s = timeout_s
        self.batch_lock = threading.Lock()
        """One batch lookup at a time (each may decode up to dashboard_data.BATCH_BYTE_BUDGET)."""
        self.port: int | None = None
        self._httpd: _PoolServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> int:
        handler = type("DashboardHandler", (_Handler,), {"dashboard": self, "timeout": self.timeout_s})
        context = None
        if self.tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*self.tls)
        try:
            self._httpd = _PoolServer((self.host, self.requested_port), handler, workers=self.workers,
                                      timeout_s=self.timeout_s, tls=context)
        except OSError as err:
            raise OSError(f"dashboard cannot listen on {self.host}:{self.requested_port}: {err}") from None
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="dashboard", daemon=True)
        self._thread.start()
        return self.port

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    @property
    def refused(self) -> int:
        """Connections refused so far because every worker was busy."""
        return self._httpd.refused if self._httpd is not None else 0

    def authorized(self, header: str | None) -> bool:
        if not self.tokens:
            return True
        presented = (header[len(BEARER):] if header and header.startswith(BEARER) else "").encode()
        return any([hmac.compare_digest(presented, token) for token in self.tokens])  # both compared, always

    def answer(self, path: str, query: dict[str, list[str]]) -> Any:
        """The JSON of an /api/ path. ValueError: a bad argument; KeyError: nothing there; Busy: another
        batch lookup runs."""
        if path == "/api/overview":
            return self.data.overview(since=_int_arg(query, "since", 0))
        if path == "/api/batches":
            return self.data.batches(limit=_int_arg(query, "limit", 50))
        match = _BATCH.match(path)
        if match:
            if not self.batch_lock.acquire(blocking=False):
                raise Busy("another batch lookup is running; try again shortly")
            try:
                return self.data.batch(int(match.group(1)))
            finally:
                self.batch_lock.release()
        raise KeyError(f"no such API path: {path}")


class _Handler(BaseHTTPRequestHandler):
    dashboard: DashboardServer
    server_version = "dlc-rl-dashboard"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 -- the base class's name
        logger.debug("dashboard: %s", redact(format % args))

    def end_headers(self) -> None:
        for name, value in SECURITY_HEADERS.items():
            self.send_header(name, value)
        super().end_headers()

    def do_GET(self) -> None:  # noqa: N802 -- http.server's name
        if not host_allowed(self.headers.get("Host"), self.dashboard.hosts):
            self._send_json(HTTPStatus.MISDIRECTED_REQUEST, {"error": (
                f"this dashboard does not answer for Host {self.headers.get('Host')!r}: open it as localhost, "
                "127.0.0.1 or [::1], or add the name to coordinator.dashboard_hosts (a check against DNS rebinding)")})
            return
        url = urlsplit(self.path)
        path = url.path
        if path in ("/", "/index.html"):
            self._send_file("dashboard.html", "text/html; charset=utf-8")
        elif path.startswith("/static/") and path[len("/static/"):] in STATIC_FILES:
            name = path[len("/static/"):]
            self._send_file(name, STATIC_FILES[name])
        elif path.startswith("/api/"):
            self._api(path, parse_qs(url.query))
        else:
            self._send_json(HTTPStatus.NOT_FOUND, {"error": f"not found: {path}"})

    def _api(self, path: str, query: dict[str, list[str]]) -> None:
        if not self.dashboard.authorized(self.headers.get("Authorization")):
            self._send_json(HTTPStatus.UNAUTHORIZED, {"error": (
                "this coordinator needs a token: Authorization: Bearer <token> (its dashboard_token, or auth_token)")})
            return
        try:
            body = self.dashboard.answer(path, query)
        except ValueError as err:
            self._send_json(HTTPStatus.BAD_REQUEST, {"error": str(err)})
        except KeyError as err:
            self._send_json(HTTPStatus.NOT_FOUND, {"error": err.args[0] if err.args else str(err)})
        except Busy as err:
            self._send_json(HTTPStatus.TOO_MANY_REQUESTS, {"error": str(err)},
                            extra={"Retry-After": str(BATCH_RETRY_AFTER_S)})
        except Exception as err:  # Redis unreachable, ...: the page says so and asks again
            logger.warning("dashboard %s failed: %r", path, err)
            self._send_json(HTTPStatus.SERVICE_UNAVAILABLE, {"error": f"{type(err).__name__}: {err}"})
        else:
            self._send_json(HTTPStatus.OK, body)

    def _send_file(self, name: str, content_type: str) -> None:
        self._send(HTTPStatus.OK, (STATIC_DIR / name).read_bytes(), content_type)

    def _send_json(self, status: HTTPStatus, body: Any, *, extra: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(body, allow_nan=False).encode(), "application/json", extra=extra)

    def _send(self, status: HTTPStatus, data: bytes, content_type: str, *,
              extra: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for name, value in (extra or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)
