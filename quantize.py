"""Write a W8A8 INT8/FP8 compressed-tensors checkpoint that plain `vllm.LLM(model=OUT)` loads.

    python quantize.py --model DIR --fmt int8 [--uaq-scale 1.5] --out DIR [--check]
    python quantize.py --model DIR --fmt none --uaq-scale 1.5 --out DIR [--check]
    python quantize.py --model DIR --fmt int3 --group 0 --out DIR [--check]

--fmt int6 .. int2 (the mismatch dial, beyond the paper) write what the emulating rollout engine loads:
a plain float32 HF checkpoint whose decoder projections are rounded to that grid (config.json records
the format as `qurl_emulated_quant`).

--check loads the result in vLLM next to the bf16 model and reports the log-prob gap on a few
problems (FP8 without an FP8 kernel: measured with the HF fake-quant emulation instead).
--fmt none quantizes nothing: it writes the UAQ-rescaled model (Eq. 11) as a plain HF checkpoint in
the input's dtype, for any trainer to start from (e.g. verl with its own FP8 rollout); config.json
records uaq_scale, and --check compares its log-probs with the input's (equal up to rounding).
"""
import argparse
import gc
import sys

from qurl_mini.infra.progress import quiet_third_parties, setup_logging, verbose_requested

if __name__ == "__main__":  # before torch and vLLM load: they read their log settings then
    quiet_third_parties(verbose_requested())

from qurl_mini.infra.errors import OneLineError  # noqa: E402
from qurl_mini.infra.paths import check_output_dir, check_outputs_apart  # noqa: E402
from qurl_mini.quant import FORMATS  # noqa: E402


def logprob_gap(model_dir: str, out_dir: str, fmt: str, texts: list[str]) -> dict:
    import torch

    from qurl_mini.actor import load_actor, token_logprobs
    from qurl_mini.engine import Platform, RolloutEngine
    from qurl_mini.quant import fake_quantized

    actor, tokenizer = load_actor(model_dir)
    sequences = [tokenizer.encode(t) for t in texts]
    if fmt == "none":  # UAQ only: the same function (Eq. 11), so the gap is rounding
        rescaled, _ = load_actor(out_dir)
        with torch.no_grad():
            gaps = []
            for seq in sequences:
                ids = torch.tensor([seq])
                gaps += (token_logprobs(rescaled, ids, torch.ones_like(ids)) -
                         token_logprobs(actor, ids, torch.ones_like(ids))).abs().flatten().tolist()
        return {"how": "HF model before vs after UAQ, float32", "max": max(gaps), "mean": sum(gaps) / len(gaps)}
    platform = Platform.detect()
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
    from qurl_mini.evaluate import free_engine

    engines = {}
    out_format = fmt if FORMATS[fmt].vllm_kernel else "unquantized"  # an emulated format: an unquantized checkpoint
    for name, path, engine_format in (("bf16", model_dir, "unquantized"), (fmt, out_dir, out_format)):
        engine = RolloutEngine(path, engine_format=engine_format, platform=platform, seed=0,
                               max_model_len=2 ** max_len.bit_length())
        engines[name] = engine.prompt_logprobs(sequences)
        free_engine(engine)  # one engine at a time: this one gone before the next starts
        del engine
        gc.collect()
    gaps = [abs(a - b) for s1, s2 in zip(engines["bf16"], engines[fmt]) for a, b in zip(s1, s2)]
    return {"how": "vLLM bf16 engine vs vLLM quantized engine", "max": max(gaps), "mean": sum(gaps) / len(gaps)}


def main(argv=None) -> int:
    from qurl_mini.infra.cli import ArgumentParser  # an unknown flag: one line

    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="HF folder, hub id or model name (smollm2-135m: "
                                                                   "converted once into .cache)")
    parser.add_argument("--fmt", choices=["none", *FORMATS], required=True,
                        help="quantization format; none: only UAQ, an HF checkpoint in the input's dtype; "
                             "int6 .. int2: weights rounded to that grid (emulated), a float32 HF checkpoint")
    parser.add_argument("--group", type=int, default=None,
                        help="int6 .. int2: input columns sharing one scale (0 = per output channel; default 32)")
    parser.add_argument("--uaq-scale", type=float, default=1.0, help="apply UAQ with this s first (1.0 = off)")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--check", action="store_true", help="load the result and report the log-prob gap")
    parser.add_argument("--verbose", action="store_true", help="show third-party warnings and progress bars (vLLM, "
                                                               "torch, transformers); also QURL_VERBOSE=1")
    args = parser.parse_args(argv)
    if args.fmt == "none" and args.uaq_scale == 1.0:
        print("error: --fmt none only applies UAQ: give --uaq-scale s != 1 (1.5 recommended)", file=sys.stderr)
        return 2
    setup_logging(verbose_requested(argv))  # --verbose or QURL_VERBOSE=1
    import torch

    from qurl_mini.actor import load_actor
    from qurl_mini.infra.checkpoint import tensor_bytes, written_atomically
    from qurl_mini.data import synthetic_splits
    from qurl_mini.named_models import resolve_model
    from qurl_mini.quant import QuantError, check_group, dequantize, describe, quantized_state, save_quantized_checkpoint
    from qurl_mini.uaq import apply_uaq

    try:
        check_output_dir(args.out, "--out")
        args.model = resolve_model(args.model, ".cache")
        check_outputs_apart({"--out": args.out}, {"--model": args.model})
        if args.group is not None and args.fmt == "none":
            raise QuantError("--group needs a quantized --fmt (int6 .. int2)")
        model, tokenizer = load_actor(args.model, dtype="auto" if args.fmt == "none" else torch.float32)
        if args.fmt != "none":
            check_group(model, args.fmt, args.group)
        apply_uaq(model, args.uaq_scale)
    except OneLineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        # whole, or not there
        with written_atomically(args.out, tensor_bytes(model.state_dict()), then="run again") as folder:
            if args.fmt == "none":
                model.save_pretrained(folder)
                what = (f"UAQ-rescaled (s={args.uaq_scale:g}) {str(model.dtype).removeprefix('torch.')} HF checkpoint "
                        f"(not quantized)")
            elif not FORMATS[args.fmt].vllm_kernel:
                _, quantized = quantized_state(model, args.fmt, group=args.group)
                rounded = {n: dequantize(q, s) for n, (q, s) in quantized.items()}
                model.config.qurl_emulated_quant = {"fmt": args.fmt, "group": args.group if args.group is not None
                                                    else FORMATS[args.fmt].default_group}
                model.save_pretrained(folder, state_dict={**model.state_dict(), **rounded})
                what = f"{describe(args.fmt, args.group)} (emulated: weights on the grid, float32 HF checkpoint)"
            else:
                save_quantized_checkpoint(model, None, folder, args.fmt)
                what = f"{args.fmt} W8A8 checkpoint (compressed-tensors)"
            tokenizer.save_pretrained(folder)
    except OneLineError as e:  # a full disk
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {what} to {args.out}")
    if args.check:
        _, problems = synthetic_splits(0, 4, max_number=10, seed=1234)
        gap = logprob_gap(args.model, args.out, args.fmt, [p.prompt + p.answer for p in problems])
        what = "|log p_uaq - log p_in|" if args.fmt == "none" else "|log p_quant - log p_bf16|"
        print(f"check ({gap['how']}): {what} max {gap['max']:.4f}, mean {gap['mean']:.4f} nats")
    return 0


if __name__ == "__main__":
    from qurl_mini.infra.fast_exit import exit_now

    exit_now(main())  # no ~3 s of interpreter teardown after the work is done
