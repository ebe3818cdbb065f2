"""Local launcher (`make run`): the whole stack on this machine, with the same entrypoints and the same
`DLC_*` settings as docker compose.

    python -m launcher [--config configs/default.toml] [--steps N] [--run-dir DIR | --fresh] [--a.b VALUE ...]

Builds the model if missing, starts its own redis-server (unless `redis.url` is set), then the
coordinator, `num_samplers` samplers and the trainer as processes, each logging to `<run_dir>/logs/`.
Shows a progress bar until the trainer has trained `steps` batches, then writes `summary.json` and the
plots, and stops everything. Ctrl-C stops every service; starting again with the same `--run-dir` resumes
the run (Redis's append-only file, the coordinator's state, the trainer's checkpoint); a finished one is refused
before anything starts (`run_folder`: `--fresh` picks a new folder).

A service that crashes is restarted as docker compose's `restart:` would (`RESTART_POLICY`, from
docker-compose.yml): a sampler or the trainer on a non-zero exit (or a signal), the coordinator on any
exit (it waits for SERVING again), each at most `max_restarts` times, after a short backoff; the embedded
redis-server as the coordinator (on the same port, append-only file and users: the services reconnect); a
line in the progress output says which one, its exit code and where its log is. A service left stopped (past
the bound, or one that exits 0 before the trainer has trained every step) stops the rest, saying which one
and where its log is. Every child dies with the launcher, however it dies; one launcher per run folder.

Modules: `cli` (the command line; a bad config or a finished run refused before the heavy imports), `processes` (one service as a process; compose's restart rule), `stack` (`LocalStack`, the whole
stack, which the integration tests drive too), `lifecycle` (children that die with the launcher; the run
folder's lock), `run` (the run loop, progress, summary.json), `run_folder` (a finished run refused, `--fresh`),
`plots`.
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
"""The checkout this launcher runs from (configs/default.toml, the services' modules)."""
IMAGE_CONFIGS = Path("/configs")
"""Where the images keep the shipped configs (docker/Dockerfile.gpu; compose mounts the checkout's over them)."""


def default_config() -> Path:
    """configs/default.toml of the checkout, else of the image (the launcher installed as a package)."""
    in_checkout = REPO / "configs" / "default.toml"
    in_image = IMAGE_CONFIGS / "default.toml"
    return in_checkout if in_checkout.is_file() or not in_image.is_file() else in_image
