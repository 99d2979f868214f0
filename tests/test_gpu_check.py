"""The GPU acceptance check's CPU half (scripts/gpu_check.py --cpu-half): what it can check without CUDA."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_the_cpu_half_of_the_gpu_check_passes_and_reports_each_check(tmp_path):
    proc = subprocess.run([sys.executable, "scripts/gpu_check.py", "--cpu-half", "--out-dir", str(tmp_path),
                           "--max-new-tokens", "16", "--prompts", "2", "--group", "2"], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert {n: r["status"] for n, r in report.items()} == {
        "cuda": "skipped", "parity-int8": "pass", "parity-fp8": "pass", "train-int8": "pass", "throughput": "skipped"}
    assert report["parity-int8"]["value"] < 0.05 and report["train-int8"]["value"] > 0
    lines = [line for line in proc.stdout.splitlines() if line.split()[:1] and line.split()[0] in report]
    assert len(lines) == len(report)  # one line per check
