"""Rollout speed of unquantized (bf16, fp32) and INT8 W8A8 vLLM engines, side by side in one run,
over model shapes from the embedded one up to Qwen2.5-0.5B's.

    python benchmarks/bench_rollout.py                      # all shapes, writes docs/results/bench_rollout.*
    python benchmarks/bench_rollout.py --shapes embedded --prompts 8 --tokens 16   # a quick look

Weights are random (speed does not depend on their values), built from a Qwen2 config: nothing is
downloaded. Every engine decodes the same prompts with the same sampling settings and exactly the
same output length (ignore_eos). All engines of a shape are started first and then timed in turns
(round r times one batch of each engine, the order rotating), so a slow spell of this shared machine hits
every engine alike; the INT8 ratio is the median over rounds of that round's ratio. Reported per shape: decode tokens/s per engine, INT8 / fastest
unquantized engine, the memory-bound limit of that ratio (weight bytes read per decode step,
embeddings and lm_head included: they stay unquantized), and the time to quantize + sync the actor.
FP8 is left out on CPUs: it is emulated there in an unquantized engine, so its speed says nothing.
"""
import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# name -> Qwen2 shape (layers, hidden, heads, kv_heads, intermediate, vocab)
SHAPES = {
    "embedded": dict(layers=4, hidden=192, heads=6, kv_heads=2, intermediate=None, vocab_size=128),
    "d512x8": dict(layers=8, hidden=512, heads=8, kv_heads=2, intermediate=1536, vocab_size=32768),
    "qwen2.5-0.5b": dict(layers=24, hidden=896, heads=14, kv_heads=2, intermediate=4864, vocab_size=151936),
    "smollm2-135m": None,  # the real model, by its name (its own weights: `--model smollm2-135m`)
}
# engine name -> (--quant, dtype of everything not quantized: INT8 follows the CPU like train.py)
ENGINES = {"bf16": ("none", "bfloat16"), "fp32": ("none", "float32"), "int8": ("int8", "auto"), "fp8": ("fp8", "auto")}
CPU_ENGINES = ["bf16", "fp32", "int8"]  # the default on a CPU, where FP8 is emulated (its speed says nothing)


def weight_bytes(model, quantized_names: set[str], unquantized_bytes: int) -> int:
    """Bytes of weights a decode step reads: 1 per quantized code (+ its fp32 scale), else dtype size."""
    total = 0
    for name, p in model.named_parameters():
        if name in quantized_names:
            total += p.numel() + 4 * p.shape[0]
        else:
            total += p.numel() * unquantized_bytes
    return total


