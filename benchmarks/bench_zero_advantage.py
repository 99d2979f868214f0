"""--skip-zero-advantage against running every row: the update on the same step's rows, in turns.

    python benchmarks/bench_zero_advantage.py     # -> docs/results/bench_zero_advantage.json (~5 min on 2 cores)

A real GRPO step of `make demo-real`'s shape (SmolLM2-135M-arith, 8 prompts x 8 samples, INT8 rollout, no KL) gives
the rows, with whatever share of all-equal-reward groups that step drew (measured, reported); then the trainer's
Updater runs on them with and without skipping, A B A B ..., and the medians are kept. The saving to expect is the
skipped share of the update's tokens (a skipped row runs neither its forward nor its backward).
"""
import dataclasses
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))


def time_update(trainer, experience, rounds: int) -> dict:
    """Median seconds of the update, skipping and not, in turns; the skipped shares of one update."""
    import torch

    cfg, updater = trainer.cfg, trainer.updater
    for opt in updater.optimizers.values():  # the same arithmetic, without moving the weights far
        for group in opt.param_groups:
            group["lr"] = 1e-12
    times, shares = {"skip": [], "run every row": []}, {}
    for _ in range(rounds):
        for path in times:
            updater.cfg = dataclasses.replace(cfg, skip_zero_advantage=path == "skip")
            updater.skip_zero_rows = updater.cfg.skip_zero_advantage
            torch.manual_seed(0)
            t0 = time.perf_counter()
            stats = updater(experience)
            times[path].append(time.perf_counter() - t0)
            if path == "skip":
                shares = {k: stats[k] for k in ("skipped_rows_frac", "skipped_tokens_frac", "skipped_minibatches")}
    updater.cfg = cfg
    return {"seconds": {path: statistics.median(t) for path, t in times.items()}, **shares}


def main(argv=None) -> int:
    from qurl_mini.infra.cli import ArgumentParser

    p = ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="one real step per seed (its own rows)")
    p.add_argument("--out", default=os.path.join(REPO, "docs", "results", "bench_zero_advantage.json"))
    args = p.parse_args(argv)

    import shutil

    from bench_shared_prompt import SHAPES, one_step_rows

    from qurl_mini.infra.hardware import describe_cpu
    from qurl_mini.infra.progress import setup_logging

    setup_logging()
    result = {"cpu": describe_cpu(), "rounds": args.rounds, "shape": SHAPES["smollm2-135m-arith"], "steps": {}}
    for seed in args.seeds:
        trainer, experience = one_step_rows("smollm2-135m-arith", SHAPES["smollm2-135m-arith"], seed)
        with trainer:
            measured = time_update(trainer, experience, args.rounds)
        shutil.rmtree(trainer.cfg.out_dir, ignore_errors=True)
        s = measured["seconds"]
        measured["speedup"] = s["run every row"] / s["skip"]
        measured["saved_share"] = 1 - s["skip"] / s["run every row"]
        result["steps"][f"seed {seed}"] = measured
        print(json.dumps({f"seed {seed}": measured}), flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
