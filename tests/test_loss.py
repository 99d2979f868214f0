"""The objectives against values worked out by hand (C = 2, eps = 0.2): the paper's five and the corrections the
field uses today (icepop, seq-tis, geo-tis, seq-mask)."""
import math

import pytest
import torch

from qurl_mini.loss import OBJECTIVES, aggregate, kl_k3, policy_loss, policy_stats, sampler_mismatch, value_loss


def loss_and_stats(logp, prox, behav, adv, mask, agg="token-mean", **objective):
    """policy_loss (a token mean unless agg says otherwise) and policy_stats, on the same tokens."""
    return policy_loss(logp, prox, behav, adv, mask, agg=agg, **objective), policy_stats(logp, prox, behav, adv, mask,
                                                                                        **objective)

# (pi_theta, pi_prox, pi_behav, A) per token, and the per-token objective each equation gives.
#   R = theta/prox, R_hat = theta/behav, rho = prox/behav, clip range [0.8, 1.2]
# The sequence-level rules see row 0 = tokens 0-2 (prod rho = 1 * 3 * 2 = 6, geometric mean 6^(1/3) = 1.817) and
# row 1 = tokens 3-4 (prod rho = 4 * 3 = 12, geometric mean 3.46): seq-tis weights both rows min(., 2) = 2, geo-tis
# 1.817 and 2, seq-mask drops both (6 and 12 > C); icepop keeps the tokens with 1/2 <= rho <= 2 (tokens 0 and 2).
G = 6 ** (1 / 3)
TOKENS = [
    # R = 1.25 (clipped), rho = 1
    ((0.5, 0.4, 0.4, +1.0), dict(ppo=1.2, naive=1.2, decoupled=1.2, tis=1.2, acr=1.2,
                                 icepop=1.2, **{"seq-tis": 2.4, "geo-tis": G * 1.2, "seq-mask": 0.0})),
    # R = 1, R_hat = 3, rho = 3 > C: TIS truncates to 2; ACR's r = 2/3, upper bound 1.8
    ((0.3, 0.3, 0.1, +1.0), dict(ppo=1.0, naive=1.2, decoupled=3.0, tis=2.0, acr=2.0,
                                 icepop=0.0, **{"seq-tis": 2.0, "geo-tis": G, "seq-mask": 0.0})),
    # R = 3, rho = 2 = C exactly (no truncation, r = 1)
    ((0.6, 0.2, 0.1, +1.0), dict(ppo=1.2, naive=1.2, decoupled=2.4, tis=2.4, acr=2.4,
                                 icepop=2.4, **{"seq-tis": 2.4, "geo-tis": G * 1.2, "seq-mask": 0.0})),
    # negative advantage: R = 0.5 -> clip to 0.8 wins the min; R_hat = 2; rho = 4
    ((0.1, 0.2, 0.05, -1.0), dict(ppo=-0.8, naive=-2.0, decoupled=-3.2, tis=-1.6, acr=-1.6,
                                  icepop=0.0, **{"seq-tis": -1.6, "geo-tis": -1.6, "seq-mask": 0.0})),
    # R = 5/3 with rho = 3: TIS clips at 1.2, ACR's raised bound 1.8 lets 5/3 through
    ((0.5, 0.3, 0.1, +1.0), dict(ppo=1.2, naive=1.2, decoupled=3.6, tis=2.4, acr=2 * 5 / 3,
                                 icepop=0.0, **{"seq-tis": 2.4, "geo-tis": 2.4, "seq-mask": 0.0})),
]
# d(objective)/d(log pi_theta) per token: weight * R * A where the unclipped branch is active, else 0
NEW = ("icepop", "seq-tis", "geo-tis", "seq-mask")
GRADS = [
    dict(ppo=0, naive=0, decoupled=0, tis=0, acr=0, **dict.fromkeys(NEW, 0)),
    dict(ppo=1.0, naive=0, decoupled=3.0, tis=2.0, acr=2.0, icepop=0, **{"seq-tis": 2.0, "geo-tis": G, "seq-mask": 0}),
    dict(ppo=0, naive=0, decoupled=0, tis=0, acr=0, **dict.fromkeys(NEW, 0)),
    dict(ppo=0, naive=-2.0, decoupled=0, tis=0, acr=0, **dict.fromkeys(NEW, 0)),
    dict(ppo=0, naive=0, decoupled=0, tis=0, acr=2 * 5 / 3, **dict.fromkeys(NEW, 0)),
]


