"""Resharding: a checkpoint written by a trainer sharded over 2 gloo ranks (FSDP2, trainer.parallel.dp_shard = 2)
resumes in one process and on 4 ranks (DCP reshards on load: trainer_svc/checkpoint.py). The ranks run
tests/unit/reshard_worker.py; for a tied and an untied model:

(a) what the checkpoint holds comes back bit for bit on 1 and on 4 ranks: the whole weights, the AdamW moments
    and step counts, the kept snapshots; and the rest of the state too: the step counter, the DC-GRPO multiplier,
    the weight version, the kept versions, their publish steps, the live version, and the RNG states (every rank
    takes rank 0's: the checkpoint holds one set, written by rank 0);
(b) the next batch trained from the checkpoint gives the same step on 1, 2 and 4 ranks: the gradients AdamW
    applies agree within float32 reordering (F32_GRAD_RTOL), and the weights and moments after AdamW within the
    bound that gradient tolerance implies through AdamW's update, plus float32 rounding (`adamw_weight_bound`).
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.trainer_ranks import GLOO_ABORT, aborted_in_cpp
from tests.unit.test_step import F32_GRAD_RTOL

pytestmark = pytest.mark.slow  # three runs of ranks first (about 25 s here)

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests/unit/reshard_worker.py"
WRITER_RANKS = 2
RESUMED_ON = (1, 4)
EPS32 = 2.0**-23
MODELS = ("tied", "untied")


def run_worker(ranks: int, mode: str, out: Path) -> None:
    """reshard_worker.py on `ranks` gloo ranks under torchrun, or in one plain process (no process group, as the
    service runs with dp_shard = 1). One more try only after a rank's C++ abort with no Python error
    (`benchmarks.trainer_ranks.aborted_in_cpp`); a save's folder is emptied before it."""
    if ranks == 1:
        cmd = [sys.executable, str(WORKER), mode, str(out)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               str(WORKER), mode, str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0 and aborted_in_cpp(proc.stderr, WORKER.name):
        print(f"a rank aborted in C++ ({GLOO_ABORT!r}) without a Python error: running the ranks again")
        if mode == "save":
            shutil.rmtree(out, ignore_errors=True)
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]


