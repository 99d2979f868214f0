"""Micro-batches sized by tokens (--max-tokens-per-micro-batch), trimmed to their longest row, and
gradient checkpointing: the accumulated gradient is the whole minibatch's, for every loss aggregation."""
import random

import pytest
import torch

from qurl_mini.actor import (Critic, batched_logprobs, batched_values, enable_gradient_checkpointing, load_actor,
                             token_logprobs)
from qurl_mini.batch import Experience, align_per_token, micro_batch_slices, pack_sequences
from qurl_mini.config import Config
from qurl_mini.embedded import build_tiny_model
from qurl_mini.loss import AGGREGATIONS, aggregate, kl_k3, masked_mean, policy_loss, value_loss

SHAPE = dict(layers=2, hidden=64, heads=2, kv_heads=1)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("micro")
    return build_tiny_model(str(tmp / "actor"), seed=0, **SHAPE), build_tiny_model(str(tmp / "ref"), seed=1, **SHAPE)


def _sequences(n=9, seed=0):
    """Rows of different lengths, right-padded; one empty response, one much longer row."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 128) for _ in range(rng.randint(3, 8))] for _ in range(n)]
    responses = [[rng.randrange(3, 128) for _ in range(rng.randint(1, 12))] for _ in range(n)]
    responses[2] = []
    responses[5] = [rng.randrange(3, 128) for _ in range(30)]
    return prompts, responses, pack_sequences(prompts, responses, pad_id=0)


def _experience(actor, reference, critic, max_tokens=None):
    """A PPO-shaped experience: the old policies near the actor, rewards and values random."""
    torch.manual_seed(2)
    prompts, responses, seq = _sequences()
    mask = seq.response_mask
    prox = batched_logprobs(actor, seq, 4, 1.0, max_tokens=max_tokens) + 0.3 * torch.randn(mask.shape)
    behav = align_per_token([[random.uniform(-4, 0) for _ in r] for r in responses], prompts, seq.input_ids.shape[1])
    return Experience(seq, prox_logp=prox, behav_logp=behav, advantages=torch.randn(mask.shape) * mask,
                      ref_logp=batched_logprobs(reference, seq, 4, 1.0, max_tokens=max_tokens),
                      old_values=batched_values(critic, seq, 4, max_tokens=max_tokens),
                      returns=torch.randn(mask.shape) * mask)


def _updater(models, **flags):
    """An `update.Updater` on a tiny actor, reference and critic (no engine, no data); lr 0, no clipping."""
    from qurl_mini.update import Updater

    torch.manual_seed(3)
    actor = load_actor(models[0])[0].train()
    critic = Critic(actor)
    torch.nn.init.normal_(critic.value_head.weight, std=0.5)  # zero-initialised: no backbone gradient
    cfg = Config(algo="ppo", objective="acr", kl_coef=0.1, max_grad_norm=1e9, **flags)
    if cfg.gradient_checkpointing:  # as the updater sets it up
        enable_gradient_checkpointing(actor, critic.backbone)
    updater = Updater(cfg, actor, critic, load_actor(models[1])[0].eval())
    updater.optimizers = {"actor": torch.optim.SGD(actor.parameters(), lr=0.0),
                          "critic": torch.optim.SGD(critic.parameters(), lr=0.0)}
    updater.schedulers = {k: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0) for k, o in updater.optimizers.items()}
    return updater


def _grads(updater):
    return {f"{part}.{n}": p.grad.clone() for part, model in (("actor", updater.actor), ("critic", updater.critic))
            for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(got, expected, what):
    """Equal up to fp32 rounding: within 1e-5 of the tensor's largest entry (summation order differs)."""
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max(), what


def _full_batch_loss(updater, exp):
    """The minibatch loss written out once, on the whole untrimmed batch: Eq. 1's KL term in the policy term's
    --loss-agg average, PPO's value loss a token mean."""
    cfg, seq, m = updater.cfg, exp.sequences, exp.mask
    logp = token_logprobs(updater.actor, seq.input_ids, seq.attention_mask, cfg.temperature)
    loss = policy_loss(logp, exp.prox_logp, exp.behav_logp, exp.advantages, m, objective=cfg.objective,
                       clip_low=cfg.clip_low, clip_high=cfg.clip_high, tis_cap=cfg.tis_cap, agg=cfg.loss_agg)
    kl = aggregate(kl_k3(logp, exp.ref_logp), m, cfg.loss_agg)
    values = updater.critic(seq.input_ids, seq.attention_mask)
    return loss, kl, loss + cfg.kl_coef * kl + masked_mean(value_loss(values, exp.old_values, exp.returns,
                                                                      cfg.value_clip), m)


