"""--measure-acr-gap: ||g_ACR - g_TIS|| / ||g_TIS|| against two independent backward passes."""
import math
from types import SimpleNamespace

import pytest
import torch

from qurl_mini.acr_gap import AcrTisGap
from qurl_mini.loss import aggregation_units, policy_loss

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
    loss = policy_loss(theta, micro.prox_logp, micro.behav_logp, micro.advantages, micro.mask,
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
    loss = policy_loss(theta, micro.prox_logp, micro.behav_logp, micro.advantages, micro.mask,
                       objective=objective, agg="token-mean", **ARGS)
    gap.add(theta, micro, agg="token-mean", units=aggregation_units(micro.mask, "token-mean"), **ARGS)
    loss.backward()
    assert gap.relative() == pytest.approx(expected.item(), rel=1e-6)
    assert math.isfinite(gap.relative()) and gap.relative() > 0.5  # the rescued token dominates here


def test_no_rescued_token_no_gap_and_no_extra_backward():
    theta, micro = _tokens()
    micro.advantages = torch.tensor([[-1.0, 1.0, -1.0]])  # the rho = 5 token now has A < 0: nothing to rescue
    gap = AcrTisGap(torch.nn.ParameterList([theta]), "acr")
    gap.add(theta, micro, agg="token-mean", units=aggregation_units(micro.mask, "token-mean"), **ARGS)
    assert gap.diff is None and gap.relative() == 0.0


def test_rescued_tokens_report_what_each_objective_lets_through():
    """The worked token (rho = 5, R = 1.5, A = +1, C = 2, eps = 0.2): both weight it 2; TIS's bound 1.2 clips it, ACR's
    3.0 does not; d(objective)/d(log pi) from autograd: 0 under TIS, 2 * 1.5 * 1 = 3 under ACR."""
    from qurl_mini.acr_gap import rescued_tokens
    from qurl_mini.batch import SequenceBatch
    from qurl_mini.loss import POLICY_OBJECTIVES, sequence_ratio

    theta, micro = _tokens()
    micro.sequences = SequenceBatch(torch.tensor([[5, 6, 7, 8]]), torch.ones(1, 4, dtype=torch.long), micro.mask)
    (token,) = rescued_tokens(theta, micro, **ARGS)
    assert token["token_id"] == 6 and token["context_ids"] == [5]
    assert token["rho"] == pytest.approx(5) and token["R"] == pytest.approx(1.5) and token["weight"] == 2
    assert token["tis_upper_bound"] == pytest.approx(1.2) and token["acr_upper_bound"] == pytest.approx(3.0)
    rho = torch.exp(micro.prox_logp - micro.behav_logp)
    for name in ("tis", "acr"):
        logp = theta.detach().clone().requires_grad_(True)
        R = torch.exp(logp - micro.prox_logp)
        surrogate = POLICY_OBJECTIVES[name](R, None, rho, 0.2, 0.2, 2.0, seq=sequence_ratio(rho, micro.mask))
        surrogate.per_token(micro.advantages)[0, 0].backward()
        assert logp.grad[0, 0].item() == pytest.approx(token["grad_wrt_logp"][name])
