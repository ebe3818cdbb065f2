"""The experiment's vLLM engines and how a run's weight versions reach them.

`EnginePool` keeps one `SamplerEngine` (the service's own engine) per precision and starts each once: an
engine start costs 30-60 s on CPU, a weight reload tens of milliseconds. Only one engine runs at a time
(the plan groups runs by precision), so the machine never holds two.

`WeightPublisher` writes a run's sampler versions with `rlcommon.weight_store.publish_version` (the
trainer service's format) and reloads the engine from them (`SamplerEngine.reload_weights`, verified).
In the `noisy` setting each published version carries Gaussian noise (`perturb_state_dict`) of the same
draw (seeded by the run's seed), scaled to each tensor's current RMS: a systematic discrepancy, like a
quantization error, rather than a fresh random one at each sync. The trainer keeps the clean weights of the
version, so the noise is a pure numerical discrepancy.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor, nn

from rlcommon.config import SamplerConfig, SamplingConfig
from rlcommon.weight_store import publish_version
from sampler_svc.engine import SamplerEngine

__all__ = ["EnginePool", "WeightPublisher", "perturb_state_dict"]

logger = logging.getLogger(__name__)


class EnginePool:
    """One running vLLM engine at a time, started on first use per dtype and reused across runs."""

    def __init__(self, *, model_dir: Path, sampler: SamplerConfig, sampling: SamplingConfig) -> None:
        self.model_dir = model_dir
        self.sampler = sampler
        self.sampling = sampling
        self._engine: SamplerEngine | None = None
        self._dtype: str | None = None
        self.start_seconds: dict[str, float] = {}
        """Wall time of each engine start, by dtype."""

    async def get(self, dtype: str) -> SamplerEngine:
        """The engine of `dtype` (stops the running engine of another dtype first)."""
        if self._engine is not None and self._dtype == dtype:
            return self._engine
        await self.close()
        started = time.perf_counter()
        engine = SamplerEngine(
            model_dir=self.model_dir,
            sampler=self.sampler.model_copy(update={"dtype": dtype}),
            sampling=self.sampling,
        )
        await engine.start()
        self._engine, self._dtype = engine, dtype
        self.start_seconds[dtype] = self.start_seconds.get(dtype, 0.0) + time.perf_counter() - started
        logger.info("vLLM %s engine started in %.1f s", dtype, time.perf_counter() - started)
        return engine

    async def close(self) -> None:
        engine, self._engine, self._dtype = self._engine, None, None
        if engine is not None:
            await engine.stop()


def perturb_state_dict(state: Mapping[str, Tensor], *, sigma: float, seed: int) -> dict[str, Tensor]:
    """Copy of `state` with N(0, (sigma * rms(tensor))^2) noise added to every floating-point tensor.

    Relative to each tensor's root-mean-square value, so norms (all ones) and projections get noise of the
    same relative size. Deterministic for a seed (the noise is drawn on CPU in float32, in key order).
    """
    if sigma < 0:
        raise ValueError(f"sigma must be >= 0, got {sigma}")
    generator = torch.Generator().manual_seed(seed)
    noisy = {}
    for name in sorted(state):
        tensor = state[name]
        if not tensor.is_floating_point() or sigma == 0:
            noisy[name] = tensor.detach().clone()
            continue
        rms = tensor.detach().float().pow(2).mean().sqrt()
        noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32) * (sigma * rms.cpu())
        noisy[name] = (tensor.detach().float() + noise.to(tensor.device)).to(tensor.dtype)
    return noisy


class WeightPublisher:
    """Publishes one run's sampler versions under `root` and loads them into the engine."""

    def __init__(
        self,
        *,
        root: Path,
        source_dir: Path,
        scratch_model: nn.Module,
        clean_initial_dir: Path,
        noise_sigma: float = 0.0,
        noise_seed: int = 0,
    ) -> None:
        self.root = root
        self.source_dir = source_dir
        self.scratch_model = scratch_model
        """A model of the same architecture into which noisy weights are loaded before publishing."""
        self.clean_initial_dir = clean_initial_dir
        """The initial weights published once as version 0 (shared by every clean run)."""
        self.noise_sigma = noise_sigma
        self.noise_seed = noise_seed
        self.publish_seconds = 0.0
        self.reload_seconds = 0.0
        self._served: Path | None = None

    def publish(self, model: nn.Module, *, weight_version: int, step: int) -> Path:
        """Write version `weight_version` of the sampler (the model's weights, plus the run's noise draw)."""
        started = time.perf_counter()
        if weight_version == 0 and self.noise_sigma == 0:
            return self.clean_initial_dir
        source = model
        if self.noise_sigma > 0:
            noisy = perturb_state_dict(model.state_dict(), sigma=self.noise_sigma, seed=self.noise_seed)
            self.scratch_model.load_state_dict(noisy)
            source = self.scratch_model
        published = publish_version(
            source,
            publish_dir=self.root,
            weight_version=weight_version,
            step=step,
            source_dir=self.source_dir,
        )
        self.publish_seconds += time.perf_counter() - started
        return Path(published.path)

    async def sync(self, engine: SamplerEngine, model: nn.Module, *, weight_version: int, step: int) -> None:
        """Publish version `weight_version` and make the engine serve it."""
        folder = self.publish(model, weight_version=weight_version, step=step)
        started = time.perf_counter()
        await engine.reload_weights(folder, weight_version=weight_version)
        self.reload_seconds += time.perf_counter() - started
        previous, self._served = self._served, folder
        if previous is not None and previous != folder and previous.parent == self.root:
            shutil.rmtree(previous, ignore_errors=True)  # the engine holds newer weights now

    def cleanup(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
