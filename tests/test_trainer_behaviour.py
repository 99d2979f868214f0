"""What the trainer does, pinned so that a broken trainer fails: --objective reaches the loss through
the trainer's own update, and DAPO's dynamic sampling (its rollout) drops the groups that carry no signal.
In-process, a tiny random Qwen2, no engine (the update and the sync with a live engine:
tests/test_trainer.py; UAQ's effect on the INT8 codes: tests/test_quant_uaq.py)."""
import random
from types import SimpleNamespace

import pytest
import torch

from qurl_mini.actor import token_logprobs
from qurl_mini.batch import Experience, pack_sequences
from qurl_mini.config import Config
from qurl_mini.embedded import build_char_tokenizer, tiny_qwen2_config


def _tiny_actor():
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(tiny_qwen2_config(build_char_tokenizer(), layers=1, hidden=64, heads=2,
                                              kv_heads=1)).train()


def _updater(objective: str):
    """The trainer's update (`update.Updater`) on a fresh tiny actor (no engine, no data, no reference); one
    minibatch, no gradient clipping."""
    from qurl_mini.update import Updater

    return Updater(Config(quant="int8", objective=objective, kl_coef=0.0, minibatches=1, max_grad_norm=1e9),
                   _tiny_actor())


def _experience(actor, log_rho: float) -> Experience:
    """Six rows; pi_prox = the actor itself (R = 1 before the update) and pi_behav = pi_prox - log_rho
    on every response token, so rho = pi_prox / pi_behav = exp(log_rho) everywhere; advantages +-1."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 100) for _ in range(4)] for _ in range(6)]
    responses = [[rng.randrange(3, 100) for _ in range(rng.randint(3, 7))] for _ in range(6)]
    seq = pack_sequences(prompts, responses, pad_id=0)
    mask = seq.response_mask
    with torch.no_grad():
        prox = token_logprobs(actor, seq.input_ids, seq.attention_mask) * mask
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, -1.0])[:, None] * mask
    return Experience(seq, prox_logp=prox, behav_logp=prox - log_rho * mask, advantages=advantages)


def _update_gradient(objective: str, log_rho: float) -> torch.Tensor:
    """The actor's gradient after one `Updater` call (its minibatch and micro-batch path), flattened."""
    updater = _updater(objective)
    stats = updater(_experience(updater.actor, log_rho))
    assert stats["skipped_updates"] == 0
    return torch.cat([p.grad.flatten() for p in updater.actor.parameters() if p.grad is not None])


def test_naive_and_acr_objectives_give_different_gradients_where_rho_is_not_1():
    """rho = 1.5 (< C = 2): ACR is rho * min(R A, clip(R) A) with R = 1, gradient rho * A * dR;
    naive's ratio is R / rho = 0.67, outside its clip range [0.8, 1.2]: the tokens with A < 0 are clipped
    (no gradient) and those with A > 0 carry weight 1, not 1.5. The two must differ, clearly."""
    naive, acr = _update_gradient("naive", 0.405), _update_gradient("acr", 0.405)
    assert naive.norm() > 0 and acr.norm() > 0
    assert (naive - acr).norm() > 0.2 * acr.norm()


def test_naive_and_acr_objectives_give_the_same_gradient_where_rho_is_1():
    """pi_behav = pi_prox: both reduce to PPO's Eq. 1, so the trainer's gradients agree to rounding."""
    naive, acr = _update_gradient("naive", 0.0), _update_gradient("acr", 0.0)
    assert acr.norm() > 0
    assert torch.allclose(naive, acr, rtol=1e-5, atol=1e-9)


class ScriptedEngine:
    """Answers prompt [i] with the responses scripted for problem i (text -> one token per character)."""

    def __init__(self, responses):
        self.responses = responses

    def generate(self, prompts, *, n, temperature, max_tokens, stop_token_ids):
        from qurl_mini.engine import Rollout

        return [[Rollout(p, [ord(c) for c in text], [0.0] * len(text), truncated=False)
                 for text in self.responses[p[0]]] for p in prompts]


def _scripted_sampler(problems, responses, **flags):
    """The trainer's rollout (`sampling.GroupSampler`) on a scripted engine and a one-token-per-problem prompt."""
    from qurl_mini.algorithms import ALGORITHMS
    from qurl_mini.data import PromptOrder
    from qurl_mini.sampling import GroupSampler

    cfg = Config(algo="dapo", prompts_per_step=len(problems), group_size=4, max_new_tokens=8, **flags)
    tokenizer = SimpleNamespace(eos_token_id=0, decode=lambda ids, **_: "".join(map(chr, ids)))
    return GroupSampler(cfg, ALGORITHMS["dapo"], ScriptedEngine(responses), tokenizer,
                        prompts=SimpleNamespace(ids=lambda p: [problems.index(p)]), problems=problems,
                        order=PromptOrder(len(problems), seed=0))


def test_dapo_dynamic_sampling_drops_the_all_right_and_all_wrong_groups():
    from qurl_mini.data import Problem

    problems = [Problem(f"{i}+1?", f"#### {i + 1}", float(i + 1)) for i in range(4)]
    responses = {0: ["#### 1", "#### 1", "#### 1", "#### 1"],  # all right
                 1: ["#### 2", "#### 9", "#### 9", "#### 9"],  # one right
                 2: ["#### 7", "#### 7", "#### 8", "#### 0"],  # all wrong
                 3: ["#### 4", "#### 4", "#### 4", "#### 3"]}  # three right
    kept = _scripted_sampler(problems, responses, dapo_max_tries=1).sample()  # DAPO: with dynamic sampling
    assert sorted(kept.problems, key=problems.index) == [problems[1], problems[3]]
    assert kept.stats == {"rollout_rounds": 1, "groups_dropped": 2, "batch_prompts": 2}
    by_question = {p.question: c.tolist() for p, c in zip(kept.problems, kept.correct)}
    assert by_question == {"1+1?": [1, 0, 0, 0], "3+1?": [1, 1, 1, 0]}


