"""Policy objectives of the QuRL paper, one function per equation, plus KL and value losses.

Three policies score every sampled token (all as log-probabilities, tensors [B, T]):
    logp        pi_theta   the actor being updated (carries the gradient)
    prox_logp   pi_prox    the full-precision old actor, recomputed before the update
    behav_logp  pi_behav   the (quantized) rollout engine that sampled the token
With R = pi_theta/pi_prox, R_hat = pi_theta/pi_behav and rho = pi_prox/pi_behav, every objective
below is one weighted PPO surrogate  weight * min(ratio * A, clip(ratio, low, high) * A).
"""
import math
from dataclasses import dataclass

import torch

AGGREGATIONS = ("token-mean", "seq-mean-token-mean")


@dataclass
class ClippedSurrogate:
    """weight * min(ratio * A, clip(ratio, low, high) * A): the pieces one objective chooses."""
    weight: torch.Tensor | float
    ratio: torch.Tensor
    low: torch.Tensor | float
    high: torch.Tensor | float

    def per_token(self, A):
        clipped = torch.minimum(torch.clamp(self.ratio, min=self.low), torch.as_tensor(self.high))
        return self.weight * torch.minimum(self.ratio * A, clipped * A)

    # The min takes the clipped branch (and the token's gradient is zero) exactly when:
    def clipped_above(self, A):
        return (A > 0) & (self.ratio > self.high)

    def clipped_below(self, A):
        return (A < 0) & (self.ratio < self.low)


def objective_ppo(R, R_hat, rho, eps_low, eps_high, C, seq=None):
    """Eq. 1: full-precision old actor as the denominator, no correction for the sampler."""
    return ClippedSurrogate(weight=1.0, ratio=R, low=1 - eps_low, high=1 + eps_high)


def objective_naive(R, R_hat, rho, eps_low, eps_high, C, seq=None):
    """Eq. 3: the quantized sampler as the old policy (ratio R_hat)."""
    return ClippedSurrogate(weight=1.0, ratio=R_hat, low=1 - eps_low, high=1 + eps_high)


def objective_decoupled(R, R_hat, rho, eps_low, eps_high, C, seq=None):
    """Eq. 4: decoupled PPO, importance weight rho, clipping around pi_prox."""
    return ClippedSurrogate(weight=rho, ratio=R, low=1 - eps_low, high=1 + eps_high)


def objective_tis(R, R_hat, rho, eps_low, eps_high, C, seq=None):
    """Eq. 5 (FlashRL): decoupled PPO with the importance weight truncated at C."""
    return ClippedSurrogate(weight=torch.clamp(rho, max=C), ratio=R, low=1 - eps_low, high=1 + eps_high)


def objective_acr(R, R_hat, rho, eps_low, eps_high, C, seq=None):
    """Eq. 9 (QuRL ACR): TIS whose upper clip bound grows to (1+eps)/r where pi_behav was truncated.

    Eq. 6-8: truncating the weight at C is the same as replacing pi_behav by max(pi_behav, pi_prox / C), i.e.
    weighting the decoupled term (Eq. 4) by r = pi_behav / max(pi_behav, pi_prox / C) <= 1: the token's term is
    rho * (r R) * A. Seen on the ratio that carries the update, r R, TIS's clip of R at 1 + eps is a clip of r R
    at r (1 + eps): r scales the clip range down where the sampler was most off (Eq. 8). ACR keeps the upper
    bound where it should be: clipping R at (1 + eps) / r clips r R at 1 + eps again."""
    r = 1.0 / torch.clamp(rho / C, min=1.0)  # r = pi_behav / max(pi_behav, pi_prox / C)   (Eq. 6-7)
    return ClippedSurrogate(weight=torch.clamp(rho, max=C), ratio=R, low=1 - eps_low, high=(1 + eps_high) / r)


# ----- the corrections frameworks use today (TRL, verl, slime, NeMo-RL), on the same footing ----------------
# Thresholds come from C = --tis-cap: keep [1/C, C] (TRL's default is C = 3: --tis-cap 3).


