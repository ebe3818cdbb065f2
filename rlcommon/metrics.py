"""One place for metrics: JSONL lines, TensorBoard scalars and Prometheus gauges.

Services call `sink.log(step, {...})` once per step (trainer) or `sink.gauge(name, value)` for live
values; nothing else in a service prints metrics.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_GAUGES: dict[str, Any] = {}  # one Prometheus gauge per full name per process (the registry is global)
_GAUGES_LOCK = threading.Lock()


def start_metrics_server(port: int | None, host: str) -> int | None:
    """Serve Prometheus metrics on `host`:`port` (0 = a free one); returns the bound port, None when off.
    `host` is the service's configured one (127.0.0.1 unless a container's network must reach it)."""
    if port is None:
        return None
    from prometheus_client import start_http_server

    server, _thread = start_http_server(port, addr=host)
    bound = server.server_address[1]
    logger.info("prometheus metrics on %s:%d/metrics", host, bound)
    return bound


def _prom_name(service: str, key: str) -> str:
    clean = "".join(ch if ch.isalnum() else "_" for ch in key)
    return f"dlc_{service}_{clean}"


class MetricsSink:
    """Writes per-step metrics to `<dir>/metrics.jsonl`, TensorBoard (optional), Prometheus gauges (unless
    `step_gauges` is off) and `trackers` (rlcommon/trackers.py: W&B, trackio), every one with the same keys."""

    def __init__(
        self,
        *,
        service: str,
        jsonl_path: str | Path | None = None,
        tensorboard_dir: str | Path | None = None,
        trackers: list[Any] | None = None,
        step_gauges: bool = True,
    ) -> None:
        self.service = service
        self._trackers = list(trackers or [])
        self._step_gauges = step_gauges
        self._tracker_failed: set[int] = set()
        self._gauges: dict[str, Any] = {}
        """name -> its Prometheus gauge (looked up once: a trainer row sets ~50 each step)."""
        self._jsonl = None
        if jsonl_path is not None:
            path = Path(jsonl_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._jsonl = path.open("a", buffering=1)
        self._tb = None
        if tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(tensorboard_dir))
            except ImportError as err:  # tensorboard is optional outside the trainer
                logger.warning("TensorBoard disabled: %s", err)

    def gauge(self, name: str, value: float, help_text: str = "") -> None:
        """Set a Prometheus gauge `dlc_<service>_<name>`."""
        g = self._gauges.get(name)
        if g is None:
            from prometheus_client import Gauge

            full = _prom_name(self.service, name)
            with _GAUGES_LOCK:
                g = _GAUGES.get(full)
                if g is None:
                    g = Gauge(full, help_text or name)
                    _GAUGES[full] = g
            self._gauges[name] = g
        g.set(value)

    def log(self, step: int, values: dict[str, Any]) -> None:
        """Record one step: a JSONL line with every value, TB scalars and gauges for the numeric ones.

        The step's TB scalars go in one event (a Summary of many values, as TensorFlow's merged summaries
        write them), not one event each: a trainer row has ~50 of them, and an event costs a protobuf, a
        CRC and a write apiece (about 2 ms of the tiny model's ~30 ms step)."""
        record = {**values, "step": step}
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record, default=_json_default) + "\n")
        scalars = []
        for key, value in values.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                continue
            scalars.append((key, float(value)))
            if self._step_gauges:
                self.gauge(key, float(value))
        if self._tb is not None and scalars:
            from tensorboard.compat.proto.summary_pb2 import Summary

            summary = Summary(value=[Summary.Value(tag=f"{self.service}/{key}", simple_value=value)
                                     for key, value in scalars])
            self._tb.file_writer.add_summary(summary, step)
        for index, tracker in enumerate(self._trackers):
            try:
                tracker.log(step, dict(scalars))
            except Exception as err:  # a tracker's outage must not stop training; metrics.jsonl has the row
                if index not in self._tracker_failed:
                    self._tracker_failed.add(index)
                    logger.warning("%s failed to log step %d (logged once; metrics.jsonl keeps every row): %s",
                                   type(tracker).__name__, step, err)

    def close(self) -> None:
        for tracker in self._trackers:
            try:
                tracker.close()
            except Exception as err:
                logger.warning("%s did not close cleanly: %s", type(tracker).__name__, err)
        self._trackers = []
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
            self._tb = None


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    if hasattr(obj, "tolist"):
        return obj.tolist()
    return str(obj)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Read a metrics.jsonl file, skipping a torn last line."""
    rows = []
    p = Path(path)
    if not p.exists():
        return rows
    for line in p.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


class RowWindow(Sequence[dict[str, Any]]):
    """The rows of a metrics.jsonl as a sequence whose length counts every row, but which holds only the
    last ones (`JsonlFollower(keep=...)`): indexing or slicing an older row raises IndexError."""

    def __init__(self, keep: int) -> None:
        self._rows: deque[dict[str, Any]] = deque(maxlen=keep)
        self._total = 0

    def append(self, row: dict[str, Any]) -> None:
        self._rows.append(row)
        self._total += 1

    @property
    def first_kept(self) -> int:
        return self._total - len(self._rows)

    def __len__(self) -> int:
        return self._total

    def __iter__(self):  # the kept rows
        return iter(self._rows)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            start, stop, step = index.indices(self._total)
            return [self[i] for i in range(start, stop, step)]
        if index < 0:
            index += self._total
        if not self.first_kept <= index < self._total:
            raise IndexError(f"row {index} is not kept (rows {self.first_kept}..{self._total - 1} are)")
        return self._rows[index - self.first_kept]


class JsonlFollower:
    """The rows of a growing metrics.jsonl, reading only what was appended since the last `rows()` call, and
    holding only the last `keep` of them (a day-long run's rows stay on disk, not in memory).

    A file replaced since (the trainer cuts it back to its checkpoint on resume: a new file under the same
    name), or shorter than what was read, is read again from its start. A torn last line waits for its end.
    """

    def __init__(self, path: str | Path, *, keep: int = 1000) -> None:
        self.path = Path(path)
        self.keep = keep
        self._rows = RowWindow(keep)
        self._identity: tuple[int, int] | None = None
        self._offset = 0

    def rows(self) -> RowWindow:
        """Every complete row so far (`len` counts them all; the last `keep` can be read). The same window,
        extended in place, unless the file was replaced."""
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return self._rows
        identity = (stat.st_dev, stat.st_ino)
        if identity != self._identity or stat.st_size < self._offset:
            self._identity, self._offset, self._rows = identity, 0, RowWindow(self.keep)
        if stat.st_size == self._offset:
            return self._rows
        with self.path.open("rb") as f:
            f.seek(self._offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # complete lines only
        for line in data[:end].splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                self._rows.append(row)
        self._offset += end
        return self._rows
