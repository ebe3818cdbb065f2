"""The few Docker Engine API calls the Swarm autoscaler makes (stdlib only: the coordinator image has no Docker SDK).

`DockerAPI(host)`: `unix:///var/run/docker.sock` (a manager's socket) or `tcp://HOST:PORT` (plain HTTP: a socket
proxy on the stack's network that lets through only these calls). Calls:

- `service(name)`: GET /services/{name} (its spec, its version index);
- `tasks(name)`: GET /tasks?filters={"service":[name]} (each replica's desired and current state, its container);
- `scale(service, replicas)`: POST /services/{id}/update?version={index} with the same spec and another replica
  count, which is what `docker service scale` does.

A failed call raises `DockerError` with the engine's message and HTTP status (409: the service changed since it was
read; read it again).
"""

from __future__ import annotations

import copy
import http.client
import json
import socket
import urllib.parse
from typing import Any

__all__ = ["API_VERSION", "DockerAPI", "DockerError"]

API_VERSION = "v1.41"
"""Docker Engine 20.10 and later answer it."""


class DockerError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"Docker API {status}: {message}")
        self.status = status


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


class DockerAPI:
    def __init__(self, host: str = "unix:///var/run/docker.sock", *, timeout_s: float = 10.0) -> None:
        parsed = urllib.parse.urlparse(host)
        if parsed.scheme == "unix" and parsed.path:
            self._connect = lambda: _UnixConnection(parsed.path, timeout_s)
        elif parsed.scheme in ("tcp", "http") and parsed.hostname and parsed.port:
            self._connect = lambda: http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=timeout_s)
        else:
            raise ValueError(f"docker host {host!r}: expected unix:///path/to/docker.sock or tcp://HOST:PORT")
        self.host = host

    def _call(self, method: str, path: str, *, query: dict[str, str] | None = None, body: Any = None) -> Any:
        url = f"/{API_VERSION}{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
        conn = self._connect()
        try:
            payload = None if body is None else json.dumps(body).encode()
            headers = {"Content-Type": "application/json"} if payload is not None else {}
            conn.request(method, url, body=payload, headers=headers)
            reply = conn.getresponse()
            data = reply.read()
        except OSError as err:
            raise DockerError(0, f"{method} {path} at {self.host}: {err}") from err
        finally:
            conn.close()
        if reply.status >= 300:
            try:
                message = json.loads(data).get("message", "")
            except ValueError:
                message = data.decode(errors="replace")[:500]
            raise DockerError(reply.status, f"{method} {path}: {message}")
        return json.loads(data) if data else None

    def service(self, name: str) -> dict[str, Any]:
        return self._call("GET", f"/services/{urllib.parse.quote(name, safe='')}")

    def tasks(self, service_name: str) -> list[dict[str, Any]]:
        return self._call("GET", "/tasks", query={"filters": json.dumps({"service": [service_name]})})

    def scale(self, service: dict[str, Any], replicas: int) -> None:
        """Set `service`'s (as `service()` read it) replica count; DockerError 409/500 if it changed meanwhile."""
        spec = copy.deepcopy(service["Spec"])
        mode = spec.get("Mode", {})
        if "Replicated" not in mode:
            raise DockerError(0, f"service {spec.get('Name')} is not replicated ({sorted(mode)}): nothing to scale")
        mode["Replicated"]["Replicas"] = int(replicas)
        self._call("POST", f"/services/{service['ID']}/update", query={"version": str(service["Version"]["Index"])},
                   body=spec)
