"""Policy-loss corrections for off-policy tokens: DLC, DC-GRPO (`dual`) and the baselines.

Pure tensor functions; DESIGN.md section 4 defines every symbol. Per response token t:

    logp          l_t     = log pi_theta(y_t|s_t)      trainer, current weights, carries grad
    logp_version  l^v_t   = log pi_theta_v(y_t|s_t)    trainer numerics at the weight version that sampled y_t
    logp_sampler  lmu_t   = log mu(y_t|s_t)            the sampler's processed log-prob
    delta_num = l^v - lmu (numerical discrepancy), delta_lag = l - l^v (policy lag)
    lag ratio w = exp(delta_lag), full ratio rho = exp(l - lmu)

Every log-ratio is formed in log space, non-finite values are replaced (NaN -> 0, +-inf -> +-clamp) and the
result clamped to +-`log_ratio_clamp` before `exp`, so nothing a sampler can send makes the loss NaN or
infinite. Masked positions are selected with `torch.where`, never multiplied, so garbage in padding cannot
leak. The loss is the token mean over the mask: L = (1/N) sum_t m_t * loss_t, N = sum_t m_t.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from rlcommon.config import METHODS, CorrectionConfig
from rlcommon.step_stats import (
    DELTA_LAG_MEAN,
    DELTA_LAG_STD,
    DELTA_MEAN,
    DELTA_NUM_MEAN,
    DELTA_NUM_STD,
    ESS_FULL,
    ESS_LAG,
    ESS_LAG_SE,
    M2PO_KEPT_FRAC,
    MIS_MASKED_FRAC,
    NONFINITE_INPUTS,
    PPO_CLIP_FRAC,
    RATIO_CLIP_FRAC,
)

__all__ = [
    "CENTERED_METHODS",
    "METHODS",
    "CorrectionConfig",
    "CorrectionState",
    "ess",
    "decompose_log_ratio",
    "centering_term",
    "policy_loss",
    "dual_update",
]

CENTERED_METHODS = ("center", "dlc")
"""Methods whose loss uses the centered score surrogate g_t = l_t - c_t (they need `centering`)."""
_ESS_LOG_BOUND = 1e6  # log-weights are bounded to +-this inside `ess` (keeps 2*logw finite in float64)


@dataclass
class CorrectionState:
    """State carried across steps by the corrections (only DC-GRPO has any)."""

    lam: float = 0.0
    """DC-GRPO Lagrange multiplier lambda (>= 0)."""


def ess(log_weights: Tensor, mask: Tensor) -> Tensor:
    """Normalized effective sample size (sum m w)^2 / (N sum m w^2) of w = exp(log_weights) over masked tokens.

    Computed in log space (float64): log ESS = 2 LSE(logw) - log N - LSE(2 logw). Returns a scalar in
    (0, 1]: 1 for equal weights, 1/N when one weight dominates; 1 when no token is masked. NaN log-weights
    count as zero weights.
    """
    if log_weights.shape != mask.shape:
        raise ValueError(f"ess: log_weights shape {tuple(log_weights.shape)} != mask shape {tuple(mask.shape)}")
    selected = mask.bool()
    num_tokens = selected.sum()
    if int(num_tokens) == 0:
        return torch.ones((), dtype=torch.float64, device=log_weights.device)
    log_w = torch.nan_to_num(
        log_weights.detach().double(), nan=-_ESS_LOG_BOUND, posinf=_ESS_LOG_BOUND, neginf=-_ESS_LOG_BOUND
    ).clamp(-_ESS_LOG_BOUND, _ESS_LOG_BOUND)
    log_w = log_w[selected]
    log_ess = 2 * torch.logsumexp(log_w, 0) - torch.log(num_tokens.double()) - torch.logsumexp(2 * log_w, 0)
    return torch.exp(log_ess).clamp(max=1.0)


ESS_SE_BLOCKS = 8
"""`ess_se` leaves out one of this many contiguous blocks of rows at a time (whole prompt groups when the rows
are grouped and their number is a multiple of 8 times the group size, as the trainer's batches are)."""


def ess_se(log_weights: Tensor, mask: Tensor, blocks: int = ESS_SE_BLOCKS) -> float:
    """Jackknife standard error of `ess` over `blocks` contiguous blocks of rows (a row is one response): how
    much the batch's ESS would move with other rollouts of the same policies. 0 with fewer than 2 rows."""
    rows = log_weights.shape[0]
    blocks = min(blocks, rows)
    if blocks < 2:
        return 0.0
    bounds = [round(i * rows / blocks) for i in range(blocks + 1)]
    keep = torch.ones(rows, dtype=torch.bool, device=log_weights.device)
    left_out = []
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        keep[lo:hi] = False
        left_out.append(float(ess(log_weights[keep], mask[keep])))
        keep[lo:hi] = True
    mean = sum(left_out) / blocks
    return math.sqrt((blocks - 1) / blocks * sum((e - mean) ** 2 for e in left_out))


def decompose_log_ratio(*, logp: Tensor, logp_version: Tensor, logp_sampler: Tensor) -> tuple[Tensor, Tensor]:
    """(delta_num, delta_lag) = (l^v - lmu, l - l^v), detached; their sum is l - lmu."""
    logp = logp.detach()
    return logp_version - logp_sampler, logp - logp_version


def _safe_log_ratio(log_ratio: Tensor, bound: float) -> Tensor:
    """NaN -> 0, +-inf -> +-bound, then clamp to [-bound, bound]; keeps the gradient inside the bounds."""
    return torch.nan_to_num(log_ratio, nan=0.0, posinf=bound, neginf=-bound).clamp(-bound, bound)


def _renormalized_probs(topk_logprobs: Tensor) -> Tensor:
    """softmax over the K ids; NaN/+inf entries get probability 0; an all-invalid row is all zeros."""
    logits = topk_logprobs.detach()
    logits = torch.where(torch.isnan(logits) | (logits == math.inf), -math.inf, logits)
    row_max = logits.amax(dim=-1, keepdim=True)
    valid_row = torch.isfinite(row_max)
    unnormalized = torch.exp(logits - torch.where(valid_row, row_max, 0.0))
    probs = unnormalized / unnormalized.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(logits.dtype).tiny)
    return torch.where(valid_row, probs, 0.0)


