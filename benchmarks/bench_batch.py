"""INT8 / unquantized decode speed against the batch size, at one model shape, in one run.

    python benchmarks/bench_batch.py                                   # Qwen2.5-0.5B shape, 1..64 sequences
    python benchmarks/bench_batch.py --shape embedded --sequences 1 8 --tokens 16   # a quick look

Why the batch matters: a decode step reads every weight once for the whole batch. With few sequences
the step is bound by weight bytes, which INT8 halves (the memory-bound limit); with many, by
arithmetic, where INT8 saves less (and pays for quantizing every activation per token). The engines
(bf16, fp32, INT8 W8A8; random weights from a Qwen2 config, nothing downloaded) are started once;
then each round times every engine at every batch size, in an order that rotates from round to
round, and each ratio is the median over rounds of that round's INT8 / fastest-unquantized ratio
(as in bench_rollout.py, whose engines and shapes this reuses).
"""
import argparse
import gc
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_rollout import CPU_ENGINES, ENGINES, SHAPES, decode_rates, int8_vs_best_unquantized, plot_ratios, weight_bytes  # noqa: E402


def bench(args, platform, tmp) -> dict:
    from qurl_mini import quant
    from qurl_mini.actor import load_actor
    from qurl_mini.data import synthetic_splits
    from qurl_mini.embedded import build_tiny_model
    from qurl_mini.engine import RolloutEngine

    shape = SHAPES[args.shape]
    model_dir = build_tiny_model(os.path.join(tmp, args.shape), seed=0, max_positions=1024, **shape)
    actor, tok = load_actor(model_dir)
    _, problems = synthetic_splits(0, max(args.sequences), 10, seed=0)
    prompts = [tok.encode(q.prompt) for q in problems]
    max_len = 2 ** (max(map(len, prompts)) + args.tokens + 8).bit_length()
    quantized_names = {f"{n}.weight" for n in quant.quant_target_names(actor)}
    engines = {e: RolloutEngine.from_actor(actor, tok, os.path.join(tmp, e), quant_fmt=ENGINES[e][0],
                                           platform=platform, dtype=ENGINES[e][1], seed=0, max_model_len=max_len,
                                           kv_cache_gib=args.kv_cache_gib)[0] for e in args.engines}
    bytes_per = {e: weight_bytes(actor, quantized_names if ENGINES[e][0] in ("int8", "fp8") else set(),
                                 2 if engines[e].dtype == "bfloat16" else 4) for e in engines}
    per_batch = {s: {name: [] for name in engines} for s in args.sequences}
    for r in range(args.repeats):  # one round = every batch size, every engine (rotating order inside)
        for s in args.sequences:
            rates = decode_rates(engines, prompts[:s], 1, args.tokens, 1, warmup=(r == 0), rotate=r)
            for name in engines:
                per_batch[s][name] += rates[name]
        print(f"  round {r + 1}/{args.repeats} done", flush=True)
    rows = []
    for s in args.sequences:
        row = {"sequences": s, "engines": {e: {"dtype": engines[e].dtype, "per_round": per_batch[s][e],
                                               "decode_tokens_per_s": statistics.median(per_batch[s][e]),
                                               "weight_bytes": bytes_per[e]} for e in engines}}
        row.update(int8_vs_best_unquantized(row["engines"]))
        rows.append(row)
    del engines
    gc.collect()
    return {"shape": args.shape, **shape, "params": sum(p.numel() for p in actor.parameters()), "rows": rows}


def plot(result, path, cpu):
    rows = [r for r in result["rows"] if "int8_speedup" in r]
    plot_ratios(path, [r["sequences"] for r in rows], rows, measured="median of rounds",
                xlabel="sequences decoded together",
                title=f"INT8 decode speed-up vs batch, {result['shape']} shape (random weights)\n{cpu}",
                note=lambda r: f"vs {r['best_unquantized']}", xytext=(4, -14), base=2)


def main() -> None:
    from qurl_mini.infra.cli import ArgumentParser  # an unknown flag: one line

    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen2.5-0.5b", choices=[s for s in SHAPES if SHAPES[s]])  # random weights
    p.add_argument("--engines", nargs="+", default=CPU_ENGINES, choices=list(ENGINES))
    p.add_argument("--sequences", nargs="+", type=int, default=[1, 4, 16, 64], help="batch sizes (sequences)")
    p.add_argument("--tokens", type=int, default=64, help="decoded tokens per sequence (exactly)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds")
    p.add_argument("--kv-cache-gib", type=int, default=2)
    p.add_argument("--out", default="docs/results/bench_batch", help="writes OUT.json and OUT.png ('' = none)")
    args = p.parse_args()

    from qurl_mini.engine import Platform
    from qurl_mini.infra.hardware import describe_cpu
    from qurl_mini.infra.progress import setup_logging

    setup_logging()
    cpu = describe_cpu()
    print(f"CPU: {cpu}\n{args.shape}: sequences {args.sequences} x {args.tokens} tokens, {args.repeats} rounds",
          flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        result = bench(args, Platform.detect(), tmp)
    print(f"\nCPU: {cpu}\n{'sequences':>9s} " + " ".join(f"{e:>9s}" for e in args.engines) + "  int8/best  mem-bound limit")
    for r in result["rows"]:
        rates = " ".join(f"{r['engines'][e]['decode_tokens_per_s']:9.0f}" for e in args.engines)
        ratio = (f"  {r['int8_speedup']:5.2f}x vs {r['best_unquantized']} "
                 f"({' / '.join(f'{x:.2f}' for x in r['int8_speedup_per_round'])})  {r['memory_bound_limit']:5.2f}x"
                 if "int8_speedup" in r else "")
        print(f"{r['sequences']:9d} {rates}{ratio}")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out + ".json", "w") as f:
            json.dump({"cpu": cpu, "settings": vars(args), "random_weights": True, **result}, f, indent=1)
        plot(result, args.out + ".png", cpu)
        print(f"wrote {args.out}.json and {args.out}.png")


if __name__ == "__main__":
    main()
