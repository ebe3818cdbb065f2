"""The images' health check (rlcommon/healthcheck.py): it reads the service's own command line and config,
then asks the service; here against a real HTTP metrics endpoint and a real process's /proc entry."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading

import pytest

from rlcommon.entrypoint import config_from_args
from rlcommon.healthcheck import main, probe, service_of


def test_the_service_is_read_off_its_command_line():
    argv = ["/opt/venv/bin/python", "-m", "sampler_svc", "--config", "/configs/default.toml", "--sampler.metrics_port", "9"]
    assert service_of(argv) == ("sampler_svc", ["--config", "/configs/default.toml", "--sampler.metrics_port", "9"])
    assert service_of(["python", "-m", "rlcommon.models", "--preset", "tiny"]) is None
    cfg = config_from_args(["--port", "7000", "--coordinator.host", "0.0.0.0"], port_flag=True)
    assert cfg.coordinator.port == 7000 and cfg.coordinator.host == "0.0.0.0"


@pytest.fixture
def metrics_server():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            self.send_response(200 if self.path == "/metrics" else 404)
            self.end_headers()
            self.wfile.write(b"dlc_up 1\n")

        def log_message(self, *_):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_a_trainer_or_sampler_is_healthy_while_its_metrics_answer(metrics_server, monkeypatch):
    for module, section in (("trainer_svc", "trainer"), ("sampler_svc", "sampler")):
        monkeypatch.setenv(f"DLC_{section.upper()}__METRICS_PORT", str(metrics_server))
        assert probe(module, config_from_args([])) is None
    monkeypatch.setenv("DLC_TRAINER__METRICS_PORT", "1")  # nothing listens on port 1
    problem = probe("trainer_svc", config_from_args([]), timeout_s=2)
    assert problem.startswith("http://127.0.0.1:1/metrics: ")


@pytest.mark.parametrize(("bind", "metrics_host"), [("0.0.0.0", "0.0.0.0"), ("127.0.0.3", "127.0.0.3")])
def test_the_probe_reaches_the_metrics_host_the_service_binds(monkeypatch, bind, metrics_host):
    """compose: metrics_host 0.0.0.0 (reached on loopback); a service bound to one address: that address."""
    from rlcommon.metrics import start_metrics_server

    port = start_metrics_server(0, bind)
    monkeypatch.setenv("DLC_SAMPLER__METRICS_PORT", str(port))
    monkeypatch.setenv("DLC_SAMPLER__METRICS_HOST", metrics_host)
    assert probe("sampler_svc", config_from_args([])) is None


def test_a_coordinator_that_does_not_listen_is_unhealthy():
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert probe("coordinator", config_from_args(["--port", str(port)], port_flag=True), timeout_s=1) == (
        "the coordinator's health service is not SERVING"
    )


def test_main_checks_the_process_it_is_pointed_at(metrics_server, capsys):
    """A real process whose command line names the sampler service and its metrics port."""
    argv = [sys.executable, "-c", "import sys; print('ready', flush=True); sys.stdin.read()", "-m", "sampler_svc",
            "--sampler.metrics_port", str(metrics_server)]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        # Until the child prints, /proc/<pid>/cmdline may still be this process's (forked, not yet exec'd).
        assert proc.stdout.readline().strip() == "ready"
        assert main(["--pid", str(proc.pid)]) == 0
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
        proc.stdout.close()
    assert main(["--pid", str(proc.pid)]) == 1  # gone: its /proc entry is no more
    assert "cannot read the command line" in capsys.readouterr().err