def _batch():
    """Row 0: tokens 0-2; row 1: tokens 3-4 and padding; row 2: empty."""
    logp = torch.zeros(3, 3)
    prox, behav, adv, mask = torch.zeros(3, 3), torch.zeros(3, 3), torch.zeros(3, 3), torch.zeros(3, 3)
    for k, ((theta, p, b, a), _) in enumerate(TOKENS):
        i, j = divmod(k, 3)
        logp[i, j], prox[i, j], behav[i, j], adv[i, j], mask[i, j] = math.log(theta), math.log(p), math.log(b), a, 1
    return logp.requires_grad_(), prox, behav, adv, mask


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_token_mean_value_and_gradient_match_hand_calculation(objective):
    logp, prox, behav, adv, mask = _batch()
    loss, stats = loss_and_stats(logp, prox, behav, adv, mask, objective=objective, tis_cap=2.0)
    expected = -sum(t[1][objective] for t in TOKENS) / 5
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    loss.backward()
    expected_grad = [-g[objective] / 5 for g in GRADS]
    got = [logp.grad[divmod(k, 3)].item() for k in range(5)]
    assert got == pytest.approx(expected_grad, abs=1e-5)
    assert logp.grad[1, 2].item() == 0 and logp.grad[2].abs().sum().item() == 0  # padding, empty row


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_seq_mean_token_mean_averages_each_nonempty_row(objective):
    logp, prox, behav, adv, mask = _batch()
    loss, _ = loss_and_stats(logp, prox, behav, adv, mask, objective=objective, agg="seq-mean-token-mean")
    row0 = sum(t[1][objective] for t in TOKENS[:3]) / 3
    row1 = sum(t[1][objective] for t in TOKENS[3:]) / 2
    assert loss.item() == pytest.approx(-(row0 + row1) / 2, rel=1e-5)  # the empty row is not counted


def test_stats_report_truncation_clipping_and_the_step_reports_the_sampler_gap():
    logp, prox, behav, adv, mask = _batch()
    _, stats = loss_and_stats(logp, prox, behav, adv, mask, objective="tis", tis_cap=2.0)
    assert stats["tis_trunc_frac"] == pytest.approx(3 / 5)  # rho = 3, 4, 3 exceed C = 2
    assert stats["rho_max"] == pytest.approx(4.0, rel=1e-5)
    # tokens 0, 2, 3, 4 take the clipped branch under TIS
    assert stats["clip_frac"] == pytest.approx(4 / 5)
    gap = sum(math.log(b) - math.log(p) for (_, p, b, _), _ in TOKENS) / 5
    assert "kl_behav_prox" not in stats  # the step's, over all its tokens, once:
    assert sampler_mismatch(prox, behav, mask, tis_cap=2.0)["kl_behav_prox"] == pytest.approx(gap, rel=1e-5)
    _, acr_stats = loss_and_stats(logp, prox, behav, adv, mask, objective="acr", tis_cap=2.0)
    assert acr_stats["clip_frac"] == pytest.approx(3 / 5)  # ACR lets token 4 through


def test_all_objectives_collapse_when_sampler_equals_proximal():
    torch.manual_seed(0)
    prox = torch.randn(4, 6).log_softmax(-1)
    logp = (prox + 0.3 * torch.randn(4, 6)).requires_grad_()
    adv, mask = torch.randn(4, 6), (torch.rand(4, 6) > 0.3).float()
    losses, grads = [], []
    for objective in OBJECTIVES:
        loss, _ = loss_and_stats(logp, prox, prox.clone(), adv, mask, objective=objective)
        (grad,) = torch.autograd.grad(loss, logp)
        losses.append(loss.item())
        grads.append(grad)
    assert max(losses) - min(losses) < 1e-6
    assert all(torch.allclose(g, grads[0], atol=1e-7) for g in grads)


def test_empty_mask_gives_zero_loss_not_nan():
    logp = torch.zeros(2, 3, requires_grad=True)
    for agg in ("token-mean", "seq-mean-token-mean"):
        loss, stats = loss_and_stats(logp, logp.detach(), logp.detach(), torch.ones(2, 3), torch.zeros(2, 3),
                                  objective="acr", agg=agg)
        assert loss.item() == 0.0 and math.isfinite(stats["rho_max"])


def test_unknown_objective_and_aggregation_are_refused():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="unknown objective"):
        policy_loss(x, x, x, x, x + 1, objective="grpo", agg="token-mean")
    with pytest.raises(ValueError, match="unknown aggregation"):
        aggregate(x, x + 1, "sum")


