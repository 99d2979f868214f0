"""The mismatch dial: emulated int6 .. int2 formats through train.py, eval.py and quantize.py, and
experiments/mismatch.py's answer to its question, from its own runs."""
import json
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(REPO, ".cache")
sys.path.insert(0, os.path.join(REPO, "experiments"))
import mismatch  # noqa: E402


def stats(mean, sd, kl=1e-3, seeds=3):
    return {"mean": mean, "sd": sd, "start": 0.385, "kl_k3_median": kl, "final": [mean] * seeds}


def test_headline_says_yes_only_when_naive_breaks_beyond_the_spread_and_acr_holds():
    base = {"bf16": stats(0.95, 0.01)}
    yes = base | {"int2g32-naive": stats(0.20, 0.05), "int2g32-tis": stats(0.90, 0.02), "int2g32-acr": stats(0.93, 0.02)}
    assert mismatch.headline(yes, ["int2g32"]).startswith("**Yes: `int2g32`.**")
    # naive 10 points under, but its spread reaches BF16's: not beyond the seed spread
    wide = base | {"int2g32-naive": stats(0.84, 0.10), "int2g32-acr": stats(0.94, 0.01)}
    assert mismatch.headline(wide, ["int2g32"]).startswith("**No format")
    # naive breaks, but so does ACR: every objective fails together, and it is said
    both = base | {"int2g32-naive": stats(0.10, 0.02), "int2g32-tis": stats(0.30, 0.02), "int2g32-acr": stats(0.50, 0.02)}
    text = mismatch.headline(both, ["int2g32"])
    assert text.startswith("**No format") and "every objective ends >= 10 points under BF16" in text
    assert "TIS and ACR differ" in text
    # fewer than 3 seeds: not judged, and said
    partial = yes | {"int2g32-naive": stats(0.20, 0.05, seeds=2)}
    text = mismatch.headline(partial, ["int2g32"])
    assert text.startswith("**No format") and "`int2g32`: fewer than 3 seeds finished" in text


def test_per_format_verdicts_name_who_holds_who_fails_and_who_differs_beyond_the_spread():
    rows = {"bf16": stats(0.90, 0.02), "int3-naive": stats(0.60, 0.05), "int3-tis": stats(0.88, 0.02),
            "int3-acr": stats(0.89, 0.01), "int3-seq-mask": stats(0.84, 0.01), "int3-geo-tis": stats(0.70, 0.2)}
    text = mismatch.format_verdicts(rows, ["int3", "int2g32"])
    line = next(x for x in text.splitlines() if x.startswith("- `int3`"))
    # seq-mask: 6 points under (not >= 10) and beyond the spread: in between; geo-tis' spread of 20 points
    # reaches BF16's: the rule cannot tell it from BF16 (it holds), nor from anything else
    assert "fails: naive; holds: tis, acr, geo-tis; in between: seq-mask." in line
    assert "acr 89.0 vs seq-mask 84.0" in line and "naive 60.0 vs tis 88.0" in line
    assert "tis 88.0 vs acr 89.0" not in line and "geo-tis" not in line.split("Apart")[1]
    assert "`int2g32`" not in text  # no rows there: nothing said
    few = mismatch.format_verdicts(rows | {"int3-acr": stats(0.89, 0.01, seeds=2)}, ["int3"])
    assert "fewer than 3 seeds" in few


def test_sweep_rows_map_to_the_dial_flags():
    assert mismatch.row_flags("bf16") == ["--quant", "none", "--objective", "ppo"]
    assert mismatch.row_flags("int3-seq-mask") == ["--quant", "int3", "--quant-group", "0", "--objective", "seq-mask"]
    assert mismatch.row_flags("int3-naive") == ["--quant", "int3", "--quant-group", "0", "--objective", "naive"]
    assert mismatch.row_flags("int2g32-acr") == ["--quant", "int2", "--quant-group", "32", "--objective", "acr"]


