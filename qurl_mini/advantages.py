"""Advantage estimators and reward shaping: GRPO (group-normalized), GAE (PPO), DAPO's tricks.

`ADVANTAGE_ESTIMATORS` maps a name to (rewards [N], mask [N, T], values [N, T] or None, cfg) ->
(advantages [N, T], returns [N, T] or None); cfg supplies group_size, gamma and lam.
"""
import torch


def grpo_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """(r - mean_group) / (std_group + eps) for rewards laid out group after group."""
    groups = rewards.view(-1, group_size)
    normalized = (groups - groups.mean(-1, keepdim=True)) / (groups.std(-1, keepdim=True) + eps)
    return normalized.view(-1)


def gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float):
    """Generalized Advantage Estimation over the masked (response) positions of [N, T] tensors.

    delta_t = r_t + gamma * V_{t+1} - V_t,  A_t = delta_t + gamma * lam * A_{t+1}; returns = A + V.
    """
    advantages = torch.zeros_like(values)
    next_value = torch.zeros(values.shape[0])
    next_advantage = torch.zeros(values.shape[0])
    for t in reversed(range(values.shape[1])):
        m = mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = advantage * m
        # padding positions pass the future through unchanged
        next_value = torch.where(m > 0, values[:, t], next_value)
        next_advantage = torch.where(m > 0, advantage, next_advantage)
    return advantages, (advantages + values) * mask


def group_advantages(rewards, mask, values, cfg):
    """GRPO / DAPO: every token of a response gets its group-normalized reward; no returns."""
    return grpo_advantages(rewards, cfg.group_size)[:, None] * mask, None


def gae_advantages(rewards, mask, values, cfg):
    """PPO: the reward sits on the last response token, GAE on the critic's values, then centred."""
    last = (mask.cumsum(-1) == mask.sum(-1, keepdim=True)) & (mask > 0)
    advantages, returns = gae(last.float() * rewards[:, None], values, mask, cfg.gamma, cfg.lam)
    mean = (advantages * mask).sum() / mask.sum().clamp(min=1)
    return (advantages - mean) * mask, returns  # centring: a common PPO choice


ADVANTAGE_ESTIMATORS = {"group": group_advantages, "gae": gae_advantages}


def overlong_penalty(length: int, max_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment: 0 until max_tokens - buffer, then linear down to -penalty."""
    start = max_tokens - buffer
    if buffer == 0 or length <= start:
        return 0.0
    return -penalty * min(1.0, (length - start) / buffer)


def informative_groups(correct: torch.Tensor, group_size: int) -> torch.Tensor:
    """DAPO dynamic sampling: True for groups with some right and some wrong answers (DAPO's
    0 < |{o_i correct}| < G). It reads accuracy, not the shaped reward: an all-wrong group whose
    lengths differ only by the overlong penalty teaches nothing about the answer, and is dropped."""
    groups = correct.view(-1, group_size)
    return (groups.max(-1).values - groups.min(-1).values) > 1e-9
