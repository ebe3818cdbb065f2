"""The run dashboard: a read-only web page and JSON API the coordinator serves on `coordinator.dashboard_port`.

    GET /                      the page (coordinator/static/dashboard.html; it polls the API every 2 s)
    GET /static/<file>         its script, style and the vendored chart library (static/vendor/README.md)
    GET /api/overview?since=N  status, samplers, plan, syncs, dead letters, step rows N.. (dashboard_data.py)
    GET /api/batches?limit=N   the newest N batches of the ledger
    GET /api/batches/<id>      one batch's rollouts, with the trainer's per-token log-ratios

Read-only: nothing here changes the run. With `coordinator.auth_token` set, every /api/ request needs it
(`Authorization: Bearer <token>`; the page sends the `?token=` of its own address); the page and its static
files hold no data and need none. It binds the coordinator's host: beyond localhost only with a token (the
coordinator refuses to start otherwise). Standard library HTTP server, one thread per request.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import ssl
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from coordinator.dashboard_data import DashboardData

logger = logging.getLogger(__name__)

__all__ = ["DashboardServer"]

STATIC_DIR = Path(__file__).resolve().parent / "static"
STATIC_FILES = {
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
    "vendor/uPlot.iife.min.js": "text/javascript; charset=utf-8",
    "vendor/uPlot.min.css": "text/css; charset=utf-8",
}
"""Every file the page may load; nothing else under static/ (or anywhere) is served."""
_BATCH = re.compile(r"^/api/batches/(\d{1,18})$")


def _int_arg(query: dict[str, list[str]], name: str, default: int) -> int:
    values = query.get(name)
    if not values:
        return default
    try:
        return int(values[0])
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {values[0]!r}") from None


class DashboardServer:
    """Serves the page and the API from a background thread; `start()` returns the bound port."""

    def __init__(self, data: DashboardData, *, host: str, port: int, token: str | None,
                 tls_cert: str | None = None, tls_key: str | None = None) -> None:
        self.data = data
        self.tls = (tls_cert, tls_key) if tls_cert else None
        self.host = host
        self.requested_port = port
        self.token = token or None
        self.port: int | None = None
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> int:
        handler = type("DashboardHandler", (_Handler,), {"dashboard": self})
        try:
            self._httpd = ThreadingHTTPServer((self.host, self.requested_port), handler)
        except OSError as err:
            raise OSError(f"dashboard cannot listen on {self.host}:{self.requested_port}: {err}") from None
        self._httpd.daemon_threads = True
        if self.tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*self.tls)
            self._httpd.socket = context.wrap_socket(self._httpd.socket, server_side=True)
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="dashboard", daemon=True)
        self._thread.start()
        return self.port

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def authorized(self, header: str | None) -> bool:
        if self.token is None:
            return True
        presented = header[len("Bearer "):] if header and header.startswith("Bearer ") else ""
        return hmac.compare_digest(presented.encode(), self.token.encode())

    def answer(self, path: str, query: dict[str, list[str]]) -> Any:
        """The JSON of an /api/ path. ValueError: a bad argument; KeyError: nothing there."""
        if path == "/api/overview":
            return self.data.overview(since=_int_arg(query, "since", 0))
        if path == "/api/batches":
            return self.data.batches(limit=_int_arg(query, "limit", 50))
        match = _BATCH.match(path)
        if match:
            return self.data.batch(int(match.group(1)))
        raise KeyError(f"no such API path: {path}")


class _Handler(BaseHTTPRequestHandler):
    dashboard: DashboardServer
    server_version = "dlc-rl-dashboard"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 -- the base class's name
        logger.debug("dashboard: " + format, *args)

    def do_GET(self) -> None:  # noqa: N802 -- http.server's name
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
            self._send_json(HTTPStatus.UNAUTHORIZED,
                            {"error": "this coordinator needs its token: Authorization: Bearer <token>"})
            return
        try:
            body = self.dashboard.answer(path, query)
        except ValueError as err:
            self._send_json(HTTPStatus.BAD_REQUEST, {"error": str(err)})
        except KeyError as err:
            self._send_json(HTTPStatus.NOT_FOUND, {"error": err.args[0] if err.args else str(err)})
        except Exception as err:  # Redis unreachable, ...: the page says so and asks again
            logger.warning("dashboard %s failed: %r", path, err)
            self._send_json(HTTPStatus.SERVICE_UNAVAILABLE, {"error": f"{type(err).__name__}: {err}"})
        else:
            self._send_json(HTTPStatus.OK, body)

    def _send_file(self, name: str, content_type: str) -> None:
        self._send(HTTPStatus.OK, (STATIC_DIR / name).read_bytes(), content_type)

    def _send_json(self, status: HTTPStatus, body: Any) -> None:
        self._send(status, json.dumps(body, allow_nan=False).encode(), "application/json")

    def _send(self, status: HTTPStatus, data: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.end_headers()
        self.wfile.write(data)
