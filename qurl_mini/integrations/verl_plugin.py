"""QuRL's objectives as verl policy losses: `loss_mode=qurl_acr` (Eq. 9) and `qurl_tis` (Eq. 5).

Imported on every `import verl` (driver and Ray workers) through the `verl.plugins` entry point
in pyproject.toml; the equations themselves are qurl_mini/loss.py's, not a copy.

verl's names for the three policies of qurl_mini/loss.py:
    log_prob            log pi_theta   the actor being updated
    old_log_prob        log pi_prox    the FSDP actor before the update (verl's decoupled mode)
    rollout_is_weights  rho = pi_prox / pi_behav, from verl's rollout correction, which takes
                        pi_behav from the (quantized) vLLM engine's log-probs
ACR needs rho untruncated (r = 1/max(1, rho/C), Eq. 6-7), so verl must not truncate it
(algorithm.rollout_correction.rollout_is_threshold >= exp(20), the clamp verl applies to log rho
anyway) and the cap C is applied here, from `policy_loss.tis_cap` (QuRLPolicyLossConfig).
"""
from dataclasses import dataclass

import torch
from verl.trainer.ppo.core_algos import agg_loss, register_policy_loss
from verl.workers.config import PolicyLossConfig

from qurl_mini.loss import OBJECTIVE_FNS, masked_mean, surrogate_stats

DEFAULT_TIS_CAP = 2.0
UNTRUNCATED = 1e9  # a rollout_is_threshold above verl's own bound exp(20) ~ 4.9e8: rho arrives as is


@dataclass
class QuRLPolicyLossConfig(PolicyLossConfig):
    """verl's policy-loss config plus the truncation C of Eq. 5 and 9. Select it with
    `actor_rollout_ref.actor.policy_loss._target_=qurl_mini.integrations.verl_plugin.QuRLPolicyLossConfig`
    and set `+actor_rollout_ref.actor.policy_loss.tis_cap=C` (without it, C = 2)."""
    tis_cap: float = DEFAULT_TIS_CAP

    def __post_init__(self):
        if not self.tis_cap >= 1.0:
            raise ValueError(f"policy_loss.tis_cap must be >= 1 (it truncates pi_prox/pi_behav), got {self.tis_cap}")


def qurl_policy_loss(objective, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                     rollout_is_weights):
    """verl's policy-loss signature around qurl_mini's objective `objective` -> (loss, metrics)."""
    if rollout_is_weights is None:
        raise ValueError(f"loss_mode=qurl_{objective} needs verl's rollout_is_weights (pi_old / pi_rollout): set "
                         f"algorithm.rollout_correction.rollout_is=token and rollout_is_threshold={UNTRUNCATED:g}")
    C = config.policy_loss.get("tis_cap", DEFAULT_TIS_CAP)
    eps_low = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
    eps_high = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
    mask = response_mask.to(log_prob.dtype)
    A = advantages.detach()
    rho = rollout_is_weights.detach().to(log_prob.dtype)  # pi_prox / pi_behav (0 on padding: verl masks it)
    R = torch.exp(log_prob - old_log_prob.detach())  # pi_theta / pi_prox
    R_hat = R * rho  # pi_theta / pi_behav, exactly, without a log of the masked zeros
    surrogate = OBJECTIVE_FNS[objective](R, R_hat, rho, eps_low, eps_high, C)
    # verl's aggregation: normalized by the global batch (tokens or sequences, all micro-batches and ranks)
    loss = agg_loss(loss_mat=-surrogate.per_token(A), loss_mask=response_mask, loss_agg_mode=loss_agg_mode,
                    **config.global_batch_info)
    with torch.no_grad():
        stats = surrogate_stats(surrogate, A, rho, mask, plain_high=1 + eps_high, tis_cap=C)
        log_rho = torch.where(mask > 0, torch.log(rho), torch.zeros_like(rho))
        stats["kl_behav_prox"] = masked_mean(-log_rho, mask).item()
    # floats: verl averages each over micro-batches and ranks (so rho_max is a mean of maxima there)
    return loss, {f"actor/{name}": value for name, value in stats.items()}


@register_policy_loss("qurl_acr")
def qurl_acr_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                  rollout_is_weights=None):
    """Eq. 9 (QuRL ACR): TIS whose upper clip bound grows to (1+eps)/r where pi_behav was truncated."""
    return qurl_policy_loss("acr", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                            rollout_is_weights)


@register_policy_loss("qurl_tis")
def qurl_tis_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                  rollout_is_weights=None):
    """Eq. 5 (FlashRL TIS), for comparison: min(rho, C) times the PPO surrogate clipped around pi_prox."""
    return qurl_policy_loss("tis", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                            rollout_is_weights)
