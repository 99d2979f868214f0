"""The RL loop: quantized vLLM rollout -> reward -> log-probs -> advantages -> update -> sync.

One step, in order (`Trainer.step`):
  1. rollout    the engine (bf16, INT8 or FP8) samples G responses per prompt, with pi_behav
  2. reward     exact match of the '####' answer (DAPO: + overlong shaping, dynamic sampling)
  3. logprobs   the full-precision actor recomputes pi_prox (the reference pi_ref, PPO's values)
  4. advantages GRPO/DAPO: group-normalized; PPO: GAE on the critic's values
  5. update     minibatch steps on the chosen objective (Eq. 1/3/4/5/9)
  6. sync       quantize the updated actor and load it into the live engine, in place
What differs between GRPO, PPO and DAPO is data: `algorithms.ALGORITHMS`.
"""
import contextlib
import json
import logging
import os
import random
import time

import torch

from . import checkpoint, quant
from .actor import (Critic, autocast_context, batched_logprobs, batched_values, device_of, enable_gradient_checkpointing,
                    frozen_reference_dtype, load_actor, token_logprobs)
from .advantages import ADVANTAGE_ESTIMATORS
from .algorithms import ALGORITHMS
from .batch import Experience, align_per_token, pack_sequences
from .config import Config
from .data import PromptSampler, load_problems
from .embedded import warm_start
from .engine import Platform, RolloutEngine, context_length
from .evaluate import greedy_accuracy
from .hardware import describe_cpu
from .loss import (aggregation_units, combine_stats, kl_k3, masked_mean, policy_loss, policy_stats, sampler_mismatch,
                   sequence_ratio, value_loss)
from .metrics import MetricsLog, plot_metrics
from .named_models import is_named, resolve_model, weights_hash
from .paths import check_model_dir, check_output_dir, check_outputs_apart, looks_like_path
from .progress import progress_bar
from .prompts import PromptBuilder
from .run_dir import RunLock, stop_point
from .sampling import GroupSampler
from .sync_probe import SyncProbe
from .trackers import Trackers
from .uaq import apply_uaq
from .errors import OneLineError

log = logging.getLogger("qurl_mini")


class TrainingError(OneLineError, RuntimeError):
    """The run cannot go on (e.g. too many NaN steps); the message is one line."""


def base_model_path(cfg: Config, train_problems) -> str:
    """--model, or the embedded tiny Qwen2 after its (cached) SFT warm start: the synthetic variant on
    the synthetic task, the byte-fallback one (any text, 2048 positions) on real data."""
    if cfg.model is not None:
        return resolve_model(cfg.model, cfg.cache_dir)  # a name (smollm2-135m): its folder, converted once
    variant = "synthetic" if cfg.data == "synthetic" else "text"
    return warm_start(cfg.cache_dir, train_problems, variant=variant, steps=cfg.sft_steps, lr=cfg.sft_lr,
                      teacher_slip=cfg.teacher_slip, seed=0, source=os.path.basename(cfg.data))