@pytest.mark.slow
def test_int3_per_channel_training_and_int2_group_eval(tmp_path, capfd):
    """`train.py --quant int3 --quant-group 0 --steps 2` runs (engine, sync and sync probe on that grid),
    then `eval.py --quant int2 --quant-group 32` evaluates its final model on an emulated engine."""
    proc = subprocess.run([sys.executable, "train.py", "--cache-dir", CACHE, "--out-dir", str(tmp_path),
                           "--quant", "int3", "--quant-group", "0", "--steps", "2", "--prompts-per-step", "4",
                           "--eval-size", "4", "--run-name", "dial", "--sync-check-every", "1"],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = " ".join((proc.stdout + proc.stderr).split())  # the run's log (rich wraps long lines)
    assert "INT3 (a mismatch-dial format beyond the paper): the rollout engine EMULATES it" in said
    assert "int3, per output channel" in said
    rows = [json.loads(line) for line in (tmp_path / "dial" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        # the engine took the synced int3 weights: its log-probs match the actor computing on that grid
        assert r["sync_probe_gap"] < 0.05, r
        assert r["kl_behav_prox_k3"] > 0 and r["rho_min_step"] <= 1 <= r["rho_max_step"]
        assert r["codes_changed_frac"] >= 0
    out = tmp_path / "eval.json"
    import eval as eval_script  # in this process: its vLLM import is paid already

    capfd.readouterr()
    assert eval_script.main(["--model", str(tmp_path / "dial" / "final"), "--quant", "int2", "--quant-group", "32",
                             "--eval-size", "4", "--out", str(out)]) == 0, capfd.readouterr().err[-3000:]
    result = json.loads(out.read_text())
    (model,) = result["models"].values()
    assert model["engine_format"] == "int2-emulated" and result["settings"]["quant_group"] == 32
    assert model["n_problems"] == 4
    capfd.readouterr()  # a group size that does not divide the columns: one line, exit 2
    assert eval_script.main(["--model", str(tmp_path / "dial" / "final"), "--quant", "int2", "--quant-group", "40",
                             "--eval-size", "4"]) == 2
    err = capfd.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("error: --quant-group 40 does not divide")


@pytest.mark.slow
def test_mismatch_smoke_writes_its_tables_and_plots_from_its_own_runs(tmp_path):
    out = tmp_path / "mismatch"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "experiments", "mismatch.py"), "--smoke",
                           "--parallel", str(min(2, len(os.sched_getaffinity(0)))), "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=900)  # 2 runs at a time, a core each
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    md = (tmp_path / "mismatch.md").read_text()
    for png in ("mismatch_dose_response.png", "mismatch_curves.png"):
        assert (tmp_path / png).stat().st_size > 10_000 and f"]({png})" in md
    assert "## Is there a format where naive Eq. 3 breaks while ACR holds?" in md
    for label in mismatch.DIAL:  # the static table has every format, at the warm start and the BF16 run's end
        assert len(re.findall(rf"^\| `{label}` \| (W8A8|per )", md, flags=re.M)) == 2, label
    data = json.loads((tmp_path / "mismatch.json").read_text())
    static = data["static"]["warm_start"]
    # 4 prompts x 4 samples (~220 tokens) is one small sample: the finer formats can swap places (int8 6e-5
    # vs int4g32 3e-5 on one warm start, 3e-6 vs 9e-5 on another); the coarsest is ~100x above both
    assert max(static["int8"]["kl_k3"], static["int4g32"]["kl_k3"]) * 10 < static["int2g32"]["kl_k3"]
    assert "## Per format: which objectives hold, which fail" in md
    assert set(data["training"]) == {"bf16", "int2g32-seq-mask"}  # the other rows: the same runner, another flag
    for row in ("bf16", "int2g32-seq-mask"):
        summary = json.loads((tmp_path / "mismatch_runs" / "runs" / f"{row}-seed0" / "summary.json").read_text())
        assert data["training"][row]["final"] == [summary["final_test_accuracy"]]
