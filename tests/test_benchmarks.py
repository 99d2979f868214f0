"""The benchmark scripts run, and what they report follows from what they timed and from the sizes."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_bench_batch_reports_paired_ratios_and_the_memory_bound_limit(tmp_path):
    out = tmp_path / "bb"
    proc = subprocess.run([sys.executable, "benchmarks/bench_batch.py", "--shape", "embedded", "--engines", "bf16",
                           "int8", "--sequences", "1", "3", "--tokens", "4", "--repeats", "2", "--kv-cache-gib", "1",
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "CPU: " in proc.stdout and (tmp_path / "bb.png").stat().st_size > 0
    result = json.loads((tmp_path / "bb.json").read_text())
    assert [r["sequences"] for r in result["rows"]] == [1, 3]
    params = result["params"]
    for row in result["rows"]:
        bf16, int8 = row["engines"]["bf16"], row["engines"]["int8"]
        assert len(bf16["per_round"]) == len(int8["per_round"]) == 2
        ratios = [i / b for i, b in zip(int8["per_round"], bf16["per_round"])]
        assert row["int8_speedup_per_round"] == pytest.approx(ratios)
        assert row["int8_speedup"] == pytest.approx(sum(ratios) / 2)  # the median of two rounds
        # bytes read per decode step: bf16 = 2 per parameter; INT8 = 1 per quantized code + an fp32 scale
        # per output row, the rest (embeddings/lm_head, norms) in the INT8 engine's dtype: bf16, or fp32 where
        # the CPU has no native bf16 (AVX2-only: `--engine-dtype auto` picks float32, as train.py does)
        assert bf16["weight_bytes"] == 2 * params
        rest = {"bfloat16": 2, "float32": 4}[int8["dtype"]]
        layers, hidden, inter = result["layers"], result["hidden"], 512
        kv = result["kv_heads"] * hidden // result["heads"]
        rows_out = layers * (hidden + 2 * kv + hidden + 2 * inter + hidden)  # q, k, v, o, gate, up, down
        codes = layers * (hidden * (hidden + 2 * kv) + hidden * hidden + 3 * hidden * inter)
        assert int8["weight_bytes"] == codes + 4 * rows_out + rest * (params - codes)
        assert row["memory_bound_limit"] == pytest.approx(bf16["weight_bytes"] / int8["weight_bytes"])
