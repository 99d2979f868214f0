"""How much ACR (Eq. 9) changes an update over TIS (Eq. 5): ||g_ACR - g_TIS|| / ||g_TIS||, same minibatch.

The two share the weight min(rho, C) and differ only in the upper clip bound: TIS clips R at 1 + eps, ACR at
(1 + eps) / r. So their gradients differ only on the tokens ACR rescues (A > 0, rho > C, 1 + eps < R <= (1 + eps) / r),
and g_ACR - g_TIS is the gradient of loss_ACR - loss_TIS: one extra backward pass, on the micro-batches that hold
such a token (none elsewhere: there the difference is exactly 0). `--measure-acr-gap`, with --objective tis or acr.
"""
import torch

from .loss import policy_loss

PAIR = ("tis", "acr")  # the objectives whose gradients differ by what this measures


class AcrTisGap:
    """Accumulates grad(loss_ACR - loss_TIS) over a minibatch's micro-batches; `relative()` reads it against the
    minibatch's own gradient (which is TIS's or ACR's, by --objective) before that is clipped."""

    def __init__(self, model, objective: str):
        assert objective in PAIR, f"--measure-acr-gap compares {PAIR}, not {objective!r}"
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.objective = objective
        self.diff = None  # [grad of (loss_ACR - loss_TIS)] per parameter, summed over micro-batches

    def add(self, logp, micro, *, agg, over, **objective_args) -> None:
        """Before the micro-batch's own backward (its graph is kept for it)."""
        loss_acr, stats = policy_loss(logp, micro.prox_logp, micro.behav_logp, micro.advantages, micro.mask,
                                      objective="acr", agg=agg, over=over, **objective_args)
        if stats["clip_rescued_frac"] == 0:
            return  # no rescued token: the two gradients are equal here
        loss_tis, _ = policy_loss(logp, micro.prox_logp, micro.behav_logp, micro.advantages, micro.mask,
                                  objective="tis", agg=agg, over=over, **objective_args)
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
