"""What the experiment scripts share: one train.py run per (row, seed), reused when already on disk,
read back as {summary, metrics}, and summarised over seeds."""
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(out_dir, name, flags, log_dir, core: int | None = None) -> str:
    """One train.py run (skipped if its summary exists); returns its folder. core: pin the run (vLLM's
    OpenMP threads, which the HF actor in the same process shares) to that one CPU core."""
    run_dir = os.path.join(out_dir, "runs", name)
    if os.path.exists(os.path.join(run_dir, "summary.json")):
        return run_dir
    os.makedirs(log_dir, exist_ok=True)
    cmd = [sys.executable, os.path.join(REPO, "train.py"), "--out-dir", os.path.join(out_dir, "runs"),
           "--run-name", name, "--cache-dir", os.path.join(REPO, ".cache"), *flags]
    t0 = time.time()
    with open(os.path.join(log_dir, f"{name}.log"), "w") as log:
        env = os.environ if core is None else {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": str(core), "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"error: run {name} failed (exit {proc.returncode}); see {log.name}")
    print(f"  {name}: {time.time() - t0:.0f} s" + (f" (core {core})" if core is not None else ""), flush=True)
    return run_dir


def read_run(run_dir) -> dict:
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {"summary": summary, "metrics": rows}


def mean_sd(xs):
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def series(runs, key):
    """Per step, the mean over seeds of metrics[key] (None where missing)."""
    steps = [r["step"] for r in runs[0]["metrics"]]
    out = []
    for i in range(len(steps)):
        vals = [r["metrics"][i].get(key) for r in runs if i < len(r["metrics"]) and r["metrics"][i].get(key) is not None]
        out.append(statistics.mean(vals) if vals else None)
    return steps, out


def test_accuracy_curve(runs):
    """(steps, mean over seeds of the greedy test accuracy): at the start, every --eval-every and the end."""
    evals = {}
    for r in runs:
        evals.setdefault(0, []).append(r["summary"]["initial_test_accuracy"])
        for m in r["metrics"]:
            if m.get("test_accuracy") is not None:
                evals.setdefault(m["step"], []).append(m["test_accuracy"])
    xs = sorted(evals)
    return xs, [statistics.mean(evals[x]) for x in xs]


def commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                          text=True).stdout.strip() or "?"
