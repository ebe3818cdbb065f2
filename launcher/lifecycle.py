"""What ties the local stack's processes to the launcher's life: children that die with it, and one launcher
per run folder.

- `spawn` starts a child that the kernel sends a signal when the launcher dies, whatever kills it (Linux
  `PR_SET_PDEATHSIG`, set by `setpriv --pdeathsig` before it execs the command, else between fork and exec, so
  it covers redis-server as well as the Python services).
  The signal follows the *thread* that forked, so every child is forked by one thread that lives as long as
  the launcher. The Python services also watch their parent themselves (`rlcommon.entrypoint.watch_parent`).
- `RunDirLock`: an exclusive `flock` on `<run_dir>/launcher.lock`, held while the launcher runs. The kernel
  drops it when the process dies, however it dies, so a lock left by a killed launcher never blocks the next;
  a second launcher on a folder in use is refused with the holder's pid, host and start time.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

_PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None
_spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="launcher-spawn")
"""The one thread that forks every child (a child's PDEATHSIG fires when the thread that forked it ends)."""


_SETPRIV = shutil.which("setpriv")
"""util-linux's setpriv: sets PDEATHSIG and execs the command, so Popen needs no preexec_fn. A preexec_fn makes
Python fork and run code in the child, including the at-fork handlers of gRPC (which the launcher has loaded):
seen to break the child (epoll errors) and fail a redis-server start now and then."""


def spawn(argv: list[str], *, death_signal: int = signal.SIGTERM, **popen_kwargs: Any) -> subprocess.Popen:
    """`subprocess.Popen(argv, **popen_kwargs)` for a child that gets `death_signal` when this process dies."""
    if _SETPRIV is not None and sys.platform == "linux":
        name = signal.Signals(death_signal).name.removeprefix("SIG")
        wrapped = [_SETPRIV, "--pdeathsig", name, "--", *argv]
        return _spawner.submit(subprocess.Popen, wrapped, **popen_kwargs).result()
    parent = os.getpid()

    def die_with_parent() -> None:  # in the child, between fork and exec: no allocation-heavy work here
        if _prctl is not None:
            _prctl(_PR_SET_PDEATHSIG, death_signal, 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before the prctl took effect
            os._exit(1)

    return _spawner.submit(subprocess.Popen, argv, preexec_fn=die_with_parent, **popen_kwargs).result()


class RunDirInUseError(RuntimeError):
    """Another live launcher holds the run folder."""


class RunDirLock:
    """`<run_dir>/launcher.lock`, flock-ed exclusively from `acquire` to `release` (or this process's death)."""

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.path = Path(run_dir).resolve() / "launcher.lock"
        self._fd: int | None = None

    def acquire(self) -> RunDirLock:
        """Take the lock and write who holds it; RunDirInUseError naming the holder when another process has it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 4096).decode(errors="replace")
            os.close(fd)
            raise RunDirInUseError(
                f"run folder {self.path.parent} is in use by another launcher ({describe_holder(holder)}; lock "
                f"{self.path}): stop that one first, or pick another --run-dir"
            ) from None
        holder = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": time.strftime("%Y-%m-%d %H:%M:%S %z"), "argv": sys.argv}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Drop the lock (the file stays: deleting it would race with a launcher opening it)."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def describe_holder(text: str) -> str:
    """`pid 123 on host h, started 2026-12-02 08:27:34 +0000` from the lock file's JSON (or what it holds)."""
    try:
        holder = json.loads(text)
        return f"pid {holder['pid']} on host {holder['host']}, started {holder['started']}"
    except (ValueError, KeyError, TypeError):
        return f"holder not recorded yet: {text.strip()!r}" if text.strip() else "holder not recorded yet"
