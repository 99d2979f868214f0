"""Rollout speed and weight-sync cost, BF16 vs INT8 W8A8 engines side by side in one run.

    python benchmarks/bench_rollout.py [--hidden 192 --layers 4] [--prompts 64 --n 8 --tokens 24]

Prints decode throughput of each engine, their ratio, and the time to quantize + sync the actor.
(FP8 is left out on CPUs: it is emulated there in a bf16 engine, so its speed says nothing.)
"""
import argparse
import gc
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=192)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    from qurl_mini import quant
    from qurl_mini.actor import load_actor
    from qurl_mini.data import synthetic_splits
    from qurl_mini.embedded import build_tiny_model
    from qurl_mini.engine import Platform, RolloutEngine, checkpoint_tensors
    from qurl_mini.hardware import describe_cpu

    tmp = tempfile.mkdtemp()
    model_dir = build_tiny_model(os.path.join(tmp, "m"), layers=args.layers, hidden=args.hidden, heads=args.heads)
    actor, tok = load_actor(model_dir)
    _, problems = synthetic_splits(0, args.prompts, 10, seed=0)
    prompts = [tok.encode(q.prompt) for q in problems]
    platform = Platform.detect()
    results = {}
    for fmt in ("bf16", "int8"):
        path = model_dir if fmt == "bf16" else quant.save_quantized_checkpoint(actor, tok, os.path.join(tmp, "q"), "int8")
        engine = RolloutEngine(path, engine_format=fmt, platform=platform, seed=0, max_model_len=128)
        engine.generate(prompts, n=args.n, temperature=1.0, max_tokens=args.tokens, stop_token_ids=[])  # warm-up
        rates, syncs = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            out = engine.generate(prompts, n=args.n, temperature=1.0, max_tokens=args.tokens, stop_token_ids=[])
            rates.append(sum(len(r.response_ids) for g in out for r in g) / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            engine.load_weights(checkpoint_tensors(actor, fmt)[0])
            syncs.append(time.perf_counter() - t0)
        results[fmt] = (statistics.median(rates), statistics.median(syncs))
        del engine
        gc.collect()
    print(f"\nCPU: {describe_cpu()}")
    print(f"model: {args.layers} layers, d={args.hidden}; {args.prompts} prompts x {args.n} samples x {args.tokens} tokens")
    for fmt, (rate, sync) in results.items():
        print(f"{fmt:5s} decode {rate:9.0f} tokens/s   quantize+sync {1000 * sync:7.1f} ms")
    print(f"int8 / bf16 decode throughput ratio: {results['int8'][0] / results['bf16'][0]:.2f}")


if __name__ == "__main__":
    main()