@dataclass
class SequenceRatio:
    """Per token, its response's log(prod rho) = sum of log rho over the response, and the response's length."""
    log_sum: torch.Tensor
    length: torch.Tensor


def sequence_ratio(rho, mask) -> SequenceRatio:
    """Each row's sum of log rho over its response tokens and its token count, broadcast to every token."""
    log_rho = torch.where(mask > 0, torch.log(rho), torch.zeros_like(rho))
    return SequenceRatio(log_rho.sum(-1, keepdim=True).expand_as(rho), mask.sum(-1, keepdim=True).expand_as(rho))


def objective_icepop(R, R_hat, rho, eps_low, eps_high, C, seq=None):
    """Token-level two-sided masking (IcePop / MIS; verl rollout_is=token with a mask, NeMo-RL icepop, TRL
    token_mask): decoupled PPO (Eq. 4) with weight rho where 1/C <= rho <= C, and no gradient elsewhere."""
    keep = (rho >= 1.0 / C) & (rho <= C)
    return ClippedSurrogate(weight=torch.where(keep, rho, torch.zeros_like(rho)), ratio=R, low=1 - eps_low,
                            high=1 + eps_high)


def objective_seq_tis(R, R_hat, rho, eps_low, eps_high, C, seq=None):
    """Sequence-level truncated IS (TRL sequence_truncate, slime sequence/truncate): every token of a response
    weighted by min(prod_t rho_t, C), the response's own ratio, truncated at C."""
    return ClippedSurrogate(weight=torch.clamp(torch.exp(seq.log_sum), max=C), ratio=R, low=1 - eps_low,
                            high=1 + eps_high)


def objective_geo_tis(R, R_hat, rho, eps_low, eps_high, C, seq=None):
    """Geometric-mean sequence IS (slime geometric): weight min(exp(mean_t log rho_t), C) for every token of a
    response: a per-token-sized ratio that does not explode with length."""
    return ClippedSurrogate(weight=torch.clamp(torch.exp(seq.log_sum / seq.length.clamp(min=1)), max=C), ratio=R,
                            low=1 - eps_low, high=1 + eps_high)


def objective_seq_mask(R, R_hat, rho, eps_low, eps_high, C, seq=None):
    """Sequence masking (TRL sequence_mask, its default; NeMo-RL/OpenRLHF seq-mask-tis): weight prod_t rho_t, and a
    response whose ratio leaves [1/C, C] is dropped whole."""
    w = torch.exp(seq.log_sum)
    keep = (w >= 1.0 / C) & (w <= C)
    return ClippedSurrogate(weight=torch.where(keep, w, torch.zeros_like(w)), ratio=R, low=1 - eps_low,
                            high=1 + eps_high)


OBJECTIVE_FNS = {"ppo": objective_ppo, "naive": objective_naive, "decoupled": objective_decoupled,
                 "tis": objective_tis, "acr": objective_acr}  # the paper's (Eq. 1, 3, 4, 5, 9)
CORRECTION_FNS = {"icepop": objective_icepop, "seq-tis": objective_seq_tis, "geo-tis": objective_geo_tis,
                  "seq-mask": objective_seq_mask}  # the field's, beside them
POLICY_OBJECTIVES = {**OBJECTIVE_FNS, **CORRECTION_FNS}  # what --objective chooses from
OBJECTIVES = tuple(POLICY_OBJECTIVES)


def masked_mean(x, mask, dim=None, over=None):
    """Mean of x where mask is 1. `over`: the count to divide by instead of the mask's own: a micro-batch
    divides by its whole minibatch's count, so that the micro-batches' results add up to the minibatch's."""
    return (x * mask).sum(dim) / (mask.sum(dim).clamp(min=1) if over is None else over)


