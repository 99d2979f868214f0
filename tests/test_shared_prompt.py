"""--shared-prompt: a group's prompt once, its responses packed after it, is the unshared computation exactly.

On a step's kind of rows: prompts of different lengths (the chat template and the plain format), responses of
length 1, ending in EOS (= pad on SmolLM2), truncated at --max-new-tokens, groups of 1 and of 8. Log-probs agree
to 1e-5 nats per token (float32; the mean |gap| over tokens, the largest gap within 5e-5: on SmolLM2's 30 layers
the unshared rows themselves move by up to 1.5e-5 when run in a batch or alone, measured on an AMD EPYC, AVX2),
gradients of the trainer's own loss to 1e-4 relative, PPO's values to 1e-6 of the largest.
"""
import random

import pytest
import torch

from qurl_mini.actor import (Critic, batched_logprobs, batched_values, load_actor, shared_prompt_logprobs,
                             shared_prompt_values, token_logprobs)
from qurl_mini.batch import Experience, pack_sequences
from qurl_mini.config import Config
from qurl_mini.data import synthetic_splits
from qurl_mini.packing import pack_groups, packed_micro_batches, prompt_groups, split_groups
from qurl_mini.prompts import PromptBuilder
from qurl_mini.update import Updater

MAX_NEW_TOKENS = 12


def step_rows(tokenizer, prompt_format: str):
    """Three groups (8, 1 and 3 responses) of the synthetic task's prompts, as a rollout would give them: real
    answer tokens cut to many lengths, one of length 1 (EOS alone), some ending in EOS, one truncated."""
    builder = PromptBuilder(prompt_format, tokenizer)
    problems = synthetic_splits(3, 1, max_number=99, seed=3)[0]
    eos, rng = tokenizer.eos_token_id, random.Random(0)
    prompts, responses = [], []
    for problem, size in zip(problems, (8, 1, 3)):
        answer = tokenizer.encode(f"{problem.answer} because {problem.question}", add_special_tokens=False)
        for k in range(size):
            length = rng.randint(1, MAX_NEW_TOKENS)
            response = answer[:length - 1] + [eos] if k % 2 else answer[:length]
            prompts.append(builder.ids(problem))
            responses.append([eos] if k == 1 else response)
    responses[0] = answer[:MAX_NEW_TOKENS]  # truncated: no EOS at --max-new-tokens
    return pack_sequences(prompts, responses, tokenizer.pad_token_id)


@pytest.fixture(scope="module")
def embedded():
    from qurl_mini.embedded import build_tiny_model

    import tempfile

    torch.manual_seed(0)
    return load_actor(build_tiny_model(tempfile.mkdtemp(prefix="shared-"), seed=0))


@pytest.fixture(scope="module")
def smollm2():
    from qurl_mini.infra.paths import ModelError
    from qurl_mini.named_models import resolve_model

    import os

    try:
        return load_actor(resolve_model("smollm2-135m-arith", os.path.join(os.path.dirname(os.path.dirname(
            os.path.abspath(__file__))), ".cache")))
    except ModelError as e:
        pytest.fail(str(e))


MODELS = [("embedded", "plain"), pytest.param("smollm2", "chat", marks=pytest.mark.slow)]


def test_the_rows_are_what_the_test_says(embedded):
    seq = step_rows(embedded[1], "plain")
    lengths = seq.response_mask.sum(-1).tolist()
    assert prompt_groups(seq) == [8, 1, 3] and 1 in lengths and max(lengths) == MAX_NEW_TOKENS
    prompts = (seq.attention_mask.sum(-1) - seq.response_mask.sum(-1)).tolist()
    assert len({prompts[0], prompts[8], prompts[9]}) > 1  # prompts of different lengths


def assert_same_logprobs(a, b, mask):
    assert torch.equal(a != 0, mask)  # the same layout: 0 off the response tokens
    gap = (a - b).abs()[mask]
    assert gap.mean().item() <= 1e-5 and gap.max().item() <= 5e-5, (gap.mean().item(), gap.max().item())


