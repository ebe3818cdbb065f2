"""The dashboard's HTTP server (coordinator/dashboard.py) under clients that misbehave, over real sockets with a
real coordinator and redis-server behind it: an idle TCP connection to the HTTPS dashboard (its handshake runs in
a worker, with a timeout), a client that never sends its request (dropped after the socket timeout), more
connections than workers (503 at once), Host headers of other names (421: DNS rebinding), the headers every
answer carries, and the request line's `token=` kept out of the log."""

from __future__ import annotations

import http.client
import json
import logging
import shutil
import socket
import ssl

import pytest

from coordinator.dashboard import DashboardServer, host_allowed, redact
from coordinator.dashboard_data import DashboardData
from coordinator.service import Coordinator
from rlcommon.bus import RedisConnection
from rlcommon.config import RunConfig, load_config
from rlcommon.models.tokenizer import CharTokenizer
from tests.integration.test_coordinator_grpc import self_signed

RUN_ID = "dash-http"


@pytest.fixture
def serve(redis_url):
    """`serve(**kwargs)`: a started DashboardServer over a started Coordinator; stopped after the test."""
    cfg = load_config(RunConfig, [], {"bus": {"run_id": RUN_ID}, "coordinator": {
        "batch_size": 2, "group_size": 2, "max_inflight_batches": 2, "sync_policy": "never"}})
    conn = RedisConnection(redis_url, reconnect_max_s=2.0)
    core = Coordinator(cfg, conn=conn, encode=CharTokenizer().encode)
    core.start()
    servers: list[DashboardServer] = []

    def start(**kwargs) -> DashboardServer:
        data = DashboardData(core=core, on_coordinator=lambda fn: fn(), conn=conn, tokenizer=CharTokenizer())
        server = DashboardServer(data, host="127.0.0.1", port=0, **{"token": None, **kwargs})
        server.start()
        servers.append(server)
        return server

    try:
        yield start
    finally:
        for server in servers:
            server.stop()
        core.stop()
        conn.close()


def request(port: int, path: str = "/", *, host: str | None = None, headers: dict | None = None,
            tls: ssl.SSLContext | None = None) -> tuple[int, dict[str, str], bytes]:
    """GET `path` with the Host header `host` (default 127.0.0.1:port); (status, headers, body)."""
    if tls is not None:
        client = http.client.HTTPSConnection("127.0.0.1", port, timeout=60, context=tls)
    else:
        client = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        client.putrequest("GET", path, skip_host=True)
        client.putheader("Host", host if host is not None else f"127.0.0.1:{port}")
        for name, value in (headers or {}).items():
            client.putheader(name, value)
        client.endheaders()
        reply = client.getresponse()
        return reply.status, dict(reply.getheaders()), reply.read()
    finally:
        client.close()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl makes the test certificate")
def test_an_idle_tcp_connection_does_not_block_the_https_dashboard(serve, tmp_path):
    cert, key = self_signed(tmp_path)
    server = serve(tls_cert=str(cert), tls_key=str(key))
    idle = socket.create_connection(("127.0.0.1", server.port), timeout=60)  # connects, never says hello
    try:
        tls = ssl.create_default_context(cafile=str(cert))
        status, _, page = request(server.port, "/", tls=tls)
        assert status == 200 and b"dashboard.js" in page and b'id="fleet"' in page  # the fleet line's place
        status, _, body = request(server.port, "/api/overview", tls=tls)
        assert status == 200
        # No tick ran: the desired sampler count is not decided yet (coordinator/fleet.py).
        assert {k: v for k, v in json.loads(body)["fleet"].items() if k in ("desired", "reason")} == \
            {"desired": 0, "reason": ""}
    finally:
        idle.close()


def test_a_client_that_never_sends_its_request_is_dropped_after_the_socket_timeout(serve):
    server = serve(timeout_s=0.5)
    idle = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    try:
        assert idle.recv(1024) == b""  # the server closed it (the client's own timeout: 60 s)
    finally:
        idle.close()