def decode_rates(engines: dict, prompts, n, tokens, rounds, warmup: bool = True, rotate: int = 0) -> dict:
    """{engine name: decode tokens/s of each round}; every engine decodes one batch per round (after one
    warm-up batch each), in an order that rotates from round to round (starting `rotate` places on)."""
    from vllm import SamplingParams

    params = SamplingParams(n=n, temperature=1.0, max_tokens=tokens, ignore_eos=True, logprobs=0, detokenize=False)
    requests = [{"prompt_token_ids": p} for p in prompts]
    for engine in engines.values() if warmup else ():
        engine.llm.generate(requests, params, use_tqdm=False)
    names, rates = list(engines), {name: [] for name in engines}
    for r in range(rotate, rotate + rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            outs = engines[name].llm.generate(requests, params, use_tqdm=False)
            rates[name].append(sum(len(s.token_ids) for o in outs for s in o.outputs) / (time.perf_counter() - t0))
    return rates


def bench_shape(name, shape, args, platform, tmp):
    from qurl_mini import quant
    from qurl_mini.actor import load_actor
    from qurl_mini.data import synthetic_splits
    from qurl_mini.embedded import build_tiny_model
    from qurl_mini.engine import RolloutEngine

    if shape is None:
        from qurl_mini.named_models import resolve_model

        model_dir = resolve_model(name, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache"))
    else:
        model_dir = build_tiny_model(os.path.join(tmp, name), seed=0, max_positions=1024, **shape)
    actor, tok = load_actor(model_dir)
    _, problems = synthetic_splits(0, args.prompts, 10, seed=0)
    prompts = [tok.encode(q.prompt) for q in problems]
    max_len = 2 ** (max(map(len, prompts)) + args.tokens + 8).bit_length()
    quantized_names = {f"{n}.weight" for n in quant.quant_target_names(actor)}
    row = {"shape": name, **(shape or {}), "params": sum(p.numel() for p in actor.parameters()),
           "quantized_params": sum(actor.get_parameter(n).numel() for n in quantized_names), "engines": {}}
    engines = {e: RolloutEngine.from_actor(actor, tok, os.path.join(tmp, f"{name}-{e}"), quant_fmt=ENGINES[e][0],
                                           platform=platform, dtype=ENGINES[e][1], seed=0, max_model_len=max_len,
                                           kv_cache_gib=args.kv_cache_gib, enforce_eager=args.enforce_eager,
                                           gpu_memory_utilization=args.gpu_memory_utilization)[0]
               for e in args.engines}
    rates = decode_rates(engines, prompts, args.n, args.tokens, args.repeats)
    for engine_name, engine in engines.items():
        fmt, rate = ENGINES[engine_name][0], statistics.median(rates[engine_name])
        syncs = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            engine.sync_weights(actor)
            syncs.append(time.perf_counter() - t0)
        bytes_per = 2 if engine.dtype == "bfloat16" else 4
        row["engines"][engine_name] = {
            "dtype": engine.dtype, "decode_tokens_per_s": rate, "per_round": rates[engine_name],
            "sync_s": statistics.median(syncs),
            "weight_bytes": weight_bytes(actor, quantized_names if fmt in ("int8", "fp8") else set(), bytes_per)}
        print(f"  {name:13s} {engine_name:5s} ({engine.dtype:8s}) {rate:9.0f} tok/s   sync {1000 * row['engines'][engine_name]['sync_s']:7.1f} ms",
              flush=True)
    del engine, engines
    gc.collect()
    row.update(int8_vs_best_unquantized(row["engines"]))
    del actor
    gc.collect()
    return row


def int8_vs_best_unquantized(engines: dict) -> dict:
    """The fastest unquantized engine, INT8's speed-up over it (median of the per-round ratios: paired,
    both timed in the same round) and the memory-bound limit; {} without INT8 or an unquantized engine."""
    unquantized = {k: v for k, v in engines.items() if ENGINES[k][0] == "none"}
    if "int8" not in engines or not unquantized:
        return {}
    best = max(unquantized, key=lambda k: unquantized[k]["decode_tokens_per_s"])
    int8 = engines["int8"]
    per_round = [i / b for i, b in zip(int8["per_round"], unquantized[best]["per_round"])]
    return {"best_unquantized": best, "int8_speedup": statistics.median(per_round), "int8_speedup_per_round": per_round,
            "memory_bound_limit": unquantized[best]["weight_bytes"] / int8["weight_bytes"]}


def plot_ratios(path, x, rows, *, measured, xlabel, title, note, xytext, **xscale):
    """INT8 / fastest unquantized (measured) and its memory-bound limit against x, one point per row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(x, [r["int8_speedup"] for r in rows], "o-", label=f"INT8 W8A8 / fastest unquantized ({measured})")
    ax.plot(x, [r["memory_bound_limit"] for r in rows], "s--", label="memory-bound limit (weight bytes)")
    for r, xi in zip(rows, x):
        ax.annotate(note(r), (xi, r["int8_speedup"]), fontsize=8, textcoords="offset points", xytext=xytext)
    ax.axhline(1.0, color="black", lw=0.5)
    ax.set_xscale("log", **xscale)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("decode throughput ratio")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot(rows, path, cpu):
    rows = [r for r in rows if "int8_speedup" in r]
    plot_ratios(path, [r["params"] / 1e6 for r in rows], rows, measured="measured",
                xlabel="parameters (millions, random weights)",
                title=f"vLLM rollout decode speed-up of INT8\n{cpu}",
                note=lambda r: f"{r['shape']}\nvs {r['best_unquantized']}", xytext=(4, -18))


def main() -> None:
    from qurl_mini.infra.cli import ArgumentParser  # an unknown flag: one line

    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=[s for s in SHAPES if SHAPES[s]], choices=list(SHAPES),
                   help="random-weight shapes, or smollm2-135m (the real model, by name)")
    p.add_argument("--engines", nargs="+", default=None, choices=list(ENGINES),
                   help=f"default: {' '.join(CPU_ENGINES)} (+ fp8 on CUDA)")
    p.add_argument("--prompts", type=int, default=32, help="prompts per batch")
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--tokens", type=int, default=64, help="decoded tokens per sample (exactly)")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds (each engine decodes one batch per round)")
    p.add_argument("--kv-cache-gib", type=int, default=2)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="CUDA: each engine's share of the GPU")
    p.add_argument("--enforce-eager", action="store_true", help="CUDA: engines without CUDA graphs (CPU: always)")
    p.add_argument("--out", default="docs/results/bench_rollout", help="writes OUT.json and OUT.png ('' = none)")
    args = p.parse_args()

    from qurl_mini.engine import Platform
    from qurl_mini.infra.hardware import describe_cpu
    from qurl_mini.infra.progress import setup_logging

    setup_logging()
    cpu, platform = describe_cpu(), Platform.detect()
    args.engines = args.engines or CPU_ENGINES + (["fp8"] if platform.cuda else [])
    print(f"CPU: {cpu}\n{args.prompts} prompts x {args.n} samples x {args.tokens} tokens per batch, "
          f"{args.repeats} rounds, engines in turns", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [bench_shape(name, SHAPES[name], args, platform, tmp) for name in args.shapes]

    print(f"\nCPU: {cpu}")
    print(f"{'shape':13s} {'params':>8s} " + " ".join(f"{e:>9s}" for e in args.engines) +
          "  int8/best  mem-bound limit")
    for r in rows:
        rates = " ".join(f"{r['engines'][e]['decode_tokens_per_s']:9.0f}" for e in args.engines)
        ratio = (f"  {r['int8_speedup']:6.2f}x vs {r['best_unquantized']}  {r['memory_bound_limit']:6.2f}x"
                 if "int8_speedup" in r else "")
        print(f"{r['shape']:13s} {r['params'] / 1e6:7.1f}M {rates}{ratio}")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out + ".json", "w") as f:
            json.dump({"cpu": cpu, "settings": vars(args), "random_weights": all(SHAPES[s] for s in args.shapes), "rows": rows}, f, indent=1)
        plot(rows, args.out + ".png", cpu)
        print(f"wrote {args.out}.json and {args.out}.png")


if __name__ == "__main__":
    main()
