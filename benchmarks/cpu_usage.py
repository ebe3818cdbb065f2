"""CPU seconds per service of a running stack: what bounds its speed when every service shares a few cores.

`CpuMonitor` samples, every `interval_s`, the user + system CPU seconds of every process below this one
(the launcher's services and their children: vLLM's engine-core process counts as its sampler's) and labels
each by the service it belongs to. `cpu_between(t0, t1)` gives each service's CPU seconds in a wall-clock
window (linear interpolation between samples). A stack doing W CPU-seconds of work per step on C cores cannot
run faster than C / W steps per second, however well its stages overlap.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from collections import defaultdict

import psutil

__all__ = ["CpuMonitor", "service_of"]

SERVICES = {"coordinator": "coordinator", "sampler_svc": "sampler", "trainer_svc": "trainer",
            "redis-server": "redis"}
"""A word of a process's command line -> the service it runs."""


def service_of(cmdline: list[str]) -> str | None:
    """The service a command line runs (`python -m sampler_svc ...` -> "sampler"), or None. redis-server
    rewrites its title: its command line is one string, "/path/redis-server 127.0.0.1:6379"."""
    for word in (part for arg in cmdline for part in arg.split()):
        name = os.path.basename(word)
        if name in SERVICES:
            return SERVICES[name]
    return None


class CpuMonitor:
    """Background sampler of the CPU seconds of this process's descendants, by service."""

    def __init__(self, interval_s: float = 0.1) -> None:
        self.interval_s = interval_s
        self.times: list[float] = []
        self.totals: list[dict[str, float]] = []
        self._labels: dict[int, str] = {}
        self._seconds: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cpu-monitor", daemon=True)

    def __enter__(self) -> CpuMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _label(self, process: psutil.Process) -> str:
        """The service of `process` or of its nearest ancestor that runs one; "other" for none."""
        if process.pid not in self._labels:
            label = None
            with_ancestors = [process, *process.parents()]
            for p in with_ancestors:
                try:
                    label = service_of(p.cmdline())
                except psutil.Error:
                    continue
                if label is not None:
                    break
            self._labels[process.pid] = label or "other"
        return self._labels[process.pid]

    def sample(self) -> None:
        for process in psutil.Process().children(recursive=True):
            try:
                cpu = process.cpu_times()
                self._label(process)  # labeled while it runs (its ancestors are readable)
            except psutil.Error:  # exited meanwhile: its last reading stays counted
                continue
            self._seconds[process.pid] = cpu.user + cpu.system
        totals: dict[str, float] = defaultdict(float)
        for pid, seconds in self._seconds.items():
            totals[self._labels[pid]] += seconds
        self.times.append(time.time())
        self.totals.append(dict(totals))

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def _at(self, t: float) -> dict[str, float]:
        i = bisect.bisect_left(self.times, t)
        if i == 0 or i == len(self.times):
            raise ValueError(f"time {t:.2f} is outside the sampled window "
                             f"({self.times[0] if self.times else 'none'}..{self.times[-1] if self.times else ''})")
        t0, t1 = self.times[i - 1], self.times[i]
        a, b = self.totals[i - 1], self.totals[i]
        share = (t - t0) / (t1 - t0) if t1 > t0 else 1.0
        return {k: a.get(k, 0.0) + share * (b.get(k, 0.0) - a.get(k, 0.0)) for k in set(a) | set(b)}

    def cpu_between(self, t0: float, t1: float) -> dict[str, float]:
        """CPU seconds each service used between wall-clock times t0 < t1."""
        start, end = self._at(t0), self._at(t1)
        return {k: max(end.get(k, 0.0) - start.get(k, 0.0), 0.0) for k in sorted(set(start) | set(end))}
