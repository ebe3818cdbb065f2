"""The starting model as the coordinator vouches for it (GetStartingModel): `model.name_or_path` resolved from the
coordinator's own storage and its manifest hashed (rlcommon/model_manifest.py), once, in a thread of its own.

A sampler that fetches the model from the weight server checks the server's manifest against this digest before it
downloads a byte (sampler_svc/weight_fetch.py): the weight server is then trusted for nothing but bandwidth.
Hashing reads every byte of the model (seconds per GB), so it runs in the background: until it is done the answer
is `NotReady` (the RPC's UNAVAILABLE, which callers retry); a model the coordinator cannot read is `ModelUnreadable`
with the reason, for good (FAILED_PRECONDITION).

A preset the coordinator cannot build (its image has no torch; a read-only cache) is waited for: the trainer builds
it into the shared cache (rlcommon/models/builder.py, under a file lock), and the coordinator finds it there.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rlcommon.model_manifest import manifest_digest, model_manifest

__all__ = ["ModelDigest", "ModelUnreadable", "NotReady", "StartingModel"]

logger = logging.getLogger("coordinator")

WAIT_S = 2.0
"""How often a model another service must build is looked for again."""


def cannot_build_here(err: BaseException) -> bool:
    """A resolve that failed because this process may not build the model, which another service does: no torch in
    the coordinator's image, or a cache it may not write."""
    return isinstance(err, ImportError) or (isinstance(err, OSError) and err.errno in (errno.EROFS, errno.EACCES))


@dataclass(frozen=True)
class ModelDigest:
    name_or_path: str
    manifest_sha256: str
    num_files: int
    num_bytes: int


class NotReady(Exception):
    """Still hashing: ask again."""


class ModelUnreadable(Exception):
    """The coordinator could not resolve or read the model (str(): why)."""


class StartingModel:
    """`digest()` of the model `resolve()` returns, computed once by the first `start()` (or `digest()`)."""

    def __init__(self, name_or_path: str, resolve: Callable[[], Path], *, wait_s: float = WAIT_S) -> None:
        self.name_or_path = name_or_path
        self._resolve = resolve
        self._wait_s = wait_s
        self._waiting_for = ""
        """Why the model is not there yet (a service that may build it has not yet), while it is waited for."""
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._digest: ModelDigest | None = None
        self._error: str | None = None

    @classmethod
    def from_config(cls, model_cfg, task_cfg) -> StartingModel:
        from rlcommon.models import resolve_model

        return cls(model_cfg.name_or_path, lambda: resolve_model(model_cfg, task_cfg))

    def start(self) -> None:
        """Start hashing in the background (once; later calls do nothing)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._hash, name="starting-model-hash", daemon=True)
                self._thread.start()

    def digest(self) -> ModelDigest:
        """The digest; NotReady while it is computed (this starts it), ModelUnreadable when it cannot be."""
        self.start()
        if self._error is not None:
            raise ModelUnreadable(self._error)
        if self._digest is None:
            raise NotReady(f"the coordinator is still hashing the starting model {self.name_or_path!r}"
                           + (f" (waiting for it: {self._waiting_for})" if self._waiting_for else "") + ": ask again")
        return self._digest

    def wait(self, timeout_s: float) -> None:
        """Block until the hash is done or failed (tests)."""
        self.start()
        assert self._thread is not None
        self._thread.join(timeout_s)

    def _hash(self) -> None:
        started = time.monotonic()
        try:
            folder = self._resolved()
            manifest = model_manifest(folder)
        except Exception as err:  # noqa: BLE001 - any failure is the answer, logged and kept
            self._error = (f"the coordinator cannot read the starting model {self.name_or_path!r} to vouch for it: "
                           f"{type(err).__name__}: {err}")
            logger.error("%s", self._error)
            return
        num_bytes = sum(manifest["sizes"].values())
        self._digest = ModelDigest(self.name_or_path, manifest_digest(manifest), len(manifest["files"]), num_bytes)
        self._waiting_for = ""
        logger.info("starting model %s (%s): %d files, %.2f GB, manifest sha256 %s (hashed in %.1f s)",
                    self.name_or_path, folder, len(manifest["files"]), num_bytes / 1e9, self._digest.manifest_sha256,
                    time.monotonic() - started)

    def _resolved(self) -> Path:
        waited = 0.0
        while True:
            try:
                return self._resolve()
            except Exception as err:  # noqa: BLE001 - sorted below
                if not cannot_build_here(err):
                    raise
                self._waiting_for = (f"this coordinator may not build it ({type(err).__name__}: {err}); another "
                                     "service (the trainer) builds it into the shared model cache")
                if waited % 60 < self._wait_s:
                    logger.info("starting model %s: %s (%.0f s so far)", self.name_or_path, self._waiting_for, waited)
            time.sleep(self._wait_s)
            waited += self._wait_s