def test_dapo_drops_an_all_wrong_group_whose_lengths_differ():
    """DAPO filters on accuracy: the all-wrong group's shaped rewards differ (the overlong penalty
    reaches 3 of its 4 responses), yet it carries no answer signal and is dropped; the mixed one stays."""
    from qurl_mini.data import Problem, PromptOrder
    from qurl_mini.sampling import Samples

    problems = [Problem("1+1?", "#### 2", 2.0), Problem("2+2?", "#### 4", 4.0)]
    responses = {0: ["#### 3", " #### 3", "  #### 3", "####3"],  # all wrong; 6, 7, 8 and 5 tokens
                 1: ["#### 4", "#### 5", "#### 4", "#### 5"]}  # two right, two wrong
    rollout = _scripted_sampler(problems, responses, overlong_buffer=4, overlong_penalty=1.0, dapo_max_tries=1)

    everything = rollout.draw(2)
    wrong = everything.problems.index(problems[0])
    assert everything.correct[wrong].tolist() == [0, 0, 0, 0]
    # overlong shaping from 4 tokens on, -1 at 8: lengths 6, 7, 8, 5 -> -0.5, -0.75, -1, -0.25
    assert everything.rewards[wrong].tolist() == pytest.approx([-0.5, -0.75, -1.0, -0.25])

    rollout.order = PromptOrder(2, seed=0)  # the same draw again, now through dynamic sampling
    kept = rollout.sample()
    assert isinstance(kept, Samples) and kept.problems == [problems[1]]
    assert kept.stats == {"rollout_rounds": 1, "groups_dropped": 1, "batch_prompts": 1}
    assert kept.correct[0].tolist() == [1, 0, 1, 0]
    assert kept.rewards[0].tolist() == pytest.approx([0.5, -0.5, 0.5, -0.5])  # advantages see the shaped reward


def test_a_steps_rho_max_is_the_largest_rho_of_its_tokens_not_a_mean_of_minibatch_maxima():
    """Three minibatches (of 2 rows) x 2 epochs; one token's rho is 7 and all others are 1.25: the step's rho_max
    is 7 (a mean of the minibatch maxima would be (7 + 1.25 + 1.25) / 3 = 3.17)."""
    import math

    updater = _updater("acr")
    updater.cfg.minibatches, updater.cfg.ppo_epochs = 3, 2
    experience = _experience(updater.actor, math.log(1.25))
    first = experience.mask[0].nonzero()[0].item()
    experience.behav_logp[0, first] = experience.prox_logp[0, first] - math.log(7.0)
    stats = updater(experience)
    assert stats["rho_max"] == pytest.approx(7.0, rel=1e-5)


def test_a_steps_signal_shares_and_the_one_warning_of_a_run_that_cannot_learn(caplog):
    """The shares a step logs (responses cut off, groups whose rewards are all equal), and `SignalWatch`: one
    warning line with the fix, once per run, after 3 steps without signal (the run itself: tests/test_e2e.py)."""
    import logging

    from qurl_mini.engine import Rollout
    from qurl_mini.metrics import SignalWatch
    from qurl_mini.sampling import Samples

    samples = Samples()
    for rewards, cut in (([0.0, 0.0], [True, True]), ([1.0, 0.0], [True, False])):
        samples.add(None, [Rollout([1], [2], [0.0], truncated=c) for c in cut], torch.tensor(rewards),
                    torch.tensor(rewards))
    assert samples.signal_stats() == {"truncated_share": 0.75, "zero_advantage_groups": 0.5}

    with caplog.at_level(logging.WARNING, logger="qurl_mini"):
        watch = SignalWatch(max_new_tokens=4)
        watch.observe(1, 0.0, 1.0)
        watch.observe(2, 0.0, 0.9)
        assert not caplog.records  # two steps are not yet "several"
        for step in (3, 4, 5):
            watch.observe(step, 0.0, 1.0)
    (warning,) = caplog.records  # once per run
    assert warning.getMessage() == ("steps 1-3: every response scored 0 and 97% of the responses hit "
                                    "--max-new-tokens 4, cut off before their '####' answer: nothing to learn from; "
                                    "raise --max-new-tokens")

    def verdict(*steps):  # (accuracy, truncated share) of 3 steps in a row
        watch = SignalWatch(max_new_tokens=24)
        watch.recent = [(i + 1, accuracy, cut) for i, (accuracy, cut) in enumerate(steps)]
        return watch.problem()

    all_wrong = verdict((0.0, 0.1), (0.0, 0.0), (0.0, 0.2))  # answers not cut off, yet never right
    assert "start easier" in all_wrong and all_wrong.endswith("or lower --lr")
    assert "every response scored 1" in verdict((1.0, 0.0), (1.0, 0.0), (1.0, 0.0))
    assert verdict((0.2, 0.6), (0.1, 0.7), (0.0, 0.6)).endswith("cut off before their '####' answer; raise "
                                                                "--max-new-tokens")
    assert verdict((0.0, 0.1), (0.1, 0.0), (0.0, 0.2)) is None  # one step with signal: it can learn
    assert verdict((0.5, 0.5), (0.5, 0.5), (0.5, 0.5)) is None  # half cut off is not "mostly"
