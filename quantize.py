"""Write a W8A8 INT8/FP8 compressed-tensors checkpoint that plain `vllm.LLM(model=OUT)` loads.

    python quantize.py --model DIR --fmt int8 [--uaq-scale 1.5] --out DIR [--check]

--check loads the result in vLLM next to the bf16 model and reports the log-prob gap on a few
problems (FP8 without an FP8 kernel: measured with the HF fake-quant emulation instead).
"""
import argparse
import sys

from qurl_mini.progress import setup_logging


def logprob_gap(model_dir: str, out_dir: str, fmt: str, texts: list[str]) -> dict:
    import torch

    from qurl_mini.actor import load_actor, token_logprobs
    from qurl_mini.engine import Platform, RolloutEngine
    from qurl_mini.quant import fake_quantized

    platform = Platform.detect()
    actor, tokenizer = load_actor(model_dir)
    sequences = [tokenizer.encode(t) for t in texts]
    max_len = max(map(len, sequences)) + 8
    if fmt == "fp8" and not platform.fp8_kernel:
        with torch.no_grad():
            gaps = []
            for seq in sequences:
                ids = torch.tensor([seq])
                exact = token_logprobs(actor, ids, torch.ones_like(ids))
                with fake_quantized(actor, "fp8"):
                    emulated = token_logprobs(actor, ids, torch.ones_like(ids))
                gaps += (emulated - exact).abs().flatten().tolist()
        return {"how": "HF fake-quant emulation (no FP8 kernel here)", "max": max(gaps), "mean": sum(gaps) / len(gaps)}
    engines = {}
    for name, path, engine_format in (("bf16", model_dir, "bf16"), (fmt, out_dir, fmt)):
        engine = RolloutEngine(path, engine_format=engine_format, platform=platform, seed=0,
                               max_model_len=2 ** max_len.bit_length())
        engines[name] = engine.prompt_logprobs(sequences)
        del engine
    gaps = [abs(a - b) for s1, s2 in zip(engines["bf16"], engines[fmt]) for a, b in zip(s1, s2)]
    return {"how": "vLLM bf16 engine vs vLLM quantized engine", "max": max(gaps), "mean": sum(gaps) / len(gaps)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="HF folder or hub id (a causal LM)")
    parser.add_argument("--fmt", choices=["int8", "fp8"], required=True, help="quantization format")
    parser.add_argument("--uaq-scale", type=float, default=1.0, help="apply UAQ with this s first (1.0 = off)")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--check", action="store_true", help="load the result and report the log-prob gap")
    args = parser.parse_args(argv)
    setup_logging()
    from qurl_mini.actor import ModelError, load_actor
    from qurl_mini.data import synthetic_splits
    from qurl_mini.quant import save_quantized_checkpoint
    from qurl_mini.uaq import UAQError, apply_uaq

    try:
        model, tokenizer = load_actor(args.model)
        apply_uaq(model, args.uaq_scale)
    except (ModelError, UAQError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    save_quantized_checkpoint(model, tokenizer, args.out, args.fmt)
    print(f"wrote {args.fmt} W8A8 checkpoint (compressed-tensors) to {args.out}")
    if args.check:
        _, problems = synthetic_splits(0, 4, max_number=10, seed=1234)
        gap = logprob_gap(args.model, args.out, args.fmt, [p.prompt + p.answer for p in problems])
        print(f"check ({gap['how']}): |log p_quant - log p_bf16| max {gap['max']:.4f}, mean {gap['mean']:.4f} nats")
    return 0


if __name__ == "__main__":
    sys.exit(main())
