"""Optional token authentication, by role, and TLS for the coordinator's gRPC server (clients: rlcommon.rpc).

With `coordinator.auth_token` set, every Coordinator call must carry the metadata `authorization: Bearer <token>`;
a missing or unknown token is UNAUTHENTICATED. Each token is a role's, and a role may make only its calls
(coordinator/server.py `METHOD_ROLES`); another call is PERMISSION_DENIED, naming the role and the call:

    operator  coordinator.auth_token (the write token: dlcctl, the launcher)   every call
    trainer   coordinator.trainer_token                                        the trainer's calls and the reads
    sampler   coordinator.sampler_token (shared by every sampler)              the samplers' calls
    read      coordinator.dashboard_token (the dashboard, read-only dlcctl)    the reads

A role token left unset is no token at all: that role's clients then need the write token, as before role tokens
existed. Every token must differ from the others. gRPC health and reflection stay open. Tokens travel in clear text
unless TLS is on (`coordinator.tls_cert` + `tls_key` on the server, `coordinator.tls_ca` on clients).
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Any

import grpc

from rlcommon.rpc import AUTH_HEADER, BEARER, OPERATOR, READ, ROLES, SAMPLER, TRAINER, auth_metadata, read_pem

logger = logging.getLogger(__name__)

__all__ = [
    "AUTH_HEADER",
    "OPERATOR",
    "READ",
    "ROLES",
    "SAMPLER",
    "TRAINER",
    "RoleTokens",
    "TokenAuthInterceptor",
    "auth_metadata",
    "server_credentials",
]

ROLE_TOKEN_KEYS = {OPERATOR: "auth_token", TRAINER: "trainer_token", SAMPLER: "sampler_token",
                   READ: "dashboard_token"}
"""The `coordinator.*` key of each role's token."""
_ROLE_WORDS = {
    OPERATOR: "the operator's write token (auth_token)",
    TRAINER: "the trainer's token (trainer_token, role trainer)",
    SAMPLER: "the samplers' token (sampler_token, role sampler)",
    READ: "the read-only dashboard token (dashboard_token, role read)",
}


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


class RoleTokens:
    """The tokens the coordinator accepts, each a role's: `write` (operator; required) and the optional `trainer`,
    `sampler` and `read` (dashboard) tokens. ValueError when two are the same."""

    def __init__(self, write: str, *, trainer: str | None = None, sampler: str | None = None,
                 read: str | None = None) -> None:
        if not write:
            raise ValueError("the coordinator's role tokens need a write token (coordinator.auth_token)")
        given = {OPERATOR: write, TRAINER: trainer or None, SAMPLER: sampler or None, READ: read or None}
        self._tokens = {role: token.encode() for role, token in given.items() if token}
        roles = list(self._tokens)
        for i, first in enumerate(roles):
            for second in roles[i + 1:]:
                if hmac.compare_digest(self._tokens[first], self._tokens[second]):
                    raise ValueError(f"coordinator.{ROLE_TOKEN_KEYS[second]} must differ from coordinator."
                                     f"{ROLE_TOKEN_KEYS[first]}: each role's token grants that role's calls only")

    @classmethod
    def from_config(cls, ccfg: Any) -> RoleTokens | None:
        """The tokens of a `CoordinatorConfig`; None without auth_token (no call is checked)."""
        if not ccfg.auth_token:
            return None
        return cls(ccfg.auth_token, trainer=ccfg.trainer_token, sampler=ccfg.sampler_token, read=ccfg.dashboard_token)

    @property
    def roles(self) -> frozenset[str]:
        """The roles with a token."""
        return frozenset(self._tokens)

    def role_of(self, token: bytes) -> str | None:
        """The role whose token `token` is, None when it is none's (every token is compared, whichever matches)."""
        found = None
        for role, expected in self._tokens.items():
            if hmac.compare_digest(token, expected):
                found = role
        return found

    def role_of_call(self, metadata: Any) -> str | None:
        """The role of the token a call's metadata carries (None: no token, or an unknown one)."""
        given, _ = _bearer(metadata)
        return None if given is None else self.role_of(given)


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


def refusal(method: str, role: str, allowed: Collection[str]) -> str:
    """The PERMISSION_DENIED message of `role` calling `method` (a full name /pkg.Svc/Method), which `allowed`
    roles may call."""
    call = method.rsplit("/", 1)[-1]
    takes = " or ".join(_ROLE_WORDS[r] for r in ROLES if r in allowed)
    if role == READ:
        return (f"{call}: {_ROLE_WORDS[READ]} cannot change the run's state (a read-only token); this call takes "
                f"{takes}")
    return f"{call}: {_ROLE_WORDS[role]} may not make this call; it takes {takes}"


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Requires `authorization: Bearer <token>` on every method of `service` (its full name, e.g.
    dlc.coordinator.v1.Coordinator), and that the token's role be one of `method_roles[method]` (full names:
    /pkg.Svc/Method); a method of `service` missing from `method_roles` takes the write token only. Other services
    (health, reflection) stay open."""

    def __init__(self, tokens: RoleTokens, method_roles: Mapping[str, Collection[str]], *, service: str) -> None:
        self._tokens = tokens
        self._method_roles = {method: frozenset(roles) for method, roles in method_roles.items()}
        self._prefix = f"/{service}/"
        self._refused = 0
        self._next_log = 0.0

    def problem(self, method: str, metadata: Any) -> tuple[grpc.StatusCode, str] | None:
        """Why a call of `method` with `metadata` is refused (status code, message), or None when it is not."""
        if not method.startswith(self._prefix):
            return None
        given, problem = _bearer(metadata)
        if given is None:
            return grpc.StatusCode.UNAUTHENTICATED, str(problem)
        role = self._tokens.role_of(given)
        if role is None:
            return grpc.StatusCode.UNAUTHENTICATED, "invalid token"
        allowed = self._method_roles.get(method, frozenset({OPERATOR}))
        if role in allowed:
            return None
        return grpc.StatusCode.PERMISSION_DENIED, refusal(method, role, allowed)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        problem = self.problem(method, handler_call_details.invocation_metadata)
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
