"""Calls to the coordinator that survive its restart: retry UNAVAILABLE with exponential backoff."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

logger = logging.getLogger(__name__)
T = TypeVar("T")

RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def _backoff(attempt: int) -> float:
    return min(0.2 * 2**attempt, 5.0)


def call_with_retry(fn: Callable[[], T], *, what: str, max_wait_s: float = 300.0) -> T:
    """Run the blocking RPC `fn` until it succeeds or fails with a non-retryable status."""
    deadline = time.monotonic() + max_wait_s
    attempt = 0
    while True:
        try:
            return fn()
        except grpc.RpcError as err:
            code = err.code() if hasattr(err, "code") else None
            if code not in RETRYABLE or time.monotonic() > deadline:
                raise
            delay = _backoff(attempt)
            if attempt == 0 or attempt % 10 == 0:
                logger.warning("%s: coordinator unavailable (%s); retrying", what, code)
            attempt += 1
            time.sleep(delay)


async def acall_with_retry(fn: Callable[[], Awaitable[T]], *, what: str, max_wait_s: float = 300.0) -> T:
    """Asyncio twin of `call_with_retry`."""
    deadline = time.monotonic() + max_wait_s
    attempt = 0
    while True:
        try:
            return await fn()
        except grpc.RpcError as err:
            code = err.code() if hasattr(err, "code") else None
            if code not in RETRYABLE or time.monotonic() > deadline:
                raise
            if attempt == 0 or attempt % 10 == 0:
                logger.warning("%s: coordinator unavailable (%s); retrying", what, code)
            await asyncio.sleep(_backoff(attempt))
            attempt += 1
