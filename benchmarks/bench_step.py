"""Whole RL steps, --quant none vs --quant int8, same config: where does a step's time go?

    python benchmarks/bench_step.py [--shape d512x8] [--prompts 4 --n 4 --tokens 256] [--steps 4]

Runs train.py twice on a random-weight model of the given shape (nothing downloaded; rewards
are ~0, which does not matter for timing), then reports the mean split of a step (rollout /
actor log-probs / update / quantize+sync, first step left out as warm-up), the rollout's share
and the step speed-up of the INT8 rollout. The paper's premise is that the rollout is most of the
step (~70% on GPUs, long responses); pick --tokens and the batch to see where that holds here.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)
PHASES = ("time_rollout", "time_logprob", "time_update", "time_sync")


def main() -> None:
    from bench_rollout import SHAPES

    from qurl_mini.infra.cli import ArgumentParser  # an unknown flag: one line

    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="d512x8", choices=list(SHAPES))
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--tokens", type=int, default=256, help="--max-new-tokens (random weights rarely stop earlier)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", default="docs/results/bench_step.json", help="JSON results ('' = none)")
    args = p.parse_args()

    from qurl_mini.embedded import build_tiny_model
    from qurl_mini.infra.hardware import describe_cpu

    cpu = describe_cpu()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(os.path.join(tmp, "model"), seed=0, max_positions=2048, **SHAPES[args.shape])
        for quant in ("none", "int8"):
            cmd = [sys.executable, os.path.join(REPO, "train.py"), "--model", model, "--quant", quant,
                   "--steps", str(args.steps), "--prompts-per-step", str(args.prompts), "--group-size", str(args.n),
                   "--max-new-tokens", str(args.tokens), "--minibatches", "1", "--kl-coef", "0", "--eval-every", "0",
                   "--eval-size", "2", "--save-every", str(args.steps), "--out-dir", tmp, "--run-name", quant]
            print(f"running {quant} ...", flush=True)
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"train.py --quant {quant} failed:\n{proc.stderr[-2000:]}")
            with open(os.path.join(tmp, quant, "metrics.jsonl")) as f:
                rows = [json.loads(line) for line in f][1:]  # step 1 is warm-up
            results[quant] = {k: statistics.mean(r[k] for r in rows) for k in PHASES + ("time_step", "response_len")}

    print(f"\nCPU: {cpu}\nshape {args.shape}, {args.prompts} prompts x {args.n} samples x {args.tokens} tokens, "
          f"mean of steps 2..{args.steps}")
    print(f"{'rollout':8s} " + " ".join(f"{k[5:]:>9s}" for k in PHASES) + "   step  rollout share")
    for quant, r in results.items():
        print(f"{quant:8s} " + " ".join(f"{r[k]:8.2f}s" for k in PHASES) +
              f" {r['time_step']:6.2f}s  {100 * r['time_rollout'] / r['time_step']:5.1f}%")
    speedup = results["none"]["time_step"] / results["int8"]["time_step"]
    rollout_speedup = results["none"]["time_rollout"] / results["int8"]["time_rollout"]
    print(f"INT8 rollout: step {speedup:.2f}x faster, rollout phase {rollout_speedup:.2f}x faster")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"cpu": cpu, "settings": vars(args), "random_weights": True, "results": results,
                       "step_speedup": speedup, "rollout_speedup": rollout_speedup}, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