@pytest.mark.parametrize("name,fmt", MODELS)
def test_shared_logprobs_equal_the_unshared_ones(name, fmt, request):
    model, tokenizer = request.getfixturevalue(name)
    seq = step_rows(tokenizer, fmt)
    args = (seq.input_ids, seq.attention_mask, 1.0)
    with torch.no_grad():  # the same inputs and outputs: one swapped for the other
        unshared = token_logprobs(model, *args, only=seq.response_mask)
        shared = shared_prompt_logprobs(model, *args, only=seq.response_mask)
    mask = seq.response_mask > 0
    assert shared.shape == unshared.shape and torch.equal(shared != 0, mask)  # the same layout, 0 off the responses
    assert_same_logprobs(shared, unshared, mask)
    # the micro-batch plan (sub-rows of a group cut by tokens) changes nothing either
    for max_rows, max_tokens in ((3, None), (64, 60)):
        planned = batched_logprobs(model, seq, max_rows, 1.0, max_tokens, shared=True)
        assert_same_logprobs(planned, batched_logprobs(model, seq, max_rows, 1.0, max_tokens), mask)
        assert_same_logprobs(planned, unshared, mask)


@pytest.mark.parametrize("name,fmt", MODELS)
def test_the_updates_gradient_is_the_same_shared_or_not(name, fmt, request):
    """The trainer's own minibatch step (ACR with a KL term, Updater._minibatch_step, lr 0), both ways: the same
    gradient, loss terms and statistics."""
    model, tokenizer = request.getfixturevalue(name)
    seq = step_rows(tokenizer, fmt)
    torch.manual_seed(1)
    prox = batched_logprobs(model, seq, 64, 1.0)
    mask = seq.response_mask
    experience = Experience(seq, prox_logp=prox, behav_logp=prox + 0.1 * torch.randn(prox.shape) * mask,
                            advantages=torch.randn(len(seq), 1) * mask, ref_logp=prox - 0.05 * mask)
    grads, stats = {}, {}
    for shared in (False, True):
        updater = Updater(Config(objective="acr", kl_coef=0.01, shared_prompt=shared, micro_batch_size=5,
                                 max_grad_norm=1e9), model,
                          reference=model)
        updater.optimizers = {"actor": torch.optim.SGD(model.parameters(), lr=0.0)}
        updater.schedulers = {"actor": torch.optim.lr_scheduler.LambdaLR(updater.optimizers["actor"], lambda s: 1.0)}
        stats[shared] = updater._minibatch_step(experience)
        grads[shared] = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    worst = max(((a - b).norm() / a.norm()).item() for a, b in zip(grads[False], grads[True]) if a.norm() > 0)
    assert worst <= 1e-4
    assert stats[True].keys() == stats[False].keys()
    for key, value in stats[False].items():
        assert stats[True][key] == pytest.approx(value, rel=1e-3, abs=1e-5), key


def test_ppo_values_are_the_same_at_the_response_positions(embedded):
    model, tokenizer = embedded
    seq = step_rows(tokenizer, "plain")
    critic = Critic(model)
    torch.manual_seed(0)
    torch.nn.init.normal_(critic.value_head.weight)  # values up to ~13 here
    args = (seq.input_ids, seq.attention_mask)
    with torch.no_grad():
        unshared, shared = critic(*args), shared_prompt_values(critic, *args, only=seq.response_mask)
    mask = seq.response_mask > 0
    largest = unshared[mask].abs().max().item()  # float32 rounding: within 1e-6 of the largest value
    assert (shared - unshared)[mask].abs().max().item() <= 1e-6 * largest
    planned = batched_values(critic, seq, 3, shared=True)
    assert (planned - unshared)[mask].abs().max().item() <= 1e-6 * largest


def test_the_packed_row_and_mask_of_a_two_response_group():
    """The docstring's drawing of pack_groups: prompt p0..p2, responses a (2 tokens) and b (3 tokens)."""
    seq = pack_sequences([[10, 11, 12]] * 2, [[20, 21], [30, 31, 32]], pad_id=0)
    packed = pack_groups(seq, [2])
    assert packed.input_ids.tolist() == [[10, 11, 12, 20, 21, 30, 31, 32]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 4, 5]]
    attends = (packed.attention_bias[0, 0] == 0).int().tolist()
    assert attends[5] == [1, 1, 1, 0, 0, 1, 0, 0]  # b0: the prompt and itself, not a
    assert attends[4] == [1, 1, 1, 1, 1, 0, 0, 0]  # a1: the prompt, a0, itself
    # a0 and b0 scored from p2; a1 from a0, b1 from b0, b2 from b1
    assert packed.hidden_index.tolist() == [2, 3, 2, 5, 6]
    assert packed.target_ids.tolist() == [20, 21, 30, 31, 32]


