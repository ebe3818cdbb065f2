"""How the sampler starts vLLM's engine-core process (sampler_svc/engine_process.py): the start method and
torch.compile switched for the child only, the parent left as it was, and a forked child that no longer
signals its parent's event loop. (That the sampler service really forks its engine core, and serves, is
checked on a real run in tests/integration/test_end_to_end.py.)"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sampler_svc import engine_process
from sampler_svc.engine_process import DYNAMO_DISABLE_ENV, START_METHOD_ENV, engine_core_start

REPO = Path(__file__).resolve().parents[2]


def test_the_variables_vllm_reads_are_set_in_the_block_and_restored_after(monkeypatch):
    monkeypatch.setenv(START_METHOD_ENV, "spawn")  # what vLLM's CPU platform leaves
    monkeypatch.delenv(DYNAMO_DISABLE_ENV, raising=False)
    with engine_core_start("fork", without_compile=True):
        assert os.environ[START_METHOD_ENV] == "fork"
        assert os.environ[DYNAMO_DISABLE_ENV] == "1"
    assert os.environ[START_METHOD_ENV] == "spawn" and DYNAMO_DISABLE_ENV not in os.environ
    with engine_core_start(None):
        assert os.environ[START_METHOD_ENV] == "spawn"
    with pytest.raises(ValueError, match="'fork' or 'spawn'"):
        with engine_core_start("forkserver"):  # type: ignore[arg-type]
            pass


def _report_dynamo(conn) -> None:
    import torch._dynamo

    conn.send(torch._dynamo.config.disable)
    conn.close()


def test_a_child_forked_without_compile_has_torch_compile_off_and_the_parent_keeps_it():
    import torch._dynamo

    assert not torch._dynamo.config.disable
    context = multiprocessing.get_context("fork")
    for without_compile in (True, False):
        parent_end, child_end = context.Pipe()
        with engine_core_start("fork", without_compile=without_compile):
            child = context.Process(target=_report_dynamo, args=(child_end,))
            child.start()
        assert parent_end.recv() is without_compile
        child.join(timeout=60)
        assert child.exitcode == 0
    assert not torch._dynamo.config.disable
    assert not engine_process._child_without_compile


def test_a_forked_child_caught_signal_does_not_reach_the_parents_event_loop(tmp_path):
    """asyncio's signal handling writes each caught signal to a wakeup fd that a fork copies. Without
    `forget_parent_signals`, a SIGTERM to the engine-core process (vLLM's shutdown sends one) is delivered to
    the sampler's loop as its own. The parent's loop sees SIGUSR1 (sent after the child is gone) only after any
    byte the child wrote, so its handler running first proves the child wrote none."""
    script = textwrap.dedent("""
        import asyncio, multiprocessing, os, signal, sys
        from sampler_svc.engine_process import engine_core_start

        def child():
            os.kill(os.getpid(), signal.SIGTERM)  # the inherited Python-level handler catches it

        async def main():
            loop = asyncio.get_running_loop()
            seen, done = [], asyncio.Event()
            loop.add_signal_handler(signal.SIGTERM, lambda: seen.append("SIGTERM"))
            loop.add_signal_handler(signal.SIGUSR1, lambda: (seen.append("SIGUSR1"), done.set()))
            context = multiprocessing.get_context("fork")
            with engine_core_start("fork"):
                process = context.Process(target=child)
                process.start()
            await loop.run_in_executor(None, process.join)
            os.kill(os.getpid(), signal.SIGUSR1)
            await asyncio.wait_for(done.wait(), 60)
            print("seen", seen)

        asyncio.run(main())
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    assert "seen ['SIGUSR1']" in done.stdout, done.stdout
