"""One real RL step in-process (tiny model, INT8 engine): what the step logs is what it computed, and
an update moves the actor's weights, the next sync the engine's (DAPO's sampling and the objectives'
gradients through the trainer: tests/test_trainer_behaviour.py)."""
import json
import math

import pytest
import torch

from qurl_mini.config import Config
from qurl_mini.embedded import build_tiny_model


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
    real_update = trainer.updater

    def recording_update(experience):
        seen.append(experience)
        return real_update(experience)

    monkeypatch.setattr(trainer, "updater", recording_update)
    row = trainer.step(1)
    (exp,) = seen
    # by hand, token by token: k1 = mean log(pi_behav / pi_prox), k3 = mean (rho - 1 - log rho)
    gaps = [(b - p) for b_row, p_row, m_row in zip(exp.behav_logp.tolist(), exp.prox_logp.tolist(), exp.mask.tolist())
            for b, p, m in zip(b_row, p_row, m_row) if m == 1]
    assert len(gaps) == exp.mask.sum().item() > 0
    assert row["kl_behav_prox"] == pytest.approx(sum(gaps) / len(gaps), rel=1e-5, abs=1e-9)
    assert row["kl_behav_prox_k3"] == pytest.approx(sum(math.exp(-g) - 1 + g for g in gaps) / len(gaps),
                                                    rel=1e-4, abs=1e-12)
    # the experience is row-aligned: every selected minibatch carries the same rows of every tensor
    rows = torch.tensor([2, 0])
    mb = exp[rows]
    assert torch.equal(mb.sequences.input_ids, exp.sequences.input_ids[rows])
    assert torch.equal(mb.prox_logp, exp.prox_logp[rows]) and torch.equal(mb.advantages, exp.advantages[rows])
    assert mb.old_values is None and len(mb) == 2


def test_an_update_moves_the_actors_weights_and_the_next_sync_the_engines(trainer):
    """On a batch with advantages +-1 (a random model's own answers are all wrong: zero advantages, no
    update), one `update` changes the actor's projections; the engine's log-probs of a fixed sequence
    change only at the next `sync`, to match the updated actor within the INT8 start gap."""
    from qurl_mini.actor import token_logprobs
    from qurl_mini.batch import Experience, pack_sequences

    sequence = trainer.probe.sequence
    prompt_len = len(sequence) // 2
    seq = pack_sequences([sequence[:prompt_len]] * 4, [sequence[prompt_len:]] * 4, trainer.tokenizer.pad_token_id)
    mask = seq.response_mask
    with torch.no_grad():
        prox = token_logprobs(trainer.actor, seq.input_ids, seq.attention_mask) * mask
    experience = Experience(seq, prox_logp=prox, behav_logp=prox,
                            advantages=torch.tensor([1.0, 1.0, 1.0, -0.5])[:, None] * mask,
                            ref_logp=prox if trainer.reference is not None else None)
    name = "model.layers.0.self_attn.q_proj.weight"
    weight_before = trainer.actor.get_parameter(name).detach().clone()
    engine_before = trainer.probe_sides.engine_logprobs()

    scheduler = trainer.updater.schedulers["actor"]
    scheduler.base_lrs, base_lrs = [1e-2], scheduler.base_lrs  # a step the bf16/INT8 engine cannot miss
    try:
        trainer.updater(experience)
    finally:
        scheduler.base_lrs = base_lrs
    assert (trainer.actor.get_parameter(name) - weight_before).abs().max() > 0
    assert torch.equal(trainer.probe_sides.engine_logprobs(), engine_before)  # not synced yet

    synced = trainer.engine.sync_weights(trainer.actor)
    assert name in synced.codes
    engine_after = trainer.probe_sides.engine_logprobs()
    moved = (engine_after - engine_before).abs().mean().item()
    assert moved > 1e-4
    assert (engine_after - trainer.probe_sides.actor_logprobs()).abs().mean().item() < moved
