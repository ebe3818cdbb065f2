"""Peak memory and time of the trainer's LM head + log-softmax + gather, whole vs chunked, forward + backward.

    python -m benchmarks.logprobs_memory --json [--vocab 151936] [--hidden 256] [--tokens 2048] [--topk 20]

`whole` is what autograd does on the [N, V] log-softmax (logits and log-probs kept for the backward);
`chunked` is `trainer_svc.logprobs.chunked_head_logprobs` (the trainer's path). Each variant runs in its own
fresh process (so that peak RSS is its own), in turn, `--repeats` times; reported: the peak RSS above the
process's baseline (inputs allocated), the median wall time, and the ratios chunked / whole from the same
run. The values and gradients of the two are compared (max abs difference).
Vocabulary 151936 is Qwen3's; the hidden width only scales the matmuls, not the vocabulary-sized memory.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import statistics
import sys
import time
from typing import Any

import torch

from trainer_svc.logprobs import chunked_head_logprobs


def _whole(hidden, weight, bias, ids, temperature, chunk_tokens):
    del chunk_tokens
    logits = torch.nn.functional.linear(hidden, weight, bias).float() / temperature[:, None]
    return torch.log_softmax(logits, dim=-1).gather(1, ids)


def _chunked(hidden, weight, bias, ids, temperature, chunk_tokens):
    return chunked_head_logprobs(hidden, weight, bias, ids, temperature, chunk_tokens=chunk_tokens)


VARIANTS = {"whole": _whole, "chunked": _chunked}


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _measure(variant: str, settings: dict[str, Any], queue: mp.Queue) -> None:
    torch.set_num_threads(settings["threads"])
    gen = torch.Generator().manual_seed(0)
    n, h, v, k = settings["tokens"], settings["hidden"], settings["vocab"], settings["topk"]
    hidden = torch.randn(n, h, generator=gen).requires_grad_(True)
    weight = (0.02 * torch.randn(v, h, generator=gen)).requires_grad_(True)
    ids = torch.randint(0, v, (n, k + 1), generator=gen)
    temperature = torch.full((n,), 0.9)
    upstream = torch.randn(n, k + 1, generator=gen)
    baseline = _peak_rss_mb()
    started = time.perf_counter()
    out = VARIANTS[variant](hidden, weight, None, ids, temperature, settings["chunk_tokens"])
    (out * upstream).sum().backward()
    wall = time.perf_counter() - started
    queue.put({
        "peak_mb": _peak_rss_mb() - baseline,
        "wall_s": wall,
        "out": out.detach()[:64].numpy().copy(),  # numpy: torch tensors would go through shared memory
        "grad_hidden": hidden.grad[:64].numpy().copy(),
        "grad_weight_norm": float(weight.grad.norm()),
    })


def _run_one(variant: str, settings: dict[str, Any]) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_measure, args=(variant, settings, queue))
    proc.start()
    result = queue.get(timeout=1800)
    proc.join()
    return result


def run(settings: dict[str, Any]) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in VARIANTS}
    for repeat in range(settings["repeats"]):
        for name in VARIANTS:
            runs[name].append(_run_one(name, settings))
            print(f"[{repeat + 1}/{settings['repeats']}] {name}: peak +{runs[name][-1]['peak_mb']:.0f} MB, "
                  f"{runs[name][-1]['wall_s']:.2f} s", file=sys.stderr, flush=True)
    whole, chunked = runs["whole"][0], runs["chunked"][0]
    summary = {name: {"peak_mb": round(max(r["peak_mb"] for r in rs), 1),
                      "wall_s": round(statistics.median(r["wall_s"] for r in rs), 3)} for name, rs in runs.items()}
    logits_mb = settings["tokens"] * settings["vocab"] * 4 / 1e6
    chunk = settings["chunk_tokens"] or max(1, (1 << 26) // settings["vocab"])
    return {
        **{k: settings[k] for k in ("vocab", "hidden", "tokens", "topk", "repeats", "threads")},
        "chunk_tokens": chunk,
        "logits_mb": round(logits_mb, 1),
        **summary,
        "memory_ratio": round(summary["chunked"]["peak_mb"] / summary["whole"]["peak_mb"], 3),
        "time_ratio": round(summary["chunked"]["wall_s"] / summary["whole"]["wall_s"], 3),
        "max_abs_diff_logprobs": float(abs(whole["out"] - chunked["out"]).max()),
        "max_abs_diff_grad_hidden": float(abs(whole["grad_hidden"] - chunked["grad_hidden"]).max()),
        "grad_weight_norm_rel_diff": abs(whole["grad_weight_norm"] - chunked["grad_weight_norm"])
        / max(whole["grad_weight_norm"], 1e-30),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--vocab", type=int, default=151_936, help="vocabulary size (Qwen3: 151936)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden width (scales the matmuls only)")
    parser.add_argument("--tokens", type=int, default=2048, help="response positions (B x T)")
    parser.add_argument("--topk", type=int, default=20, help="K transmitted top-K ids per position")
    parser.add_argument("--chunk-tokens", type=int, default=None, help="positions per chunk (default: 256 MiB of logits)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    args = parser.parse_args(argv)
    settings = dict(vocab=args.vocab, hidden=args.hidden, tokens=args.tokens, topk=args.topk,
                    chunk_tokens=args.chunk_tokens, repeats=args.repeats, threads=args.threads)
    result = run(settings)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"LM head + log-softmax + gather, fwd+bwd: {result['tokens']} positions x vocab {result['vocab']} "
              f"(logits {result['logits_mb']} MB), chunks of {result['chunk_tokens']}")
        for name in VARIANTS:
            print(f"  {name:8s} peak +{result[name]['peak_mb']} MB, {result[name]['wall_s']} s")
        print(f"  chunked/whole: memory {result['memory_ratio']}, time {result['time_ratio']}; max |diff| "
              f"logprobs {result['max_abs_diff_logprobs']:.2e}, grad {result['max_abs_diff_grad_hidden']:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
