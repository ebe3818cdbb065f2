"""How the sampler starts vLLM's engine-core process on CPU: forked from the sampler, not spawned.

`AsyncLLM` always runs its engine core in a process of its own, and vLLM's CPU platform sets
`VLLM_WORKER_MULTIPROC_METHOD=spawn` when it checks the engine's config (vllm/platforms/cpu.py). A spawned
process starts a fresh interpreter that imports vLLM again: 13-16 s of this machine's CPU on the critical
path of `make run`'s first step, after the 15 s the sampler already spent importing it. A forked one starts
with vLLM, torch and the config already in memory.

Fork is safe only in a process that has run no OpenMP parallel region yet: torch's CPU build uses GNU
libgomp, whose thread pool does not survive a fork, and a forked child then hangs in its first parallel
region (checked: one 512 x 512 matmul on 2 threads in the parent before the fork, and the engine core hung
in its start-up). The sampler service starts its engine before anything else (it has loaded only the
tokenizer), so it forks (`sampler.cpu_engine_start = "fork"`, the default); `SamplerEngine` used as a
library (tests, benchmarks: processes that may have run torch) spawns unless told otherwise.

An eager engine on CPU also runs without torch.compile in its engine-core process (`TORCHDYNAMO_DISABLE`):
vLLM compiles a few helpers even when `enforce_eager` is set (`batched_count_greater_than`, the rank of each
sampled token among the logprobs) with inductor, which generates and builds C++ on their first call: 2-3 s
of the first batch here, and dynamo's guards on every later call (the engine core's CPU per batch fell from
about 0.7-1.1 s to 0.4 s with it off, side by side under the same load).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from typing import Literal

from rlcommon.environ import scoped_environ

__all__ = ["EngineStart", "engine_core_start", "forget_parent_signals"]

EngineStart = Literal["fork", "spawn"]
START_METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"
DYNAMO_DISABLE_ENV = "TORCHDYNAMO_DISABLE"

_registered = False
_register_lock = threading.Lock()
_child_without_compile = False
"""Set while `engine_core_start(..., without_compile=True)` forks: the child turns torch.compile off."""


def forget_parent_signals() -> None:
    """In a forked child: stop writing caught signals to the parent's asyncio wakeup fd.

    `signal.set_wakeup_fd` is process state that a fork copies, with the socket it names: without this, a
    SIGTERM to the engine-core process (vLLM's own shutdown sends one) would reach the sampler's event loop
    as if the sampler itself had been signalled."""
    if threading.current_thread() is threading.main_thread():
        with contextlib.suppress(ValueError, OSError):
            signal.set_wakeup_fd(-1)


def _after_fork_in_child() -> None:
    forget_parent_signals()
    if _child_without_compile:
        import torch._dynamo  # imported already with vLLM; its config read the environment then

        torch._dynamo.config.disable = True


def _register_at_fork() -> None:
    global _registered
    with _register_lock:
        if not _registered:
            os.register_at_fork(after_in_child=_after_fork_in_child)
            _registered = True


@contextlib.contextmanager
def engine_core_start(method: EngineStart | None, *, without_compile: bool = False) -> Iterator[None]:
    """Within the block vLLM starts its processes with `method` (None: as vLLM decides), and, with
    `without_compile`, those processes run with torch.compile off; this process is left as it was (the
    variables are restored after the block, torch's own configuration is untouched here)."""
    global _child_without_compile
    if method not in (None, "fork", "spawn"):
        raise ValueError(f"engine start method must be 'fork' or 'spawn', got {method!r}")
    values = {START_METHOD_ENV: method} if method is not None else {}
    if without_compile:
        values[DYNAMO_DISABLE_ENV] = "1"  # read by a spawned process's torch when it imports
    _register_at_fork()  # a forked child (vLLM's default start on GPU too) forgets the parent's signals
    with _register_lock:
        _child_without_compile = without_compile
    try:
        with scoped_environ(values):
            yield
    finally:
        with _register_lock:
            _child_without_compile = False
