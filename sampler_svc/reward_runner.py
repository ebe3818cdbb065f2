"""Rewards off the sampler's event loop: `RewardRunner` scores responses in worker processes.

    runner = await RewardRunner(cfg.reward, kinds=[cfg.task.kind], metrics=sink).start()
    scored = await runner.score_many([ScoreRequest(kind, response, answer, extras, info), ...])  # one task's G
    total, components = await runner.score(kind, response, answer, extras, info)               # one response
    await runner.stop()

Each worker is `python -m sampler_svc.reward_runner`, a fresh interpreter that imports only the rewards and the
user's modules (not vLLM: starting one takes about 0.3 s here, and forking the sampler, which holds vLLM's
engine and its threads, is not safe). It runs `rlcommon.task.rewards.score_component` in its main thread (where
math-verify's SIGALRM timeouts work) for each (response, component) call of a request and answers one JSON line
per call, so a task's G responses cost one round trip. A call that raises, returns something that is not a
finite number, takes longer than `reward.timeout_s` (the worker is killed and replaced, and the calls after it
go to the new one) or kills its worker scores 0 for that component of that response: it is counted by kind
(`rlcommon.task.rewards.FAILURE_KINDS`; Prometheus `dlc_sampler_reward_failures_<kind>_total`, and the rollout's
`timings["reward_failures"]`), logged once per kind and component, and never reaches the sampler's loop.
A worker's stdout is the protocol: what the user's code prints goes to its stderr, the sampler's log.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from rlcommon.config import ConfigError, RewardComponent, RewardConfig
from rlcommon.task.rewards import (
    ResponseInfo,
    RewardFailure,
    components_for,
    load_user_function,
    score_component,
)

__all__ = ["RewardRunner", "ScoreRequest", "Scored"]

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0
"""Longest a worker may take to start (imports: the user's modules, math-verify's sympy)."""
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class ScoreRequest:
    kind: str
    """The task kind (its default reward when `reward.components` is empty)."""
    response: str
    answer: str
    extras: Mapping[str, str] = field(default_factory=dict)
    info: ResponseInfo = ResponseInfo()


@dataclass(frozen=True)
class Scored:
    total: float
    """Sum of weight x value over the components (a failed component counts 0)."""
    components: dict[str, float]
    """Each component's unweighted value by name (a failed one: 0 under its name)."""
    failures: tuple[tuple[str, str], ...] = ()
    """(component name, failure kind) of each component that failed on this response."""


class _Worker:
    """One worker process and its pipes."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def start(cls, init: dict[str, Any]) -> _Worker:
        env = dict(os.environ)  # this module's package importable wherever the sampler runs from
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "sampler_svc.reward_runner", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, limit=1 << 24, env=env,
        )
        worker = cls(proc)
        try:
            await worker.send(init)
            reply = await asyncio.wait_for(worker.receive(), START_TIMEOUT_S)
        except BaseException:
            await worker.kill()
            raise
        if reply is None or "error" in reply:
            await worker.kill()
            raise ConfigError(reply["error"] if reply else f"a reward worker exited at start (code {proc.returncode})")
        return worker

    async def send(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(message).encode() + b"\n")
        await self.proc.stdin.drain()

    async def receive(self) -> dict[str, Any] | None:
        """The next line the worker wrote, or None when it exited."""
        assert self.proc.stdout is not None
        line = await self.proc.stdout.readline()
        return json.loads(line) if line else None

    async def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        await self.proc.wait()

    async def reap(self, timeout_s: float = 5.0) -> int | None:
        """The exit code of a worker whose output ended (it exited, or is about to). Not `kill` first: killing
        an exited process makes subprocess reap it behind asyncio's child watcher (a warning, code 255)."""
        try:
            return await asyncio.wait_for(self.proc.wait(), timeout_s)
        except TimeoutError:
            await self.kill()
            return self.proc.returncode

    async def close(self, timeout_s: float = 2.0) -> None:
        """End of input: the worker exits; killed if it does not within `timeout_s` (a call still hanging)."""
        if self.proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                self.proc.stdin.close()
        try:
            await asyncio.wait_for(self.proc.wait(), timeout_s)
        except TimeoutError:
            await self.kill()


