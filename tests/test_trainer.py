"""One real RL step in-process (tiny model, INT8 engine): what the step logs is what it computed."""
import json

import pytest
import torch

from qurl_mini.config import Config
from qurl_mini.embedded import build_tiny_model
from qurl_mini.loss import masked_mean


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    from qurl_mini.trainer import Trainer

    tmp = tmp_path_factory.mktemp("trainer")
    tiny = build_tiny_model(str(tmp / "tiny"), layers=1, hidden=64, heads=2, kv_heads=1)
    data = tmp / "gsm.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}+1?", "answer": f"#### {i + 1}"}) + "\n" for i in range(40)))
    cfg = Config(model=tiny, data=str(data), quant="int8", out_dir=str(tmp / "runs"), run_name="t", steps=1,
                 prompts_per_step=4, eval_size=4, max_new_tokens=8, minibatches=4)
    return Trainer(cfg)


def test_logged_kl_behav_prox_is_the_steps_kl_over_all_its_tokens(trainer, monkeypatch):
    seen = []
    real_update = type(trainer).update

    def recording_update(self, experience):
        seen.append(experience)
        return real_update(self, experience)

    monkeypatch.setattr(type(trainer), "update", recording_update)
    row = trainer.step(1)
    (exp,) = seen
    step_kl = masked_mean(exp.behav_logp - exp.prox_logp, exp.mask).item()
    assert row["kl_behav_prox"] == pytest.approx(step_kl, rel=1e-6, abs=1e-12)
    # the experience is row-aligned: every selected minibatch carries the same rows of every tensor
    rows = torch.tensor([2, 0])
    mb = exp[rows]
    assert torch.equal(mb.sequences.input_ids, exp.sequences.input_ids[rows])
    assert torch.equal(mb.prox_logp, exp.prox_logp[rows]) and torch.equal(mb.advantages, exp.advantages[rows])
    assert mb.old_values is None and len(mb) == 2 and sum(map(len, exp.split(3))) == len(exp)


class ScriptedEngine:
    """Answers prompt [i] with the responses scripted for problem i (text -> one token per character)."""

    def __init__(self, responses):
        self.responses = responses

    def generate(self, prompts, *, n, temperature, max_tokens, stop_token_ids):
        from qurl_mini.engine import Rollout

        return [[Rollout(p, [ord(c) for c in text], [0.0] * len(text), truncated=False)
                 for text in self.responses[p[0]]] for p in prompts]


def test_dapo_drops_an_all_wrong_group_whose_lengths_differ():
    """DAPO filters on accuracy: the all-wrong group's shaped rewards differ (the overlong penalty
    reaches 3 of its 4 responses), yet it carries no answer signal and is dropped; the mixed one stays."""
    from types import SimpleNamespace

    from qurl_mini.algorithms import ALGORITHMS
    from qurl_mini.data import Problem, PromptSampler
    from qurl_mini.trainer import Samples, Trainer

    cfg = Config(algo="dapo", prompts_per_step=2, group_size=4, max_new_tokens=8, overlong_buffer=4,
                 overlong_penalty=1.0, dapo_max_tries=1)
    problems = [Problem("1+1?", "#### 2", 2.0), Problem("2+2?", "#### 4", 4.0)]
    responses = {0: ["#### 3", " #### 3", "  #### 3", "####3"],  # all wrong; 6, 7, 8 and 5 tokens
                 1: ["#### 4", "#### 5", "#### 4", "#### 5"]}  # two right, two wrong
    fake = SimpleNamespace(cfg=cfg, algorithm=ALGORITHMS["dapo"], train_problems=problems,
                           sampler=PromptSampler(2, seed=0), engine=ScriptedEngine(responses),
                           prompts=SimpleNamespace(ids=lambda p: [problems.index(p)]),
                           tokenizer=SimpleNamespace(eos_token_id=0, decode=lambda ids, **_: "".join(map(chr, ids))))
    fake.sample = lambda num_prompts=None: Trainer.sample(fake, num_prompts)

    everything = fake.sample(2)
    wrong = everything.problems.index(problems[0])
    assert everything.correct[wrong].tolist() == [0, 0, 0, 0]
    # overlong shaping from 4 tokens on, -1 at 8: lengths 6, 7, 8, 5 -> -0.5, -0.75, -1, -0.25
    assert everything.rewards[wrong].tolist() == pytest.approx([-0.5, -0.75, -1.0, -0.25])

    fake.sampler = PromptSampler(2, seed=0)  # the same draw again, now through dynamic sampling
    kept = Trainer.sample_with_dynamic_sampling(fake)
    assert isinstance(kept, Samples) and kept.problems == [problems[1]]
    assert kept.stats == {"rollout_rounds": 1, "groups_dropped": 1, "batch_prompts": 1}
    assert kept.correct[0].tolist() == [1, 0, 1, 0]
    assert kept.rewards[0].tolist() == pytest.approx([0.5, -0.5, 0.5, -0.5])  # advantages see the shaped reward
