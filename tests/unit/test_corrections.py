"""trainer_svc.corrections: every method's loss and gradient against scalar references computed by hand,
finite differences (gradcheck, float64), ESS, centering, the log-ratio decomposition, the DC-GRPO
multiplier and inputs a broken sampler could send."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer_svc.corrections import (
    METHODS,
    CorrectionConfig,
    CorrectionState,
    centering_term,
    decompose_log_ratio,
    dual_update,
    ess,
    ess_se,
    policy_loss,
)

CONFIG = CorrectionConfig()
C, EPS, LO, HI, TAU = CONFIG.clip, CONFIG.ppo_eps, CONFIG.mis_low, CONFIG.mis_high, CONFIG.m2po_tau

# Two rollouts x three tokens, the last token of row 1 is padding (with garbage values). Log-ratios
# l - lmu: 0.4 (rho 1.49: PPO-clipped), -0.1, 0.9 (rho 2.46 > C and > mis_high), -0.8 (rho 0.45 < mis_low
# and PPO-clipped with A < 0), 0.05; M2PO keeps only the two smallest squares.
LOGP = [[-0.5, -1.2, -0.2], [-1.0, -0.9, -3.0]]
LOGP_VERSION = [[-0.6, -1.0, -0.5], [-1.1, -0.5, -2.0]]
LOGP_SAMPLER = [[-0.9, -1.1, -1.1], [-0.2, -0.95, 5.0]]
MASK = [[1, 1, 1], [1, 1, 0]]
ADV = [1.0, -0.5]
CENTER = [[-0.3, -0.7, -0.1], [-0.6, -0.4, 9.0]]


def tensors(requires_grad: bool = True):
    f64 = dict(dtype=torch.float64)
    return dict(
        logp=torch.tensor(LOGP, **f64, requires_grad=requires_grad),
        logp_version=torch.tensor(LOGP_VERSION, **f64),
        logp_sampler=torch.tensor(LOGP_SAMPLER, **f64),
        advantages=torch.tensor(ADV, **f64),
        mask=torch.tensor(MASK, dtype=torch.bool),
        centering=torch.tensor(CENTER, **f64, requires_grad=requires_grad),
    )


def clip(value: float, low: float, high: float) -> float:
    return min(max(value, low), high)


def ppo_token(ratio: float, adv: float) -> tuple[float, float]:
    """(-min(r A, clip(r) A), d/dl) with r = exp(l - .), so dr/dl = r."""
    unclipped, clipped = ratio * adv, clip(ratio, 1 - EPS, 1 + EPS) * adv
    if unclipped <= clipped:
        return -unclipped, -adv * ratio
    return -clipped, 0.0


def reference(method: str, lam: float = 0.0) -> tuple[float, list[list[float]], list[list[float]]]:
    """(loss, dL/dlogp, dL/dcentering) from scalar formulas of DESIGN section 4."""
    num_tokens = sum(map(sum, MASK))
    total = 0.0
    grad = [[0.0] * 3 for _ in range(2)]
    grad_center = [[0.0] * 3 for _ in range(2)]
    kept = set()
    if method == "m2po":
        squares = sorted(
            ((LOGP[b][t] - LOGP_SAMPLER[b][t]) ** 2, b, t) for b in range(2) for t in range(3) if MASK[b][t]
        )
        running = 0.0
        for k, (square, b, t) in enumerate(squares, start=1):
            running += square
            if running / k <= TAU:
                kept.add((b, t))
    for b in range(2):
        for t in range(3):
            if not MASK[b][t]:
                continue
            lp, lv, ls, adv, cen = LOGP[b][t], LOGP_VERSION[b][t], LOGP_SAMPLER[b][t], ADV[b], CENTER[b][t]
            rho = math.exp(lp - ls)
            if method == "naive":
                value, g, gc = -adv * lp, -adv, 0.0
            elif method in ("tis", "vcpo"):
                weight = min(rho, C)
                value, g, gc = -weight * adv * lp, -weight * adv, 0.0
            elif method == "mis":
                weight = rho if LO <= rho <= HI else 0.0
                value, g, gc = -weight * adv * lp, -weight * adv, 0.0
            elif method == "center":
                value, g, gc = -adv * (lp - cen), -adv, adv
            elif method == "dlc":
                weight = min(math.exp(lp - lv), C)
                value, g, gc = -weight * adv * (lp - cen), -weight * adv, weight * adv
            elif method == "ppo":
                (value, g), gc = ppo_token(rho, adv), 0.0
            elif method == "decoupled_ppo":  # pi_prox = pi_theta at the start of the step: r = 1
                behaviour = min(math.exp(lp - ls), C)
                value, g = ppo_token(1.0, adv)
                value, g, gc = behaviour * value, behaviour * g, 0.0
            elif method == "m2po":
                value, g = ((-rho * adv, -rho * adv) if (b, t) in kept else (0.0, 0.0))
                gc = 0.0
            elif method == "dual":
                delta = abs(math.exp(lp) - math.exp(ls))
                (value, g), gc = ppo_token(rho, adv - lam * delta), 0.0
            else:
                raise AssertionError(method)
            total += value
            grad[b][t] = g / num_tokens
            grad_center[b][t] = gc / num_tokens
    return total / num_tokens, grad, grad_center


@pytest.mark.parametrize("method", METHODS)
def test_loss_and_gradient_match_hand_computation(method):
    inputs = tensors()
    lam = 0.7
    loss, metrics = policy_loss(method, **inputs, config=CONFIG, state=CorrectionState(lam=lam))
    loss.backward()
    expected_loss, expected_grad, expected_grad_center = reference(method, lam=lam)
    assert loss.item() == pytest.approx(expected_loss, rel=1e-12, abs=1e-12)
    torch.testing.assert_close(inputs["logp"].grad, torch.tensor(expected_grad, dtype=torch.float64))
    center_grad = inputs["centering"].grad
    center_grad = torch.zeros(2, 3, dtype=torch.float64) if center_grad is None else center_grad
    torch.testing.assert_close(center_grad, torch.tensor(expected_grad_center, dtype=torch.float64))
    assert all(isinstance(v, float) for v in metrics.values())
    assert metrics["tokens"] == 5.0


def test_reference_exercises_every_branch():
    """The fixture's ratios reach clipping, MIS masking and M2PO dropping (else the tests above prove less)."""
    ratios = [math.exp(LOGP[b][t] - LOGP_SAMPLER[b][t]) for b in range(2) for t in range(3) if MASK[b][t]]
    assert any(r > C for r in ratios) and any(r < LO for r in ratios) and any(1 - EPS < r < 1 + EPS for r in ratios)
    _, grad, _ = reference("ppo")
    assert any(g == 0.0 for row in grad for g in row[:2])  # a clipped token
    _, grad, _ = reference("m2po")
    assert sum(g == 0.0 for row in grad for g in row) >= 2  # a dropped token besides padding


