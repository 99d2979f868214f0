"""The RL loop: quantized vLLM rollout -> reward -> log-probs -> advantages -> update -> sync.

One step, in order (`Trainer.step`):
  1. rollout    the engine (bf16, INT8 or FP8) samples G responses per prompt, with pi_behav  GroupSampler.sample
  2. reward     exact match of the '####' answer (DAPO: + overlong shaping, dynamic sampling)
  3. logprobs   the full-precision actor recomputes pi_prox (the reference pi_ref, PPO's values)  batched_logprobs
  4. advantages GRPO/DAPO: group-normalized; PPO: GAE on the critic's values  ADVANTAGE_ESTIMATORS
  5. update     minibatch steps on the chosen objective (Eq. 1/3/4/5/9)  Updater (update.py)
  6. sync       quantize the updated actor and load it into the live engine, in place  RolloutEngine.sync_weights
What differs between GRPO, PPO and DAPO is data: `algorithms.ALGORITHMS`.
"""
import json
import logging
import os
import random

import torch

from . import quant
from .actor import Critic, batched_logprobs, batched_values, enable_gradient_checkpointing, frozen_reference_dtype, load_actor
from .advantages import ADVANTAGE_ESTIMATORS
from .algorithms import ALGORITHMS
from .base_model import base_model_path
from .batch import Experience, align_per_token, pack_sequences
from .config import Config
from .data import PromptOrder, load_problems
from .engine import Platform, RolloutEngine, context_length
from .evaluate import greedy_accuracy
from .infra import checkpoint
from .infra.hardware import describe_cpu
from .infra.memory import budget_below_one_sequence
from .infra.paths import check_model_dir, check_output_dir, check_outputs_apart, looks_like_path
from .infra.progress import Timer, progress_bar
from .infra.run_lock import RunLock
from .infra.signals import stop_point
from .infra.trackers import Trackers
from .loss import sampler_mismatch
from .metrics import MetricsLog, SignalWatch, WeightUpdateMonitor, plot_metrics
from .named_models import is_named, weights_hash
from .prompts import PromptBuilder
from .sampling import GroupSampler
from .sync_probe import ProbeSides, SyncProbe
from .token_records import TokenLog
from .uaq import apply_uaq
from .update import TrainingError, Updater

