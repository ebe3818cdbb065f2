"""The one client of the coordinator: trainer, samplers, launcher and `dlcctl` all dial through it.

    client = CoordinatorClient.from_config(cfg.coordinator)          # blocking (trainer, launcher, dlcctl)
    reply = client.call("ReportStep", pb.ReportStepRequest(...))
    client = AsyncCoordinatorClient.from_config(cfg.coordinator)     # asyncio (samplers)
    reply = await client.call("AckWeightVersion", request)
    async for update in client.stream("SubscribeWeightUpdates", request): ...

Transport failures are gRPC's own business: the channel's service config retries UNAVAILABLE with
exponential backoff (`retryPolicy`) and, for services, waits for the channel to be ready
(`waitForReady`) instead of failing at once while the coordinator is down. What gRPC cannot know is that
every coordinator RPC is idempotent (a re-report gets its first answer, a re-registration resets health):
so `call` sends again a call that a server shutting down cut off (CANCELLED), that ran out of its deadline
while the coordinator was away (DEADLINE_EXCEEDED), or that exhausted the retry policy (UNAVAILABLE), until
`max_wait_s`. A restarted coordinator never kills a client. Once the process stops
(`stop_waiting_on_coordinator`), nothing is sent again, and the blocking clients' calls still in flight
`STOP_GRACE_S` later are cancelled: a stop never waits on a coordinator that is away (or on the Redis behind it).

TLS: `tls_ca` is the PEM of the CA that signed the coordinator's certificate (or the self-signed
certificate itself); `tls_server_name` overrides the name checked against the certificate when the address
is not a name in it. The token travels as `authorization: Bearer <token>` metadata on every call.

Tokens by role (coordinator/auth.py): `from_config(cfg.coordinator, role=...)` sends the role's own token when the
config holds one (`token_for`): the trainer its `trainer_token`, a sampler its `sampler_token`, a reader its
`dashboard_token`; otherwise the write token (`auth_token`), else the read-only `dashboard_token`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import weakref
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import coordinator_pb2 as pb
from protos import coordinator_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

__all__ = [
    "APP_RETRYABLE",
    "OPERATOR",
    "READ",
    "READS_BUSY",
    "ROLES",
    "SAMPLER",
    "TRAINER",
    "AsyncCoordinatorClient",
    "CoordinatorClient",
    "auth_metadata",
    "channel_options",
    "read_pem",
    "service_config",
    "stop_waiting_on_coordinator",
    "token_for",
]

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Coordinator"].full_name
HEALTH_SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
AUTH_HEADER = "authorization"
BEARER = "Bearer "

APP_RETRYABLE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
)
"""Codes `call` sends an idempotent call again on: the coordinator was away or went away mid-call. Also retried:
RESOURCE_EXHAUSTED from a coordinator with too many reads in flight (READS_BUSY in its details; not gRPC's own
RESOURCE_EXHAUSTED for an oversized message, which a retry cannot fix)."""
READS_BUSY = "coordinator.max_reads_in_flight"
"""Named in the details of the coordinator's RESOURCE_EXHAUSTED for too many reads in flight."""

OPERATOR, TRAINER, SAMPLER, READ = "operator", "trainer", "sampler", "read"
ROLES = (OPERATOR, TRAINER, SAMPLER, READ)
"""Who calls the coordinator, each with a token of its own (coordinator/auth.py)."""
_OWN_TOKEN = {OPERATOR: "auth_token", TRAINER: "trainer_token", SAMPLER: "sampler_token", READ: "dashboard_token"}


