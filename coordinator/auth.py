"""Optional shared-token authentication and TLS for the coordinator's gRPC server (clients: rlcommon.rpc).

With `coordinator.auth_token` set, every Coordinator call must carry the metadata
`authorization: Bearer <token>`; a missing or wrong token is UNAUTHENTICATED. The read-only calls (status,
history, plans) also take `coordinator.dashboard_token`, a token that can change nothing (the dashboard's, or a
read-only operator's); a state-changing call with it is PERMISSION_DENIED. gRPC health and reflection stay open.
Tokens travel in clear text unless TLS is on (`coordinator.tls_cert` + `tls_key` on the server,
`coordinator.tls_ca` on clients).
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Awaitable, Callable, Collection
from typing import Any

import grpc

from rlcommon.rpc import AUTH_HEADER, BEARER, auth_metadata, read_pem

logger = logging.getLogger(__name__)

__all__ = [
    "AUTH_HEADER",
    "TokenAuthInterceptor",
    "auth_metadata",
    "server_credentials",
]


def _bearer(metadata: Any) -> tuple[bytes | None, str | None]:
    """The call's bearer token, or None and why there is none."""
    values = [value for key, value in (metadata or ()) if key == AUTH_HEADER]
    if not values:
        return None, f"missing '{AUTH_HEADER}: Bearer <token>' metadata: this coordinator needs the run's token"
    value = values[0]
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    if not value.startswith(BEARER):
        return None, f"'{AUTH_HEADER}' metadata must be 'Bearer <token>'"
    return value[len(BEARER) :].encode(), None


def _same(given: bytes, expected: str | None) -> bool:
    return bool(expected) and hmac.compare_digest(given, expected.encode())  # type: ignore[union-attr]


def _token_problem(expected: str, metadata: Any, *, read_token: str | None = None,
                   read_only: bool = False) -> tuple[grpc.StatusCode, str] | None:
    """Why the call's metadata does not authorize it (status code, message), or None when it does."""
    given, problem = _bearer(metadata)
    if given is None:
        return grpc.StatusCode.UNAUTHENTICATED, str(problem)
    if _same(given, expected) or (read_only and _same(given, read_token)):
        return None
    if _same(given, read_token):
        return grpc.StatusCode.PERMISSION_DENIED, "the read-only dashboard token cannot change the run's state"
    return grpc.StatusCode.UNAUTHENTICATED, "invalid token"


def _denied_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that aborts with `code`."""

    async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)

    kwargs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny, **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(deny, **kwargs)
    if handler.stream_stream:
        return grpc.stream_stream_rpc_method_handler(deny, **kwargs)
    return grpc.unary_unary_rpc_method_handler(deny, **kwargs)


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Requires `authorization: Bearer <token>` on the methods in `protected` (full names: /pkg.Svc/Method);
    those also in `read_methods` take `read_token` too."""

    def __init__(self, token: str, protected: Collection[str], *, read_token: str | None = None,
                 read_methods: Collection[str] = ()) -> None:
        if not token:
            raise ValueError("TokenAuthInterceptor needs a non-empty token")
        if read_token is not None and hmac.compare_digest(read_token.encode(), token.encode()):
            raise ValueError("coordinator.dashboard_token must differ from coordinator.auth_token (it is read-only)")
        self._token = token
        self._read_token = read_token or None
        self._protected = frozenset(protected)
        self._read_methods = frozenset(read_methods)
        self._refused = 0
        self._next_log = 0.0

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method not in self._protected:
            return handler
        problem = _token_problem(self._token, handler_call_details.invocation_metadata,
                                 read_token=self._read_token, read_only=method in self._read_methods)
        if problem is None:
            return handler
        code, message = problem
        self._log_refusal(method, message)
        return _denied_handler(handler, code, message)

    def _log_refusal(self, method: str, message: str) -> None:
        """A warning for the first refusal, then at most one every 10 s with the count (a flood of bad calls
        must not flood the log)."""
        now = time.monotonic()
        self._refused += 1
        if now >= self._next_log:
            logger.warning("rejected %s: %s (%d refused calls since the last warning)", method, message,
                           self._refused)
            self._refused, self._next_log = 0, now + 10.0


def server_credentials(tls_cert: str | None, tls_key: str | None) -> grpc.ServerCredentials | None:
    """TLS credentials from PEM files (None when TLS is off); ValueError names a bad file."""
    if tls_cert is None and tls_key is None:
        return None
    if tls_cert is None or tls_key is None:
        raise ValueError("coordinator.tls_cert and coordinator.tls_key must be set together")
    key = read_pem(tls_key, "coordinator.tls_key")
    cert = read_pem(tls_cert, "coordinator.tls_cert")
    return grpc.ssl_server_credentials([(key, cert)])
