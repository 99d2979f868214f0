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