def test_token_budget_slices_respect_the_budget_and_cover_every_row_once_in_order():
    _, _, seq = _sequences()
    lengths = seq.attention_mask.sum(-1).tolist()
    for budget in (1, 20, 40, 64, 10_000):
        slices = micro_batch_slices(seq, 4, budget)
        rows = [i for s in slices for i in range(len(seq))[s]]
        assert rows == list(range(len(seq)))  # every row once, in the given order
        for s in slices:
            n, width = s.stop - s.start, max(lengths[s])
            assert n * width <= budget or n == 1  # a row longer than the budget goes alone
        if budget >= sum(lengths) and budget >= len(seq) * max(lengths):
            assert len(slices) == 1
    # greedy: a micro-batch closes only when the next row would not fit
    for s, nxt in zip(slices := micro_batch_slices(seq, 4, 40), slices[1:]):
        assert (s.stop - s.start + 1) * max(lengths[s.start:nxt.start + 1]) > 40
    assert [s.stop - s.start for s in micro_batch_slices(seq, 4)] == [4, 4, 1]  # by rows, as before


def test_micro_batches_by_tokens_trim_only_padding_and_keeps_per_token_tensors_aligned(models):
    actor = load_actor(models[0])[0]
    exp = _experience(actor, actor, Critic(actor))
    micros = [exp[rows].trimmed() for rows in micro_batch_slices(exp.sequences, len(exp), 40)]
    assert sum(map(len, micros)) == len(exp) and len(micros) > 2
    start = 0
    for micro in micros:
        rows, width = slice(start, start + len(micro)), micro.sequences.input_ids.shape[1]
        assert len(micro) * width <= 40 or len(micro) == 1
        assert width == micro.sequences.attention_mask.sum(-1).max()  # trimmed to its own longest row
        assert not exp.sequences.attention_mask[rows, width:].any()  # only padding was dropped
        assert torch.equal(micro.sequences.input_ids, exp.sequences.input_ids[rows, :width])
        for name in ("prox_logp", "behav_logp", "advantages", "ref_logp", "old_values", "returns", "mask"):
            assert torch.equal(getattr(micro, name), getattr(exp, name)[rows, :width - 1]), name
        assert not exp.mask[rows, width - 1:].any()  # no response token beyond the cut
        start += len(micro)


def test_token_budget_logprobs_equal_the_full_batch_on_every_real_position(models):
    actor = load_actor(models[0])[0]
    _, _, seq = _sequences()
    real = seq.attention_mask[:, 1:].bool()  # targets inside each row
    full = batched_logprobs(actor, seq, len(seq), 1.0)
    for budget in (1, 40):
        by_tokens = batched_logprobs(actor, seq, len(seq), 1.0, max_tokens=budget)
        assert by_tokens.shape == full.shape
        torch.testing.assert_close(by_tokens[real], full[real], rtol=0, atol=1e-5)
        values = batched_values(Critic(actor), seq, len(seq), max_tokens=budget)
        assert values.shape == full.shape


@pytest.mark.parametrize("loss_agg", AGGREGATIONS)
def test_token_budget_micro_batches_give_the_full_batch_gradient(models, loss_agg):
    whole = _updater(models, loss_agg=loss_agg)
    exp = _experience(whole.actor, whole.reference, whole.critic, max_tokens=40)
    policy, kl, loss = _full_batch_loss(whole, exp)
    loss.backward()
    expected = _grads(whole)
    assert len(expected) > 20 and all(g.abs().sum() > 0 for g in expected.values())
    for flags in (dict(max_tokens_per_micro_batch=40), dict(max_tokens_per_micro_batch=1), dict(micro_batch_size=2)):
        updater = _updater(models, loss_agg=loss_agg, **flags)
        stats = updater._minibatch_step(exp)
        got = _grads(updater)
        assert got.keys() == expected.keys()
        for name in expected:
            _assert_same(got[name], expected[name], f"{flags} {name}")
        assert stats["policy_loss"] == pytest.approx(policy.item(), rel=1e-5, abs=1e-7)
        assert stats["kl_ref"] == pytest.approx(kl.item(), rel=1e-5, abs=1e-9)


def test_gradient_checkpointing_gives_the_same_loss_and_gradient(models):
    exp = None
    results = {}
    for checkpointing in (False, True):
        updater = _updater(models, loss_agg="seq-mean-token-mean", max_tokens_per_micro_batch=64,
                                gradient_checkpointing=checkpointing)
        exp = exp or _experience(updater.actor, updater.reference, updater.critic)
        calls = []
        updater.actor.model.layers[0].register_forward_pre_hook(lambda *a: calls.append(1))  # recompute may stop early
        stats = updater._minibatch_step(exp)
        results[checkpointing] = stats, _grads(updater), len(calls)
        assert updater.actor.is_gradient_checkpointing == checkpointing
        assert updater.critic.backbone.is_gradient_checkpointing == checkpointing
    (plain, g_plain, calls_plain), (ckpt, g_ckpt, calls_ckpt) = results[False], results[True]
    assert calls_ckpt == 2 * calls_plain  # each layer ran again in the backward pass
    for k in ("policy_loss", "kl_ref", "value_loss", "grad_norm"):
        assert ckpt[k] == pytest.approx(plain[k], rel=1e-5, abs=1e-7), k
    for name in g_plain:
        _assert_same(g_ckpt[name], g_plain[name], name)


def test_max_tokens_per_micro_batch_must_be_positive():
    from qurl_mini.config import ConfigError

    with pytest.raises(ConfigError, match="--max-tokens-per-micro-batch must be >= 1"):
        Config(max_tokens_per_micro_batch=0)
