"""Integration fixtures: the tiny model folder and ONE real vLLM CPU engine per test session.

The engine lives on a dedicated event-loop thread (`EngineRunner`): tests call `runner.run(coro)`,
which runs the coroutine on that loop and waits for it. vLLM's AsyncLLM is created on that loop and shut
down (with its engine-core process) at the end of the session, whatever the tests did.

`DLC_TEST_MODEL_DIR=/path/to/folder` replaces the built tiny model (any Qwen3 folder vLLM can serve).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rlcommon.config import ModelConfig, SamplerConfig, SamplingConfig, TaskConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
ENGINE_TIMEOUT_S = 300.0
"""Longest a single engine call (start included) may take before the test fails."""


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The default run's tiny model (built once and cached under <repo>/.cache/models)."""
    override = os.environ.get("DLC_TEST_MODEL_DIR")
    if override:
        return Path(override).resolve()
    from rlcommon.models import resolve_model

    return resolve_model(ModelConfig(cache_dir=str(REPO_ROOT / ".cache" / "models")), TaskConfig())


class EngineRunner:
    """An asyncio loop on its own thread, running a `SamplerEngine`'s coroutines for synchronous tests."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="vllm-engine-loop", daemon=True)
        self._thread.start()
        self.engine: Any = None
        self.version_dirs: dict[int, Path] = {}
        """Folder of every weight version the engine has served, for trainer-side checks."""

    def run(self, coro: Any, timeout: float = ENGINE_TIMEOUT_S) -> Any:
        """Run `coro` on the engine's loop and return its result (re-raising its exception)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        try:
            if self.engine is not None:
                self.run(self.engine.stop(), timeout=60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
            if not self._thread.is_alive():
                self.loop.close()


SAMPLER_ENGINE_CONFIG = (
    SamplerConfig(dtype="float32", gpu_memory_utilization=0.3, kv_cache_gib=1.0, max_model_len=256, seed=0),
    SamplingConfig(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=16, logprobs_topk=20),
)
"""The session engine's settings: float32, temperature 1, top-p 1 (the trainer-match setting)."""


@pytest.fixture(scope="session")
def sampler_engine(tiny_model_dir: Path) -> Iterator[EngineRunner]:
    """One vLLM CPU engine (float32) for the whole session, on the tiny model; shut down at the end."""
    from sampler_svc.engine import SamplerEngine

    sampler_cfg, sampling_cfg = SAMPLER_ENGINE_CONFIG
    runner = EngineRunner()
    try:
        runner.engine = SamplerEngine(model_dir=tiny_model_dir, sampler=sampler_cfg, sampling=sampling_cfg)
        with pytest.MonkeyPatch.context() as patch:
            # Read when vLLM spawns its engine-core process: leave a core to the test process.
            patch.setenv("VLLM_CPU_OMP_THREADS_BIND", os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"))
            patch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
            runner.run(runner.engine.start())
        runner.version_dirs[runner.engine.weight_version] = tiny_model_dir
        yield runner
    finally:
        runner.close()
