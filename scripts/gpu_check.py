"""The GPU acceptance check: run it first on a new GPU machine (`make gpu-check`, under 10 minutes on one GPU).

    python scripts/gpu_check.py                 # every check this machine can run; report in runs/gpu-check.json
    python scripts/gpu_check.py --cpu-half      # only the checks that need no CUDA (what `make test` runs)

Checks, each one line (pass / fail / skipped, with its number):
  cuda          torch sees the GPU that nvidia-smi lists (driver new enough for the wheel's CUDA)
  parity-int8   the INT8 W8A8 engine vs the HF actor computing like it (fake quant): mean |log-prob gap|
  parity-fp8    the same for FP8 (a real kernel on compute capability >= 8.9; emulated elsewhere)
  train-int8    train.py on the real model (--model smollm2-135m, GSM8K chat prompts), 3 GRPO steps with INT8
                rollout and the sync probe after every step (sleep mode, the in-place CUDA reload)
  throughput    rollout tokens/s of INT8 and FP8 against bf16 at Qwen2.5-0.5B's shape (the paper's Fig. 8), GPU only

The GPU half has NOT been run by this project (its machines have no GPU): docs/gsm8k-gpu.md.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
PARITY_LIMIT = 0.05  # nats per token, mean over the sequences' tokens (a tiny model is not chaotic under W8A8)
TEXTS = ["Q: Ann has 3 apples and gets 4 more. How many apples now?\nA: 3+4=7\n#### 7",
         "Q: Ben has 9 pens and gives away 2. How many pens now?\nA: 9-2=7\n#### 7"]


def check_cuda(args) -> dict:
    from qurl_mini.infra import hardware

    problem = hardware.cuda_problem()
    if problem:
        return {"status": "fail", "detail": problem}
    import torch

    if not torch.cuda.is_available():
        return {"status": "skipped", "detail": "no GPU (nvidia-smi lists none)"}
    return {"status": "pass", "detail": f"{torch.cuda.get_device_name()}, driver {hardware.driver_version()}, "
                                        f"torch {torch.__version__} CUDA {torch.version.cuda}"}


def check_parity(fmt: str):
    def check(args) -> dict:
        import torch

        from qurl_mini.actor import load_actor, token_logprobs
        from qurl_mini.embedded import build_tiny_model
        from qurl_mini.engine import Platform, RolloutEngine
        from qurl_mini.evaluate import free_engine

        platform = Platform.detect()
        with tempfile.TemporaryDirectory() as tmp:
            actor, tokenizer = load_actor(build_tiny_model(os.path.join(tmp, "m"), seed=0, layers=2))
            engine, _ = RolloutEngine.from_actor(actor, tokenizer, os.path.join(tmp, "e"), quant_fmt=fmt,
                                                 platform=platform, seed=0, max_model_len=256)
            sequences = [tokenizer.encode(t) for t in TEXTS]
            gaps = []
            for seq, engine_logp in zip(sequences, engine.prompt_logprobs(sequences)):
                ids = torch.tensor([seq], device=actor.device)
                with torch.no_grad(), engine.computing_like(actor):
                    hf = token_logprobs(actor, ids, torch.ones_like(ids))[0].cpu()
                gaps += (torch.tensor(engine_logp) - hf).abs().tolist()
            what = engine.engine_format
            free_engine(engine)
        gap = sum(gaps) / len(gaps)
        return {"status": "pass" if gap < PARITY_LIMIT else "fail", "value": gap, "engine": what,
                "detail": f"{what} engine vs HF emulation: mean |log-prob gap| {gap:.4f} nats (limit {PARITY_LIMIT})"}
    return check


def check_train(args) -> dict:
    out = tempfile.mkdtemp(prefix="gpu-check-")
    steps = 3
    cmd = [sys.executable, os.path.join(REPO, "train.py"), "--model", "smollm2-135m", "--out-dir", out,
           "--run-name", "train-int8", "--data", args.data, "--test-data", args.test_data, "--prompt-format", "chat",
           "--quant", "int8", "--steps", str(steps), "--prompts-per-step", str(args.prompts), "--group-size", str(args.group),
           "--max-new-tokens", str(args.max_new_tokens), "--max-prompt-tokens", "256", "--eval-size", "4",
           "--sync-check-every", "1", "--lr", "1e-6", "--minibatches", "2"]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    seconds = time.time() - t0
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"status": "fail", "detail": f"train.py exited {proc.returncode}: {last}", "command": " ".join(cmd)}
    with open(os.path.join(out, "train-int8", "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    probed = [r["step"] for r in rows if "sync_probe_gap" in r]
    ok = probed == list(range(1, steps + 1))
    kl = max(r["kl_behav_prox_k3"] for r in rows)
    return {"status": "pass" if ok else "fail", "value": kl, "seconds": seconds,
            "detail": f"{len(rows)} steps, sync probe passed after steps {probed}, max KL(behav||prox) k3 {kl:.2e}, "
                      f"{seconds:.0f} s"}


def check_throughput(args) -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"status": "skipped", "detail": "GPU only (on a CPU FP8 is emulated; `make bench` measures INT8 there)"}
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_rollout.py"), "--shapes",
                           "qwen2.5-0.5b", "--prompts", "64", "--n", "4", "--tokens", "256", "--repeats", "3", "--engines", "bf16", "int8", "fp8",
                           "--out", os.path.join(args.out_dir, "gpu-check-throughput")],
                          cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"status": "fail", "detail": (proc.stderr.strip().splitlines() or ["bench_rollout failed"])[-1]}
    with open(os.path.join(args.out_dir, "gpu-check-throughput.json")) as f:
        row = json.load(f)["rows"][0]
    rates = {name: e["decode_tokens_per_s"] for name, e in row["engines"].items()}
    best = max(v for k, v in rates.items() if k in ("bf16", "fp32"))
    ratios = {k: v / best for k, v in rates.items() if k in ("int8", "fp8")}
    return {"status": "pass" if all(r > 1.0 for r in ratios.values()) else "fail", "value": ratios,
            "detail": ", ".join(f"{k.upper()} {r:.2f}x bf16" for k, r in ratios.items())}


CHECKS = {"cuda": (check_cuda, False), "parity-int8": (check_parity("int8"), True),
          "parity-fp8": (check_parity("fp8"), True), "train-int8": (check_train, True),
          "throughput": (check_throughput, False)}  # name -> (check, part of the CPU half)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-half", action="store_true", help="only the checks that need no CUDA")
    parser.add_argument("--out-dir", default="runs", help="where gpu-check.json goes")
    parser.add_argument("--data", default=os.path.join(REPO, "..", "shared", "data", "gsm8k", "train.jsonl"))
    parser.add_argument("--test-data", default=os.path.join(REPO, "..", "shared", "data", "gsm8k", "test.jsonl"))
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=4, help="train-int8: prompts per step")
    parser.add_argument("--group", type=int, default=4, help="train-int8: samples per prompt")
    args = parser.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    report = {}
    for name, (check, cpu_half) in CHECKS.items():
        if args.cpu_half and not cpu_half:
            report[name] = {"status": "skipped", "detail": "needs CUDA (--cpu-half)"}
        else:
            try:
                report[name] = check(args)
            except Exception as e:  # one line per check; the report says which failed and how
                report[name] = {"status": "fail", "detail": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        print(f"{name:12s} {report[name]['status']:8s} {report[name]['detail']}", flush=True)
    path = os.path.join(args.out_dir, "gpu-check.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    failed = [n for n, r in report.items() if r["status"] == "fail"]
    print(f"gpu-check: {len(failed)} failed ({', '.join(failed) or 'none'}); report {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    from qurl_mini.infra.progress import quiet_third_parties, setup_logging

    quiet_third_parties(False)
    setup_logging(False)
    sys.exit(main())
