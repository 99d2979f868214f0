"""The RL loop: quantized vLLM rollout -> reward -> advantages -> proximal log-probs -> update -> sync.

One step, in order (`Trainer.step`):
  1. rollout    the engine (bf16, INT8 or FP8) samples G responses per prompt, with pi_behav
  2. reward     exact match of the '####' answer (DAPO: + overlong shaping, dynamic sampling)
  3. advantages GRPO/DAPO: group-normalized; PPO: GAE on the critic's values
  4. logprobs   the full-precision actor recomputes pi_prox (and the reference, for KL)
  5. update     minibatch steps on the chosen objective (Eq. 1/3/4/5/9)
  6. sync       quantize the updated actor and load it into the live engine, in place
"""
import contextlib
import json
import logging
import math
import os
import random
import time

import torch

from . import checkpoint, quant
from .actor import (Critic, align_per_token, batched_logprobs, batched_values, load_actor, pack_sequences,
                    token_logprobs)
from .advantages import gae, grpo_advantages, informative_groups, overlong_penalty
from .config import Config
from .data import PromptSampler, load_problems, reward
from .embedded import warm_start
from .engine import Platform, RolloutEngine, sync_state
from .evaluate import greedy_accuracy
from .loss import kl_k3, masked_mean, policy_loss, value_loss
from .metrics import MetricsLog, plot_metrics
from .progress import progress_bar
from .uaq import apply_uaq