def test_a_group_is_split_into_sub_rows_where_it_would_exceed_the_token_budget():
    seq = pack_sequences([[1] * 10] * 4, [[2] * 5, [2] * 6, [2] * 7, [2] * 8], pad_id=0)
    assert split_groups(seq, [4], max_rows=64, max_tokens=21) == [2, 1, 1]  # 10+5+6 | 10+7 | 10+8
    assert split_groups(seq, [4], max_rows=3) == [3, 1]
    assert packed_micro_batches(seq, 64, 21) == [slice(0, 2), slice(2, 3), slice(3, 4)]


@pytest.mark.parametrize("max_rows,max_tokens", [(3, None), (64, 60), (64, 25), (2, None), (64, 1)])
def test_a_micro_batchs_own_prompt_groups_are_the_plans_packed_rows(embedded, max_rows, max_tokens):
    """shared_prompt_logprobs takes a micro-batch's rows alone and packs `prompt_groups` of them: the plan's
    sub-rows, as two sub-rows of one group never share a micro-batch."""
    seq = step_rows(embedded[1], "plain")
    pieces = split_groups(seq, prompt_groups(seq), max_rows, max_tokens)
    plan = packed_micro_batches(seq, max_rows, max_tokens)
    assert [size for rows in plan for size in prompt_groups(seq[rows].trimmed())] == pieces


def test_minibatches_shuffle_groups_and_keep_their_sizes():
    seq = pack_sequences([[1, 2]] * 4 + [[3, 4]] * 4 + [[5]] * 4 + [[6, 7, 8]] * 4, [[9]] * 16, pad_id=0)
    experience = Experience(seq, *(torch.zeros(seq.response_mask.shape),) * 3)
    model = torch.nn.Linear(1, 1)
    for shared in (False, True):
        parts = Updater(Config(minibatches=4, shared_prompt=shared), model).minibatch_rows(experience)
        assert sorted(len(p) for p in parts) == [4, 4, 4, 4]
        assert sorted(torch.cat(parts).tolist()) == list(range(16))
        if shared:  # each minibatch is one whole group
            assert all(prompt_groups(experience[p].sequences) == [4] for p in parts)


def test_the_dry_run_computes_the_flop_saving_from_the_sizes():
    """The hand count: the decoder's matmuls on G(P+R) tokens unshared, P+GR shared; attention on every pair of
    each row's square; the lm_head on the G x R response tokens either way."""
    from qurl_mini.infra.memory import ModelShape, group_forward_flops, shared_prompt_saving

    shape = ModelShape(layers=2, hidden=1, intermediate=4, heads=1, kv_heads=1, vocab=10, tied=True)
    linear, head = 2 * shape.decoder_linear_params, 2 * shape.vocab * shape.hidden
    prompt, response, group = 100, 10, 8
    pairs_cost = 4 * shape.layers * shape.heads * shape.head_dim
    unshared = linear * group * (prompt + response) + pairs_cost * group * (prompt + response) ** 2 + head * group * response
    shared = linear * (prompt + group * response) + pairs_cost * (prompt + group * response) ** 2 + head * group * response
    assert group_forward_flops(shape, prompt, response, group, shared=False) == unshared
    assert group_forward_flops(shape, prompt, response, group, shared=True) == shared
    assert shared_prompt_saving(shape, prompt, response, group) == pytest.approx(unshared / shared)
    # at the GSM8K preset's shape, attention's square eats most of the decoder's 1.41x
    from qurl_mini.infra.memory import KNOWN_SHAPES

    qwen = KNOWN_SHAPES["Qwen/Qwen2.5-0.5B-Instruct"]
    assert 1.0 < shared_prompt_saving(qwen, 150, 300, 8) < 3600 / 2550