class RewardRunner:
    """Scores responses with `reward.components` in `reward.workers` worker processes (see the module)."""

    def __init__(self, cfg: RewardConfig, *, kinds: Sequence[str] = (), metrics: Any | None = None) -> None:
        self.cfg = cfg
        self.kinds = tuple(kinds)
        """Task kinds scored (their default components' modules are imported when the workers start)."""
        self.metrics = metrics
        self.failures: Counter[str] = Counter()
        """Failed calls by failure kind (FAILURE_KINDS)."""
        self.restarts = 0
        """Workers replaced after a hang or a crash."""
        self._logged: set[tuple[str, str]] = set()
        self._slots: asyncio.Queue[_Worker | None] = asyncio.Queue()
        self._workers: set[_Worker] = set()

    def _init_message(self) -> dict[str, Any]:
        return {"components": [c.model_dump(mode="json") for c in self.cfg.components], "kinds": list(self.kinds),
                "sys_path": list(sys.path)}

    async def start(self) -> RewardRunner:
        """Start the workers; ConfigError (naming it) when a user function cannot be imported there."""
        started = time.perf_counter()
        results = await asyncio.gather(*(_Worker.start(self._init_message()) for _ in range(self.cfg.workers)),
                                       return_exceptions=True)
        for result in results:
            if isinstance(result, _Worker):
                self._workers.add(result)
                self._slots.put_nowait(result)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.stop()
            raise errors[0]
        logger.info("%d reward worker(s) started in %.2f s (timeout %.1f s per call)", self.cfg.workers,
                    time.perf_counter() - started, self.cfg.timeout_s)
        return self

    async def stop(self) -> None:
        workers, self._workers = list(self._workers), set()
        await asyncio.gather(*(w.close() for w in workers), return_exceptions=True)

    # ------------------------------------------------------------------------------------------ scoring

    async def score(self, kind: str, response: str, answer: str, extras: Mapping[str, str],
                    info: ResponseInfo) -> tuple[float, dict[str, float]]:
        """One response's total and components (a failing component counts 0; never raises for it)."""
        (scored,) = await self.score_many([ScoreRequest(kind, response, answer, extras, info)])
        return scored.total, scored.components

    async def score_many(self, requests: Sequence[ScoreRequest]) -> list[Scored]:
        """Score every request (a task's G responses) in one round trip to one worker."""
        if not requests:
            return []
        components = [list(components_for(self.cfg.components, r.kind)) for r in requests]
        calls = [(i, c) for i, comps in enumerate(components) for c in range(len(comps))]
        results: dict[tuple[int, int], dict[str, float] | tuple[str, str]] = {}
        items = [{"kind": r.kind, "response": r.response, "answer": r.answer, "extras": dict(r.extras),
                  "info": asdict(r.info)} for r in requests]
        worker = await self._slots.get()
        finished = False
        try:
            while len(results) < len(calls):
                pending = [call for call in calls if call not in results]
                if worker is None:
                    try:
                        worker = await _Worker.start(self._init_message())
                        self._workers.add(worker)
                    except (ConfigError, OSError, TimeoutError) as err:
                        for call in pending:  # no worker: this request's calls fail, the next one tries again
                            results[call] = ("crashed", f"no reward worker: {err}")
                        break
                worker = await self._run_calls(worker, items, pending, results)
            finished = True
        finally:
            if not finished and worker is not None:  # cancelled mid-request: its answers would reach the next one
                self._workers.discard(worker)
                with contextlib.suppress(ProcessLookupError):
                    worker.proc.kill()
                worker = None
            self._slots.put_nowait(worker)
        return [self._scored(i, comps, results) for i, comps in enumerate(components)]

    async def _run_calls(self, worker: _Worker, items: list[dict[str, Any]], calls: list[tuple[int, int]],
                         results: dict[tuple[int, int], Any]) -> _Worker | None:
        """Send `calls` to `worker` and read their answers into `results`; returns the worker, or None after it
        was killed (a call that hung) or died (the calls after that one are left for the next worker)."""
        try:
            await worker.send({"items": items, "calls": calls})
        except (BrokenPipeError, ConnectionResetError):
            await self._drop(worker, exited=True)
            results[calls[0]] = ("crashed", f"the reward worker exited (code {worker.proc.returncode})")
            return None
        for call in calls:
            try:
                reply = await asyncio.wait_for(worker.receive(), self.cfg.timeout_s)
            except TimeoutError:
                results[call] = ("timeout", f"no value within reward.timeout_s = {self.cfg.timeout_s:g} s")
                await self._drop(worker)
                return None
            if reply is None:
                await self._drop(worker, exited=True)
                results[call] = ("crashed", f"the reward worker exited (code {worker.proc.returncode})")
                return None
            results[call] = reply["v"] if "v" in reply else (reply["fail"], reply["msg"])
        return worker

    async def _drop(self, worker: _Worker, *, exited: bool = False) -> None:
        """Replace `worker` (the next call starts a new one): killed after a hang, reaped after it exited."""
        self._workers.discard(worker)
        self.restarts += 1
        await (worker.reap() if exited else worker.kill())
        if self.metrics is not None:
            self.metrics.gauge("reward_worker_restarts_total", self.restarts)

    def _scored(self, index: int, components: list[RewardComponent],
                results: Mapping[tuple[int, int], Any]) -> Scored:
        total, values, failures = 0.0, {}, []
        for c, component in enumerate(components):
            result = results[(index, c)]
            if isinstance(result, dict):
                total += component.weight * sum(result.values())
                values.update(result)
                continue
            kind, message = result
            values[component.name] = 0.0
            failures.append((component.name, kind))
            self._count_failure(component.name, kind, message)
        return Scored(total=total, components=values, failures=tuple(failures))

    def _count_failure(self, name: str, kind: str, message: str) -> None:
        self.failures[kind] += 1
        if self.metrics is not None:
            self.metrics.gauge(f"reward_failures_{kind}_total", self.failures[kind])
        if (name, kind) not in self._logged:
            self._logged.add((name, kind))
            logger.warning("reward component %r failed (%s): %s; scored 0 (logged once per kind of failure and "
                           "component; counted in dlc_sampler_reward_failures_%s_total)", name, kind, message, kind)


