"""Policy objectives of the QuRL paper, one function per equation, plus the KL and value losses.

The paper's symbols in this file (all of them, flags included: docs/symbols.md). Per token, tensors [B, T]:
    logp        log pi_theta     the actor being updated (carries the gradient)
    prox_logp   log pi_prox      pi_theta_old: the full-precision actor before the update
    behav_logp  log pi_behav     pi_theta_hat_old: the (quantized) rollout engine that sampled the token
    A           A_{i,t}          advantages;  mask: 1 on the response tokens, |o_i| = mask.sum(-1)
    R = pi_theta / pi_prox,  R_hat = pi_theta / pi_behav,  rho = pi_prox / pi_behav
    C = tis_cap (--tis-cap);  eps_low, eps_high = clip_low, clip_high;  r = 1 / max(1, rho / C) (Eq. 6-7)
Every objective is one weighted PPO surrogate, weight * min(ratio * A, clip(ratio, low, high) * A), averaged as
--loss-agg says (Eq. 1's 1/G sum_i 1/|o_i| sum_t, over a batch's responses, or DAPO's mean over its tokens).

ACR by hand (eps = 0.2, C = 2): a token with rho = 5 has r = 2 / 5 = 0.4, weight min(5, 2) = 2 and upper bound
1.2 / 0.4 = 3.0. With R = 1.5 and A = +1, TIS clips R at 1.2 (zero gradient) while ACR passes the token with
weight 2. At rho = 1e5 (the paper's Fig. 3b) the bound is 1.2 * 1e5 / 2 = 6e4. (tests/test_loss.py redoes these.)
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
    """Eq. 9 (QuRL ACR): TIS whose upper clip bound grows to (1+eps)/r where pi_behav was truncated. Eq. 6-8: the
    truncation replaces pi_behav by max(pi_behav, pi_prox / C), weighting Eq. 4's term by r <= 1: rho (r R) A, so TIS's
    clip of R at 1 + eps clips r R at r (1 + eps) (Eq. 8); clipping R at (1 + eps) / r clips r R at 1 + eps again."""
    r = 1.0 / torch.clamp(rho / C, min=1.0)  # r = pi_behav / max(pi_behav, pi_prox / C)   (Eq. 6-7)
    return ClippedSurrogate(weight=torch.clamp(rho, max=C), ratio=R, low=1 - eps_low, high=(1 + eps_high) / r)


# ----- the corrections frameworks use today (TRL, verl, slime, NeMo-RL), on the same footing: their thresholds
# come from C = --tis-cap, keep [1/C, C] (TRL's default is C = 3: --tis-cap 3) --------------------------------


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


def masked_mean(x, mask, dim=None):
    """Mean of x where mask is 1 (0 where it has no 1)."""
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def aggregate(per_token, mask, agg):
    """The --loss-agg average of a batch: aggregate_sum / aggregation_units."""
    return aggregate_sum(per_token, mask, agg) / aggregation_units(mask, agg)


def aggregate_sum(per_token, mask, agg):
    """'token-mean' (DAPO): the sum over all tokens; 'seq-mean-token-mean': Eq. 1's sum_i 1/|o_i| sum_t."""
    if agg == "token-mean":
        return (per_token * mask).sum()
    return masked_mean(per_token, mask, dim=-1)[mask.sum(-1) > 0].sum()


def aggregation_units(mask, agg):
    """What aggregate_sum is divided by: the tokens, or the responses that have tokens (Eq. 1's G); at least 1."""
    if agg not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {agg!r}; choose from {AGGREGATIONS}")
    return (mask.sum() if agg == "token-mean" else (mask.sum(-1) > 0).sum()).clamp(min=1)


def clipped_surrogate(logp, prox_logp, behav_logp, mask, *, objective, clip_low=0.2, clip_high=0.2, tis_cap=2.0, seq=None):
    """The --objective's ClippedSurrogate on these tokens, and rho: the ratios of Sec. 4.1, formed here alone.
    seq: each token's response's ratio (`sequence_ratio`; by default, of the rows of these [B, T] tensors)."""
    if objective not in POLICY_OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}; choose from {OBJECTIVES}")
    prox_logp, behav_logp = prox_logp.detach(), behav_logp.detach()
    R, R_hat, rho = torch.exp(logp - prox_logp), torch.exp(logp - behav_logp), torch.exp(prox_logp - behav_logp)
    seq = sequence_ratio(rho, mask) if seq is None else seq
    return POLICY_OBJECTIVES[objective](R, R_hat, rho, clip_low, clip_high, tis_cap, seq=seq), rho


def policy_objective(logp, prox_logp, behav_logp, advantages, mask, **objective):
    """The per-token objective weight * min(ratio A, clip(ratio, low, high) A), [B, T], to aggregate over the mask."""
    surrogate, _ = clipped_surrogate(logp, prox_logp, behav_logp, mask.to(logp.dtype), **objective)
    return surrogate.per_token(advantages.detach())


def policy_loss(logp, prox_logp, behav_logp, advantages, mask, *, agg, **objective):
    """-aggregate(the per-token objective): the loss of a whole batch (update.py sums a minibatch's micro-batches)."""
    return -aggregate(policy_objective(logp, prox_logp, behav_logp, advantages, mask, **objective), mask, agg)


@torch.no_grad()
def policy_stats(logp, prox_logp, behav_logp, advantages, mask, *, objective, clip_low=0.2, clip_high=0.2,
                 tis_cap=2.0) -> dict:
    """The clipping and truncation statistics of a minibatch, the only place they are computed: on all of its
    response tokens at once, one flat tensor in row order (so each is what it says: a share of them, or a max)."""
    present, seq = mask > 0, sequence_ratio(torch.exp(prox_logp - behav_logp), mask.to(logp.dtype))
    flat = [t[present] for t in (logp, prox_logp, behav_logp, advantages, seq.log_sum, seq.length)]
    surrogate, rho = clipped_surrogate(*flat[:3], None, seq=SequenceRatio(*flat[4:]), objective=objective,
                                       clip_low=clip_low, clip_high=clip_high, tis_cap=tis_cap)
    return surrogate_stats(surrogate, flat[3], rho, torch.ones_like(flat[0]), plain_high=1 + clip_high, tis_cap=tis_cap)


COMBINE = {"rho_max": max, "skipped_updates": sum, "skipped_minibatches": sum}  # over minibatches; others: means


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
        "clip_frac": above + below, "clip_frac_upper": above, "clip_frac_lower": below,
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
    KL(behav || prox) two ways: kl_behav_prox is k1 = mean log(pi_behav / pi_prox) (unbiased, noisy, can be < 0),
    kl_behav_prox_k3 is k3 = mean (rho - 1 - log rho) (always >= 0); rho's extremes; the share with rho > C."""
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
    """Schulman's k3 estimator of KL(pi_theta || pi_ref), per token, always >= 0: pi_ref / pi_theta - 1 - log of it."""
    log_ratio = ref_logp - logp
    return torch.exp(log_ratio) - log_ratio - 1


def value_loss(values, old_values, returns, clip=0.2):
    """PPO's clipped value loss per token: 0.5 * max((V - G)^2, (clip(V, V_old +- c) - G)^2)."""
    clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    return 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