def test_k3_kl_matches_closed_form():
    logp, ref = torch.tensor([math.log(0.5), math.log(0.2)]), torch.tensor([math.log(0.25), math.log(0.2)])
    # k3 = ref/p - log(ref/p) - 1: 0.5 - log 0.5 - 1 = 0.193147, and 0 when equal
    assert kl_k3(logp, ref).tolist() == pytest.approx([0.5 + math.log(2) - 1, 0.0], abs=1e-6)


def test_value_loss_takes_the_larger_of_clipped_and_unclipped():
    values, old, returns = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.5, 0.0]]), torch.tensor([[0.0, 2.0]])
    # token 0: unclipped (1-0)^2 = 1, clipped to 0.7: 0.49 -> 1; token 1: (0-2)^2 = 4 both; halved: 0.5 and 2
    assert value_loss(values, old, returns, clip=0.2)[0].tolist() == pytest.approx([0.5, 2.0])


# Clipping is decided by which branch of the min is active (issue: products compared in floating
# point reported 18% "clipped" tokens for weighted objectives where none was). C = 2, eps = 0.2.
#   (pi_theta, pi_prox, pi_behav, A), and for each objective: "above", "below" or None
CLIP_TOKENS = [
    ((0.60, 0.40, 0.40, +1.0), dict(ppo="above", naive="above", decoupled="above", tis="above", acr="above")),
    ((0.20, 0.40, 0.40, -1.0), dict(ppo="below", naive="below", decoupled="below", tis="below", acr="below")),
    ((0.20, 0.40, 0.40, +1.0), dict(ppo=None, naive=None, decoupled=None, tis=None, acr=None)),  # R < low, A > 0
    ((0.60, 0.40, 0.40, -1.0), dict(ppo=None, naive=None, decoupled=None, tis=None, acr=None)),  # R > high, A < 0
    # R = 1.5, rho = 3 > C: ACR's bound is 1.2 / (2/3) = 1.8, so ACR alone keeps this token
    ((0.45, 0.30, 0.10, +1.0), dict(ppo="above", naive="above", decoupled="above", tis="above", acr=None)),
    # R = 2.0 is above even ACR's widened bound 1.8
    ((0.60, 0.30, 0.10, +1.0), dict(ppo="above", naive="above", decoupled="above", tis="above", acr="above")),
    # R = 0.5, rho = 3, A < 0: the lower bound is not widened; naive's R_hat = 1.5 is not clipped for A < 0
    ((0.15, 0.30, 0.10, -1.0), dict(ppo="below", naive=None, decoupled="below", tis="below",
                                    acr="below")),
    # R = 1, rho = 0.5: only naive's R_hat = 0.5 is outside, below for A < 0
    ((0.30, 0.30, 0.60, -1.0), dict(ppo=None, naive="below", decoupled=None, tis=None, acr=None)),
    ((0.60, 0.40, 0.40, 0.0), dict(ppo=None, naive=None, decoupled=None, tis=None, acr=None)),  # A = 0: never
]


def _clip_batch():
    """The 9 tokens in a [2, 6] batch; the 3 padding positions hold ratios that would be clipped."""
    logp, prox, behav = torch.full((2, 6), math.log(0.9)), torch.full((2, 6), math.log(0.1)), torch.full((2, 6), -5.0)
    adv, mask = torch.ones(2, 6), torch.zeros(2, 6)
    for k, ((theta, p, b, a), _) in enumerate(CLIP_TOKENS):
        i, j = divmod(k, 6)
        logp[i, j], prox[i, j], behav[i, j], adv[i, j], mask[i, j] = math.log(theta), math.log(p), math.log(b), a, 1
    return logp.requires_grad_(), prox, behav, adv, mask


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_clip_fractions_split_by_bound_match_hand_classification(objective):
    logp, prox, behav, adv, mask = _clip_batch()
    loss, stats = loss_and_stats(logp, prox, behav, adv, mask, objective=objective, tis_cap=2.0)
    # the field's rules clip like decoupled PPO (ratio R, bounds 1 +- eps); their masks zero a gradient without a clip
    kinds = [t[1].get(objective, t[1]["decoupled"]) for t in CLIP_TOKENS]
    n = len(CLIP_TOKENS)
    assert stats["clip_frac_upper"] == pytest.approx(kinds.count("above") / n)
    assert stats["clip_frac_lower"] == pytest.approx(kinds.count("below") / n)
    assert stats["clip_frac"] == pytest.approx((kinds.count("above") + kinds.count("below")) / n)
    # the definition agrees with autograd: a token (A != 0) is clipped exactly when its gradient is zero
    loss.backward()
    for k, ((_, _, _, a), kind) in enumerate(CLIP_TOKENS):
        if a != 0 and objective in kind:
            assert (logp.grad[divmod(k, 6)].item() == 0) == (kind[objective] is not None), (k, kind)