# ---------------------------------------------------------------------------------------------- the worker


def _worker_main() -> None:
    """The worker process: an init line (components, task kinds, sys.path), then requests of calls."""
    import signal

    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # the user's prints go to stderr (the sampler's log), not into the protocol
    sys.stdout = sys.stderr
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C stops the sampler, which stops this
    with contextlib.suppress(OSError, AttributeError):  # the sampler died: so does this worker (Linux)
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    stdin = sys.stdin.buffer
    init = json.loads(stdin.readline() or "{}")
    sys.path[:0] = [p for p in init.get("sys_path", []) if p not in sys.path]
    try:
        configured = [RewardComponent.model_validate(c) for c in init.get("components", [])]
        functions = _load(configured, init.get("kinds", []))
    except Exception as err:
        protocol.write(json.dumps({"error": str(err)}) + "\n")
        return
    protocol.write(json.dumps({"ready": True, "pid": os.getpid()}) + "\n")
    for line in stdin:
        request = json.loads(line)
        items = request["items"]
        for index, c in request["calls"]:
            item = items[index]
            component = components_for(configured, item["kind"])[c]
            protocol.write(json.dumps(_call(component, functions.get(component.name), item)) + "\n")


def _load(configured: list[RewardComponent], kinds: Sequence[str]) -> dict[str, Any]:
    """Import every user function (ConfigError naming one that cannot be) and what the built-ins in use need."""
    components = configured or [c for kind in kinds for c in components_for((), kind)]
    if any(c.name == "math_verify" for c in components):
        import math_verify  # noqa: F401 - sympy's import: 0.4 s before the first call, not inside its timeout
    return {c.name: load_user_function(c.name) for c in configured if ":" in c.name}


def _call(component: RewardComponent, fn: Any, item: dict[str, Any]) -> dict[str, Any]:
    try:
        values = score_component(component, item["response"], item["answer"], item["extras"],
                                 ResponseInfo(**item["info"]), fn=fn)
        return {"v": values}
    except RewardFailure as err:
        return {"fail": err.kind, "msg": str(err)}
    except BaseException as err:  # noqa: BLE001 - whatever the user's function raises (SystemExit too) scores 0
        return {"fail": "raised", "msg": f"{type(err).__name__}: {err}"[:500]}

if __name__ == "__main__":
    _worker_main()