def aggregate(per_token, mask, agg, over=None):
    """'token-mean': sum_t over all tokens / their number; 'seq-mean-token-mean': Eq. 1's
    1/G sum_i 1/|o_i| sum_t, G = the non-empty rows. `over`: that number of tokens or of rows
    (`aggregation_units`) of the whole minibatch, for a micro-batch of it."""
    if agg == "token-mean":
        return masked_mean(per_token, mask, over=over)
    if agg == "seq-mean-token-mean":
        has_tokens = mask.sum(-1) > 0
        per_seq = masked_mean(per_token, mask, dim=-1)  # 1/|o_i| sum_t
        return per_seq[has_tokens].sum() / (has_tokens.sum().clamp(min=1) if over is None else over)
    raise ValueError(f"unknown aggregation {agg!r}; choose from {AGGREGATIONS}")


def aggregation_units(mask, agg):
    """What `aggregate` divides by: the tokens ('token-mean') or the non-empty rows (G)."""
    if agg not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {agg!r}; choose from {AGGREGATIONS}")
    return mask.sum() if agg == "token-mean" else (mask.sum(-1) > 0).sum()


def policy_loss(logp, prox_logp, behav_logp, advantages, mask, *, objective, clip_low=0.2,
                clip_high=0.2, tis_cap=2.0, agg="token-mean", over=None):
    """loss = -aggregate(objective per token) (`over`: the minibatch's units, for a micro-batch of it), and
    stats about clipping and truncation over these tokens (a minibatch's: `policy_stats`; the sampler gap
    over the whole step: `sampler_mismatch`)."""
    if objective not in POLICY_OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}; choose from {OBJECTIVES}")
    mask = mask.to(logp.dtype)
    prox_logp, behav_logp, A = prox_logp.detach(), behav_logp.detach(), advantages.detach()
    R = torch.exp(logp - prox_logp)
    R_hat = torch.exp(logp - behav_logp)
    rho = torch.exp(prox_logp - behav_logp)
    surrogate = POLICY_OBJECTIVES[objective](R, R_hat, rho, clip_low, clip_high, tis_cap, seq=sequence_ratio(rho, mask))
    loss = -aggregate(surrogate.per_token(A), mask, agg, over)
    with torch.no_grad():
        stats = surrogate_stats(surrogate, A, rho, mask, plain_high=1 + clip_high, tis_cap=tis_cap)
    return loss, stats


@torch.no_grad()
def policy_stats(logp, prox_logp, behav_logp, advantages, seq_log_sum, seq_length, *, objective, clip_low=0.2,
                 clip_high=0.2, tis_cap=2.0) -> dict:
    """The clipping and truncation statistics of one minibatch, from its response tokens (1-D tensors: every
    token of the minibatch at once, so each statistic is what it says: a share, or a max; seq_*: each token's
    response's, from `sequence_ratio`)."""
    R, R_hat, rho = (torch.exp(logp - prox_logp), torch.exp(logp - behav_logp), torch.exp(prox_logp - behav_logp))
    surrogate = POLICY_OBJECTIVES[objective](R, R_hat, rho, clip_low, clip_high, tis_cap,
                                             seq=SequenceRatio(seq_log_sum, seq_length))
    return surrogate_stats(surrogate, advantages, rho, torch.ones_like(logp), plain_high=1 + clip_high,
                           tis_cap=tis_cap)


# how a step's statistics combine over its minibatches and epochs: a max stays a max, the rest are means
COMBINE = {"rho_max": max, "skipped_updates": sum}


def combine_stats(per_minibatch: list[dict]) -> dict:
    keys = dict.fromkeys(k for stats in per_minibatch for k in stats)
    return {k: COMBINE.get(k, lambda xs: sum(xs) / len(xs))([s[k] for s in per_minibatch if k in s]) for k in keys}


