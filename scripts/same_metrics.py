"""Two seeded runs give the same metrics: every key of every metrics.jsonl row but the timings (time_*) equal.
The check for a change that must not change behaviour (run the same train.py command before and after it).

    python scripts/same_metrics.py runs/before runs/after
"""
import argparse
import os
import sys


def rows(run_dir: str) -> list[dict]:
    """The run's metrics rows without their timings; a folder without metrics or with a line cut short: one line."""
    from qurl_mini.metrics import read_metrics_lines

    if not os.path.isfile(f"{run_dir}/metrics.jsonl"):
        fail(f"{run_dir}: no metrics.jsonl")
    found, torn = read_metrics_lines(f"{run_dir}/metrics.jsonl")
    if torn:
        fail(f"{run_dir}/metrics.jsonl: line {', '.join(map(str, torn))} is cut short or not JSON")
    return [{k: v for k, v in row.items() if not k.startswith("time_")} for row in found]


def fail(message: str):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)  # 1 says the metrics differ


def differences(a: list[dict], b: list[dict]) -> list[str]:
    if len(a) != len(b):
        return [f"{len(a)} rows vs {len(b)}"]
    return [f"step {x.get('step')}: {k} {x.get(k)!r} vs {y.get(k)!r}" for x, y in zip(a, b)
            for k in sorted(x.keys() | y.keys()) if x.get(k) != y.get(k)]


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from qurl_mini.infra.cli import ArgumentParser  # an unknown flag: one line

    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", help="a run folder (its metrics.jsonl)")
    parser.add_argument("after", help="the other run folder")
    args = parser.parse_args()
    before, after = rows(args.before), rows(args.after)
    found = differences(before, after)
    print("\n".join(found) if found else f"same metrics: {len(before)} rows, every non-time key equal")
    sys.exit(1 if found else 0)
