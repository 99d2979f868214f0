"""Policy objectives of the QuRL paper, one function per equation, plus KL and value losses.

Three policies score every sampled token (all as log-probabilities, tensors [B, T]):
    logp        pi_theta   the actor being updated (carries the gradient)
    prox_logp   pi_prox    the full-precision old actor, recomputed before the update
    behav_logp  pi_behav   the (quantized) rollout engine that sampled the token
With R = pi_theta/pi_prox, R_hat = pi_theta/pi_behav and rho = pi_prox/pi_behav:
"""
import torch

OBJECTIVES = ("ppo", "naive", "decoupled", "tis", "acr")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean")


def clipped_surrogate(ratio, advantages, low, high):
    """min(ratio * A, clip(ratio, low, high) * A), the PPO surrogate."""
    clipped = torch.minimum(torch.clamp(ratio, min=low), torch.as_tensor(high, dtype=ratio.dtype))
    return torch.minimum(ratio * advantages, clipped * advantages)


def objective_ppo(R, R_hat, rho, A, eps_low, eps_high, C):
    """Eq. 1: full-precision old actor as the denominator, no correction for the sampler."""
    return clipped_surrogate(R, A, 1 - eps_low, 1 + eps_high)


def objective_naive(R, R_hat, rho, A, eps_low, eps_high, C):
    """Eq. 3: the quantized sampler as the old policy (ratio R_hat)."""
    return clipped_surrogate(R_hat, A, 1 - eps_low, 1 + eps_high)


def objective_decoupled(R, R_hat, rho, A, eps_low, eps_high, C):
    """Eq. 4: decoupled PPO, importance weight rho, clipping around pi_prox."""
    return rho * clipped_surrogate(R, A, 1 - eps_low, 1 + eps_high)


def objective_tis(R, R_hat, rho, A, eps_low, eps_high, C):
    """Eq. 5 (FlashRL): decoupled PPO with the importance weight truncated at C."""
    return torch.clamp(rho, max=C) * clipped_surrogate(R, A, 1 - eps_low, 1 + eps_high)


def objective_acr(R, R_hat, rho, A, eps_low, eps_high, C):
    """Eq. 9 (QuRL ACR): TIS whose upper clip bound grows to (1+eps)/r where pi_behav was truncated."""
    # r = pi_behav / max(pi_behav, pi_prox / C) = 1 / max(1, rho / C)                   (Eq. 6-7)
    r = 1.0 / torch.clamp(rho / C, min=1.0)
    return torch.clamp(rho, max=C) * clipped_surrogate(R, A, 1 - eps_low, (1 + eps_high) / r)


OBJECTIVE_FNS = {"ppo": objective_ppo, "naive": objective_naive, "decoupled": objective_decoupled,
                 "tis": objective_tis, "acr": objective_acr}


def masked_mean(x, mask, dim=None):
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def aggregate(per_token, mask, agg):
    """'token-mean': over all masked tokens; 'seq-mean-token-mean': Eq. 1's 1/G sum_i 1/|o_i| sum_t."""
    if agg == "token-mean":
        return masked_mean(per_token, mask)
    if agg == "seq-mean-token-mean":
        has_tokens = mask.sum(-1) > 0
        per_seq = masked_mean(per_token, mask, dim=-1)
        return per_seq[has_tokens].sum() / has_tokens.sum().clamp(min=1)
    raise ValueError(f"unknown aggregation {agg!r}; choose from {AGGREGATIONS}")


def policy_loss(logp, prox_logp, behav_logp, advantages, mask, *, objective, clip_low=0.2,
                clip_high=0.2, tis_cap=2.0, agg="token-mean"):
    """loss = -aggregate(objective per token), and stats about clipping and the sampler gap."""
    if objective not in OBJECTIVE_FNS:
        raise ValueError(f"unknown objective {objective!r}; choose from {OBJECTIVES}")
    mask = mask.to(logp.dtype)
    prox_logp, behav_logp, advantages = prox_logp.detach(), behav_logp.detach(), advantages.detach()
    R = torch.exp(logp - prox_logp)
    R_hat = torch.exp(logp - behav_logp)
    rho = torch.exp(prox_logp - behav_logp)
    per_token = OBJECTIVE_FNS[objective](R, R_hat, rho, advantages, clip_low, clip_high, tis_cap)
    loss = -aggregate(per_token, mask, agg)

    with torch.no_grad():
        # a token is clipped when the min picks the clipped branch (its gradient is then zero)
        ratio = R_hat if objective == "naive" else R
        truncated = torch.clamp(rho, max=tis_cap)
        weight = {"decoupled": rho, "tis": truncated, "acr": truncated}.get(objective, torch.ones_like(rho))
        clipped = (per_token < weight * ratio * advantages - 1e-12).to(mask.dtype)
        present = mask > 0
        stats = {
            "clip_frac": masked_mean(clipped, mask).item(),
            "tis_trunc_frac": masked_mean((rho > tis_cap).to(mask.dtype), mask).item(),
            "rho_max": rho[present].max().item() if present.any() else 1.0,
            "kl_behav_prox": masked_mean(behav_logp - prox_logp, mask).item(),
            "ratio_mean": masked_mean(ratio, mask).item(),
        }
    return loss, stats


def kl_k3(logp, ref_logp):
    """Schulman's k3 estimator of KL(pi_theta || pi_ref), per token, always >= 0."""
    log_ratio = ref_logp - logp
    return torch.exp(log_ratio) - log_ratio - 1


def value_loss(values, old_values, returns, mask, clip=0.2):
    """PPO's clipped value loss: 0.5 * max((V - G)^2, (clip(V, V_old +- c) - G)^2)."""
    clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    loss = 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
    return masked_mean(loss, mask)

