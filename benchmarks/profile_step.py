"""Where one real-model RL step spends its time, phase by phase, against the bound of each phase.

    python benchmarks/profile_step.py            # -> docs/results/profile_step.json (~5 min on 2 cores)

The trainer runs `--steps` GRPO steps of the real model (`--model smollm2-135m-arith`, the synthetic task in the
chat format, INT8 rollout) exactly as train.py does, and records each phase's seconds (rollout, log-probs,
update, sync). The bounds, measured on this CPU in the same process:
  - matmul rate: float32 GEMMs of the model's own shapes (tokens x 576 x 1536 ...), GFLOP/s;
  - log-probs: 2 x (decoder matmul parameters x tokens + lm_head parameters x response tokens) FLOPs, at that rate
    (the lm_head runs on the response positions only: `token_logprobs(only=)`; its A/B is measured here too);
  - update: ppo_epochs x 3 x that forward (forward + backward), + the AdamW steps measured alone;
  - plain: the same minibatches through the plain HF forward + backward (`model(..., labels).loss`), timed here:
    the honest baseline for what the trainer's update could cost.
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def matmul_rate(hidden: int, intermediate: int, tokens: int, repeats: int = 10, rounds: int = 5) -> float:
    """float32 GFLOP/s of [tokens, hidden] @ [hidden, intermediate] and back (the MLP's shapes): the best of
    `rounds` (a bound is what the CPU can do, not what a busy moment gave)."""
    import torch

    x, w = torch.randn(tokens, hidden), torch.randn(hidden, intermediate)
    y, w2 = torch.randn(tokens, intermediate), torch.randn(intermediate, hidden)
    x @ w, y @ w2  # warm-up
    best = 0.0
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(repeats):
            x @ w
            y @ w2
        best = max(best, repeats * 2 * (2 * tokens * hidden * intermediate) / (time.perf_counter() - t0) / 1e9)
    return best


def head_only_where_needed(actor, minibatches, rounds: int = 3) -> dict:
    """Forward + backward seconds of token_logprobs over the minibatches with the lm_head on every position vs on
    the response positions only (`only=`, what the trainer does), timed in turns."""
    from qurl_mini.actor import token_logprobs

    times = {"all positions": [], "response positions only": []}
    for _ in range(rounds):
        for name in times:
            t0 = time.perf_counter()
            for seq in minibatches:
                only = seq.response_mask if name.startswith("response") else None
                logp = token_logprobs(actor, seq.input_ids, seq.attention_mask, only=only)
                (logp * seq.response_mask).sum().backward()
            times[name].append(time.perf_counter() - t0)
            actor.zero_grad(set_to_none=True)
    return {name: statistics.median(t) for name, t in times.items()}


def matmul_params(model) -> int:
    """Parameters that take part in a matmul per token: every Linear, the (tied) lm_head included."""
    import torch

    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def main(argv=None) -> int:
    from qurl_mini.infra.cli import ArgumentParser  # an unknown flag: one line

    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-arith")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--out", default=os.path.join(REPO, "docs", "results", "profile_step.json"))
    args = p.parse_args(argv)

    import tempfile

    import torch

    from qurl_mini.config import Config
    from qurl_mini.infra.hardware import describe_cpu
    from qurl_mini.infra.progress import setup_logging
    from qurl_mini.trainer import Trainer

    setup_logging()
    out_dir = tempfile.mkdtemp(prefix="profile-")
    cfg = Config(model=args.model, data="synthetic", prompt_format="chat", algo="grpo", quant="int8", objective="acr",
                 steps=args.steps, prompts_per_step=8, group_size=8, max_new_tokens=24, lr=1e-5, kl_coef=0.0,
                 minibatches=4, ppo_epochs=1, eval_size=8, out_dir=out_dir, cache_dir=os.path.join(REPO, ".cache"),
                 run_name="profile", sync_check_every=0,
                 shared_prompt=False)  # one row per response, as profile_step.json was measured (bench_shared_prompt.py: the packed step)
    phases, tokens = [], []
    with Trainer(cfg) as trainer:
        captured = {}
        update = trainer.updater

        def keep_experience(experience):  # the step's minibatches, for the plain baseline below
            captured["experience"] = experience
            return update(experience)

        trainer.updater = keep_experience
        for step in range(1, args.steps + 1):
            row = trainer.step(step)
            phases.append({k: row[k] for k in ("time_rollout", "time_logprob", "time_update", "time_sync", "time_step")})
            tokens.append(int(captured["experience"].sequences.attention_mask.sum()))
        actor = trainer.actor
        experience = captured["experience"]
        # the plain baseline: the same minibatches, HF's own forward + backward, one AdamW step each
        opt = torch.optim.AdamW(actor.parameters(), lr=1e-12)
        plain, adam = [], []
        for rows in torch.arange(len(experience)).chunk(cfg.minibatches):
            seq = experience[rows].trimmed().sequences
            t0 = time.perf_counter()
            actor(input_ids=seq.input_ids, attention_mask=seq.attention_mask, labels=seq.input_ids).loss.backward()
            t1 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            plain.append(t1 - t0)
            adam.append(time.perf_counter() - t1)
        minibatches = [experience[rows].trimmed().sequences for rows in torch.arange(len(experience)).chunk(cfg.minibatches)]
        head_ab = head_only_where_needed(actor, minibatches)
        width = experience.sequences.input_ids.shape[1]
        rate = matmul_rate(actor.config.hidden_size, actor.config.intermediate_size, tokens=width * 8)
        params = matmul_params(actor)
        head_params = actor.get_output_embeddings().weight.numel()

    shutil.rmtree(out_dir, ignore_errors=True)  # the profiled run's folder
    padded_tokens = sum(mb.input_ids.numel() for mb in minibatches)
    response_tokens = int(experience.sequences.response_mask.sum())
    forward_s = 2 * ((params - head_params) * padded_tokens + head_params * response_tokens) / (rate * 1e9)
    last = phases[-1]
    result = {
        "cpu": describe_cpu(), "model": args.model, "settings": {"prompts_per_step": 8, "group_size": 8,
                                                                 "max_new_tokens": 24, "minibatches": 4,
                                                                 "ppo_epochs": 1, "quant": "int8"},
        "phases_per_step": phases, "sequences": len(experience), "tokens_attended": tokens[-1],
        "tokens_padded": padded_tokens, "response_tokens": response_tokens, "matmul_params": params,
        "lm_head_params": head_params, "matmul_gflops": rate,
        "lm_head_fwd_bwd_s": head_ab, "lm_head_on_responses_speedup": head_ab["all positions"] / head_ab["response positions only"],
        "bound_s": {"logprob": forward_s, "update": 3 * forward_s * cfg.ppo_epochs + sum(adam)},
        "plain_hf_forward_backward_s": sum(plain), "adamw_steps_s": sum(adam),
        "ratio_to_bound": {"logprob": last["time_logprob"] / forward_s,
                           "update": last["time_update"] / (3 * forward_s * cfg.ppo_epochs + sum(adam))},
        "update_vs_plain_hf": last["time_update"] / (sum(plain) + sum(adam)),
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: result[k] for k in ("phases_per_step", "bound_s", "ratio_to_bound", "update_vs_plain_hf",
                                             "matmul_gflops", "lm_head_fwd_bwd_s")}, indent=1))
    print(f"wrote {args.out}; mean step {statistics.mean(ph['time_step'] for ph in phases):.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
