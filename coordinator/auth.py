"""Optional shared-token authentication and TLS for the coordinator's gRPC server (clients: rlcommon.rpc).

With `coordinator.auth_token` set, every state-changing call must carry the metadata
`authorization: Bearer <token>`; a missing or wrong token is UNAUTHENTICATED. Read-only calls (status,
history, plans, health, reflection) stay open. The token travels in clear text unless TLS is on
(`coordinator.tls_cert` + `tls_key` on the server, `coordinator.tls_ca` on clients).
"""

from __future__ import annotations

import hmac
import logging
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


def _token_problem(expected: str, metadata: Any) -> str | None:
    """Why the call's metadata does not authenticate, or None when it does."""
    values = [value for key, value in (metadata or ()) if key == AUTH_HEADER]
    if not values:
        return f"missing '{AUTH_HEADER}: Bearer <token>' metadata: this call changes state and needs the run's token"
    value = values[0]
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    if not value.startswith(BEARER):
        return f"'{AUTH_HEADER}' metadata must be 'Bearer <token>'"
    if not hmac.compare_digest(value[len(BEARER) :].encode(), expected.encode()):
        return "invalid token"
    return None


def _denied_handler(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that aborts with UNAUTHENTICATED."""

    async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

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
    """Requires `authorization: Bearer <token>` on the methods in `protected` (full names: /pkg.Svc/Method)."""

    def __init__(self, token: str, protected: Collection[str]) -> None:
        if not token:
            raise ValueError("TokenAuthInterceptor needs a non-empty token")
        self._token = token
        self._protected = frozenset(protected)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method not in self._protected:
            return handler
        problem = _token_problem(self._token, handler_call_details.invocation_metadata)
        if problem is None:
            return handler
        logger.warning("rejected %s: %s", handler_call_details.method, problem)
        return _denied_handler(handler, problem)


def server_credentials(tls_cert: str | None, tls_key: str | None) -> grpc.ServerCredentials | None:
    """TLS credentials from PEM files (None when TLS is off); ValueError names a bad file."""
    if tls_cert is None and tls_key is None:
        return None
    if tls_cert is None or tls_key is None:
        raise ValueError("coordinator.tls_cert and coordinator.tls_key must be set together")
    key = read_pem(tls_key, "coordinator.tls_key")
    cert = read_pem(tls_cert, "coordinator.tls_cert")
    return grpc.ssl_server_credentials([(key, cert)])
