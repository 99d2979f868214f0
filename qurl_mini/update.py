"""Phase 5 of an RL step: minibatch AdamW steps on the chosen objective (Eq. 1/3/4/5/9, or a correction).

The step's `Experience` is cut into --minibatches for each of --ppo-epochs passes; each minibatch is one optimizer
step. Gradient accumulation lives here alone: a minibatch's gradient is summed over micro-batches, and each
micro-batch's loss is its sum over tokens (or responses) divided by the whole minibatch's count
(loss.aggregation_units), so the micro-batch losses add up to the minibatch's (tests/test_micro_batches.py). The
policy statistics are computed once per minibatch, on all of its tokens (loss.policy_stats), and combine over
minibatches by their own rule (loss.COMBINE: a max stays a max).
"""
import logging

import torch

from .acr_gap import AcrTisGap
from .actor import autocast_context, device_of, shared_prompt_logprobs, shared_prompt_values, token_logprobs
from .batch import Experience, micro_batch_slices
from .infra import checkpoint
from .infra.errors import OneLineError
from .loss import aggregate_sum, aggregation_units, combine_stats, kl_k3, policy_objective, policy_stats, value_loss
from .packing import packed_micro_batches, prompt_groups

log = logging.getLogger("qurl_mini")


class TrainingError(OneLineError, RuntimeError):
    """The run cannot go on (e.g. too many NaN steps); the message is one line."""