def test_acr_reports_its_widened_and_rescued_tokens():
    logp, prox, behav, adv, mask = _clip_batch()
    _, acr = loss_and_stats(logp, prox, behav, adv, mask, objective="acr", tis_cap=2.0)
    assert acr["clip_widened_frac"] == pytest.approx(3 / 9)  # tokens 4, 5, 6 have rho = 3 > C
    assert acr["clip_widened_frac"] == pytest.approx(acr["tis_trunc_frac"])  # r < 1 <=> rho > C
    assert acr["clip_rescued_frac"] == pytest.approx(1 / 9)  # token 4: 1.2 < R = 1.5 <= 1.8
    _, tis = loss_and_stats(logp, prox, behav, adv, mask, objective="tis", tis_cap=2.0)
    assert tis["clip_widened_frac"] == 0 and tis["clip_rescued_frac"] == 0
    assert tis["clip_frac_upper"] - acr["clip_frac_upper"] == pytest.approx(acr["clip_rescued_frac"])


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_nothing_is_clipped_when_every_ratio_is_inside_the_bounds(objective):
    torch.manual_seed(0)
    B, T = 64, 20
    prox = -torch.rand(B, T) * 2
    A, mask = torch.randn(B, 1).expand(B, T).contiguous(), torch.ones(B, T)
    # R == 1 and pi_behav == pi_prox: every ratio is exactly 1
    _, stats = loss_and_stats(prox.clone(), prox, prox.clone(), A, mask, objective=objective)
    assert stats["clip_frac"] == 0 and stats["clip_frac_upper"] == 0 and stats["clip_frac_lower"] == 0
    # R within [0.92, 1.07] and R_hat, rho close to 1 as well (the weight rho != 1 must not matter)
    behav = prox + 0.01 * torch.randn(B, T)
    logp = prox + 0.02 * torch.randn(B, T)
    _, stats = loss_and_stats(logp, prox, behav, A, mask, objective=objective)
    assert stats["clip_frac"] == 0 and stats["clip_widened_frac"] == 0


def test_sequence_masking_keeps_a_response_whose_ratio_is_in_range_and_drops_the_other_whole():
    """Row 0: rho 1.2 and 1.5 (prod 1.8 <= C = 2: kept, weight 1.8); row 1: rho 3 and 0.9 (prod 2.7: dropped).
    R = 1, A = +1 everywhere: seq-mask's per-token values 1.8, 1.8, 0, 0; icepop keeps rho in [0.5, 2]: 1.2, 1.5, 0,
    0.9; the gradient flows where the value is not 0."""
    prox = torch.log(torch.tensor([[0.6, 0.3], [0.3, 0.45]]))
    behav = torch.log(torch.tensor([[0.5, 0.2], [0.1, 0.5]]))
    logp, adv, mask = prox.clone().requires_grad_(), torch.ones(2, 2), torch.ones(2, 2)
    for objective, values in (("seq-mask", [1.8, 1.8, 0.0, 0.0]), ("icepop", [1.2, 1.5, 0.0, 0.9])):
        loss, stats = loss_and_stats(logp, prox, behav, adv, mask, objective=objective, tis_cap=2.0)
        assert loss.item() == pytest.approx(-sum(values) / 4, rel=1e-5)
        grad, = torch.autograd.grad(loss, logp)
        assert grad.flatten().tolist() == pytest.approx([-v / 4 for v in values], abs=1e-6)
        assert stats["masked_frac"] == pytest.approx(values.count(0.0) / 4)


def test_sampler_mismatch_reports_the_sequence_ratio_and_the_effective_sample_size():
    """rho: row 0 (2, 2), row 1 (1, 0.75); ESS of the token weights = 5.75^2 / (4 * 9.5625), of the sequences' (4,
    0.75) = 4.75^2 / (2 * 16.5625)."""
    prox = torch.log(torch.tensor([[0.4, 0.4], [0.3, 0.15]]))
    behav = torch.log(torch.tensor([[0.2, 0.2], [0.3, 0.2]]))
    stats = sampler_mismatch(prox, behav, torch.ones(2, 2), tis_cap=2.0)
    assert stats["seq_log_ratio_mean"] == pytest.approx((2 * math.log(2) + math.log(0.75)) / 2, rel=1e-5)
    assert stats["seq_log_ratio_max_abs"] == pytest.approx(2 * math.log(2), rel=1e-5)
    assert stats["ess_token"] == pytest.approx(5.75 ** 2 / (4 * 9.5625), rel=1e-5)
    assert stats["ess_seq"] == pytest.approx(4.75 ** 2 / (2 * 16.5625), rel=1e-5)
    assert stats["seq_out_of_range_frac"] == pytest.approx(0.5)  # row 0's ratio 4 > C; row 1's 0.75 is in