def test_connections_beyond_the_workers_get_503_at_once_and_the_pool_frees_up(serve):
    server = serve(workers=2, timeout_s=120)
    idle = [socket.create_connection(("127.0.0.1", server.port), timeout=60) for _ in range(2)]
    try:
        # The accept loop takes connections in order: both idle ones hold a worker when this one comes.
        status, headers, body = request(server.port, "/api/overview")
        assert status == 503 and headers["Retry-After"] == "1" and b"dashboard busy" in body
        assert headers["Referrer-Policy"] == "no-referrer" and server.refused == 1
    finally:
        for sock in idle:
            sock.close()
    # Closed by their clients: the workers read EOF and are free again (no timeout needed).
    from tests.integration.browser import wait_for

    wait_for(lambda: request(server.port, "/api/overview")[0] == 200, timeout_s=60, what="a free worker")


def test_only_loopback_names_and_configured_hosts_are_served(serve):
    server = serve(hosts=["dash.example.org"])
    port = server.port
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "localhost", f"dash.example.org:{port}",
                 "DASH.example.org", "127.0.0.1:8080"):
        assert request(port, "/api/overview", host=host)[0] == 200, host
    for host in ("evil.example:80", f"dash.example.org.evil.example:{port}", "127.0.0.2", f"[::2]:{port}",
                 "localhost.evil.example", ""):
        status, headers, body = request(port, "/", host=host)
        assert status == 421 and b"coordinator.dashboard_hosts" in body and b"DNS rebinding" in body, host
        assert headers["Referrer-Policy"] == "no-referrer"
    assert request(port, "/api/overview", host="dash.example.org")[0] == 200
    assert request(serve().port, "/", host="dash.example.org")[0] == 421  # not configured: refused


def test_host_allowed_compares_the_name_without_the_port():
    assert host_allowed("localhost:1", []) and host_allowed("[::1]", []) and host_allowed("a.b:9", ["A.b"])
    assert not host_allowed(None, []) and not host_allowed("a.b", []) and not host_allowed("[::1]x:1", [])
    assert not host_allowed("127.0.0.1.nip.io", [])


def test_every_answer_carries_the_security_headers(serve):
    server = serve(token="t")
    port = server.port
    answers = {path: request(port, path) for path in ("/", "/static/dashboard.js", "/api/overview", "/nothing")}
    answers["421"] = request(port, "/", host="evil.example")
    with socket.create_connection(("127.0.0.1", port), timeout=60) as raw:  # http.server's own error: 501
        raw.sendall(b"POST / HTTP/1.1\r\nHost: localhost\r\n\r\n")
        status_line, *lines = raw.makefile("rb").read().decode(errors="replace").split("\r\n\r\n")[0].split("\r\n")
        answers["POST"] = (int(status_line.split()[1]), dict(line.split(": ", 1) for line in lines), b"")
    assert [a[0] for a in answers.values()] == [200, 200, 401, 404, 421, 501]
    for what, (_, headers, _) in answers.items():
        assert headers["Referrer-Policy"] == "no-referrer", what
        assert headers["X-Content-Type-Options"] == "nosniff", what
        assert headers["Cache-Control"] == "no-store", what
        assert "default-src 'self'" in headers["Content-Security-Policy"], what
        assert "frame-ancestors 'none'" in headers["Content-Security-Policy"], what


def test_the_token_in_a_request_line_is_never_logged(serve, caplog):
    server = serve(token="w-secret", read_token="r-secret")
    caplog.set_level(logging.DEBUG, logger="coordinator.dashboard")
    assert request(server.port, "/?token=r-secret")[0] == 200
    assert request(server.port, "/api/overview?since=0&token=w-secret&x=1",
                   headers={"Authorization": "Bearer r-secret"})[0] == 200
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "GET /?token=[redacted]" in logged and "since=0&token=[redacted]&x=1" in logged
    assert "secret" not in logged
    assert redact('"GET /?TOKEN=abc HTTP/1.1" 200') == '"GET /?TOKEN=[redacted] HTTP/1.1" 200'