def token_for(coordinator: Any, role: str | None = None) -> str | None:
    """The token a client of `role` (None: the operator) sends, from a `CoordinatorConfig`: its role's own token when
    set; else the write token (auth_token: a role token left unset means that role needs it); else the read-only
    dashboard_token (reads only); else None."""
    own = getattr(coordinator, _OWN_TOKEN[role or OPERATOR], None)
    return own or coordinator.auth_token or getattr(coordinator, "dashboard_token", None) or None


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata that carries `token` (empty without a token)."""
    return ((AUTH_HEADER, f"{BEARER}{token}"),) if token else ()


def service_config(*, wait_for_ready: bool) -> str:
    """The channel's service config: gRPC retries UNAVAILABLE itself (5 attempts, 0.1 s doubling to 2 s)."""
    method_config = {
        "name": [{"service": SERVICE_NAME}, {"service": HEALTH_SERVICE_NAME}],
        "waitForReady": wait_for_ready,
        "retryPolicy": {
            "maxAttempts": 5,
            "initialBackoff": "0.1s",
            "maxBackoff": "2s",
            "backoffMultiplier": 2,
            "retryableStatusCodes": ["UNAVAILABLE"],
        },
    }
    return json.dumps({"methodConfig": [method_config]})


def channel_options(*, wait_for_ready: bool, tls_server_name: str | None = None) -> list[tuple[str, Any]]:
    """Options of every channel to the coordinator (service config, keepalive, reconnect backoff)."""
    options: list[tuple[str, Any]] = [
        ("grpc.enable_retries", 1),
        ("grpc.service_config", service_config(wait_for_ready=wait_for_ready)),
        # Find a dead coordinator behind an idle weight-update stream, and reconnect quickly after a restart.
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2_000),
    ]
    if tls_server_name:
        options.append(("grpc.ssl_target_name_override", tls_server_name))
    return options


def read_pem(path: str, what: str) -> bytes:
    """The bytes of a PEM file; ValueError naming `what` when it cannot be read or is not PEM."""
    file = Path(path).expanduser()
    try:
        data = file.read_bytes()
    except OSError as err:
        raise ValueError(f"{what}: cannot read {file}: {err.strerror}") from None
    if b"-----BEGIN" not in data:
        raise ValueError(f"{what}: {file} is not a PEM file")
    return data


def channel_credentials(tls_ca: str) -> grpc.ChannelCredentials:
    """TLS credentials that trust the CA (or self-signed certificate) in the PEM file `tls_ca`."""
    return grpc.ssl_channel_credentials(root_certificates=read_pem(tls_ca, "coordinator.tls_ca"))


def _backoff(attempt: int) -> float:
    return min(0.2 * 2**attempt, 5.0)


def _code(err: grpc.RpcError) -> grpc.StatusCode | None:
    return err.code() if hasattr(err, "code") else None


def _details(err: grpc.RpcError) -> str | None:
    return err.details() if hasattr(err, "details") else None


STOP_GRACE_S = 3.0
"""Once the process stops, how long a call in flight may still take before it is cancelled."""
_stopping = threading.Event()
_live_blocking_clients: weakref.WeakSet[CoordinatorClient] = weakref.WeakSet()
_stop_watch_started = threading.Lock()


def stop_waiting_on_coordinator() -> None:
    """This process is stopping (a stop signal; rlcommon/entrypoint.py calls this): a call that fails is not sent
    again, and `STOP_GRACE_S` from now the blocking clients' channels are closed, which cancels the calls still
    in flight. Safe in a signal handler (it only sets an event)."""
    _stopping.set()


def _cancel_calls_after_grace() -> None:
    _stopping.wait()
    time.sleep(STOP_GRACE_S)
    for client in list(_live_blocking_clients):
        client.channel.close()


