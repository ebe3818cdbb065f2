"""Weight channel benchmark: what a sync moves over the network, whole versus delta, against the disk floor.

    python -m benchmarks.weights --json [--presets tiny qwen3-0.6b-L2] [--dtypes bfloat16 float32]
                                 [--versions 4] [--lr 1e-6] [--out DIR]

For each preset and publish dtype, a model of that shape (random init, in memory) is trained by AdamW at `--lr`
on random gradients (every weight gets an update of about `lr`, as a real RL step does; 1e-6 is the usual
learning rate of RL on a 0.6B model) and published `--versions` times with deltas (trainer.anchor_every = 10,
rlcommon/weight_store.py). `python -m trainer_svc.weight_server` serves the folder (its own process, on
localhost), and the sampler's fetcher (sampler_svc/weight_fetch.py) pulls:
- `whole`: the first version from nothing (what a joining sampler, or a run without deltas, moves per sync);
- `delta`: each later version from the one before (what a sync moves with deltas);
in bytes on the wire and seconds to fetch, verify (sha256 of every file) and rebuild (apply the delta). The
trainer's side: seconds to publish a version with its delta, and without (a second folder, same weights). The
floor: copying the weight file and hashing it once on this disk (what any channel that writes the file and
checks it must pay). Figures are medians over the versions; the machine is shared, so compare within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOKEN = "benchmark-weights-token"


def _model(preset: str, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    from rlcommon.models.presets import preset_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(preset_config(preset))
    return model.to(getattr(torch, dtype))


def _server(run_dir: Path) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "DLC_COORDINATOR__AUTH_TOKEN": TOKEN}
    proc = subprocess.Popen([sys.executable, "-m", "trainer_svc.weight_server", f"--run_dir={run_dir}",
                             "--weight_server.port=0"], cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        match = re.search(r"serving .* on (http://127\.0\.0\.1:\d+)", line)
        if match:
            return proc, match.group(1)
    raise RuntimeError("the weight server did not start")


def _floor(path: Path, scratch: Path) -> float:
    from rlcommon.weight_store import sha256_file

    started = time.perf_counter()
    shutil.copyfile(path, scratch)
    os.fsync(os.open(scratch, os.O_RDONLY))
    sha256_file(scratch)
    seconds = time.perf_counter() - started
    scratch.unlink()
    return seconds


def measure(preset: str, dtype: str, *, versions: int, lr: float, work: Path) -> dict:
    import torch

    from rlcommon.weight_store import publish_version, version_folder
    from sampler_svc.weight_fetch import WeightFetcher

    model = _model(preset, dtype)
    master = [p.detach().float().clone() for p in model.parameters()]  # float32 master weights, as the trainer keeps
    params = [torch.nn.Parameter(m) for m in master]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    run_dir = work / f"{preset}-{dtype}"
    publish_dir, plain_dir = run_dir / "weights", run_dir / "plain"
    publish_with, publish_without, sha = [], [], {}
    for version in range(1, versions + 1):
        if version > 1:
            for p, m in zip(params, master, strict=True):
                p.grad = torch.randn_like(m)
            optimizer.step()
            with torch.no_grad():
                for live, p in zip(model.parameters(), params, strict=True):
                    live.copy_(p.to(live.dtype))
        started = time.perf_counter()
        sha[version] = publish_version(model, publish_dir=publish_dir, weight_version=version, step=version,
                                       anchor_every=10).sha256
        publish_with.append(time.perf_counter() - started)
        started = time.perf_counter()
        publish_version(model, publish_dir=plain_dir, weight_version=version, step=version)
        publish_without.append(time.perf_counter() - started)
        shutil.rmtree(version_folder(plain_dir, version))
    weights = version_folder(publish_dir, 1) / "model.safetensors"
    proc, url = _server(run_dir)
    try:
        async def pull() -> tuple[dict, list[dict]]:
            fetcher = WeightFetcher(url, run_dir / "sampler", token=TOKEN, timeout_s=60)
            fetcher.start_fresh()
            try:
                first = await fetcher.fetch(1, sha[1], local_version=None)
                later = []
                for version in range(2, versions + 1):
                    later.append(await fetcher.fetch(version, sha[version], local_version=version - 1))
                    fetcher.forget_older(version)
                return first, later
            finally:
                await fetcher.close()

        whole, deltas = asyncio.run(pull())
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    floor = statistics.median(_floor(weights, run_dir / "floor.bin") for _ in range(3))
    median = statistics.median
    row = {
        "preset": preset, "dtype": dtype, "lr": lr, "versions": versions,
        "weights_bytes": weights.stat().st_size,
        "whole": {"bytes": whole.bytes_fetched, "fetch_s": round(whole.fetch_s, 4),
                  "verify_s": round(whole.verify_s, 4)},
        "delta": {"bytes": int(median(r.bytes_fetched for r in deltas)),
                  "fetch_s": round(median(r.fetch_s for r in deltas), 4),
                  "verify_s": round(median(r.verify_s for r in deltas), 4),
                  "rebuild_s": round(median(r.rebuild_s for r in deltas), 4)},
        "publish_s": {"with_delta": round(median(publish_with[1:]), 4),
                      "without": round(median(publish_without[1:]), 4)},
        "disk_floor_s": round(floor, 4),
    }
    row["delta"]["fraction_of_whole"] = round(row["delta"]["bytes"] / row["whole"]["bytes"], 5)
    total = {k: row[k]["fetch_s"] + row[k]["verify_s"] + row[k].get("rebuild_s", 0.0) for k in ("whole", "delta")}
    row["sync_s"] = {k: round(v, 4) for k, v in total.items()}
    row["sync_over_floor"] = {k: round(v / floor, 3) for k, v in total.items()}
    shutil.rmtree(run_dir, ignore_errors=True)
    return row


def table(rows: list[dict]) -> str:
    lines = ["| preset | dtype | weights MB | whole MB | delta MB (share) | sync s whole / delta | rebuild s | "
             "publish s with / without delta | disk floor s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['preset']} | {r['dtype']} | {r['weights_bytes'] / 1e6:.1f} | {r['whole']['bytes'] / 1e6:.1f} | "
            f"{r['delta']['bytes'] / 1e6:.2f} ({100 * r['delta']['fraction_of_whole']:.1f} %) | "
            f"{r['sync_s']['whole']:.2f} / {r['sync_s']['delta']:.2f} | {r['delta']['rebuild_s']:.2f} | "
            f"{r['publish_s']['with_delta']:.2f} / {r['publish_s']['without']:.2f} | {r['disk_floor_s']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.weights", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["tiny", "qwen3-0.6b-L2"])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    parser.add_argument("--versions", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--out", type=Path, help="also write weights.json there")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="dlc-weights-bench-") as work:
        for preset in args.presets:
            for dtype in args.dtypes:
                print(f"[weights] {preset} {dtype}: publishing {args.versions} versions, fetching ...",
                      file=sys.stderr, flush=True)
                rows.append(measure(preset, dtype, versions=args.versions, lr=args.lr, work=Path(work)))
                print(f"[weights] {preset} {dtype}: delta {100 * rows[-1]['delta']['fraction_of_whole']:.2f} % "
                      f"of whole", file=sys.stderr, flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "weights.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(json.dumps(rows, indent=2) if args.json else table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