def test_m2po_drops_largest_squared_log_ratios_first():
    log_ratios = torch.tensor([[0.1, 0.5, -0.05, 0.3]], dtype=torch.float64)
    logp = torch.full((1, 4), -1.0, dtype=torch.float64, requires_grad=True)
    sampler = logp.detach() - log_ratios
    # squares 0.01 0.25 0.0025 0.09 -> prefix means 0.0025 0.00625 0.0342 0.0881: keep all but the 0.5 token
    loss, metrics = policy_loss(
        "m2po", logp=logp, logp_version=logp.detach(), logp_sampler=sampler,
        advantages=torch.tensor([1.0], dtype=torch.float64), mask=torch.ones(1, 4, dtype=torch.bool),
    )
    loss.backward()
    rho = log_ratios.exp()
    expected_grad = torch.where(torch.tensor([[True, False, True, True]]), -rho / 4, 0.0)
    torch.testing.assert_close(logp.grad, expected_grad)
    assert loss.item() == pytest.approx(float(-(rho[0, [0, 2, 3]]).sum() / 4))
    assert metrics["m2po_kept_frac"] == 0.75


# ------------------------------------------------------------------------------------- finite differences


def _shifted(method: str, x0: torch.Tensor, lam: float = 0.0):
    """L(x) with the stop-gradient quantities frozen at x0: version and sampler log-probs move with x.

    Shifting both by (x - x0) keeps every detached ratio (w, rho) constant, so finite differences see
    exactly the function whose gradient autograd computes.
    """
    base = tensors(requires_grad=False)

    def loss_of(x: torch.Tensor, centering: torch.Tensor) -> torch.Tensor:
        shift = x - x0
        kwargs = dict(base, logp=x, centering=centering)
        if method in ("tis", "vcpo", "mis", "dlc"):
            kwargs["logp_version"] = base["logp_version"] + shift
            kwargs["logp_sampler"] = base["logp_sampler"] + shift
        if method == "decoupled_ppo":  # explicit pi_prox frozen at x0; sampler fixed: pi_prox/mu constant
            kwargs["logp_prox"] = x0
        return policy_loss(method, **kwargs, config=CONFIG, state=CorrectionState(lam=lam))[0]

    return loss_of


