"""What the experiment scripts share: one train.py run per (row, seed), reused when already on disk,
read back as {summary, metrics}, and summarised over seeds."""
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


# flags that do not change what a run computes (saving a checkpoint draws no randomness): runs that differ in
# them are one experiment
NEUTRAL_FLAGS = {"--save-every"}
# what a run recorded before a flag existed computed: the path it ran then (the committed runs pin it)
BEFORE_THE_FLAG = {"shared_prompt": False}


def run(out_dir, name, flags, log_dir, core: int | None = None) -> str:
    """One train.py run (skipped if its summary exists; resumed from its newest complete checkpoint if one is
    there, a run stopped part-way, e.g. by the end of a session); returns its folder. core: pin the run (vLLM's
    OpenMP threads, which the HF actor in the same process shares) to that one CPU core."""
    run_dir = os.path.join(out_dir, "runs", name)
    if os.path.exists(os.path.join(run_dir, "summary.json")):
        return run_dir
    from qurl_mini.infra.checkpoint import newest_loadable

    os.makedirs(log_dir, exist_ok=True)
    resume = os.path.isdir(run_dir) and newest_loadable(run_dir)[0] is not None  # train.py --resume's own choice
    cmd = [sys.executable, os.path.join(REPO, "train.py"), "--out-dir", os.path.join(out_dir, "runs"),
           "--run-name", name, "--cache-dir", os.path.join(REPO, ".cache"), *flags, *(["--resume"] if resume else [])]
    t0 = time.time()
    with open(os.path.join(log_dir, f"{name}.log"), "a" if resume else "w") as log:
        env = os.environ if core is None else {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": str(core), "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"error: run {name} failed (exit {proc.returncode}); see {log.name}")
    # a finished run needs no resume point: its checkpoints go (1.6 GB each on the real model), final/ stays
    shutil.rmtree(os.path.join(run_dir, "checkpoints"), ignore_errors=True)
    print(f"  {name}: {time.time() - t0:.0f} s" + (f" (core {core})" if core is not None else ""), flush=True)
    return run_dir


def parallel_flag(value: str) -> int:
    """argparse's type for --parallel: runs at a time, a whole number >= 1 (0 would run nothing, or one at a time)."""
    import argparse

    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (runs at a time), got {n}")
    return n


def run_many(out_dir, jobs: list[tuple[str, list[str]]], log_dir, parallel: int = 1) -> list[str]:
    """run() for each (name, flags), `parallel` at a time, each pinned to its own CPU core when parallel > 1 (one
    of the cores this process may run on: a container's may not start at 0); returns the run folders in the jobs'
    order. The first run that fails stops the rest from starting (those running finish), and its error is raised."""
    import threading
    from concurrent.futures import ThreadPoolExecutor
    from queue import Queue

    allowed = sorted(os.sched_getaffinity(0))
    if parallel < 1:
        raise SystemExit(f"error: --parallel {parallel}: must be >= 1 (runs at a time)")
    if parallel > len(allowed):
        raise SystemExit(f"error: --parallel {parallel}: this process may run on {len(allowed)} CPU core(s) only")
    cores = Queue()
    for core in (allowed[:parallel] if parallel > 1 else [None]):
        cores.put(core)

    failed = threading.Event()  # a run failed (a full disk, a bad flag): start no more, the error comes out

    def one(job):
        if failed.is_set():
            return None
        name, flags = job
        core = cores.get()
        try:
            return run(out_dir, name, flags, log_dir, core=core)
        except BaseException:
            failed.set()
            raise
        finally:
            cores.put(core)

    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        return list(pool.map(one, jobs))


def read_run(run_dir) -> dict:
    """{summary, metrics} of a finished run. Damaged data (summary.json missing or not JSON, metrics.jsonl missing or
    a line of it cut short) ends the script with one line naming the file and the fix (exit 2): a finished run's
    rows are all there, so a page made without some of them would be silently wrong."""
    from qurl_mini.metrics import read_metrics_lines

    summary_path, metrics_path = os.path.join(run_dir, "summary.json"), os.path.join(run_dir, "metrics.jsonl")
    redo = "restore it from a copy (git checkout for a committed run), or remove the run folder so that it runs again"
    if not os.path.isfile(summary_path):
        fail(f"{run_dir}: no summary.json, so not a finished run; finish it (the experiment without --report-only "
             f"resumes it), or remove the folder")
    try:
        with open(summary_path) as f:
            summary = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        fail(f"{summary_path} is not JSON ({' '.join(str(e).split())}): damaged; {redo}")
    if not os.path.isfile(metrics_path):
        fail(f"{run_dir}: no metrics.jsonl beside its summary.json; {redo}")
    rows, torn = read_metrics_lines(metrics_path)
    if torn:
        fail(f"{metrics_path}: line {', '.join(map(str, torn))} of a finished run is cut short or not JSON; {redo}")
    return {"summary": summary, "metrics": rows}


def fail(message: str):
    """End the script with one line on stderr, exit 2."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


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


def one_experiment(table: dict, settings: dict, where: str) -> str:
    """The one base model hash that every run of `table` ({row: [run]}) started from, with one initial accuracy
    and the script's `settings` ({flag: value}); else SystemExit, one line naming the odd runs. A table holds
    one experiment."""
    bases, odd = {}, []
    for row, runs in table.items():
        for r in runs:
            s = r["summary"]
            config = s.get("config", {})
            name = f"{row} seed {config.get('seed', '?')}"
            bases.setdefault((s.get("base_model_hash"), s["initial_test_accuracy"]), []).append(name)
            recorded = {flag: config.get(key, BEFORE_THE_FLAG.get(key)) for flag in settings
                        for key in [flag.lstrip("-").replace("-", "_")]}
            odd += [f"{name} ({flag} {recorded[flag]})" for flag, value in settings.items()
                    if flag not in NEUTRAL_FLAGS and not _same(recorded[flag], value)]
    if len(bases) > 1 or None in {h for h, _ in bases}:
        found = "; ".join(f"base {h or 'not recorded'} at {100 * a:.1f}%: {', '.join(names[:3])}"
                          + (f" and {len(names) - 3} more" if len(names) > 3 else "") for (h, a), names in bases.items())
        raise SystemExit(f"error: {where}: the runs do not start from one recorded base ({found}); one table holds "
                         f"one experiment: remove the odd runs and run again")
    if odd:
        raise SystemExit(f"error: {where}: runs made with other settings than this script's: {', '.join(odd[:4])}; "
                         f"remove them and run again")
    return next(iter(bases))[0] if bases else None


def _same(recorded, flag_value: str) -> bool:
    if recorded is None:
        return False
    if isinstance(recorded, bool):
        return recorded == (flag_value.lower() in ("true", "1", "yes"))
    try:
        return float(recorded) == float(flag_value)
    except (TypeError, ValueError):
        return str(recorded) == flag_value