def surrogate_stats(surrogate: ClippedSurrogate, A, rho, mask, *, plain_high, tis_cap) -> dict:
    """Shares of response tokens: clipped above / below (the paper's Fig. 2b), upper bound widened
    by ACR (r < 1, the same tokens as rho > C) and 'rescued' by it (A > 0, ratio between 1+eps and
    (1+eps)/r: TIS would clip them, ACR keeps their gradient)."""
    def share(flags):
        return masked_mean(flags.to(mask.dtype), mask).item()

    ratio, high = surrogate.ratio, torch.as_tensor(surrogate.high)
    above, below = share(surrogate.clipped_above(A)), share(surrogate.clipped_below(A))
    present = mask > 0
    return {
        "clip_frac": above + below,
        "clip_frac_upper": above,
        "clip_frac_lower": below,
        "clip_widened_frac": share(high > plain_high),
        "adv_positive_frac": share(A > 0), "ratio_over_frac": share(ratio > plain_high),  # two of ACR's three
        "clip_rescued_frac": share((A > 0) & (ratio > plain_high) & (ratio <= high)),
        "tis_trunc_frac": share(rho > tis_cap),
        "masked_frac": share(torch.as_tensor(surrogate.weight).expand_as(rho) == 0),  # no gradient at all
        "rho_max": rho[present].max().item() if present.any() else 1.0,
        "ratio_mean": masked_mean(ratio, mask).item(),
    }


def sampler_mismatch(prox_logp, behav_logp, mask, tis_cap: float) -> dict:
    """How far the sampler (pi_behav) and the learner (pi_prox) disagree on the sampled tokens (Sec. 4.2).
    KL(behav || prox) two ways: k1 = mean log(pi_behav / pi_prox) (unbiased, noisy, can be < 0) and
    k3 = mean (rho - 1 - log rho) (always >= 0); rho = pi_prox / pi_behav at its extremes; share with rho > C."""
    present = mask > 0
    if not present.any():
        return {"kl_behav_prox": 0.0, "kl_behav_prox_k3": 0.0, "rho_max_step": 1.0, "rho_min_step": 1.0,
                "rho_over_cap_frac": 0.0, "seq_log_ratio_mean": 0.0, "seq_log_ratio_max_abs": 0.0, "ess_token": 1.0,
                "ess_seq": 1.0, "seq_out_of_range_frac": 0.0}
    log_rho = (prox_logp - behav_logp)[present].double()
    seq_log = ((prox_logp - behav_logp).double() * mask)[mask.sum(-1) > 0].sum(-1)  # log prod rho per response
    return {"kl_behav_prox": (-log_rho).mean().item(),
            "kl_behav_prox_k3": (log_rho.exp() - 1 - log_rho).mean().item(),
            "rho_max_step": log_rho.max().exp().item(), "rho_min_step": log_rho.min().exp().item(),
            "rho_over_cap_frac": (log_rho.exp() > tis_cap).double().mean().item(),
            # what TRL and verl log: the sequence log-ratio, and the effective sample size of the IS weights
            "seq_log_ratio_mean": seq_log.mean().item(), "seq_log_ratio_max_abs": seq_log.abs().max().item(),
            "ess_token": effective_sample_size(log_rho.exp()), "ess_seq": effective_sample_size(seq_log.exp()),
            "seq_out_of_range_frac": ((seq_log.abs() > math.log(tis_cap)).double().mean().item())}


def effective_sample_size(weights) -> float:
    """(sum w)^2 / (n sum w^2), in (0, 1]: 1 when every weight is equal (verl's rollout_is ESS)."""
    w = weights.double()
    return (w.sum() ** 2 / (len(w) * (w ** 2).sum())).item() if len(w) else 1.0


def kl_k3(logp, ref_logp):
    """Schulman's k3 estimator of KL(pi_theta || pi_ref), per token, always >= 0."""
    log_ratio = ref_logp - logp
    return torch.exp(log_ratio) - log_ratio - 1


def value_loss(values, old_values, returns, mask, clip=0.2, over=None):
    """PPO's clipped value loss: 0.5 * max((V - G)^2, (clip(V, V_old +- c) - G)^2), a token mean."""
    clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    loss = 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
    return masked_mean(loss, mask, over=over)