def test_the_worked_acr_number_of_the_docstring():
    """loss.py's docstring, eps = 0.2, C = 2: rho = 5 gives r = 0.4, weight 2, upper bound 3.0; with R = 1.5 and
    A = +1 TIS clips the token (no gradient) and ACR passes it with weight 2; rho = 1e5 (Fig. 3b) gives ~6e4."""
    import qurl_mini.loss as loss

    for said in ("r = 2 / 5 = 0.4", "weight min(5, 2) = 2", "1.2 / 0.4 = 3.0", "R = 1.5 and A = +1",
                 "1.2 * 1e5 / 2 = 6e4"):
        assert said in loss.__doc__
    rho, R = torch.tensor([[5.0]]), torch.tensor([[1.5]])
    acr = loss.objective_acr(R, None, rho, 0.2, 0.2, 2.0)
    assert acr.weight.item() == 2 and acr.high.item() == pytest.approx(3.0)
    assert loss.objective_tis(R, None, rho, 0.2, 0.2, 2.0).high == pytest.approx(1.2)
    prox = torch.tensor([[-1.0]])
    for objective, grad_wrt_logp in (("tis", 0.0), ("acr", 2 * 1.5 * 1)):  # weight * R * A where unclipped
        logp = (prox + math.log(1.5)).requires_grad_(True)
        objective_value = loss.policy_objective(logp, prox, prox - math.log(5), torch.ones(1, 1), torch.ones(1, 1),
                                                objective=objective, clip_low=0.2, clip_high=0.2, tis_cap=2.0)
        assert torch.autograd.grad(objective_value.sum(), logp)[0].item() == pytest.approx(grad_wrt_logp)
    far = loss.objective_acr(torch.ones(1), None, torch.tensor([1e5]), 0.2, 0.2, 2.0)
    assert far.high.item() == pytest.approx(6e4)


K3 = 0.5 - 1 - math.log(0.5)  # k3 of a token with pi_theta = 0.5, pi_ref = 0.25: pi_ref / pi_theta - 1 - log of it


@pytest.mark.parametrize("agg,kl", [("seq-mean-token-mean", (K3 / 1 + 0 / 3) / 2), ("token-mean", K3 / 4)])
def test_the_kl_term_is_averaged_as_the_policy_term_and_not_importance_weighted(agg, kl):
    """Eq. 1 puts beta * KL inside 1/G sum_i 1/|o_i| sum_t: a response of 1 token (k3 = K3) and one of 3 tokens
    (k3 = 0) give (K3 / 1 + 0 / 3) / 2 under seq-mean-token-mean, K3 / 4 under token-mean. rho = e on every token
    changes nothing: the KL term is not importance-weighted (README, "The objectives")."""
    from qurl_mini.batch import Experience, SequenceBatch
    from qurl_mini.config import Config
    from qurl_mini.loss import aggregation_units
    from qurl_mini.update import Updater

    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    logp = torch.log(torch.tensor([[0.5, 1.0, 1.0], [0.2, 0.3, 0.4]])).requires_grad_(True)
    ref = torch.log(torch.tensor([[0.25, 1.0, 1.0], [0.2, 0.3, 0.4]]))
    seq = SequenceBatch(torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.long), mask)
    for log_rho in (0.0, 1.0):
        micro = Experience(seq, prox_logp=logp.detach(), behav_logp=logp.detach() - log_rho,
                           advantages=torch.zeros(2, 3), ref_logp=ref)
        updater = Updater(Config(loss_agg=agg, kl_coef=0.5), torch.nn.Linear(1, 1), reference=torch.nn.Linear(1, 1))
        units = {"policy": aggregation_units(mask, agg), "tokens": aggregation_units(mask, "token-mean")}
        loss, parts = updater._micro_loss(micro, logp, None, units)
        assert parts["kl_ref"] == pytest.approx(kl, rel=1e-6)
        assert loss.item() == pytest.approx(0.5 * kl, rel=1e-6)  # A = 0: the policy term is 0