def centering_term(
    logp_topk: Tensor,
    sampler_topk_logprobs: Tensor,
    version_topk_logprobs: Tensor | None = None,
) -> Tensor:
    """c_t over the transmitted top-K ids S_t (DESIGN section 4), [B, T, K] -> [B, T].

    mu~ = the sampler's probabilities renormalized over S_t, pi~v = the trainer-at-version probabilities
    renormalized over S_t (both detached). Plain centering (`version_topk_logprobs` None, method `center`):
    c = sum mu~ * logp_topk. Numerical-only centering (method `dlc`): c = sum (mu~ - pi~v) * logp_topk.
    The gradient flows through `logp_topk` only.
    """
    if logp_topk.shape != sampler_topk_logprobs.shape:
        raise ValueError(
            f"centering_term: logp_topk shape {tuple(logp_topk.shape)} != sampler_topk_logprobs shape "
            f"{tuple(sampler_topk_logprobs.shape)}"
        )
    coefficients = _renormalized_probs(sampler_topk_logprobs)
    if version_topk_logprobs is not None:
        if version_topk_logprobs.shape != logp_topk.shape:
            raise ValueError(
                f"centering_term: version_topk_logprobs shape {tuple(version_topk_logprobs.shape)} != "
                f"logp_topk shape {tuple(logp_topk.shape)}"
            )
        coefficients = coefficients - _renormalized_probs(version_topk_logprobs)
    # A zero coefficient never multiplies a non-finite log-prob into NaN.
    terms = torch.where(coefficients != 0, coefficients.to(logp_topk.dtype) * logp_topk, 0.0)
    return terms.sum(dim=-1)


def dual_update(lam: float, mean_delta: float, tolerance: float, lr: float) -> float:
    """DC-GRPO multiplier step: max(0, lam + lr * (mean_delta - tolerance)); a non-finite delta keeps lam."""
    if not math.isfinite(mean_delta):
        return lam
    return max(0.0, lam + lr * (mean_delta - tolerance))


def _masked_mean_std(values: Tensor, selected: Tensor, num_tokens: int) -> tuple[float, float]:
    if num_tokens == 0:
        return 0.0, 0.0
    picked = values[selected].double()
    return float(picked.mean()), float(picked.std(correction=0))