log = logging.getLogger("qurl_mini")


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. too many NaN steps); the message is one line."""


def base_model_path(cfg: Config, train_problems) -> str:
    """--model, or the embedded tiny Qwen2 after its (cached) SFT warm start."""
    if cfg.model is not None:
        return cfg.model
    return warm_start(cfg.cache_dir, train_problems, steps=cfg.sft_steps, batch_size=64, lr=cfg.sft_lr,
                      teacher_slip=cfg.teacher_slip)


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.run_dir = os.path.join(cfg.out_dir, cfg.run_name)
        self.platform = Platform.detect()
        self.engine_format = self.platform.engine_format(cfg.quant)
        if self.engine_format == "fp8-emulated":
            log.warning("FP8: no FP8 kernel on this machine; the rollout engine EMULATES FP8 "
                        "(weights rounded to e4m3 with per-channel scales, computed in bf16)")

        self.train_problems, self.test_problems = load_problems(
            cfg.data, cfg.test_data, cfg.eval_size, cfg.seed, cfg.max_number)
        if cfg.prompts_per_step > len(self.train_problems):
            raise TrainingError(f"--prompts-per-step {cfg.prompts_per_step} is larger than the "
                                f"{len(self.train_problems)} training problems")
        self.base_model = base_model_path(cfg, self.train_problems)

        resume_from = self._find_resume()
        state = checkpoint.load_trainer_state(resume_from) if resume_from else {}
        self.actor, self.tokenizer = load_actor(os.path.join(resume_from, "actor") if resume_from else self.base_model)
        if not resume_from:
            apply_uaq(self.actor, cfg.uaq_scale)  # one time, before training (Eq. 11)
        self.actor.train()
        self.reference = load_actor(self.base_model)[0].eval() if cfg.kl_coef > 0 else None
        self.critic = Critic(self.actor) if cfg.algo == "ppo" else None

        self.optimizers = {"actor": torch.optim.AdamW(self.actor.parameters(), lr=cfg.lr, weight_decay=0.0)}
        if self.critic is not None:
            self.optimizers["critic"] = torch.optim.AdamW(self.critic.parameters(), lr=cfg.critic_lr)
        warmup = 3 * cfg.minibatches * cfg.ppo_epochs
        self.schedulers = {name: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
                           for name, opt in self.optimizers.items()}

        self.start_step = state.get("step", 0)
        self.sampler = PromptSampler(len(self.train_problems), cfg.seed, cursor=state.get("data_cursor", 0))
        self.bad_steps = state.get("bad_steps", 0)
        self.mismatch_warned = state.get("mismatch_warned", False)
        if resume_from:
            checkpoint.restore(resume_from, critic=self.critic, optimizers=self.optimizers,
                               schedulers=self.schedulers, state=state)
            log.info("resumed from %s (step %d)", resume_from, self.start_step)
        os.makedirs(self.run_dir, exist_ok=True)
        self.metrics = MetricsLog(os.path.join(self.run_dir, "metrics.jsonl"),
                                  resume_after_step=self.start_step if resume_from else None)
        self.monitor = quant.WeightUpdateMonitor()
        self.engine = self._start_engine()

    # -- set-up -----------------------------------------------------------------------------------

    def _find_resume(self) -> str | None:
        if self.cfg.resume is None:
            return None
        where = self.run_dir if self.cfg.resume == "latest" else self.cfg.resume
        found = checkpoint.latest_checkpoint(where)
        if found is None:
            raise TrainingError(f"--resume: no complete checkpoint in {where}")
        return found

    def _start_engine(self) -> RolloutEngine:
        """Write the (quantized) actor as a checkpoint and start vLLM on it."""
        path = os.path.join(self.run_dir, f"engine-init-{self.engine_format}")
        pairs, quantized = sync_state(self.actor, self.engine_format)
        if self.engine_format in ("int8", "fp8"):
            quant.save_quantized_checkpoint(self.actor, self.tokenizer, path, self.engine_format, pairs)
        else:  # a bf16 engine; for FP8 emulation its weights are already on the e4m3 grid
            self.actor.save_pretrained(path, state_dict=dict(pairs), safe_serialization=True)
            self.tokenizer.save_pretrained(path)
        if quantized:
            self.monitor.measure(self.actor, quantized)
        longest_prompt = max(len(self.tokenizer.encode(p.prompt)) for p in self.train_problems[:2000])
        max_len = 2 ** math.ceil(math.log2(longest_prompt + self.cfg.max_new_tokens + 8))
        return RolloutEngine(path, engine_format=self.engine_format, platform=self.platform,
                             seed=self.cfg.seed, max_model_len=max_len, kv_cache_gib=self.cfg.kv_cache_gib,
                             gpu_memory_utilization=self.cfg.gpu_memory_utilization)

    # -- the loop ---------------------------------------------------------------------------------

    def run(self) -> dict:
        cfg = self.cfg
        summary = {}
        if self.start_step == 0:
            summary["initial_test_accuracy"] = self.evaluate()
            log.info("greedy test accuracy before RL: %.1f%%", 100 * summary["initial_test_accuracy"])
        with progress_bar(f"RL {cfg.algo} / rollout {self.engine_format}", cfg.steps - self.start_step) as advance:
            for step in range(self.start_step + 1, cfg.steps + 1):
                row = self.step(step)
                if step == cfg.steps or (cfg.eval_every and step % cfg.eval_every == 0):
                    row["test_accuracy"] = self.evaluate()
                self.metrics.write(row)
                if step % cfg.save_every == 0 or step == cfg.steps:
                    self.save(step)
                advance(f"reward {row['reward_mean']:.2f} acc {row['accuracy']:.2f} "
                        f"kl(b|p) {row['kl_behav_prox']:.1e} {row['time_step']:.1f}s")
        final_dir = os.path.join(self.run_dir, "final")
        self.actor.save_pretrained(final_dir, safe_serialization=True)
        self.tokenizer.save_pretrained(final_dir)
        plot = plot_metrics(self.metrics.path, os.path.join(self.run_dir, "curves.png"),
                            summary.get("initial_test_accuracy"))
        summary.update(final_test_accuracy=self.evaluate(), final_model=final_dir, plot=plot,
                       base_model=self.base_model, metrics=self.metrics.path, config=cfg.to_dict())
        with open(os.path.join(self.run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        return summary

    def evaluate(self) -> float:
        return greedy_accuracy(self.actor, self.tokenizer, self.test_problems, self.cfg.max_new_tokens)[0]

    def step(self, step: int) -> dict:
        cfg, timer = self.cfg, Timer()
        torch.manual_seed(cfg.seed * 1_000_003 + step)  # each step's randomness depends on (seed, step) only
        random.seed(cfg.seed * 1_000_003 + step)

        # 1-2. rollout on the (quantized) engine, rewards
        with timer("rollout"):
            groups, problems, rewards, correct, stats = self.rollout()  # the engine is awake here
            self.engine.sleep()
        prompts = [r.prompt_ids for g in groups for r in g]
        responses = [r.response_ids for g in groups for r in g]
        batch = pack_sequences(prompts, responses, self.tokenizer.pad_token_id)
        mask = batch.response_mask
        behav_logp = align_per_token([r.behav_logprobs for g in groups for r in g], prompts, batch.input_ids.shape[1])

        # 4. the full-precision actor's log-probs of the sampled tokens: pi_prox (and pi_ref)
        with timer("logprob"):
            prox_logp = batched_logprobs(self.actor, batch, cfg.micro_batch_size, cfg.temperature)
            ref_logp = (batched_logprobs(self.reference, batch, cfg.micro_batch_size, cfg.temperature)
                        if self.reference is not None else None)
            old_values = batched_values(self.critic, batch, cfg.micro_batch_size) if self.critic else None

        # 3. advantages
        if cfg.algo == "ppo":
            last = (mask.cumsum(-1) == mask.sum(-1, keepdim=True)) & (mask > 0)  # reward on the last token
            token_rewards = last.float() * rewards[:, None]
            advantages, returns = gae(token_rewards, old_values, mask, cfg.gamma, cfg.lam)
            advantages = (advantages - masked_mean(advantages, mask)) * mask  # centre (a common PPO choice)
        else:
            advantages = grpo_advantages(rewards, cfg.group_size)[:, None] * mask
            returns = None

        # 5. update
        with timer("update"):
            update_stats = self.update(batch, prox_logp, behav_logp, ref_logp, advantages, old_values, returns)

        # 6. quantize + sync into the live engine
        with timer("sync"):
            self.engine.wake()
            t0 = time.perf_counter()
            pairs, quantized = sync_state(self.actor, self.engine_format)
            time_quantize = time.perf_counter() - t0
            self.engine.load_weights(pairs)
        weight_stats = self.monitor.measure(self.actor, quantized) if quantized else {}

        mismatch = masked_mean(behav_logp - prox_logp, mask).item()  # KL(behav || prox), Sec. 4.2
        if mismatch > cfg.mismatch_warn_kl and not self.mismatch_warned:
            log.warning("KL(behav||prox) = %.3g exceeds %.3g: the rollout engine and the actor disagree "
                        "(quantization too coarse, or a broken weight sync?)", mismatch, cfg.mismatch_warn_kl)
            self.mismatch_warned = True
        return {
            "step": step, "reward_mean": rewards.mean().item(), "accuracy": correct.mean().item(),
            "response_len": mask.sum(-1).mean().item(), "kl_behav_prox": mismatch, **stats, **update_stats,
            **weight_stats, "time_quantize": time_quantize, **timer.times, "time_step": sum(timer.times.values()),
            "data_cursor": self.sampler.cursor,
        }

    def rollout(self):
        """Sample G responses for each of the batch's prompts (DAPO: keep informative groups only)."""
        cfg, eos = self.cfg, self.tokenizer.eos_token_id
        kept, tries, dropped = [], 0, 0
        while len(kept) < cfg.prompts_per_step and tries < (cfg.dapo_max_tries if cfg.algo == "dapo" else 1):
            tries += 1
            indices = self.sampler.take(cfg.prompts_per_step - len(kept) if cfg.algo == "dapo" else cfg.prompts_per_step)
            problems = [self.train_problems[i] for i in indices]
            groups = self.engine.generate([self.tokenizer.encode(p.prompt) for p in problems], n=cfg.group_size,
                                          temperature=cfg.temperature, max_tokens=cfg.max_new_tokens,
                                          stop_token_ids=[eos])
            for problem, group in zip(problems, groups):
                texts = [self.tokenizer.decode(r.response_ids, skip_special_tokens=True) for r in group]
                correct = torch.tensor([reward(t, problem) for t in texts])
                shaped = correct.clone()
                if cfg.algo == "dapo":
                    shaped += torch.tensor([overlong_penalty(len(r.response_ids), cfg.max_new_tokens,
                                                             cfg.overlong_buffer, cfg.overlong_penalty) for r in group])
                    if not informative_groups(shaped, cfg.group_size).item():
                        dropped += 1
                        continue
                kept.append((problem, group, shaped, correct))
        if not kept:  # DAPO found no signal at all: train on the last round rather than nothing
            kept = [(p, g, torch.zeros(cfg.group_size), torch.zeros(cfg.group_size)) for p, g in zip(problems, groups)]
        kept = kept[:cfg.prompts_per_step]
        stats = {"rollout_rounds": tries, "groups_dropped": dropped, "batch_prompts": len(kept)} \
            if cfg.algo == "dapo" else {}
        return ([k[1] for k in kept], [k[0] for k in kept], torch.cat([k[2] for k in kept]),
                torch.cat([k[3] for k in kept]), stats)

    def update(self, batch, prox_logp, behav_logp, ref_logp, advantages, old_values, returns) -> dict:
        """Minibatch optimizer steps; a NaN/inf loss or gradient skips the step and is counted."""
        cfg, mask = self.cfg, batch.response_mask
        sums, count, skipped = {}, 0, 0
        for _ in range(cfg.ppo_epochs):
            order = torch.randperm(len(batch))
            for mb in order.chunk(cfg.minibatches):
                stats = self._minibatch_step(mb, batch, prox_logp, behav_logp, ref_logp, advantages,
                                             old_values, returns)
                if stats is None:
                    skipped += 1
                    continue
                count += 1
                for k, v in stats.items():
                    sums[k] = sums.get(k, 0.0) + v
        self.bad_steps = self.bad_steps + 1 if skipped else 0
        if self.bad_steps >= cfg.max_bad_steps:
            raise TrainingError(f"{self.bad_steps} steps in a row had a NaN/inf loss or gradient "
                                f"(--max-bad-steps {cfg.max_bad_steps}); stopping. Lower --lr or check the data.")
        out = {k: v / max(count, 1) for k, v in sums.items()}
        out["skipped_updates"] = skipped
        out["lr"] = self.schedulers["actor"].get_last_lr()[0]
        return out

    def _minibatch_step(self, mb, batch, prox_logp, behav_logp, ref_logp, advantages, old_values, returns):
        cfg, mask = self.cfg, batch.response_mask
        units = (mask[mb].sum() if cfg.loss_agg == "token-mean" else (mask[mb].sum(-1) > 0).sum()).clamp(min=1)
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=True)
        sums = {}
        for micro in mb.split(cfg.micro_batch_size):
            m = mask[micro]
            share = (m.sum() if cfg.loss_agg == "token-mean" else (m.sum(-1) > 0).sum()) / units
            logp = token_logprobs(self.actor, batch.input_ids[micro], batch.attention_mask[micro], cfg.temperature)
            loss, stats = policy_loss(logp, prox_logp[micro], behav_logp[micro], advantages[micro], m,
                                      objective=cfg.objective, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                                      tis_cap=cfg.tis_cap, agg=cfg.loss_agg)
            stats["policy_loss"] = loss.item()
            if self.reference is not None:
                kl = masked_mean(kl_k3(logp, ref_logp[micro]), m)
                loss = loss + cfg.kl_coef * kl
                stats["kl_ref"] = kl.item()
            if self.critic is not None:
                values = self.critic(batch.input_ids[micro], batch.attention_mask[micro])
                v_loss = value_loss(values, old_values[micro], returns[micro], m, cfg.value_clip)
                loss = loss + v_loss
                stats["value_loss"] = v_loss.item()
            if not torch.isfinite(loss):
                log.warning("non-finite loss (%s); skipping this update", loss.item())
                return None
            (loss * share).backward()
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + v * share.item()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.actor.parameters(), cfg.max_grad_norm)
        if self.critic is not None:
            torch.nn.utils.clip_grad_norm_(self.critic.parameters(), cfg.max_grad_norm)
        if not torch.isfinite(grad_norm):
            log.warning("non-finite gradient norm; skipping this update")
            return None
        for name, opt in self.optimizers.items():
            opt.step()
            self.schedulers[name].step()
        sums["grad_norm"] = grad_norm.item()
        return sums

    def save(self, step: int) -> str:
        return checkpoint.save_checkpoint(
            self.run_dir, step, actor=self.actor, tokenizer=self.tokenizer, critic=self.critic,
            optimizers=self.optimizers, schedulers=self.schedulers, keep=self.cfg.keep,
            trainer_state={"data_cursor": self.sampler.cursor, "bad_steps": self.bad_steps,
                           "mismatch_warned": self.mismatch_warned, "uaq_scale": self.cfg.uaq_scale,
                           "config": self.cfg.to_dict(), "base_model": self.base_model})


class Timer:
    """with timer("phase"): ... accumulates seconds into timer.times["time_phase"]."""

    def __init__(self):
        self.times = {}

    @contextlib.contextmanager
    def __call__(self, name):
        t0 = time.perf_counter()
        yield
        self.times[f"time_{name}"] = self.times.get(f"time_{name}", 0.0) + time.perf_counter() - t0