class Updater:
    """The actor's (and PPO's critic's) AdamW after a short linear warm-up, and the update that uses them."""

    def __init__(self, cfg, actor, critic=None, reference=None):
        self.cfg, self.actor, self.critic, self.reference = cfg, actor, critic, reference
        self.clip = dict(clip_low=cfg.clip_low, clip_high=cfg.clip_high, tis_cap=cfg.tis_cap)
        self.optimizers = {"actor": torch.optim.AdamW(actor.parameters(), lr=cfg.lr, weight_decay=0.0)}
        if critic is not None:
            self.optimizers["critic"] = torch.optim.AdamW(critic.parameters(), lr=cfg.critic_lr)
        warmup = 3 * cfg.minibatches * cfg.ppo_epochs
        self.schedulers = {name: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
                           for name, opt in self.optimizers.items()}
        self.bad_steps = 0  # steps in a row with a skipped (NaN/inf) minibatch
        # a row whose advantages are all 0 adds exactly 0 to the gradient (A * anything = 0), unless a KL term or a
        # critic gives it a loss of its own: then, and with --skip-zero-advantage false, every row runs
        self.skip_zero_rows = cfg.skip_zero_advantage and reference is None and critic is None

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
        """One optimizer step, its gradient accumulated over micro-batches (--micro-batch-size rows or
        --max-tokens-per-micro-batch tokens), and the minibatch's statistics; None where it was skipped."""
        cfg, device, mask = self.cfg, device_of(self.actor), minibatch.mask
        units = {"policy": aggregation_units(mask, cfg.loss_agg), "tokens": aggregation_units(mask, "token-mean")}
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=True)
        # pi_theta on every token, for the statistics; a skipped row's tokens count at R = 1 (pi_theta := pi_prox)
        parts, logp = {"policy_loss": 0.0}, minibatch.prox_logp.clone()  # a skipped row's loss is 0
        carrying = (minibatch.advantages != 0).any(-1) if self.skip_zero_rows else torch.ones(len(minibatch), dtype=bool)
        ran = carrying.nonzero().squeeze(-1)  # the rows run forward and backward
        active = minibatch[ran]
        gap = AcrTisGap(self.actor, cfg.objective) if cfg.measure_acr_gap else None
        shared = cfg.shared_prompt  # the same numbers, each group's prompt run once (actor.shared_prompt_logprobs)
        plan = packed_micro_batches if shared else micro_batch_slices  # rows, or whole packed groups
        for rows in plan(active.sequences, cfg.micro_batch_size, cfg.max_tokens_per_micro_batch) if len(ran) else []:
            micro = active[rows].trimmed().to(device)
            inputs, only = (micro.sequences.input_ids, micro.sequences.attention_mask), micro.mask
            with autocast_context(device.type):  # the forward
                micro_logp = (shared_prompt_logprobs(self.actor, *inputs, cfg.temperature, only=only) if shared
                              else token_logprobs(self.actor, *inputs, cfg.temperature, only=only))
                values = None
                if self.critic is not None:  # PPO
                    values = shared_prompt_values(self.critic, *inputs, only=only) if shared else self.critic(*inputs)
            loss, micro_parts = self._micro_loss(micro, micro_logp, values, units)
            if not torch.isfinite(loss):
                log.warning("non-finite loss (%s); skipping this update", loss.item())
                return None
            if gap is not None:
                gap.add(micro_logp, micro, agg=cfg.loss_agg, units=units["policy"], **self.clip)
            loss.backward()
            for k, v in micro_parts.items():  # each part is divided by the minibatch's units: they add up
                parts[k] = parts.get(k, 0.0) + v
            logp[ran[rows], :micro_logp.shape[1]] = micro_logp.detach().to(logp.device)
        if not len(ran):  # every row skipped: AdamW still steps (momentum), on the zero gradient the rows gave
            for p in self.actor.parameters():
                p.grad = torch.zeros_like(p)
        parts.update(skipped_rows_frac=1 - len(ran) / len(minibatch), skipped_minibatches=int(not len(ran)),
                     skipped_tokens_frac=1 - (mask[ran].sum() / mask.sum().clamp(min=1)).item())
        if gap is not None:
            parts["acr_grad_gap"] = gap.relative()  # ||g_ACR - g_TIS|| / ||g_TIS||, before clipping
        grad_norm = torch.nn.utils.clip_grad_norm_(self.actor.parameters(), cfg.max_grad_norm)
        if self.critic is not None:
            torch.nn.utils.clip_grad_norm_(self.critic.parameters(), cfg.max_grad_norm)
        if not torch.isfinite(grad_norm):
            log.warning("non-finite gradient norm; skipping this update")
            return None
        for name, opt in self.optimizers.items():
            opt.step()
            self.schedulers[name].step()
        stats = policy_stats(logp, minibatch.prox_logp, minibatch.behav_logp, minibatch.advantages, mask,
                             objective=cfg.objective, **self.clip)
        return {**stats, **parts, "grad_norm": grad_norm.item()}

    def _micro_loss(self, micro: Experience, logp, values, units: dict):
        """One micro-batch's part of the minibatch loss, and its terms' values: each term is the micro-batch's sum
        (loss.aggregate_sum) divided by the whole minibatch's `units`, so the parts add up to the minibatch's."""
        cfg, m = self.cfg, micro.mask
        objective = policy_objective(logp, micro.prox_logp, micro.behav_logp, micro.advantages, m,
                                     objective=cfg.objective, **self.clip)
        loss = -(aggregate_sum(objective, m, cfg.loss_agg) / units["policy"])  # Eq. 1/3/4/5/9
        parts = {"policy_loss": loss.item()}
        if self.reference is not None:  # Eq. 1's beta * KL(pi_theta || pi_ref), in the policy term's average
            # padding: pi_ref := pi_theta, so the k3 term is exactly 0 there (ref_logp may be 0 there,
            # and exp(0 - logp) can overflow to inf, which the mask's 0 would turn into NaN)
            kl_per_token = kl_k3(logp, torch.where(m > 0, micro.ref_logp, logp.detach()))
            kl = aggregate_sum(kl_per_token, m, cfg.loss_agg) / units["policy"]
            loss = loss + cfg.kl_coef * kl
            parts["kl_ref"] = kl.item()
        if values is not None:  # PPO's clipped value loss, a token mean
            v_loss = aggregate_sum(value_loss(values, micro.old_values, micro.returns, cfg.value_clip), m,
                                   "token-mean") / units["tokens"]
            loss = loss + v_loss
            parts["value_loss"] = v_loss.item()
        return loss, parts