class Trainer:
    """Use as `with Trainer(cfg) as trainer: trainer.run()`: the run folder is this run's until the end."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.run_dir = os.path.join(cfg.out_dir, cfg.run_name)
        check_output_dir(self.run_dir, "--out-dir")
        if cfg.model is None or is_named(cfg.model):
            check_output_dir(cfg.cache_dir, "--cache-dir")
        else:
            check_model_dir(cfg.model)
        check_outputs_apart({"--out-dir/--run-name": self.run_dir},
                            {"--model": cfg.model if cfg.model and looks_like_path(cfg.model) else None,
                             "--data": cfg.data, "--test-data": cfg.test_data})
        self.lock = RunLock(self.run_dir)  # before anything is written there; a second run stops here
        self.trackers = None
        try:
            self._set_up(cfg)
        except BaseException:
            self.close()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        """Close the trackers, give the run folder up (the process's end does too)."""
        try:
            if self.trackers is not None:
                self.trackers.close()
        finally:
            self.lock.release()

    def _set_up(self, cfg: Config) -> None:
        self.algorithm = ALGORITHMS[cfg.algo]  # the one place that looks at --algo
        self.platform = Platform.detect()
        resume_from = checkpoint.find_resume(cfg.resume, self.run_dir)
        state = checkpoint.load_trainer_state(resume_from) if resume_from else {}
        self._set_up_data()  # first: the embedded warm start (the base model) is trained on the data
        if resume_from:
            checkpoint.check_resumable(resume_from, cfg.algo, self.base_model)
        self._set_up_models(resume_from)  # resume state before the actor: a resumed actor is its checkpoint's
        self._set_up_prompts()  # after the actor: prompts are fitted with its tokenizer
        self._set_up_optimizers(resume_from, state)  # after the models are placed: they hold their parameters
        self.start_step = state.get("step", 0)
        self.sampler = PromptSampler(len(self.train_problems), cfg.seed, cursor=state.get("data_cursor", 0))
        self.bad_steps = state.get("bad_steps", 0)
        self.mismatch_warned = state.get("mismatch_warned", False)
        stop_point()  # a SIGINT/SIGTERM while loading: stop before anything is written, and the engine's start
        self.metrics = MetricsLog(os.path.join(self.run_dir, "metrics.jsonl"),
                                  resume_after_step=self.start_step if resume_from else None)
        self.trackers = Trackers(cfg.report_to, self.run_dir, cfg.run_name, cfg.to_dict(), resume=bool(resume_from))
        self._set_up_engine_and_probe()  # last: the engine starts on a copy of the actor as it now is

    # -- set-up -----------------------------------------------------------------------------------

    def _set_up_data(self) -> None:
        cfg = self.cfg
        self.train_problems, self.test_problems = load_problems(
            cfg.data, cfg.test_data, cfg.eval_size, cfg.seed, cfg.max_number)
        self.base_model = base_model_path(cfg, self.train_problems)

    def _set_up_models(self, resume_from: str | None) -> None:
        """The actor (UAQ-rescaled), the frozen reference and PPO's critic, on the training device."""
        cfg = self.cfg
        self.actor, self.tokenizer = load_actor(os.path.join(resume_from, "actor") if resume_from else self.base_model)
        if not resume_from:  # once, before training (Eq. 11); a checkpoint holds the rescaled weights already
            apply_uaq(self.actor, cfg.uaq_scale)
        quant.keep_unquantized(self.actor, cfg.quant_keep)  # before the engine's first checkpoint
        self.actor.train()
        device = torch.device("cuda" if self.platform.cuda else "cpu")  # the models train where the engine runs
        # the reference without UAQ: Eq. 11 leaves the function unchanged, and the reference is never quantized
        self.reference = (load_actor(self.base_model, dtype=frozen_reference_dtype(device.type))[0].eval()
                          if cfg.kl_coef > 0 else None)
        self.critic = Critic(self.actor) if self.algorithm.critic else None
        self._place_models(device)

    def _set_up_prompts(self) -> None:
        """Prompts as the model sees them; problems whose prompt is longer than --max-prompt-tokens dropped."""
        cfg = self.cfg
        self.prompts = PromptBuilder(cfg.prompt_format, self.tokenizer)
        self.train_problems = self.prompts.fitting(self.train_problems, cfg.max_prompt_tokens, "training problems")
        self.test_problems = self.prompts.fitting(self.test_problems, cfg.max_prompt_tokens, "test problems")
        if cfg.prompts_per_step > len(self.train_problems):
            raise TrainingError(f"--prompts-per-step {cfg.prompts_per_step} is larger than the "
                                f"{len(self.train_problems)} training problems")
        log.info("prompt format %r; the first training problem as the model sees it:\n%s",
                 self.prompts.format, self.prompts.text(self.train_problems[0]))

    def _set_up_optimizers(self, resume_from: str | None, state: dict) -> None:
        """AdamW for the actor (and critic) after a short warm-up; a resumed run's optimizer and RNG states."""
        cfg = self.cfg
        self.optimizers = {"actor": torch.optim.AdamW(self.actor.parameters(), lr=cfg.lr, weight_decay=0.0)}
        if self.critic is not None:
            self.optimizers["critic"] = torch.optim.AdamW(self.critic.parameters(), lr=cfg.critic_lr)
        warmup = 3 * cfg.minibatches * cfg.ppo_epochs
        self.schedulers = {name: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
                           for name, opt in self.optimizers.items()}
        if resume_from:
            checkpoint.restore(resume_from, critic=self.critic, optimizers=self.optimizers,
                               schedulers=self.schedulers, state=state)
            log.info("resumed from %s (step %d)", resume_from, state["step"])

    def _set_up_engine_and_probe(self) -> None:
        """vLLM on a (quantized) copy of the actor, sized for the longest prompt plus response; the rollout on it;
        the sync probe on a training prompt + its reference answer, calibrated on the fresh engine."""
        cfg = self.cfg
        longest_prompt = cfg.max_prompt_tokens or max(len(self.prompts.ids(p)) for p in self.train_problems[:2000])
        max_len = context_length(longest_prompt, cfg.max_new_tokens,
                                 getattr(self.actor.config, "max_position_embeddings", None))
        self.engine, quantized = RolloutEngine.from_actor(
            self.actor, self.tokenizer, self.run_dir, quant_fmt=cfg.quant, quant_group=cfg.quant_group,
            platform=self.platform, seed=cfg.seed, max_model_len=max_len, dtype=cfg.engine_dtype,
            kv_cache_gib=cfg.kv_cache_gib, gpu_memory_utilization=cfg.gpu_memory_utilization,
            sleep_mode=True)  # the one engine of this process that sleeps during the update (CUDA)
        self.monitor = quant.WeightUpdateMonitor()
        if quantized:
            self.monitor.measure(self.actor, quantized)  # the start point of Eq. 13's updates
        self.rollout = GroupSampler(cfg, self.algorithm, self.engine, self.tokenizer, self.prompts, self.train_problems,
                                    order=self.sampler)
        first = self.train_problems[0]
        answer = self.tokenizer.encode(first.answer, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        self.probe = SyncProbe((self.prompts.ids(first) + answer)[:self.engine.max_model_len - 1],
                               every=cfg.sync_check_every)
        if self.probe.every:
            self.probe.calibrate(self._engine_probe_logprobs(), self._actor_probe_logprobs())

    def _place_models(self, device: torch.device) -> None:
        """Actor, reference and critic onto the training device; gradient checkpointing if asked."""
        for model in (self.actor, self.reference, self.critic):
            if model is not None:
                model.to(device)
        if self.cfg.gradient_checkpointing:
            enable_gradient_checkpointing(self.actor, self.critic.backbone if self.critic is not None else None)

    def _engine_probe_logprobs(self) -> torch.Tensor:
        return torch.tensor(self.engine.prompt_logprobs([self.probe.sequence])[0])

    @torch.no_grad()
    def _actor_probe_logprobs(self) -> torch.Tensor:
        """The actor's log-probs of the probe sequence, computing like the engine (its grid), on the CPU."""
        ids = torch.tensor([self.probe.sequence], device=device_of(self.actor))
        with self.engine.computing_like(self.actor):
            return token_logprobs(self.actor, ids, torch.ones_like(ids))[0].cpu()

    # -- the loop ---------------------------------------------------------------------------------

    def run(self) -> dict:
        cfg = self.cfg
        summary = {}
        stop_point()  # a SIGINT/SIGTERM while setting up
        if self.start_step == 0:
            summary["initial_test_accuracy"] = self.evaluate()
            log.info("greedy test accuracy before RL: %.1f%%", 100 * summary["initial_test_accuracy"])
            self.trackers.log({"test_accuracy": summary["initial_test_accuracy"]}, step=0)
        with progress_bar(f"RL {cfg.algo} / rollout {self.engine.engine_format}", cfg.steps - self.start_step) as advance:
            for step in range(self.start_step + 1, cfg.steps + 1):
                stop_point()  # between steps: the last checkpoint and metrics are whole
                row = self.step(step)
                if step == cfg.steps or (cfg.eval_every and step % cfg.eval_every == 0):
                    row["test_accuracy"] = self.evaluate()
                self.metrics.write(row)
                self.trackers.log(row, step)
                if step % cfg.save_every == 0 or step == cfg.steps:
                    self.save(step)
                advance(f"reward {row['reward_mean']:.2f} acc {row['accuracy']:.2f} "
                        f"kl(b|p) {row['kl_behav_prox_k3']:.1e} {row['time_step']:.1f}s")
        final_dir = checkpoint.save_model(os.path.join(self.run_dir, "final"), self.actor, self.tokenizer)
        plot = plot_metrics(self.metrics.path, os.path.join(self.run_dir, "curves.png"),
                            summary.get("initial_test_accuracy"))
        self.trackers.image("curves", plot, cfg.steps)
        summary.update(final_test_accuracy=self.evaluate(), final_model=final_dir, plot=plot,
                       base_model=self.base_model, base_model_hash=weights_hash(self.base_model),
                       metrics=self.metrics.path,
                       checkpoints=checkpoint.checkpoint_dir(self.run_dir), trackers=self.trackers.watch(),
                       machine=describe_cpu(), engine_dtype=self.engine.dtype, config=cfg.to_dict())
        with open(os.path.join(self.run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        return summary

    def evaluate(self) -> float:
        return greedy_accuracy(self.actor, self.tokenizer, self.test_problems, self.cfg.max_new_tokens,
                               prompts=self.prompts)[0]

    def step(self, step: int) -> dict:
        cfg, timer = self.cfg, Timer()
        torch.manual_seed(cfg.seed * 1_000_003 + step)  # each step's randomness depends on (seed, step) only
        random.seed(cfg.seed * 1_000_003 + step)

        # 1-2. rollout on the (quantized) engine, and rewards
        with timer("rollout"):
            samples = self.rollout()
            self.engine.sleep()
        rollouts = samples.rollouts()
        prompts = [r.prompt_ids for r in rollouts]
        sequences = pack_sequences(prompts, [r.response_ids for r in rollouts], self.tokenizer.pad_token_id)
        mask = sequences.response_mask
        behav_logp = align_per_token([r.behav_logprobs for r in rollouts], prompts, sequences.input_ids.shape[1])

        # 3. the full-precision actor's log-probs of the sampled tokens: pi_prox (and pi_ref, V_old)
        with timer("logprob"):
            micro = dict(micro_batch_size=cfg.micro_batch_size, max_tokens=cfg.max_tokens_per_micro_batch)
            prox_logp = batched_logprobs(self.actor, sequences, temperature=cfg.temperature, **micro)
            ref_logp = (batched_logprobs(self.reference, sequences, temperature=cfg.temperature, **micro)
                        if self.reference is not None else None)
            old_values = batched_values(self.critic, sequences, **micro) if self.critic else None

        # 4. advantages
        rewards = torch.cat(samples.rewards)
        advantages, returns = ADVANTAGE_ESTIMATORS[self.algorithm.advantages](rewards, mask, old_values, cfg)
        experience = Experience(sequences, prox_logp=prox_logp, behav_logp=behav_logp, advantages=advantages,
                                ref_logp=ref_logp, old_values=old_values, returns=returns)

        # 5. update
        with timer("update"):
            update_stats = self.update(experience)

        # 6. quantize + sync into the live engine, then check that it took the weights
        with timer("sync"):
            quantized, time_quantize = self.sync()
        sync_stats = self.monitor.measure(self.actor, quantized) if quantized else {}  # Eq. 13-14
        sync_stats.update(self.probe.after_sync(step, self._engine_probe_logprobs, self._actor_probe_logprobs))

        mismatch = self._check_mismatch(behav_logp, prox_logp, mask)
        return {
            "step": step, "reward_mean": rewards.mean().item(), "accuracy": torch.cat(samples.correct).mean().item(),
            "response_len": mask.sum(-1).mean().item(), **samples.stats, **update_stats,
            **mismatch,  # over the step's tokens (k1 and k3 KL, rho's extremes), not minibatch averages
            **sync_stats, "time_quantize": time_quantize, **timer.times, "time_step": sum(timer.times.values()),
            "data_cursor": self.sampler.cursor,
        }

    def sync(self) -> tuple[dict, float]:
        """The updated actor, quantized, into the live engine, in place: its {name: (codes, scale)}, and the
        seconds the quantizing took."""
        t0 = time.perf_counter()
        pairs, quantized = self.engine.checkpoint_tensors(self.actor)
        time_quantize = time.perf_counter() - t0
        self.engine.load_weights(pairs)
        return quantized, time_quantize

    def _check_mismatch(self, behav_logp, prox_logp, mask) -> dict:
        """The sampler/learner gap over the step's tokens (Sec. 4.2); warn once when it is far too large."""
        mismatch = sampler_mismatch(prox_logp, behav_logp, mask, self.cfg.tis_cap)
        kl = mismatch["kl_behav_prox_k3"]
        if kl > self.cfg.mismatch_warn_kl and not self.mismatch_warned:
            log.warning("KL(behav||prox) = %.3g (k3) exceeds %.3g: the rollout engine and the actor disagree "
                        "(quantization too coarse, or a broken weight sync?)", kl, self.cfg.mismatch_warn_kl)
            self.mismatch_warned = True
        return mismatch

    # -- the update -------------------------------------------------------------------------------

    def update(self, experience: Experience) -> dict:
        """Minibatch optimizer steps; a NaN/inf loss or gradient skips the step and is counted. The statistics
        of the minibatches combine by their own rule (`loss.COMBINE`: a max stays a max)."""
        cfg = self.cfg
        per_minibatch, skipped = [], 0
        for _ in range(cfg.ppo_epochs):
            order = torch.randperm(len(experience))
            for rows in order.chunk(cfg.minibatches):
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

    def _minibatch_step(self, minibatch: Experience) -> dict | None:
        """One optimizer step, gradients accumulated over micro-batches (--micro-batch-size rows or
        --max-tokens-per-micro-batch tokens). Each micro-batch's loss divides by the whole minibatch's
        count (`over`), so the micro-batch losses add up to the minibatch's (tests/test_micro_batches.py);
        the policy statistics are computed once, on all of the minibatch's response tokens."""
        cfg = self.cfg
        over = {"policy": aggregation_units(minibatch.mask, cfg.loss_agg).clamp(min=1),  # G rows, or tokens
                "tokens": minibatch.mask.sum().clamp(min=1)}  # KL and value loss are token means
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=True)
        sums, tokens = {}, []
        for micro in minibatch.micro_batches(cfg.micro_batch_size, cfg.max_tokens_per_micro_batch):
            loss, parts, logp = self._micro_loss(micro.to(device_of(self.actor)), over)
            if not torch.isfinite(loss):
                log.warning("non-finite loss (%s); skipping this update", loss.item())
                return None
            loss.backward()
            for k, v in parts.items():  # each part is divided by the minibatch's count: they add up
                sums[k] = sums.get(k, 0.0) + v
            present = micro.mask > 0
            seq = sequence_ratio(torch.exp(micro.prox_logp - micro.behav_logp), micro.mask)
            tokens.append([t.detach().cpu()[present.cpu()] for t in
                           (logp, micro.prox_logp, micro.behav_logp, micro.advantages, seq.log_sum, seq.length)])
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
        return {**stats, **sums, "grad_norm": grad_norm.item()}

    def _micro_loss(self, micro: Experience, over: dict):
        """One micro-batch's part of the minibatch loss: the policy objective (+ k3 KL to the reference,
        + PPO's value loss), each divided by the minibatch's units in `over`; the parts' values; its log-probs."""
        cfg, seq, m = self.cfg, micro.sequences, micro.mask
        with autocast_context(seq.input_ids.device.type):
            logp = token_logprobs(self.actor, seq.input_ids, seq.attention_mask, cfg.temperature, only=m)
            values = self.critic(seq.input_ids, seq.attention_mask) if self.critic is not None else None
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

    def save(self, step: int) -> str:
        return checkpoint.save_checkpoint(
            self.run_dir, step, actor=self.actor, tokenizer=self.tokenizer, critic=self.critic,
            optimizers=self.optimizers, schedulers=self.schedulers, keep=self.cfg.keep,
            trainer_state={"data_cursor": self.sampler.cursor, "bad_steps": self.bad_steps,
                           "mismatch_warned": self.mismatch_warned, "uaq_scale": self.cfg.uaq_scale,
                           "config": self.cfg.to_dict(), "base_model": self.base_model})


class Timer:
    """with timer("phase"): ... accumulates seconds into timer.times["time_phase"]. A phase's end is where a
    SIGINT/SIGTERM stops the run (the step is dropped; resume redoes it from the last checkpoint)."""

    def __init__(self):
        self.times = {}

    @contextlib.contextmanager
    def __call__(self, name):
        t0 = time.perf_counter()
        yield
        self.times[f"time_{name}"] = self.times.get(f"time_{name}", 0.0) + time.perf_counter() - t0
        stop_point()
