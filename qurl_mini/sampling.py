"""Steps 1-2 of an RL step: G responses per prompt from the rollout engine, and their rewards.

DAPO adds two things here, both data to the rest of the step: overlong shaping of the reward, and
dynamic sampling, which keeps only the groups with some right and some wrong answers (a group whose
answers are all right or all wrong has zero group-normalized advantages: no signal).
"""
from dataclasses import dataclass, field

import torch

from .advantages import informative_groups, overlong_penalty
from .data import Problem, PromptOrder, decode_and_score


@dataclass
class Samples:
    """One step's rollout: per prompt a group of G responses, and per response its rewards."""
    problems: list[Problem] = field(default_factory=list)
    groups: list[list] = field(default_factory=list)  # [prompt][response]: engine.Rollout
    rewards: list[torch.Tensor] = field(default_factory=list)  # what advantages see (shaped for DAPO)
    correct: list[torch.Tensor] = field(default_factory=list)  # 1.0 where the answer is right
    stats: dict = field(default_factory=dict)

    def add(self, problem, group, rewards, correct):
        self.problems.append(problem)
        self.groups.append(group)
        self.rewards.append(rewards)
        self.correct.append(correct)

    def __len__(self):
        return len(self.groups)

    def rollouts(self) -> list:
        return [r for g in self.groups for r in g]

    def signal_stats(self) -> dict:
        """The shares a run's learning signal is judged on (metrics.SignalWatch): responses cut off at
        --max-new-tokens, and (G >= 2) groups whose rewards are all equal: zero group-normalized advantage."""
        rollouts = self.rollouts()
        stats = {"truncated_share": sum(r.truncated for r in rollouts) / max(1, len(rollouts))}
        if self.groups and len(self.groups[0]) >= 2:
            stats["zero_advantage_groups"] = sum(bool((r == r[0]).all()) for r in self.rewards) / len(self.rewards)
        return stats


@dataclass
class GroupSampler:
    """Draws the next prompts of the data order (`order`) and G responses each from `engine`, scored."""
    cfg: object  # the run's Config
    algorithm: object  # algorithms.ALGORITHMS[cfg.algo]: overlong_shaping, dynamic_sampling
    engine: object  # engine.RolloutEngine, or anything with its `generate`
    tokenizer: object
    prompts: object  # prompts.PromptBuilder: the prompt ids as the model sees them
    problems: list[Problem]
    order: PromptOrder

    def sample(self) -> Samples:
        """Phases 1-2 of an RL step: --prompts-per-step prompts, G responses each, scored (DAPO: dynamic sampling)."""
        if self.algorithm.dynamic_sampling:
            return self.sample_with_dynamic_sampling()
        return self.draw(self.cfg.prompts_per_step)

    def draw(self, num_prompts: int) -> Samples:
        """One round: the next num_prompts prompts of the data order, G responses each, and their rewards."""
        cfg = self.cfg
        problems = [self.problems[i] for i in self.order.take(num_prompts)]
        groups = self.engine.generate([self.prompts.ids(p) for p in problems], n=cfg.group_size,
                                      temperature=cfg.temperature, max_tokens=cfg.max_new_tokens,
                                      stop_token_ids=[self.tokenizer.eos_token_id])
        samples = Samples()
        for problem, group in zip(problems, groups):
            correct = torch.tensor(decode_and_score(self.tokenizer, problem, [r.response_ids for r in group])[1])
            shaped = correct.clone()
            if self.algorithm.overlong_shaping:
                shaped += torch.tensor([overlong_penalty(len(r.response_ids), cfg.max_new_tokens,
                                                         cfg.overlong_buffer, cfg.overlong_penalty) for r in group])
            samples.add(problem, group, shaped, correct)
        return samples

    def sample_with_dynamic_sampling(self) -> Samples:
        """DAPO: keep only groups with some right and some wrong answers (judged on accuracy, not on
        the shaped reward), drawing more prompts for at most --dapo-max-tries rounds; if none carries
        signal, train on the last round (zero advantages)."""
        cfg, kept, rounds, dropped = self.cfg, Samples(), 0, 0
        while len(kept) < cfg.prompts_per_step and rounds < cfg.dapo_max_tries:
            rounds += 1
            last = self.draw(cfg.prompts_per_step - len(kept))
            for problem, group, shaped, correct in zip(last.problems, last.groups, last.rewards, last.correct):
                if informative_groups(correct, cfg.group_size).item():
                    kept.add(problem, group, shaped, correct)
                else:
                    dropped += 1
        if not len(kept):
            kept = last
        kept.stats = {"rollout_rounds": rounds, "groups_dropped": dropped, "batch_prompts": len(kept)}
        return kept