@pytest.mark.parametrize("method", [m for m in METHODS if m != "dual"])
def test_gradient_matches_finite_differences(method):
    x0 = torch.tensor(LOGP, dtype=torch.float64)
    x = x0.clone().requires_grad_(True)
    centering = torch.tensor(CENTER, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(_shifted(method, x0), (x, centering), eps=1e-6, atol=1e-8)


def test_dual_gradient_is_ppo_gradient_with_penalized_advantages():
    """dual = ppo with A' = A - lam*delta (delta detached); ppo is checked against finite differences above."""
    lam = 0.7
    inputs = tensors()
    loss, metrics = policy_loss("dual", **inputs, config=CONFIG, state=CorrectionState(lam=lam))
    loss.backward()
    delta = (inputs["logp"].detach().exp() - inputs["logp_sampler"].exp()).abs()
    penalized = inputs["advantages"][:, None] - lam * delta
    x = inputs["logp"].detach().clone().requires_grad_(True)
    ppo_inputs = dict(tensors(requires_grad=False), logp=x, advantages=penalized)

    def ppo_loss(logp):
        return policy_loss("ppo", **dict(ppo_inputs, logp=logp), config=CONFIG)[0]

    assert torch.autograd.gradcheck(ppo_loss, (x,), eps=1e-6, atol=1e-8)
    ppo_loss(x).backward()
    torch.testing.assert_close(inputs["logp"].grad, x.grad)
    assert metrics["lambda"] == lam
    assert metrics["delta_mean"] == pytest.approx(float(delta[inputs["mask"]].mean()))


def test_centering_term_gradient_matches_finite_differences():
    gen = torch.Generator().manual_seed(0)
    logp_topk = torch.randn(2, 3, 4, dtype=torch.float64, generator=gen).requires_grad_(True)
    sampler = torch.randn(2, 3, 4, dtype=torch.float64, generator=gen)
    version = torch.randn(2, 3, 4, dtype=torch.float64, generator=gen)
    assert torch.autograd.gradcheck(lambda x: centering_term(x, sampler), (logp_topk,))
    assert torch.autograd.gradcheck(lambda x: centering_term(x, sampler, version), (logp_topk,))


# ------------------------------------------------------------------------------------------------- ESS


def test_ess_is_one_for_equal_weights():
    mask = torch.ones(3, 5, dtype=torch.bool)
    assert float(ess(torch.full((3, 5), -2.3), mask)) == pytest.approx(1.0, abs=1e-12)
    assert float(ess(torch.zeros(3, 5), mask)) == pytest.approx(1.0, abs=1e-12)


def test_ess_is_one_over_n_for_one_nonzero_weight():
    log_weights = torch.full((2, 4), -math.inf)
    log_weights[1, 2] = 0.7
    mask = torch.ones(2, 4, dtype=torch.bool)
    assert float(ess(log_weights, mask)) == pytest.approx(1 / 8, rel=1e-12)
    log_weights = torch.full((2, 4), -1e4)
    log_weights[0, 0] = 0.0
    assert float(ess(log_weights, mask)) == pytest.approx(1 / 8, rel=1e-12)


def test_ess_matches_direct_formula_and_ignores_masked_tokens():
    gen = torch.Generator().manual_seed(1)
    log_weights = torch.randn(4, 6, dtype=torch.float64, generator=gen)
    mask = torch.rand(4, 6, generator=gen) > 0.3
    w = log_weights.exp()[mask]
    direct = w.sum() ** 2 / (len(w) * (w**2).sum())
    assert float(ess(log_weights, mask)) == pytest.approx(float(direct), rel=1e-12)
    garbage = torch.where(mask, log_weights, torch.tensor(math.nan, dtype=torch.float64))
    assert float(ess(garbage, mask)) == pytest.approx(float(direct), rel=1e-12)


def test_ess_is_stable_for_huge_log_weights():
    log_weights = torch.tensor([[1000.0, 1000.0, 999.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    w = torch.tensor([1.0, 1.0, math.exp(-1)], dtype=torch.float64)
    assert float(ess(log_weights, mask)) == pytest.approx(float(w.sum() ** 2 / (3 * (w**2).sum())), rel=1e-6)


def test_ess_without_tokens_is_one():
    assert float(ess(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.bool))) == 1.0


def test_policy_loss_reports_ess_of_lag_and_full_ratio():
    inputs = tensors()
    _, metrics = policy_loss("naive", **inputs)
    mask = inputs["mask"]
    lag = (inputs["logp"].detach() - inputs["logp_version"]).exp()[mask]
    full = (inputs["logp"].detach() - inputs["logp_sampler"]).exp()[mask]
    assert metrics["ess_lag"] == pytest.approx(float(lag.sum() ** 2 / (5 * (lag**2).sum())), rel=1e-9)
    assert metrics["ess_full"] == pytest.approx(float(full.sum() ** 2 / (5 * (full**2).sum())), rel=1e-9)


# ------------------------------------------------------------------------------------------- centering


def test_centering_term_by_hand():
    logp_topk = torch.tensor([[[-0.5, -1.5, -2.0]]], dtype=torch.float64)
    sampler = torch.log(torch.tensor([[[0.5, 0.2, 0.1]]], dtype=torch.float64))  # mass 0.8 on the K ids
    version = torch.log(torch.tensor([[[0.3, 0.3, 0.3]]], dtype=torch.float64))
    mu = [0.5 / 0.8, 0.2 / 0.8, 0.1 / 0.8]
    plain = sum(m * lp for m, lp in zip(mu, [-0.5, -1.5, -2.0], strict=True))
    numerical = sum((m - 1 / 3) * lp for m, lp in zip(mu, [-0.5, -1.5, -2.0], strict=True))
    assert float(centering_term(logp_topk, sampler)) == pytest.approx(plain, rel=1e-12)
    assert float(centering_term(logp_topk, sampler, version)) == pytest.approx(numerical, rel=1e-12)


def _full_vocab_setup(lagged: bool):
    """Logits z (grad), sampled ids, a sampler with numerical discrepancy, top-K = the whole vocabulary."""
    gen = torch.Generator().manual_seed(3)
    batch, steps, vocab = 2, 3, 6
    logits = torch.randn(batch, steps, vocab, dtype=torch.float64, generator=gen).requires_grad_(True)
    full = torch.log_softmax(logits, -1)
    ids = torch.randint(0, vocab, (batch, steps, 1), generator=gen)
    sampler_full = torch.log_softmax(logits.detach() + 0.3 * torch.randn(batch, steps, vocab, generator=gen, dtype=torch.float64), -1)
    version_full = full.detach()
    if lagged:
        version_full = torch.log_softmax(logits.detach() + 0.5 * torch.randn(batch, steps, vocab, generator=gen, dtype=torch.float64), -1)
    return dict(
        logits=logits, full=full, logp=full.gather(2, ids).squeeze(2),
        logp_version=version_full.gather(2, ids).squeeze(2),
        logp_sampler=sampler_full.gather(2, ids).squeeze(2),
        sampler_full=sampler_full, version_full=version_full,
        advantages=torch.tensor([1.0, -0.7], dtype=torch.float64), mask=torch.ones(batch, steps, dtype=torch.bool),
    )


def test_dlc_without_lag_and_full_vocab_has_the_gradient_of_center():
    s = _full_vocab_setup(lagged=False)
    common = dict(logp=s["logp"], logp_version=s["logp_version"], logp_sampler=s["logp_sampler"],
                  advantages=s["advantages"], mask=s["mask"])
    center_loss, _ = policy_loss("center", **common, centering=centering_term(s["full"], s["sampler_full"]))
    (center_grad,) = torch.autograd.grad(center_loss, s["logits"], retain_graph=True)
    dlc_centering = centering_term(s["full"], s["sampler_full"], s["version_full"])
    dlc_loss, metrics = policy_loss("dlc", **common, centering=dlc_centering)
    (dlc_grad,) = torch.autograd.grad(dlc_loss, s["logits"])
    assert metrics["ess_lag"] == 1.0
    assert center_grad.abs().max() > 1e-3
    torch.testing.assert_close(dlc_grad, center_grad, rtol=1e-10, atol=1e-12)


def test_dlc_centering_is_zero_with_lag_but_no_numerical_discrepancy():
    s = _full_vocab_setup(lagged=True)
    # The sampler computes exactly what the trainer computes at the rollout's version: mu = pi_v.
    centering = centering_term(s["full"], s["version_full"], s["version_full"])
    assert torch.equal(centering, torch.zeros_like(centering))
    (grad,) = torch.autograd.grad(centering.sum(), s["logits"], allow_unused=True)
    assert grad is None or torch.equal(grad, torch.zeros_like(grad))
    # Truncated top-K too: both renormalized over the same ids.
    topk = s["version_full"][..., :3]
    assert torch.equal(centering_term(s["full"][..., :3], topk, topk), torch.zeros(2, 3, dtype=torch.float64))


# ------------------------------------------------------------------------------------ decomposition


def test_decomposition_sums_exactly_to_the_full_log_ratio():
    # Dyadic values: every difference is exact in floating point, so the identity holds bit for bit.
    gen = torch.Generator().manual_seed(4)
    logp, version, sampler = (-torch.randint(0, 4096, (8, 16), generator=gen).double() / 256 for _ in range(3))
    delta_num, delta_lag = decompose_log_ratio(logp=logp, logp_version=version, logp_sampler=sampler)
    assert torch.equal(delta_num + delta_lag, logp - sampler)
    assert torch.equal(delta_num, version - sampler) and torch.equal(delta_lag, logp - version)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(*(st.floats(-30, 0, allow_nan=False),) * 3), min_size=1, max_size=20))
def test_decomposition_sums_to_the_full_log_ratio(triples):
    logp, version, sampler = (torch.tensor(col, dtype=torch.float64)[None] for col in zip(*triples, strict=True))
    delta_num, delta_lag = decompose_log_ratio(logp=logp, logp_version=version, logp_sampler=sampler)
    torch.testing.assert_close(delta_num + delta_lag, logp - sampler, rtol=0, atol=1e-13)
    _, metrics = policy_loss("naive", logp=logp, logp_version=version, logp_sampler=sampler,
                             advantages=torch.ones(1, dtype=torch.float64), mask=torch.ones_like(logp, dtype=torch.bool))
    full_mean = float((logp - sampler).mean())
    assert metrics["delta_num_mean"] + metrics["delta_lag_mean"] == pytest.approx(full_mean, abs=1e-9)


# ---------------------------------------------------------------------------------------------- dual


def test_dual_multiplier_rises_above_tolerance_and_decays_to_zero_inside():
    tolerance, lr = 0.01, 0.5
    lam, history = 0.0, []
    for _ in range(10):
        lam = dual_update(lam, 0.05, tolerance, lr)
        history.append(lam)
    assert all(b > a for a, b in zip([0.0, *history], history, strict=False))
    assert lam == pytest.approx(10 * lr * 0.04)
    for _ in range(100):
        lam = dual_update(lam, 0.002, tolerance, lr)
        assert lam >= 0.0
    assert lam == 0.0
    assert dual_update(0.3, math.nan, tolerance, lr) == 0.3


def test_dual_multiplier_follows_policy_loss_delta():
    """Driving the update with policy_loss's own mean |p - p_inf|: large discrepancy raises, none decays."""
    state = CorrectionState(lam=0.0)
    inputs = tensors()
    for _ in range(3):
        _, metrics = policy_loss("dual", **inputs, config=CONFIG, state=state)
        assert metrics["delta_mean"] > CONFIG.dual_tolerance
        state = CorrectionState(lam=dual_update(state.lam, metrics["delta_mean"], CONFIG.dual_tolerance, CONFIG.dual_lr))
    assert state.lam > 0
    on_policy = dict(inputs, logp_sampler=inputs["logp"].detach(), logp_version=inputs["logp"].detach())
    for _ in range(200):
        _, metrics = policy_loss("dual", **on_policy, config=CONFIG, state=state)
        assert metrics["delta_mean"] == 0.0
        state = CorrectionState(lam=dual_update(state.lam, metrics["delta_mean"], CONFIG.dual_tolerance, CONFIG.dual_lr))
    assert state.lam == 0.0


def test_dual_penalty_lowers_the_advantage_of_discrepant_tokens():
    inputs = tensors()
    without, _ = policy_loss("dual", **inputs, state=CorrectionState(lam=0.0))
    with_penalty, _ = policy_loss("dual", **inputs, state=CorrectionState(lam=5.0))
    assert with_penalty.item() > without.item()


# ------------------------------------------------------------------------------------ robustness, API


EXTREMES = [-1e4, math.nan, math.inf, -math.inf, 1e4, 0.0, -1e-30]


@pytest.mark.parametrize("method", METHODS)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_extreme_inputs_never_give_nan(method, data):
    pick = st.sampled_from(EXTREMES) | st.floats(-50, 0)
    shape = (2, 3)

    def grid():
        return torch.tensor([[data.draw(pick) for _ in range(3)] for _ in range(2)], dtype=torch.float32)

    trainer_logp = torch.tensor([[data.draw(st.sampled_from([-1e4, -20.0, -1e-6]) | st.floats(-50, 0))
                                  for _ in range(3)] for _ in range(2)]).requires_grad_(True)
    mask = torch.tensor([[data.draw(st.booleans()) for _ in range(3)] for _ in range(2)])
    topk_logp = torch.log_softmax(torch.randn(2, 3, 4), -1).requires_grad_(True)
    sampler_topk = torch.tensor([[[data.draw(pick) for _ in range(4)] for _ in range(3)] for _ in range(2)])
    centering = centering_term(topk_logp, sampler_topk, grid()[..., None].expand(*shape, 4))
    loss, metrics = policy_loss(
        method, logp=trainer_logp, logp_version=grid(), logp_sampler=grid(),
        advantages=torch.tensor([data.draw(st.floats(-10, 10)), 1.0]), mask=mask, centering=centering,
        state=CorrectionState(lam=data.draw(st.floats(0, 100))),
    )
    assert torch.isfinite(loss)
    loss.backward()
    assert torch.isfinite(trainer_logp.grad).all()
    assert topk_logp.grad is None or torch.isfinite(topk_logp.grad).all()
    assert all(math.isfinite(v) for v in metrics.values()), metrics


def test_policy_loss_does_not_mutate_inputs_or_state():
    inputs = tensors()
    inputs["logp_sampler"][0, 0] = math.nan
    before = {k: v.detach().clone() for k, v in inputs.items()}
    state = CorrectionState(lam=0.25)
    for method in METHODS:
        policy_loss(method, **inputs, config=CONFIG, state=state)[0].backward()
    for name, value in inputs.items():
        assert torch.equal(value.detach(), before[name]) or torch.allclose(value.detach(), before[name], equal_nan=True), name
    assert state.lam == 0.25


def test_unknown_method_lists_the_valid_ones():
    with pytest.raises(ValueError, match="valid methods: naive, tis, mis"):
        policy_loss("grpo", **tensors())


def test_centered_methods_require_centering_and_shapes_are_checked():
    inputs = tensors()
    inputs["centering"] = None
    with pytest.raises(ValueError, match="needs `centering`"):
        policy_loss("dlc", **inputs)
    bad = dict(tensors(), logp_sampler=torch.zeros(2, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="logp_sampler shape"):
        policy_loss("naive", **bad)


def test_empty_mask_gives_zero_loss_with_gradient():
    inputs = dict(tensors(), mask=torch.zeros(2, 3, dtype=torch.bool))
    loss, metrics = policy_loss("dlc", **inputs)
    loss.backward()
    assert loss.item() == 0.0 and metrics["tokens"] == 0.0
    assert torch.equal(inputs["logp"].grad, torch.zeros(2, 3, dtype=torch.float64))


def test_ess_se_is_the_jackknife_spread_over_blocks_of_rows():
    """Equal weights: every block left out gives ESS 1, so no spread. One block of heavy rows: leaving it out
    moves the ESS a lot, and the jackknife says so; the formula is checked against a direct computation."""
    mask = torch.ones(16, 5)
    assert ess_se(torch.zeros(16, 5), mask) == 0.0
    log_w = torch.zeros(16, 5, dtype=torch.float64)
    log_w[:2] = 2.0  # the first of 8 blocks of 2 rows
    se = ess_se(log_w, mask)
    left_out = [float(ess(torch.cat([log_w[: 2 * b], log_w[2 * b + 2 :]]), torch.ones(14, 5))) for b in range(8)]
    mean = sum(left_out) / 8
    assert se == pytest.approx(math.sqrt(7 / 8 * sum((e - mean) ** 2 for e in left_out)), rel=1e-12)
    assert se > 0.1
    assert ess_se(log_w[:1], mask[:1]) == 0.0  # one row: no blocks to leave out
    assert ess_se(log_w[:3], mask[:3]) > 0.0  # fewer rows than blocks: one row per block
