"""The RL algorithms as data: what each one changes in the shared loop (`--algo NAME`)."""
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Algorithm:
    advantages: str  # a name in advantages.ADVANTAGE_ESTIMATORS
    critic: bool = False  # a value model (PPO)
    group_baseline: bool = True  # advantages relative to the G samples of a prompt (needs G >= 2)
    dynamic_sampling: bool = False  # DAPO: drop groups all right or all wrong, draw more prompts
    overlong_shaping: bool = False  # DAPO: soft penalty for responses near --max-new-tokens
    defaults: dict = field(default_factory=dict)  # flag defaults of the algorithm's paper


ALGORITHMS = {
    "grpo": Algorithm(advantages="group"),
    "ppo": Algorithm(advantages="gae", critic=True, group_baseline=False),
    "dapo": Algorithm(advantages="group", dynamic_sampling=True, overlong_shaping=True,
                      defaults=dict(clip_high=0.28, kl_coef=0.0, loss_agg="token-mean")),
}
