"""--skip-zero-advantage: rows of groups whose advantages are all 0 are not run in the update, and the update is the
same: the loss's denominators count them, the minibatches are the same, an all-skipped minibatch still takes its
AdamW step. With a KL term or a critic nothing is skipped."""
import copy
import json
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(REPO, ".cache")


def _model(name):
    from qurl_mini.actor import load_actor
    from qurl_mini.base_model import base_model_path
    from qurl_mini.config import Config
    from qurl_mini.data import load_problems

    cfg = Config(model=name, cache_dir=CACHE, prompt_format="chat" if name else "plain")
    problems, _ = load_problems("synthetic", None, 8, 0, 10)
    actor, tokenizer = load_actor(base_model_path(cfg, problems))
    return actor.train(), tokenizer, problems, cfg.prompt_format


def _experience(actor, tokenizer, problems, prompt_format, groups=4, group_size=4):
    """`groups` prompts x `group_size` responses of random tokens; group 0 all rewarded alike (advantages 0)."""
    from qurl_mini.actor import token_logprobs
    from qurl_mini.advantages import grpo_advantages
    from qurl_mini.batch import Experience, pack_sequences
    from qurl_mini.prompts import PromptBuilder

    gen = torch.Generator().manual_seed(0)
    builder = PromptBuilder(prompt_format, tokenizer)
    prompts, responses = [], []
    for g in range(groups):
        for _ in range(group_size):
            prompts.append(builder.ids(problems[g]))
            n = int(torch.randint(3, 9, (1,), generator=gen))
            responses.append(torch.randint(3, min(tokenizer.vocab_size, 200), (n,), generator=gen).tolist())
    seq = pack_sequences(prompts, responses, tokenizer.pad_token_id)
    rewards = torch.tensor([1.0] * group_size + [float(i % 2) for i in range(group_size * (groups - 1))])
    with torch.no_grad():
        prox = token_logprobs(actor, seq.input_ids, seq.attention_mask, only=seq.response_mask)
    behav = prox - 0.3 * torch.rand(prox.shape, generator=gen) * seq.response_mask  # rho > 1 here and there
    advantages = grpo_advantages(rewards, group_size)[:, None] * seq.response_mask
    assert (advantages[:group_size] == 0).all() and (advantages[group_size:].abs().sum(-1) > 0).all()
    return Experience(seq, prox_logp=prox, behav_logp=behav, advantages=advantages)


def _update(actor, experience, lr, **flags):
    """One update (2 epochs x 4 minibatches, AdamW at the model's own lr: the synthetic task's 1e-4, demo-real's
    1e-5) on a copy of the actor. Its first AdamW steps are near lr * sign(gradient), so a gradient entry near 0
    whose sign the float sums' order flips moves by ~2 lr: the tolerance below is relative to the weights."""
    from qurl_mini.config import Config
    from qurl_mini.update import Updater

    cfg = Config(kl_coef=0.0, lr=lr, minibatches=4, ppo_epochs=2, prompts_per_step=4, group_size=4,
                 objective="acr", quant="int8", **flags)
    model = copy.deepcopy(actor)
    torch.manual_seed(0)
    stats = Updater(cfg, model)(experience)
    return model, stats


@pytest.mark.parametrize("name", [None, "smollm2-135m-arith"], ids=["embedded", "smollm2-135m-arith"])
@pytest.mark.parametrize("shared", [True, False], ids=["shared-prompt", "row-per-response"])
def test_skipping_gives_the_same_update(name, shared):
    if name and not shared:
        pytest.skip("the real model's case runs on the default (shared-prompt) path only")
    actor, tokenizer, problems, prompt_format = _model(name)
    experience = _experience(actor, tokenizer, problems, prompt_format)
    lr = 1e-5 if name else 1e-4
    skipping, stats = _update(actor, experience, lr, skip_zero_advantage=True, shared_prompt=shared)
    running, plain = _update(actor, experience, lr, skip_zero_advantage=False, shared_prompt=shared)
    assert stats["skipped_rows_frac"] == pytest.approx(0.25) and plain["skipped_rows_frac"] == 0
    if shared:  # 4 minibatches of one group each: the all-equal group's minibatch runs no row, and still steps
        assert stats["skipped_minibatches"] == 2 and plain["skipped_minibatches"] == 0
    worst = 0.0
    for (_, a), (_, b), (_, start) in zip(skipping.named_parameters(), running.named_parameters(),
                                          actor.named_parameters()):
        moved = (b - start).norm()
        if moved > 0:
            worst = max(worst, ((a - b).norm() / b.norm()).item())
    assert worst <= 1e-6
    assert any((b - s).norm() > 0 for b, s in zip(running.parameters(), actor.parameters()))
    for key in ("clip_frac", "tis_trunc_frac", "rho_max", "clip_rescued_frac", "policy_loss"):
        assert stats[key] == pytest.approx(plain[key], rel=1e-5, abs=1e-9), key


def test_nothing_is_skipped_with_a_kl_term_or_a_critic():
    from qurl_mini.actor import Critic
    from qurl_mini.config import Config
    from qurl_mini.update import Updater

    actor, tokenizer, problems, prompt_format = _model(None)
    experience = _experience(actor, tokenizer, problems, prompt_format)
    experience.ref_logp = experience.prox_logp.clone()
    kl = Config(kl_coef=1e-3, lr=1e-3, minibatches=4, prompts_per_step=4, group_size=4)
    assert Updater(kl, copy.deepcopy(actor), reference=actor)(experience)["skipped_rows_frac"] == 0
    experience.ref_logp = None
    experience.old_values = torch.zeros_like(experience.prox_logp)
    experience.returns = experience.advantages.clone()
    ppo = Config(algo="ppo", kl_coef=0.0, lr=1e-3, minibatches=4, prompts_per_step=4, group_size=4)
    model = copy.deepcopy(actor)
    assert Updater(ppo, model, critic=Critic(model))(experience)["skipped_rows_frac"] == 0


def test_a_three_step_run_has_the_same_metrics(tmp_path):
    flags = ["--steps", "3", "--prompts-per-step", "8", "--group-size", "4", "--kl-coef", "0", "--eval-every", "0",
             "--eval-size", "8", "--quant", "int3", "--quant-group", "0", "--cache-dir", CACHE, "--out-dir",
             str(tmp_path), "--sync-check-every", "0"]
    rows = {}
    for skip in ("true", "false"):
        proc = subprocess.run([sys.executable, os.path.join(REPO, "train.py"), *flags, "--run-name", skip,
                               "--skip-zero-advantage", skip], cwd=REPO, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-2000:]
        with open(tmp_path / skip / "metrics.jsonl") as f:
            rows[skip] = [json.loads(line) for line in f]
    assert sum(r["skipped_rows_frac"] for r in rows["true"]) > 0  # the run did skip rows
    for on, off in zip(rows["true"], rows["false"]):
        for key, value in off.items():
            if key.startswith("time_") or key in ("skipped_rows_frac", "skipped_tokens_frac", "skipped_minibatches",
                                                  "ratio_mean", "ratio_over_frac"):
                continue  # timings; what skipping logs; the two statistics read on the rows that ran
            assert on[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (on["step"], key)
