"""How much ACR (Eq. 9) changes an update over TIS (Eq. 5): ||g_ACR - g_TIS|| / ||g_TIS||, same minibatch.

The two share the weight min(rho, C) and differ only in the upper clip bound: TIS clips R at 1 + eps, ACR at
(1 + eps) / r. So their gradients differ only on the tokens ACR rescues (A > 0, rho > C, 1 + eps < R <= (1 + eps) / r),
and g_ACR - g_TIS is the gradient of loss_ACR - loss_TIS: one extra backward pass, on the micro-batches that hold
such a token (none elsewhere: there the difference is exactly 0). `--measure-acr-gap`, with --objective tis or acr.
"""
import torch

from .loss import aggregate_sum, policy_objective, policy_stats

PAIR = ("tis", "acr")  # the objectives whose gradients differ by what this measures


class AcrTisGap:
    """Accumulates grad(loss_ACR - loss_TIS) over a minibatch's micro-batches; `relative()` reads it against the
    minibatch's own gradient (which is TIS's or ACR's, by --objective) before that is clipped."""

    def __init__(self, model, objective: str, examples: int = 0):
        assert objective in PAIR, f"--measure-acr-gap compares {PAIR}, not {objective!r}"
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.objective = objective
        self.diff = None  # [grad of (loss_ACR - loss_TIS)] per parameter, summed over micro-batches
        self.examples, self.keep = [], examples  # up to `examples` rescued tokens, as `rescued_tokens` gives them

    def add(self, logp, micro, *, agg, units, **objective_args) -> None:
        """Before the micro-batch's own backward (its graph is kept for it). units: what the update divides the
        micro-batch's sum by (its minibatch's, loss.aggregation_units), so the difference is the update's."""
        tokens = (logp, micro.prox_logp, micro.behav_logp, micro.advantages, micro.mask)
        if policy_stats(logp.detach(), *tokens[1:], objective="acr", **objective_args)["clip_rescued_frac"] == 0:
            return  # no rescued token: the two gradients are equal here
        if len(self.examples) < self.keep:
            self.examples += rescued_tokens(logp, micro, **objective_args)[:self.keep - len(self.examples)]
        loss_acr, loss_tis = (-(aggregate_sum(policy_objective(*tokens, objective=name, **objective_args), micro.mask,
                                              agg) / units) for name in ("acr", "tis"))
        grads = torch.autograd.grad(loss_acr - loss_tis, self.params, retain_graph=True, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(self.params, grads)]
        self.diff = grads if self.diff is None else [d + g for d, g in zip(self.diff, grads)]

    @torch.no_grad()
    def relative(self) -> float:
        """||g_ACR - g_TIS|| / ||g_TIS||, after the minibatch's backward passes and before clipping."""
        if self.diff is None:
            return 0.0
        own = [torch.zeros_like(p) if p.grad is None else p.grad for p in self.params]
        tis = own if self.objective == "tis" else [g - d for g, d in zip(own, self.diff)]  # g_TIS = g_ACR - diff
        diff_norm = torch.sqrt(sum((d.double() ** 2).sum() for d in self.diff))
        tis_norm = torch.sqrt(sum((g.double() ** 2).sum() for g in tis))
        return (diff_norm / tis_norm).item() if tis_norm > 0 else float("inf")


@torch.no_grad()
def rescued_tokens(logp, micro, *, clip_low, clip_high, tis_cap) -> list[dict]:
    """The tokens where ACR's loss differs from TIS's, each with what the two objectives do there: the weight
    min(rho, C) both apply, TIS's upper bound 1 + eps (R is past it: the clipped branch, no gradient) and ACR's
    (1 + eps) / r (R is under it: the gradient of weight * R * A with respect to log pi is weight * R * A)."""
    R, rho = torch.exp(logp - micro.prox_logp), torch.exp(micro.prox_logp - micro.behav_logp)
    r = 1.0 / torch.clamp(rho / tis_cap, min=1.0)  # Eq. 6-7
    A, high = micro.advantages, 1 + clip_high
    rescued = (micro.mask > 0) & (A > 0) & (R > high) & (R <= high / r)
    ids = micro.sequences.input_ids
    out = []
    for i, t in rescued.nonzero().tolist():
        weight = min(rho[i, t].item(), tis_cap)
        out.append({"token_id": ids[i, t + 1].item(), "context_ids": ids[i, max(0, t - 11):t + 1].tolist(),
                    "rho": rho[i, t].item(), "R": R[i, t].item(), "A": A[i, t].item(), "weight": weight,
                    "tis_upper_bound": high, "acr_upper_bound": high / r[i, t].item(),
                    "grad_wrt_logp": {"tis": 0.0, "acr": weight * R[i, t].item() * A[i, t].item()}})
    return out
