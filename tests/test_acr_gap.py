"""--measure-acr-gap: ||g_ACR - g_TIS|| / ||g_TIS|| against two independent backward passes."""
import math
from types import SimpleNamespace

import pytest
import torch

from qurl_mini.acr_gap import AcrTisGap
from qurl_mini.loss import policy_loss

ARGS = dict(clip_low=0.2, clip_high=0.2, tis_cap=2.0)


def _tokens():
    """Three response tokens: rescued by ACR (A = +1, rho = 5, R = 1.5: TIS clips it, ACR's bound is 3.0), a
    plain one (rho = 1, R = 1.1) and a negative one (A = -1, rho = 3)."""
    prox = torch.tensor([[-1.0, -2.0, -0.5]])
    behav = prox - torch.log(torch.tensor([[5.0, 1.0, 3.0]]))
    theta = torch.nn.Parameter(prox + torch.log(torch.tensor([[1.5, 1.1, 0.9]])))
    micro = SimpleNamespace(prox_logp=prox, behav_logp=behav, advantages=torch.tensor([[1.0, 1.0, -1.0]]),
                            mask=torch.ones(1, 3))
    return theta, micro


def _grad(objective, rows=None):
    theta, micro = _tokens()
    loss, _ = policy_loss(theta, micro.prox_logp, micro.behav_logp, micro.advantages, micro.mask,
                          objective=objective, agg="token-mean", **ARGS)
    loss.backward()
    return theta.grad.clone()


@pytest.mark.parametrize("objective", ["acr", "tis"])
def test_gap_equals_two_separate_gradients(objective):
    g_acr, g_tis = _grad("acr"), _grad("tis")
    # only the rescued token differs: TIS's gradient there is 0, ACR's is -(1/3) * weight 2 * R 1.5 * A 1
    assert g_tis[0, 0] == 0 and g_acr[0, 0] == pytest.approx(-2 * 1.5 / 3)
    expected = (g_acr - g_tis).norm() / g_tis.norm()

    theta, micro = _tokens()
    gap = AcrTisGap(torch.nn.ParameterList([theta]), objective)
    loss, _ = policy_loss(theta, micro.prox_logp, micro.behav_logp, micro.advantages, micro.mask,
                          objective=objective, agg="token-mean", **ARGS)
    gap.add(theta, micro, agg="token-mean", over=None, **ARGS)
    loss.backward()
    assert gap.relative() == pytest.approx(expected.item(), rel=1e-6)
    assert math.isfinite(gap.relative()) and gap.relative() > 0.5  # the rescued token dominates here


def test_no_rescued_token_no_gap_and_no_extra_backward():
    theta, micro = _tokens()
    micro.advantages = torch.tensor([[-1.0, 1.0, -1.0]])  # the rho = 5 token now has A < 0: nothing to rescue
    gap = AcrTisGap(torch.nn.ParameterList([theta]), "acr")
    gap.add(theta, micro, agg="token-mean", over=None, **ARGS)
    assert gap.diff is None and gap.relative() == 0.0