def policy_loss(
    method: str,
    *,
    logp: Tensor,
    logp_version: Tensor,
    logp_sampler: Tensor,
    advantages: Tensor,
    mask: Tensor,
    centering: Tensor | None = None,
    config: CorrectionConfig | None = None,
    state: CorrectionState | None = None,
    logp_prox: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Token-mean policy loss of `method` (DESIGN section 4 table) and its metrics.

    Shapes: logp/logp_version/logp_sampler/mask/centering [B, T], advantages [B] or [B, T]. Only `logp` and
    `centering` carry gradient (the others are detached here). `logp_prox` is pi_prox of `decoupled_ppo`;
    None means `logp.detach()`, the trainer at the start of this step when a batch gets one optimizer step.
    Never mutates its inputs or `state` (the dual multiplier is updated by the caller with `dual_update`).
    Metrics: ess_lag, ess_full, delta_num_mean/std, delta_lag_mean/std, delta_mean (mean |p - p_inf|),
    lambda, tokens, nonfinite_inputs, plus a method-specific fraction (clip / masked / kept).
    """
    if method not in METHODS:
        raise ValueError(f"unknown correction method {method!r}; valid methods: {', '.join(METHODS)}")
    config = config or CorrectionConfig()
    shape = logp.shape
    if logp.dim() != 2:
        raise ValueError(f"policy_loss: logp must be [B, T], got shape {tuple(shape)}")
    for name, tensor in (("logp_version", logp_version), ("logp_sampler", logp_sampler), ("mask", mask)):
        if tensor.shape != shape:
            raise ValueError(f"policy_loss: {name} shape {tuple(tensor.shape)} != logp shape {tuple(shape)}")
    if advantages.shape not in (shape, shape[:1]):
        raise ValueError(f"policy_loss: advantages shape {tuple(advantages.shape)} must be [B] or [B, T] = {tuple(shape)}")
    if method in CENTERED_METHODS:
        if centering is None:
            raise ValueError(f"policy_loss: method {method!r} needs `centering` (see centering_term)")
        if centering.shape != shape:
            raise ValueError(f"policy_loss: centering shape {tuple(centering.shape)} != logp shape {tuple(shape)}")
    if logp_prox is not None and logp_prox.shape != shape:
        raise ValueError(f"policy_loss: logp_prox shape {tuple(logp_prox.shape)} != logp shape {tuple(shape)}")

    bound = config.log_ratio_clamp
    clip = config.clip
    eps = config.ppo_eps
    lam = float(state.lam) if state is not None else config.dual_lambda_init
    selected = mask.bool()
    num_tokens = int(selected.sum())
    zero = logp.new_zeros(())

    def on_mask(values: Tensor) -> Tensor:
        return torch.where(selected, values, zero)

    logp = on_mask(logp)
    logp_detached = logp.detach()
    logp_version = on_mask(logp_version.detach().to(logp.dtype))
    logp_sampler = on_mask(logp_sampler.detach().to(logp.dtype))
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand(shape)
    advantages = on_mask(advantages.detach().to(logp.dtype))

    nonfinite_inputs = int((~torch.isfinite(logp_version) | ~torch.isfinite(logp_sampler)).sum())
    delta_num, delta_lag = decompose_log_ratio(logp=logp, logp_version=logp_version, logp_sampler=logp_sampler)
    log_w = _safe_log_ratio(delta_lag, bound)  # lag ratio, detached
    log_rho_detached = _safe_log_ratio(logp_detached - logp_sampler, bound)
    rho_detached = torch.exp(log_rho_detached)
    # |p_train - p_inf| with p_inf = p_train / rho, capped at probability 1.
    delta_prob = (torch.exp(logp_detached) - torch.exp((logp_detached - log_rho_detached).clamp(max=0.0))).abs()
    delta_prob = on_mask(torch.nan_to_num(delta_prob, nan=0.0, posinf=1.0))

    extra: dict[str, float] = {}

    def fraction(flags: Tensor) -> float:
        return float((flags & selected).sum()) / max(num_tokens, 1)

    def ppo_surrogate(ratio: Tensor, adv: Tensor) -> Tensor:
        extra[PPO_CLIP_FRAC] = fraction((ratio.detach() - 1).abs() > eps)
        return torch.minimum(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)

    if method == "naive":
        per_token = -advantages * logp
    elif method in ("tis", "vcpo"):
        extra[RATIO_CLIP_FRAC] = fraction(rho_detached > clip)
        per_token = -rho_detached.clamp(max=clip) * advantages * logp
    elif method == "mis":
        kept = (rho_detached >= config.mis_low) & (rho_detached <= config.mis_high)
        extra[MIS_MASKED_FRAC] = fraction(~kept)
        per_token = -torch.where(kept, rho_detached, zero) * advantages * logp
    elif method == "center":
        per_token = -advantages * (logp - on_mask(centering))
    elif method == "dlc":
        lag_ratio = torch.exp(log_w)
        extra[RATIO_CLIP_FRAC] = fraction(lag_ratio > clip)
        per_token = -lag_ratio.clamp(max=clip) * advantages * (logp - on_mask(centering))
    elif method == "ppo":
        rho = torch.exp(_safe_log_ratio(logp - logp_sampler, bound))
        per_token = -ppo_surrogate(rho, advantages)
    elif method == "decoupled_ppo":
        prox = logp_detached if logp_prox is None else on_mask(logp_prox.detach().to(logp.dtype))
        behaviour_weight = torch.exp(_safe_log_ratio(prox - logp_sampler, bound)).clamp(max=clip)
        ratio = torch.exp(_safe_log_ratio(logp - prox, bound))
        per_token = -behaviour_weight * ppo_surrogate(ratio, advantages)
    elif method == "m2po":
        log_rho = _safe_log_ratio(logp - logp_sampler, bound)
        kept = _m2po_keep_mask(log_rho.detach() ** 2, selected, config.m2po_tau)
        extra[M2PO_KEPT_FRAC] = fraction(kept)
        per_token = torch.where(kept, -torch.exp(log_rho) * advantages, zero)
    elif method == "dual":
        rho = torch.exp(_safe_log_ratio(logp - logp_sampler, bound))
        per_token = -ppo_surrogate(rho, advantages - lam * delta_prob)
    else:  # pragma: no cover - METHODS and this chain are kept in sync
        raise AssertionError(method)

    loss = on_mask(per_token).sum() / max(num_tokens, 1)

    # Reported unclamped (only non-finite values replaced), so a large discrepancy shows its true size.
    finite = dict(nan=0.0, posinf=bound, neginf=-bound)
    delta_num_mean, delta_num_std = _masked_mean_std(torch.nan_to_num(delta_num, **finite), selected, num_tokens)
    delta_lag_mean, delta_lag_std = _masked_mean_std(torch.nan_to_num(delta_lag, **finite), selected, num_tokens)
    metrics = {
        ESS_LAG: float(ess(log_w, selected)),
        ESS_LAG_SE: ess_se(log_w, selected),
        ESS_FULL: float(ess(log_rho_detached, selected)),
        DELTA_NUM_MEAN: delta_num_mean,
        DELTA_NUM_STD: delta_num_std,
        DELTA_LAG_MEAN: delta_lag_mean,
        DELTA_LAG_STD: delta_lag_std,
        DELTA_MEAN: float(delta_prob.double().sum()) / max(num_tokens, 1),
        "lambda": lam,
        "tokens": float(num_tokens),
        NONFINITE_INPUTS: float(nonfinite_inputs),
        **extra,
    }
    return loss, metrics


def _m2po_keep_mask(squared_log_ratio: Tensor, selected: Tensor, tau: float) -> Tensor:
    """Keep the k tokens with the smallest (log rho)^2, k the largest count whose mean stays <= tau.

    Dropping the largest values first makes the mean of the kept set nondecreasing in k, so k is the number
    of prefix means <= tau. Ties are broken by position (stable sort), so the mask is deterministic.
    """
    flat_values = squared_log_ratio.reshape(-1)
    flat_selected = selected.reshape(-1)
    positions = flat_selected.nonzero().squeeze(1)
    if positions.numel() == 0:
        return torch.zeros_like(selected)
    values = flat_values[positions].double()
    sorted_values, order = torch.sort(values, stable=True)
    prefix_means = torch.cumsum(sorted_values, 0) / torch.arange(1, len(values) + 1, dtype=torch.float64)
    num_kept = int((prefix_means <= tau).sum())
    keep = torch.zeros_like(flat_selected)
    keep[positions[order[:num_kept]]] = True
    return keep.reshape(selected.shape)
