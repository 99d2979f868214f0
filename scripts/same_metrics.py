"""Two seeded runs give the same metrics: every key of every metrics.jsonl row but the timings (time_*) equal.
The check for a change that must not change behaviour (run the same train.py command before and after it).

    python scripts/same_metrics.py runs/before runs/after
"""
import json
import sys


def rows(run_dir: str) -> list[dict]:
    with open(f"{run_dir}/metrics.jsonl") as f:
        return [{k: v for k, v in json.loads(line).items() if not k.startswith("time_")} for line in f if line.strip()]


def differences(a: list[dict], b: list[dict]) -> list[str]:
    if len(a) != len(b):
        return [f"{len(a)} rows vs {len(b)}"]
    return [f"step {x.get('step')}: {k} {x.get(k)!r} vs {y.get(k)!r}" for x, y in zip(a, b)
            for k in sorted(x.keys() | y.keys()) if x.get(k) != y.get(k)]


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    found = differences(rows(sys.argv[1]), rows(sys.argv[2]))
    print("\n".join(found) if found else f"same metrics: {len(rows(sys.argv[1]))} rows, every non-time key equal")
    sys.exit(1 if found else 0)
