"""--shared-prompt against one row per response: the actor's log-probs and update on the same step's rows.

    python benchmarks/bench_shared_prompt.py     # -> docs/results/bench_shared_prompt.json (~6 min on 2 cores)

For each model, a real GRPO step (INT8 rollout, the trainer as train.py runs it) gives the rows; then the log-prob
pass (pi_prox) and the update (the trainer's Updater: --minibatches AdamW steps) run on those rows with and
without --shared-prompt, in turns (A B A B ...), and the median of each is kept. Shapes:
  - smollm2-135m-arith: `make demo-real`'s step (8 prompts x 8 samples, chat template, 24 new tokens);
  - embedded: `make demo`'s step (32 prompts x 8 samples, plain prompts, 24 new tokens).
The FLOP bound counts each prompt once: 2 x (decoder matmul parameters x packed tokens + lm_head parameters x
response tokens) at the float32 matmul rate measured here on the model's shapes (forward; the update is 3x that
per pass + its AdamW steps). Its ratio to the measured time is reported beside the unshared one.
"""
import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

SHAPES = {
    "smollm2-135m-arith": dict(model="smollm2-135m-arith", prompt_format="chat", prompts_per_step=8, lr=1e-5),
    "embedded": dict(model=None, prompt_format="plain", prompts_per_step=32, lr=1e-4),
}


def one_step_rows(name: str, shape: dict, seed: int):
    """The trainer after one real step, and that step's Experience (its rows, log-probs, advantages)."""
    from qurl_mini.config import Config
    from qurl_mini.trainer import Trainer

    cfg = Config(data="synthetic", algo="grpo", quant="int8", objective="acr", steps=1, group_size=8,
                 max_new_tokens=24, kl_coef=0.0, minibatches=4, ppo_epochs=1, eval_size=8, seed=seed,
                 out_dir=tempfile.mkdtemp(prefix="bench-shared-"), cache_dir=os.path.join(REPO, ".cache"),
                 run_name=name, sync_check_every=0, **shape)
    trainer = Trainer(cfg)
    captured = {}
    update = trainer.updater

    def keep_experience(experience):
        captured["experience"] = experience
        return update(experience)

    trainer.updater = keep_experience
    trainer.step(1)
    trainer.updater = update
    return trainer, captured["experience"]


def time_paths(trainer, experience, rounds: int) -> dict:
    """Median seconds of the log-prob pass and the update, each path in turn, `rounds` times."""
    import torch

    from qurl_mini.actor import batched_logprobs

    cfg, updater = trainer.cfg, trainer.updater
    times = {path: {"logprob": [], "update": []} for path in ("unshared", "shared")}
    for opt in updater.optimizers.values():  # the same steps' arithmetic, without moving the weights far
        for group in opt.param_groups:
            group["lr"] = 1e-12
    for _ in range(rounds):
        for path in times:
            shared = path == "shared"
            t0 = time.perf_counter()
            batched_logprobs(trainer.actor, experience.sequences, cfg.micro_batch_size, cfg.temperature,
                             cfg.max_tokens_per_micro_batch, shared=shared)
            t1 = time.perf_counter()
            updater.cfg = dataclasses.replace(cfg, shared_prompt=shared)
            torch.manual_seed(0)
            updater(experience)
            times[path]["logprob"].append(t1 - t0)
            times[path]["update"].append(time.perf_counter() - t1)
    updater.cfg = cfg
    return {path: {phase: statistics.median(t) for phase, t in phases.items()} for path, phases in times.items()}


def token_counts(experience) -> dict:
    """Tokens of the step: every row's (unshared), and with each group's prompt counted once (packed)."""
    from qurl_mini.packing import prompt_groups, row_spans

    seq = experience.sequences
    spans, groups = row_spans(seq), prompt_groups(seq)
    firsts = [sum(groups[:g]) for g in range(len(groups))]
    prompts_once = sum(spans[i][0] for i in firsts)
    responses = sum(r for _, r in spans)
    return {"rows": len(seq), "groups": len(groups), "tokens_attended": int(seq.attention_mask.sum()),
            "tokens_packed": prompts_once + responses, "response_tokens": responses}


def main(argv=None) -> int:
    from qurl_mini.infra.cli import ArgumentParser  # an unknown flag: one line

    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(REPO, "docs", "results", "bench_shared_prompt.json"))
    args = p.parse_args(argv)

    from profile_step import matmul_params, matmul_rate

    from qurl_mini.infra.hardware import describe_cpu
    from qurl_mini.infra.progress import setup_logging

    setup_logging()
    result = {"cpu": describe_cpu(), "rounds": args.rounds, "seed": args.seed, "models": {}}
    for name in args.models:
        trainer, experience = one_step_rows(name, SHAPES[name], args.seed)
        with trainer:
            seconds = time_paths(trainer, experience, args.rounds)
            actor, tokens = trainer.actor, token_counts(experience)
            width = experience.sequences.input_ids.shape[1]
            rate = matmul_rate(actor.config.hidden_size, actor.config.intermediate_size, tokens=width * 8)
            params, head = matmul_params(actor), actor.get_output_embeddings().weight.numel()
            t0 = time.perf_counter()  # the update's AdamW steps, part of both bounds
            for opt in trainer.updater.optimizers.values():
                opt.step()
            adam = (time.perf_counter() - t0) * trainer.cfg.minibatches
        shutil.rmtree(trainer.cfg.out_dir, ignore_errors=True)  # the step's run folder (the engine's start weights)
        bounds = {}
        for path, counted in (("unshared", tokens["tokens_attended"]), ("shared", tokens["tokens_packed"])):
            forward = 2 * ((params - head) * counted + head * tokens["response_tokens"]) / (rate * 1e9)
            bounds[path] = {"logprob": forward, "update": 3 * forward + adam}
        result["models"][name] = {
            "shape": {**SHAPES[name], "group_size": 8, "max_new_tokens": 24, "minibatches": 4}, **tokens,
            "seconds": seconds, "matmul_gflops": rate,
            "speedup": {phase: seconds["unshared"][phase] / seconds["shared"][phase] for phase in ("logprob", "update")}
            | {"logprob+update": sum(seconds["unshared"].values()) / sum(seconds["shared"].values())},
            "bound_s": bounds,
            "ratio_to_bound": {path: {phase: seconds[path][phase] / bounds[path][phase] for phase in ("logprob", "update")}
                               for path in bounds},
        }
        print(json.dumps({name: result["models"][name]["speedup"]}), flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
