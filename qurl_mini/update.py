"""Phase 5 of an RL step: minibatch AdamW steps on the chosen objective (Eq. 1/3/4/5/9, or a correction).

The step's `Experience` is cut into --minibatches for each of --ppo-epochs passes; each minibatch is one
optimizer step whose gradient is accumulated over micro-batches. Each micro-batch's loss divides by the whole
minibatch's count, so the micro-batch losses add up to the minibatch's (tests/test_micro_batches.py). The policy
statistics are computed once per minibatch on all of its response tokens and combine over minibatches by their
own rule (`loss.COMBINE`: a max stays a max).
"""
import logging

import torch

from .acr_gap import AcrTisGap
from .actor import autocast_context, device_of, micro_batch_plan, sequence_logprobs
from .batch import Experience
from .infra import checkpoint
from .infra.errors import OneLineError
from .loss import aggregation_units, combine_stats, kl_k3, masked_mean, policy_loss, policy_stats, sequence_ratio, value_loss
from .packing import prompt_groups

log = logging.getLogger("qurl_mini")


class TrainingError(OneLineError, RuntimeError):
    """The run cannot go on (e.g. too many NaN steps); the message is one line."""


class Updater:
    """The actor's (and PPO's critic's) AdamW after a short linear warm-up, and the update that uses them."""

    def __init__(self, cfg, actor, critic=None, reference=None):
        self.cfg, self.actor, self.critic, self.reference = cfg, actor, critic, reference
        self.optimizers = {"actor": torch.optim.AdamW(actor.parameters(), lr=cfg.lr, weight_decay=0.0)}
        if critic is not None:
            self.optimizers["critic"] = torch.optim.AdamW(critic.parameters(), lr=cfg.critic_lr)
        warmup = 3 * cfg.minibatches * cfg.ppo_epochs
        self.schedulers = {name: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
                           for name, opt in self.optimizers.items()}
        self.bad_steps = 0  # steps in a row with a skipped (NaN/inf) minibatch

    def restore(self, ckpt: str, state: dict) -> None:
        """A resumed run's optimizer, scheduler and RNG states (and the critic's weights)."""
        checkpoint.restore(ckpt, critic=self.critic, optimizers=self.optimizers, schedulers=self.schedulers, state=state)
        self.bad_steps = state.get("bad_steps", 0)

    def __call__(self, experience: Experience) -> dict:
        """Minibatch optimizer steps; a NaN/inf loss or gradient skips that step and is counted."""
        cfg = self.cfg
        per_minibatch, skipped = [], 0
        for _ in range(cfg.ppo_epochs):
            for rows in self.minibatch_rows(experience):
                stats = self._minibatch_step(experience[rows])
                if stats is None:
                    skipped += 1
                else:
                    per_minibatch.append(stats)
        self.bad_steps = self.bad_steps + 1 if skipped else 0
        if self.bad_steps >= cfg.max_bad_steps:
            raise TrainingError(f"{self.bad_steps} steps in a row had a NaN/inf loss or gradient "
                                f"(--max-bad-steps {cfg.max_bad_steps}); stopping. Lower --lr or check the data.")
        return {**(combine_stats(per_minibatch) if per_minibatch else {}), "skipped_updates": skipped,
                "lr": self.schedulers["actor"].get_last_lr()[0]}

    def minibatch_rows(self, experience: Experience) -> list[torch.Tensor]:
        """--minibatches random parts of the step's rows, of equal size. With --shared-prompt the groups are
        shuffled, not the rows: a group's rows stay together (cut only where a part ends), so a minibatch packs
        each prompt once."""
        if not self.cfg.shared_prompt:
            return list(torch.randperm(len(experience)).chunk(self.cfg.minibatches))
        groups = torch.arange(len(experience)).split(prompt_groups(experience.sequences))
        return list(torch.cat([groups[g] for g in torch.randperm(len(groups)).tolist()]).chunk(self.cfg.minibatches))

    def _minibatch_step(self, minibatch: Experience) -> dict | None:
        """One optimizer step, gradients accumulated over micro-batches (--micro-batch-size rows or
        --max-tokens-per-micro-batch tokens); None where it was skipped."""
        cfg = self.cfg
        over = {"policy": aggregation_units(minibatch.mask, cfg.loss_agg).clamp(min=1),  # G rows, or tokens
                "tokens": minibatch.mask.sum().clamp(min=1)}  # KL and value loss are token means
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=True)
        loss_parts, tokens = {}, []
        gap = AcrTisGap(self.actor, cfg.objective) if cfg.measure_acr_gap else None
        plan = micro_batch_plan(minibatch.sequences, cfg.micro_batch_size, cfg.max_tokens_per_micro_batch,
                                cfg.shared_prompt)
        for rows, groups in plan:
            micro = minibatch[rows].trimmed().to(device_of(self.actor))
            loss, parts, logp = self._micro_loss(micro, groups, over)
            if not torch.isfinite(loss):
                log.warning("non-finite loss (%s); skipping this update", loss.item())
                return None
            if gap is not None:
                gap.add(logp, micro, agg=cfg.loss_agg, over=over["policy"], clip_low=cfg.clip_low,
                        clip_high=cfg.clip_high, tis_cap=cfg.tis_cap)
            loss.backward()
            for k, v in parts.items():  # each part is divided by the minibatch's count: they add up
                loss_parts[k] = loss_parts.get(k, 0.0) + v
            tokens.append(response_tokens(micro, logp))
        if gap is not None:
            loss_parts["acr_grad_gap"] = gap.relative()  # ||g_ACR - g_TIS|| / ||g_TIS||, before clipping
        grad_norm = torch.nn.utils.clip_grad_norm_(self.actor.parameters(), cfg.max_grad_norm)
        if self.critic is not None:
            torch.nn.utils.clip_grad_norm_(self.critic.parameters(), cfg.max_grad_norm)
        if not torch.isfinite(grad_norm):
            log.warning("non-finite gradient norm; skipping this update")
            return None
        for name, opt in self.optimizers.items():
            opt.step()
            self.schedulers[name].step()
        stats = policy_stats(*(torch.cat(column) for column in zip(*tokens)), objective=cfg.objective,
                             clip_low=cfg.clip_low, clip_high=cfg.clip_high, tis_cap=cfg.tis_cap)
        return {**stats, **loss_parts, "grad_norm": grad_norm.item()}

    def _micro_loss(self, micro: Experience, groups: list[int] | None, over: dict):
        """One micro-batch's part of the minibatch loss: the policy objective (+ k3 KL to the reference,
        + PPO's value loss), each divided by the minibatch's units in `over`; the parts' values; its log-probs.
        groups: the sizes of its packed rows (--shared-prompt), or None (each row on its own)."""
        cfg, seq, m = self.cfg, micro.sequences, micro.mask
        with autocast_context(seq.input_ids.device.type):
            logp = sequence_logprobs(self.actor, seq, cfg.temperature, groups)
            values = self.critic.values(seq, groups) if self.critic is not None else None
        loss, _ = policy_loss(logp, micro.prox_logp, micro.behav_logp, micro.advantages, m,
                              objective=cfg.objective, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                              tis_cap=cfg.tis_cap, agg=cfg.loss_agg, over=over["policy"])
        parts = {"policy_loss": loss.item()}
        if self.reference is not None:
            # padding: pi_ref := pi_theta, so the k3 term is exactly 0 there (ref_logp may be 0 there,
            # and exp(0 - logp) can overflow to inf, which the mask's 0 would turn into NaN)
            kl = masked_mean(kl_k3(logp, torch.where(m > 0, micro.ref_logp, logp.detach())), m, over=over["tokens"])
            loss = loss + cfg.kl_coef * kl
            parts["kl_ref"] = kl.item()
        if values is not None:
            v_loss = value_loss(values, micro.old_values, micro.returns, m, cfg.value_clip, over=over["tokens"])
            loss = loss + v_loss
            parts["value_loss"] = v_loss.item()
        return loss, parts, logp


def response_tokens(micro: Experience, logp: torch.Tensor) -> list[torch.Tensor]:
    """What `loss.policy_stats` reads of a micro-batch, on its response tokens only (CPU): pi_theta, pi_prox and
    pi_behav log-probs, advantages, and each token's sequence's log-ratio sum and length."""
    present = (micro.mask > 0).cpu()
    seq = sequence_ratio(torch.exp(micro.prox_logp - micro.behav_logp), micro.mask)
    return [t.detach().cpu()[present] for t in
            (logp, micro.prox_logp, micro.behav_logp, micro.advantages, seq.log_sum, seq.length)]
