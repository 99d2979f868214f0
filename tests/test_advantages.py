"""Advantage estimators and DAPO's shaping against numbers worked out by hand."""
from types import SimpleNamespace

import pytest
import torch

from qurl_mini.advantages import (ADVANTAGE_ESTIMATORS, gae, grpo_advantages, informative_groups,
                                  overlong_penalty)


def test_gae_with_discount_and_lambda_on_a_padded_batch():
    gamma, lam = 0.9, 0.8
    # row 0: response at t = 0..2, padding at t = 3; row 1: prompt at t = 0, response t = 1..2, padding t = 3
    mask = torch.tensor([[1.0, 1, 1, 0], [0, 1, 1, 0]])
    values = torch.tensor([[0.5, 0.2, -0.1, 9.0], [7.0, 0.3, 0.4, 5.0]])  # padding/prompt values must not leak
    rewards = torch.tensor([[0.0, 0, 1, 0], [0, 0, 2, 0]])
    advantages, returns = gae(rewards, values, mask, gamma, lam)
    # row 0: d2 = 1 + 0.1 = 1.1 -> A2 = 1.1; d1 = 0.9 * -0.1 - 0.2 = -0.29 -> A1 = -0.29 + 0.72 * 1.1 = 0.502;
    #        d0 = 0.9 * 0.2 - 0.5 = -0.32 -> A0 = -0.32 + 0.72 * 0.502 = 0.04144
    # row 1: d2 = 2 - 0.4 = 1.6 -> A2 = 1.6; d1 = 0.9 * 0.4 - 0.3 = 0.06 -> A1 = 0.06 + 0.72 * 1.6 = 1.212
    assert torch.allclose(advantages, torch.tensor([[0.04144, 0.502, 1.1, 0], [0, 1.212, 1.6, 0]]), atol=1e-6)
    assert torch.allclose(returns, torch.tensor([[0.54144, 0.702, 1.0, 0], [0, 1.512, 2.0, 0]]), atol=1e-6)


def test_group_normalisation_gives_zero_for_an_all_equal_group():
    rewards = torch.tensor([1.0, 1, 1, 1, 0, 1, 0, 1])
    adv = grpo_advantages(rewards, group_size=4)
    assert torch.isfinite(adv).all()
    assert adv[:4].tolist() == [0.0, 0.0, 0.0, 0.0]
    # group 2: mean 0.5, unbiased std sqrt(1/3): +-0.5 / 0.57735 = +-0.866025
    assert adv[4:].tolist() == pytest.approx([-0.866025, 0.866025, -0.866025, 0.866025], rel=1e-5)


def test_ppo_estimator_puts_the_reward_on_the_last_response_token_and_centres():
    cfg = SimpleNamespace(gamma=1.0, lam=1.0, group_size=1)
    mask = torch.tensor([[0.0, 1, 1, 0], [1, 1, 1, 1]])
    advantages, returns = ADVANTAGE_ESTIMATORS["gae"](torch.tensor([1.0, 0.0]), mask, torch.zeros(2, 4), cfg)
    # uncentred: row 0 gets 1 on both response tokens, row 1 nothing; the mean over 6 tokens is 1/3
    assert returns.tolist() == [[0, 1, 1, 0], [0, 0, 0, 0]]
    assert torch.allclose(advantages, torch.tensor([[0, 2 / 3, 2 / 3, 0], [-1 / 3] * 4]), atol=1e-6)


def test_group_estimator_spreads_the_normalized_reward_over_response_tokens():
    cfg = SimpleNamespace(group_size=2)
    mask = torch.tensor([[1.0, 1, 0], [0, 1, 1]])
    advantages, returns = ADVANTAGE_ESTIMATORS["group"](torch.tensor([1.0, 0.0]), mask, None, cfg)
    a = 0.5 / (0.5 ** 0.5)  # (1 - 0.5) / std([1, 0]) = 0.7071
    assert returns is None and torch.allclose(advantages, torch.tensor([[a, a, 0], [0, -a, -a]]), atol=1e-5)


@pytest.mark.parametrize("length, expected", [(0, 0.0), (20, 0.0), (21, -0.25), (23, -0.75), (24, -1.0), (30, -1.0)])
def test_overlong_penalty_at_the_buffer_edges(length, expected):
    # max 24 tokens, buffer 4: free up to 20, then linear to -1 at 24 (and no further)
    assert overlong_penalty(length, max_tokens=24, buffer=4, penalty=1.0) == pytest.approx(expected)


def test_overlong_penalty_off_with_no_buffer_and_scaled_by_penalty():
    assert overlong_penalty(24, max_tokens=24, buffer=0, penalty=1.0) == 0.0
    assert overlong_penalty(22, max_tokens=24, buffer=4, penalty=0.5) == pytest.approx(-0.25)


def test_informative_groups_are_those_with_some_right_and_some_wrong_answers():
    correct = torch.tensor([1.0, 1, 0, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 1])
    assert informative_groups(correct, group_size=4).tolist() == [True, False, False, True]
