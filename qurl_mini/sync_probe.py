"""A run-time check that the rollout engine really holds the actor's weights after a sync.

After the first sync and every N steps, one fixed sequence is scored twice: by the engine
(`prompt_logprobs`) and by the full-precision actor computing like the engine (weights, and for
W8A8 activations, rounded to the engine's grid). Their mean |log-prob gap| per token is compared
with the gap measured at start, when the engine was loaded from a checkpoint file and so is right
by construction. A sync that did not land shows up one of two ways:
  - the gap is far beyond that quantization noise (or NaN): the engine computes something else;
  - stale weights: the engine's log-probs did not move since the last check while the actor's did (or
    it agrees clearly better with the actor *before* the update than after it). The first test still
    works where the quantization noise is as large as one update (INT8 on AVX2-only CPUs).
"""
import math
from dataclasses import dataclass

import torch

from .actor import device_of, token_logprobs
from .infra.errors import OneLineError


class SyncError(OneLineError, RuntimeError):
    """The engine did not take the new weights; the message is one line."""


def mean_abs_gap(engine_logp: torch.Tensor, actor_logp: torch.Tensor) -> float:
    return (engine_logp.float() - actor_logp.float()).abs().mean().item()


@dataclass
class ProbeSides:
    """The two sides the probe compares on one sequence: the engine, and the actor computing like it."""
    engine: object  # engine.RolloutEngine
    actor: object
    sequence: list[int]

    def engine_logprobs(self) -> torch.Tensor:
        return torch.tensor(self.engine.prompt_logprobs([self.sequence])[0])

    @torch.no_grad()
    def actor_logprobs(self) -> torch.Tensor:
        """The actor's log-probs of the sequence, with its weights (and W8A8 activations) on the engine's grid."""
        ids = torch.tensor([self.sequence], device=device_of(self.actor))
        with self.engine.computing_like(self.actor):
            return token_logprobs(self.actor, ids, torch.ones_like(ids))[0].cpu()


@dataclass
class SyncProbe:
    sequence: list[int]  # prompt + reference answer of one training problem, fixed for the run
    every: int  # probe after step 1 and every `every` steps (0: never)
    noise_factor: float = 5.0  # a gap this many times the start gap is "far beyond quantization noise"
    noise_floor: float = 1e-3  # ... and at least this (nats per token): the start gap can be ~0 (fp32 engine)
    start_gap: float | None = None
    engine_last: torch.Tensor | None = None  # both sides' log-probs at the last check (or at start)
    actor_last: torch.Tensor | None = None
    actor_before: torch.Tensor | None = None  # the actor's before the next update, kept when that step is due

    def due(self, step: int) -> bool:
        return self.every > 0 and (step == 1 or step % self.every == 0)

    def calibrate(self, engine_logp, actor_logp) -> float:
        """The gap of the engine loaded from a checkpoint: quantization noise only."""
        self.start_gap = mean_abs_gap(engine_logp, actor_logp)
        self.engine_last, self.actor_last, self.actor_before = engine_logp, actor_logp, actor_logp
        if not math.isfinite(self.start_gap):
            raise SyncError("the rollout engine's log-probs are not finite right after loading the checkpoint")
        return self.start_gap

    @property
    def limit(self) -> float:
        return max(self.noise_factor * self.start_gap, self.noise_floor)

    def after_sync(self, step: int, engine_logp, actor_logp) -> dict:
        """The probe's one call per step, after the sync: on a due step, `check` the engine against the updated
        actor; before a due step, keep the actor's log-probs as that check's "before the update" (nothing
        changes the actor between this sync and the next update). engine_logp(), actor_logp(): both sides'
        log-probs of `sequence`, computed only when needed."""
        stats, actor_now = {}, None
        if self.due(step):
            actor_now = actor_logp()
            stats = self.check(step, engine_logp(), actor_now, self.actor_before)
        if self.due(step + 1):
            self.actor_before = actor_now if actor_now is not None else actor_logp()
        return stats

    def check(self, step: int, engine_logp, actor_after, actor_before) -> dict:
        """Raise SyncError unless the engine matches the updated actor; else the gaps, for the metrics."""
        gap, gap_before = mean_abs_gap(engine_logp, actor_after), mean_abs_gap(engine_logp, actor_before)
        where = (f"step {step}: the rollout engine did not take the new weights (sync probe: mean |log-prob gap| "
                 f"{gap:.2e} to the updated actor")
        if not math.isfinite(gap):
            raise SyncError(f"{where}; the engine's log-probs are not finite)")
        if gap_before < 0.5 * gap and gap > 2 * self.start_gap:  # the likeliest cause first, on any engine dtype
            raise SyncError(f"{where} but {gap_before:.2e} to the actor before the update: it still holds the old "
                            f"weights)")
        if gap > self.limit:
            raise SyncError(f"{where}, over {self.limit:.2e} = {self.noise_factor:g} x the {self.start_gap:.2e} "
                            f"measured at start)")
        engine_moved, actor_moved = mean_abs_gap(engine_logp, self.engine_last), mean_abs_gap(actor_after, self.actor_last)
        if actor_moved > self.noise_floor and engine_moved < 0.2 * actor_moved:
            raise SyncError(f"{where}; since the last check its log-probs moved {engine_moved:.2e}, the actor's "
                            f"{actor_moved:.2e}: it still holds the old weights)")
        self.engine_last, self.actor_last = engine_logp, actor_after
        return {"sync_probe_gap": gap, "sync_probe_gap_before": gap_before}
