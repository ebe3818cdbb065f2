"""The one stack configuration of the integration tests that run the whole stack (LocalStack / `run`)."""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlcommon.config import RunConfig, load_config
from tests.integration.conftest import REPO_ROOT


def stack_config(run_dir: Path, *, steps: int, run_id: str, overrides: Sequence[str] = ()) -> RunConfig:
    """configs/default.toml (what `make run` runs) with this test's run folder, run id and step count (the
    coordinator plans exactly `steps` batches), the shared model cache, then the test's own `overrides`."""
    return load_config(
        RunConfig,
        [REPO_ROOT / "configs/default.toml"],
        [
            f"--steps={steps}",
            f"--run_dir={run_dir}",
            f"--bus.run_id={run_id}",
            f"--coordinator.total_batches={steps}",
            f"--model.cache_dir={REPO_ROOT / '.cache/models'}",
            *overrides,
        ],
    )


def dlcctl_batches(stack: Any, limit: int = 1000) -> dict[str, Any]:
    """The coordinator's ledger as `dlcctl --json batches` prints it (what an operator sees)."""
    from coordinator.dlcctl import main as dlcctl_main

    out, err = io.StringIO(), io.StringIO()
    token = stack.cfg.coordinator.auth_token
    code = dlcctl_main(["--address", stack.address, *([f"--token={token}"] if token else []), "--json", "batches",
                        "--limit", str(limit)], out=out, err=err)
    assert code == 0, err.getvalue()
    return json.loads(out.getvalue())


def scrape(log_path: Path) -> str:
    """GET the Prometheus page of a service, whose port (picked free) the service logged at start-up; make run
    keeps every metrics server on 127.0.0.1, as it keeps the coordinator's gRPC."""
    import re
    import urllib.request

    match = re.search(r"prometheus metrics on (\S+):(\d+)/metrics", log_path.read_text())
    assert match, f"{log_path.name}: no metrics port logged"
    assert match.group(1) == "127.0.0.1", f"{log_path.name}: metrics bound to {match.group(1)}"
    with urllib.request.urlopen(f"http://127.0.0.1:{match.group(2)}/metrics", timeout=5) as reply:
        return reply.read().decode()
