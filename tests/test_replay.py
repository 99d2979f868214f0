"""The replay script end to end at smoke size: its tables and plots come from the runs it made."""
import json
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_replay_smoke_writes_tables_and_plots_from_its_own_runs(tmp_path):
    out = tmp_path / "replay"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "experiments", "replay.py"), "--smoke", "--parallel",
                           str(min(2, len(os.sched_getaffinity(0)))), "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=900)  # 2 runs at a time, a core each
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    md = (tmp_path / "replay.md").read_text()
    for png in ("replay_accuracy.png", "replay_clip_rho_kl.png", "replay_uaq.png"):
        assert (tmp_path / png).stat().st_size > 10_000 and f"]({png})" in md
    # each table row's final accuracy is the one its run's summary.json reports
    for row in ("bf16", "int8-acr"):
        summary = json.loads((tmp_path / "replay_work" / "runs" / f"{row}-seed0" / "summary.json").read_text())
        shown = re.search(rf"\| `{re.escape(row)}` \|[^|]*\|[^|]*\| \*\*([\d.]+)%", md).group(1)
        assert float(shown) == pytest.approx(100 * summary["final_test_accuracy"], abs=0.05)
    assert "| s=1 |" in md and "| s=1.5 |" in md
    saved = json.loads((tmp_path / "replay.json").read_text())
    assert saved["table"].keys() == {"bf16", "int8-acr"} and saved["base_model_hash"]
    steps = saved["table"]["int8-acr"][0]["steps"]  # the columns can be checked from the committed json
    assert [s["step"] for s in steps] == [1, 2] and all(s["kl_behav_prox"] is not None for s in steps)