@pytest.fixture(scope="module")
def resharded(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reshard")
    run_worker(WRITER_RANKS, "save", out)
    for ranks in RESUMED_ON:
        run_worker(ranks, "load", out)
    return out


def load(path: Path) -> dict:
    return torch.load(path, weights_only=False)


def test_the_checkpoint_is_written_by_two_ranks_and_resumed_sharded_over_four(resharded):
    for model in MODELS:
        saved = json.loads((resharded / model / "saved.json").read_text())
        assert saved["world"] == WRITER_RANKS and saved["tied"] == (model == "tied")
        assert len(list(Path(saved["path"]).glob("*.distcp"))) == WRITER_RANKS  # one tensor file per writing rank
        four = json.loads((resharded / model / "loaded-4.json").read_text())
        assert four["meta"]["ranks"] == WRITER_RANKS
        assert four["sharded_params"] == (13 if model == "tied" else 14)  # every parameter a DTensor, tied once
        assert sum(four["local_numel"]) == four["full_numel"] and len(four["local_numel"]) == 4
        assert four["local_numel"] == [four["full_numel"] // 4] * 4  # dim 0 of every tensor divides by 4 here
        one = json.loads((resharded / model / "loaded-1.json").read_text())
        assert one["sharded_params"] == 0 and one["local_numel"] == [one["full_numel"]]


@pytest.mark.parametrize("ranks", RESUMED_ON)
@pytest.mark.parametrize("model", MODELS)
def test_weights_adamw_state_and_snapshots_load_bit_for_bit(resharded, model, ranks):
    want = load(resharded / model / "want.pt")
    got = load(resharded / model / f"loaded-{ranks}.pt")
    assert set(got) == set(want) == {"model", "optimizer", "snapshots"}
    assert {k.split(".", 1)[0] for k in want["snapshots"]} == {"0", "1"}  # two kept versions crossed the checkpoint
    for part, tensors in want.items():
        assert sorted(got[part]) == sorted(tensors), part
        for name, tensor in tensors.items():
            assert got[part][name].dtype == tensor.dtype and torch.equal(got[part][name], tensor), f"{part} {name}"


@pytest.mark.parametrize("ranks", RESUMED_ON)
@pytest.mark.parametrize("model", MODELS)
def test_step_multiplier_versions_and_rng_resume(resharded, model, ranks):
    from tests.unit.reshard_worker import CONFIG, TRAINED

    saved = json.loads((resharded / model / "saved.json").read_text())
    got = json.loads((resharded / model / f"loaded-{ranks}.json").read_text())
    assert saved["step"] == TRAINED and saved["versions"] == [0, 1] and saved["weight_version"] == 1
    assert saved["lambda"] != CONFIG.correction.dual_lambda_init  # the multiplier moved: its resume means something
    for key in ("step", "lambda", "weight_version", "versions", "live_version", "published_step", "tied"):
        assert got[key] == saved[key], key
    assert got["meta"]["next_batch_id"] == TRAINED  # the service's extra_state
    # The RNG draws that followed the write on rank 0 follow the load on every rank.
    assert len(got["draws"]) == ranks and all(draws == saved["draws"] for draws in got["draws"])


def adamw_weight_bound(w: torch.Tensor, m0: torch.Tensor, v0: torch.Tensor, g: torch.Tensor, delta: float,
                       *, step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> torch.Tensor:
    """How far apart, per entry, two float32 AdamW steps from the same weights `w` and moments `m0`, `v0` (step
    count `step` after the update) may end when their gradients differ by at most `delta` around `g`.

    The update is u(x) = s m(x) / D(x), with m = b1 m0 + (1-b1) x, v = b2 v0 + (1-b2) x^2, s = lr / (1-b1^t),
    D = sqrt(v / c2) + eps, c2 = 1-b2^t; its slope u' = s ((1-b1) / D - m D' / D^2), D' = (1-b2) x / (sqrt(c2)
    sqrt(v)), where |x| / sqrt(v) <= 1 / sqrt(1-b2) (v >= (1-b2) x^2). Over |x - g| <= delta, with the extremes of
    |m|, |x| and v taken separately, |u(g') - u(g)| <= sup|u'| delta.

    Float32 rounding (half an ulp, eps32 / 2 relative, per operation, in each of the two runs): m's lerp rounds
    g - m0, its product and the sum (eps32 (1-b1)(|g| + |m0|) + eps32 |m| / 2 on m, scaled by s / D); v's two
    roundings, the sqrt, the division by sqrt(c2), the eps add, and addcdiv's product and quotient: at most
    6 eps32 |u| more; the weight's own sum eps32 |w| / 2 (and decoupled weight decay's product, the same factor in
    both runs, eps32 |w| / 2 more)."""
    b1, b2 = betas
    w, m0, v0, g = (t.double() for t in (w, m0, v0, g))
    c1, c2 = 1 - b1**step, 1 - b2**step
    s = lr / c1
    x_hi = g.abs() + delta
    x_lo = (g.abs() - delta).clamp(min=0)
    v_lo = b2 * v0 + (1 - b2) * x_lo**2
    m_hi = b1 * m0.abs() + (1 - b1) * x_hi
    d_lo = (v_lo / c2).sqrt() + eps
    x_over_sqrt_v = torch.minimum(x_hi / v_lo.sqrt(), torch.full_like(v_lo, 1 / math.sqrt(1 - b2)))  # inf/nan -> cap
    x_over_sqrt_v = torch.where(v_lo > 0, x_over_sqrt_v, torch.full_like(v_lo, 1 / math.sqrt(1 - b2)))
    d_slope = (1 - b2) / math.sqrt(c2) * x_over_sqrt_v
    slope = s * ((1 - b1) / d_lo + m_hi * d_slope / d_lo**2)
    m = b1 * m0 + (1 - b1) * g
    d = ((b2 * v0 + (1 - b2) * g**2) / c2).sqrt() + eps
    u = s * m / d
    m_rounding = EPS32 * (1 - b1) * (g.abs() + m0.abs()) + EPS32 / 2 * m.abs()
    per_run = s * m_rounding / d_lo + 6 * EPS32 * u.abs() + (1 if weight_decay else 0.5) * EPS32 * w.abs()
    rounding = 2 * per_run
    return slope * delta + rounding


@pytest.mark.parametrize("ranks", RESUMED_ON)
@pytest.mark.parametrize("model", MODELS)
def test_the_next_step_from_the_checkpoint_is_the_same_on_one_two_and_four_ranks(resharded, model, ranks):
    """The step the writer's 2 ranks took after the checkpoint, taken again from the checkpoint on `ranks`: the sum
    order of the gradients' reduction differs with the rank count (one process: none; 2 and 4 ranks: FSDP2's
    average of `loss * world`), nothing else."""
    from tests.unit.reshard_worker import TRAINED

    before = load(resharded / model / "want.pt")  # the checkpoint: the state both steps start from
    want = load(resharded / model / f"next-{WRITER_RANKS}.pt")
    got = load(resharded / model / f"next-{ranks}.pt")
    assert want["step"] == got["step"] == TRAINED + 1
    hyper = want["adamw"]
    assert got["adamw"] == hyper and hyper["amsgrad"] is False and not hyper["maximize"]
    assert sorted(got["grads"]) == sorted(want["grads"]) == sorted(want["model"])
    worst = {}
    for name, g in want["grads"].items():
        scale = float(g.abs().max())
        assert scale > 0, name
        delta = F32_GRAD_RTOL * scale
        torch.testing.assert_close(got["grads"][name], g, rtol=0, atol=delta, msg=f"gradient {name}")
        step = int(before["optimizer"][f"{name}.step"]) + 1
        m0, v0 = before["optimizer"][f"{name}.exp_avg"], before["optimizer"][f"{name}.exp_avg_sq"]
        assert torch.equal(got["optimizer"][f"{name}.step"], want["optimizer"][f"{name}.step"]), name
        assert float(want["optimizer"][f"{name}.step"]) == step, name
        bound = adamw_weight_bound(before["model"][name], m0, v0, g, delta, step=step, lr=hyper["lr"],
                                   betas=hyper["betas"], eps=hyper["eps"], weight_decay=hyper["weight_decay"])
        diff = (got["model"][name].double() - want["model"][name].double()).abs()
        assert bool((diff <= bound).all()), f"weights {name}: {int((diff > bound).sum())} entries off"
        worst[name] = float((diff / bound).max())
        # The moments: m moves by (1-b1) delta at most, v by (1-b2)(2|g| + delta) delta; plus their roundings in
        # each run (lerp: g - m0, its product, the sum; v: b2 v0, g g (1-b2), the sum: eps32 / 2 each).
        b1, b2 = hyper["betas"]
        m1, v1 = want["optimizer"][f"{name}.exp_avg"].double(), want["optimizer"][f"{name}.exp_avg_sq"].double()
        gd = g.double().abs()
        m_bound = (1 - b1) * delta + 2 * (EPS32 * (1 - b1) * (gd + m0.double().abs()) + EPS32 / 2 * m1.abs())
        v_bound = (1 - b2) * (2 * gd + delta) * delta + 3 * EPS32 * v1.abs()
        assert bool(((got["optimizer"][f"{name}.exp_avg"].double() - m1).abs() <= m_bound).all()), f"exp_avg {name}"
        assert bool(((got["optimizer"][f"{name}.exp_avg_sq"].double() - v1).abs() <= v_bound).all()), \
            f"exp_avg_sq {name}"
    assert got["metrics"].keys() == want["metrics"].keys()
    for key, value in want["metrics"].items():
        assert got["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-6, nan_ok=True), key
    print(f"{model} on {ranks} rank(s): weights' worst difference / bound {max(worst.values()):.2e}")