log = logging.getLogger("qurl_mini")


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
        """Each step takes what the one before it made."""
        self.algorithm = ALGORITHMS[cfg.algo]  # the one place that looks at --algo
        if cfg.defaults_note():
            log.info("%s", cfg.defaults_note())
        self.platform = Platform.detect()
        resume_from = checkpoint.find_resume(cfg.resume, self.run_dir)
        state = checkpoint.load_trainer_state(resume_from) if resume_from else {}
        train_problems, test_problems = load_problems(cfg.data, cfg.test_data, cfg.eval_size, cfg.seed, cfg.max_number)
        self.base_model = base_model_path(cfg, train_problems)  # the embedded warm start trains on the problems
        if resume_from:
            checkpoint.check_resumable(resume_from, cfg.to_dict(), self.base_model)
        self.actor, self.tokenizer, self.reference, self.critic = self._load_models(resume_from)
        self.prompts = PromptBuilder(cfg.prompt_format, self.tokenizer)
        self.train_problems, self.test_problems = self._fitting(train_problems, test_problems)
        self.updater = Updater(cfg, self.actor, self.critic, self.reference)
        if resume_from:
            self.updater.restore(resume_from, state)
            log.info("resumed from %s (step %d)", resume_from, state["step"])
        self.start_step = state.get("step", 0)
        self.prompt_order = PromptOrder(len(self.train_problems), cfg.seed, cursor=state.get("data_cursor", 0))
        self.mismatch_warned = state.get("mismatch_warned", False)
        self.signal_watch = SignalWatch(cfg.max_new_tokens, warned=state.get("signal_warned", False))
        self.initial_test_accuracy = state.get("initial_test_accuracy")  # a resumed run's, measured at its start
        stop_point()  # a SIGINT/SIGTERM while loading: stop before anything is written, and the engine's start
        self.metrics = MetricsLog(os.path.join(self.run_dir, "metrics.jsonl"),
                                  resume_after_step=self.start_step if resume_from else None)
        self.trackers = Trackers(cfg.report_to, self.run_dir, cfg.run_name, cfg.to_dict(), resume=bool(resume_from))
        self.token_log = TokenLog(self.run_dir, cfg, resume_after_step=self.start_step if resume_from else None)
        self.engine, start_codes = self._start_engine()  # on a copy of the actor as it now is
        self.weight_monitor = WeightUpdateMonitor()
        if self.engine.quantized:
            self.weight_monitor.measure(self.actor, start_codes)  # the start point of Eq. 13's updates
        self.group_sampler = GroupSampler(cfg, self.algorithm, self.engine, self.tokenizer, self.prompts,
                                          self.train_problems, order=self.prompt_order)
        self.probe, self.probe_sides = self._calibrated_probe(self.train_problems[0])

    def _load_models(self, resume_from: str | None):
        """The actor (UAQ-rescaled), its tokenizer, the frozen reference and PPO's critic, on the engine's device."""
        cfg = self.cfg
        actor, tokenizer = load_actor(os.path.join(resume_from, "actor") if resume_from else self.base_model)
        if not resume_from:  # once, before training (Eq. 11); a checkpoint holds the rescaled weights already
            apply_uaq(actor, cfg.uaq_scale)
        quant.keep_unquantized(actor, cfg.quant_keep)  # before the engine's first checkpoint
        actor.train()
        device = torch.device("cuda" if self.platform.cuda else "cpu")
        # the reference without UAQ: Eq. 11 leaves the function unchanged, and the reference is never quantized
        reference = (load_actor(self.base_model, dtype=frozen_reference_dtype(device.type))[0].eval()
                     if cfg.kl_coef > 0 else None)
        critic = Critic(actor) if self.algorithm.critic else None
        for model in (actor, reference, critic):
            if model is not None:
                model.to(device)
        if cfg.gradient_checkpointing:
            enable_gradient_checkpointing(actor, critic.backbone if critic is not None else None)
        return actor, tokenizer, reference, critic

    def _fitting(self, train_problems, test_problems):
        """The problems whose prompt, as the model sees it, fits --max-prompt-tokens."""
        cfg = self.cfg
        train_problems = self.prompts.fitting(train_problems, cfg.max_prompt_tokens, "training problems")
        test_problems = self.prompts.fitting(test_problems, cfg.max_prompt_tokens, "test problems")
        if cfg.prompts_per_step > len(train_problems):
            raise TrainingError(f"--prompts-per-step {cfg.prompts_per_step} is larger than the "
                                f"{len(train_problems)} training problems")
        log.info("prompt format %r; the first training problem as the model sees it:\n%s",
                 self.prompts.format, self.prompts.text(train_problems[0]))
        return train_problems, test_problems

    def _start_engine(self):
        """vLLM on a (quantized) copy of the actor, sized for the longest prompt + response; and its start codes."""
        cfg = self.cfg
        longest_prompt = cfg.max_prompt_tokens or max(len(self.prompts.ids(p)) for p in self.train_problems[:2000])
        if note := budget_below_one_sequence(cfg.max_tokens_per_micro_batch, longest_prompt, cfg.max_new_tokens):
            log.warning("%s", note)
        max_len = context_length(longest_prompt, cfg.max_new_tokens, getattr(self.actor.config, "max_position_embeddings", None))
        return RolloutEngine.from_actor(
            self.actor, self.tokenizer, self.run_dir, quant_fmt=cfg.quant, quant_group=cfg.quant_group,
            platform=self.platform, seed=cfg.seed, max_model_len=max_len, dtype=cfg.engine_dtype,
            kv_cache_gib=cfg.kv_cache_gib, gpu_memory_utilization=cfg.gpu_memory_utilization,
            sleep_mode=True,  # the one engine of this process that sleeps during the update (CUDA)
            enforce_eager=cfg.enforce_eager)

    def _calibrated_probe(self, problem):
        """The sync probe on a training prompt + its reference answer, calibrated on the fresh engine."""
        answer = self.tokenizer.encode(problem.answer, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        sides = ProbeSides(self.engine, self.actor, (self.prompts.ids(problem) + answer)[:self.engine.max_model_len - 1])
        probe = SyncProbe(sides.sequence, every=self.cfg.sync_check_every)
        if probe.every:
            probe.calibrate(sides.engine_logprobs(), sides.actor_logprobs())
        return probe, sides

    def run(self) -> dict:
        cfg = self.cfg
        stop_point()  # a SIGINT/SIGTERM while setting up
        if self.start_step == 0:
            self.initial_test_accuracy = self.evaluate()
            log.info("greedy test accuracy before RL: %.1f%%", 100 * self.initial_test_accuracy)
            self.trackers.log({"test_accuracy": self.initial_test_accuracy}, step=0)
        summary = {"initial_test_accuracy": self.initial_test_accuracy}
        with progress_bar(f"RL {cfg.algo} / rollout {self.engine.engine_format}", cfg.steps - self.start_step) as advance:
            for step in range(self.start_step + 1, cfg.steps + 1):
                stop_point()  # between steps: the last checkpoint and metrics are whole
                row = self.step(step)
                if self.is_eval_step(step):
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
                       base_model=self.base_model, base_model_hash=weights_hash(self.base_model), metrics=self.metrics.path,
                       checkpoints=checkpoint.checkpoint_dir(self.run_dir), trackers=self.trackers.watch(),
                       machine=describe_cpu(), engine_dtype=self.engine.dtype, config=cfg.to_dict())
        with open(os.path.join(self.run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        return summary

    def is_eval_step(self, step: int) -> bool:
        """--eval-every's steps and the last: greedy test accuracy, and the token page's responses."""
        return step == self.cfg.steps or bool(self.cfg.eval_every and step % self.cfg.eval_every == 0)

    def evaluate(self) -> float:
        return greedy_accuracy(self.actor, self.tokenizer, self.test_problems, self.cfg.max_new_tokens,
                               prompts=self.prompts)[0]

    def step(self, step: int) -> dict:
        """One RL step (the README's phase table); a SIGINT/SIGTERM stops it at a stop_point(), where the step is
        dropped whole (resume redoes it from the last checkpoint)."""
        cfg, timer = self.cfg, Timer()
        torch.manual_seed(cfg.seed * 1_000_003 + step)  # each step's randomness depends on (seed, step) only
        random.seed(cfg.seed * 1_000_003 + step)

        # 1-2. rollout on the (quantized) engine: G responses per prompt with pi_behav, and their rewards
        with timer("rollout"):
            samples = self.group_sampler.sample()
            self.engine.sleep()
        stop_point()
        rollouts = samples.rollouts()
        prompts = [r.prompt_ids for r in rollouts]
        sequences = pack_sequences(prompts, [r.response_ids for r in rollouts], self.tokenizer.pad_token_id)
        mask = sequences.response_mask
        behav_logp = align_per_token([r.behav_logprobs for r in rollouts], prompts, sequences.input_ids.shape[1])

        # 3. the full-precision actor's log-probs of the sampled tokens: pi_prox (and pi_ref, V_old)
        with timer("logprob"):  # token_logprobs; --shared-prompt: the same numbers, each group's prompt run once
            micro = dict(micro_batch_size=cfg.micro_batch_size, max_tokens=cfg.max_tokens_per_micro_batch, shared=cfg.shared_prompt)
            prox_logp = batched_logprobs(self.actor, sequences, temperature=cfg.temperature, **micro)
            ref_logp = (batched_logprobs(self.reference, sequences, temperature=cfg.temperature, **micro)
                        if self.reference is not None else None)
            old_values = batched_values(self.critic, sequences, **micro) if self.critic else None
        stop_point()

        # 4. advantages
        rewards = torch.cat(samples.rewards)
        advantages, returns = ADVANTAGE_ESTIMATORS[self.algorithm.advantages](rewards, mask, old_values, cfg)
        experience = Experience(sequences, prox_logp=prox_logp, behav_logp=behav_logp, advantages=advantages,
                                ref_logp=ref_logp, old_values=old_values, returns=returns)

        # 5. update: minibatch AdamW steps on the objective
        with timer("update"):
            update_stats = self.updater(experience)
        stop_point()

        # 6. quantize + load into the live engine, in place; then check that it took the weights
        with timer("sync"):
            synced = self.engine.sync_weights(self.actor)
        stop_point()
        sync_stats = self.weight_monitor.measure(self.actor, synced.codes) if self.engine.quantized else {}  # Eq. 13-14
        sync_stats.update(self.probe.after_sync(step, self.probe_sides.engine_logprobs, self.probe_sides.actor_logprobs))

        if cfg.token_page_responses and self.is_eval_step(step):  # a few responses token by token: tokens.{jsonl,html}
            with timer("token_page"): self.token_log.save(step, experience, samples, self.tokenizer)
        mismatch = self._check_mismatch(behav_logp, prox_logp, mask)
        accuracy, signal = torch.cat(samples.correct).mean().item(), samples.signal_stats()
        self.signal_watch.observe(step, accuracy, signal["truncated_share"])  # warns once if it cannot learn
        return {
            "step": step, "reward_mean": rewards.mean().item(), "accuracy": accuracy,
            "response_len": mask.sum(-1).mean().item(), **signal, **samples.stats, **update_stats,
            **mismatch,  # over the step's tokens (k1 and k3 KL, rho's extremes), not minibatch averages
            **sync_stats, "time_quantize": synced.seconds_quantize, **timer.times,
            "time_step": sum(timer.times.values()), "data_cursor": self.prompt_order.cursor,
        }

    def _check_mismatch(self, behav_logp, prox_logp, mask) -> dict:
        """The sampler/learner gap over the step's tokens (Sec. 4.2); warn once when it is far too large."""
        mismatch = sampler_mismatch(prox_logp, behav_logp, mask, self.cfg.tis_cap)
        if (kl := mismatch["kl_behav_prox_k3"]) > self.cfg.mismatch_warn_kl and not self.mismatch_warned:
            log.warning("KL(behav||prox) = %.3g (k3) exceeds %.3g: the rollout engine and the actor disagree "
                        "(quantization too coarse, or a broken weight sync?)", kl, self.cfg.mismatch_warn_kl)
            self.mismatch_warned = True
        return mismatch

    def save(self, step: int) -> str:
        return checkpoint.save_checkpoint(
            self.run_dir, step, actor=self.actor, tokenizer=self.tokenizer, critic=self.critic,
            optimizers=self.updater.optimizers, schedulers=self.updater.schedulers, keep=self.cfg.keep,
            trainer_state={"data_cursor": self.prompt_order.cursor, "bad_steps": self.updater.bad_steps,
                           "mismatch_warned": self.mismatch_warned, "signal_warned": self.signal_watch.warned,
                           "uaq_scale": self.cfg.uaq_scale, "initial_test_accuracy": self.initial_test_accuracy,
                           "config": self.cfg.to_dict(), "base_model": self.base_model})