class _Client:
    """What both clients share: settings, the retry decision and its log line."""

    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        tls_ca: str | None = None,
        tls_server_name: str | None = None,
        wait_for_ready: bool = True,
        timeout_s: float = 30.0,
        max_wait_s: float = 300.0,
    ) -> None:
        self.address = address
        self.metadata = auth_metadata(token)
        self.timeout_s = timeout_s
        self.max_wait_s = max_wait_s
        self._credentials = channel_credentials(tls_ca) if tls_ca else None
        self._options = channel_options(wait_for_ready=wait_for_ready, tls_server_name=tls_server_name)

    @classmethod
    def from_config(cls, coordinator: Any, *, address: str | None = None, role: str | None = None, **kwargs: Any):
        """A client of the coordinator a `CoordinatorConfig` names (address unless given, TLS), with the token of
        `role` (`token_for`; None: the operator's write token, else the read-only one)."""
        return cls(
            address or coordinator.dial_address,
            token=token_for(coordinator, role),
            tls_ca=coordinator.tls_ca,
            tls_server_name=coordinator.tls_server_name,
            **kwargs,
        )

    def _should_retry(self, err: grpc.RpcError, *, method: str, retry: bool, deadline: float, attempt: int) -> bool:
        code = _code(err)
        busy = code == grpc.StatusCode.RESOURCE_EXHAUSTED and READS_BUSY in (_details(err) or "")
        if not retry or not (busy or code in APP_RETRYABLE) or time.monotonic() > deadline or _stopping.is_set():
            return False
        if attempt == 0 or attempt % 10 == 0:
            logger.warning("%s: coordinator at %s unavailable (%s); retrying", method, self.address, code)
        return True


class CoordinatorClient(_Client):
    """Blocking client (see the module docstring)."""

    def __init__(self, address: str, **kwargs: Any) -> None:
        super().__init__(address, **kwargs)
        if self._credentials is None:
            self.channel = grpc.insecure_channel(address, options=self._options)
        else:
            self.channel = grpc.secure_channel(address, self._credentials, options=self._options)
        self.stub = pb_grpc.CoordinatorStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        _live_blocking_clients.add(self)
        if _stop_watch_started.acquire(blocking=False):
            threading.Thread(target=_cancel_calls_after_grace, name="coordinator-stop-watch", daemon=True).start()

    def call(self, method: str, request: Any, *, timeout_s: float | None = None, retry: bool = True) -> Any:
        """`method`(request) with the token; sent again while the coordinator is away (unless not `retry`)."""
        fn = getattr(self.stub, method)
        deadline = time.monotonic() + self.max_wait_s
        attempt = 0
        while True:
            try:
                return fn(request, metadata=self.metadata, timeout=timeout_s or self.timeout_s)
            except grpc.RpcError as err:
                if not self._should_retry(err, method=method, retry=retry, deadline=deadline, attempt=attempt):
                    raise
            time.sleep(_backoff(attempt))
            attempt += 1

    def stream(self, method: str, request: Any) -> Iterator[Any]:
        """A server-streaming call with the token (the caller resubscribes when it ends)."""
        return getattr(self.stub, method)(request, metadata=self.metadata)

    def serving(self, *, timeout_s: float = 2.0) -> bool:
        """True when the coordinator's health service answers SERVING now."""
        try:
            reply = self._health.Check(health_pb2.HealthCheckRequest(), timeout=timeout_s, wait_for_ready=False)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> CoordinatorClient:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()


class AsyncCoordinatorClient(_Client):
    """asyncio client (see the module docstring); create it on the event loop that uses it."""

    def __init__(self, address: str, **kwargs: Any) -> None:
        super().__init__(address, **kwargs)
        if self._credentials is None:
            self.channel = grpc.aio.insecure_channel(address, options=self._options)
        else:
            self.channel = grpc.aio.secure_channel(address, self._credentials, options=self._options)
        self.stub = pb_grpc.CoordinatorStub(self.channel)

    async def call(
        self, method: str, request: Any, *, timeout_s: float | None = None, retry: bool = True
    ) -> Any:
        """`method`(request) with the token; sent again while the coordinator is away (unless not `retry`)."""
        fn = getattr(self.stub, method)
        deadline = time.monotonic() + self.max_wait_s
        attempt = 0
        while True:
            try:
                return await fn(request, metadata=self.metadata, timeout=timeout_s or self.timeout_s)
            except grpc.RpcError as err:
                if not self._should_retry(err, method=method, retry=retry, deadline=deadline, attempt=attempt):
                    raise
            await asyncio.sleep(_backoff(attempt))
            attempt += 1

    def stream(self, method: str, request: Any) -> AsyncIterator[Any]:
        """A server-streaming call with the token (the caller resubscribes when it ends)."""
        return getattr(self.stub, method)(request, metadata=self.metadata)

    async def close(self) -> None:
        await self.channel.close()
