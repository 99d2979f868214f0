"""experiments/long_horizon.py: the long-horizon rule (TIS's KL drift vs ACR's) by hand-set numbers, the page with
no runs on disk, and a 3-step smoke of the script (TIS and ACR at int3, one seed) with its --report-only remake."""
import json
import math
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "experiments", "long_horizon.py")
sys.path.insert(0, os.path.join(REPO, "experiments"))
import long_horizon as lh  # noqa: E402


def steps(kls, zero_adv=0.5):
    return [{"step": i + 1, "kl_behav_prox_k3": kl, "zero_advantage_groups": zero_adv, "rho_max_step": 2.0,
             "rho_over_cap_frac": 0.0, "time_step": 1.0} for i, kl in enumerate(kls)]


def test_growth_factor_is_the_median_kl_of_the_last_tenth_over_the_first_tenth():
    # 20 steps: the first 2 and the last 2; medians 0.002 and 0.025 (the paper's 12.5x)
    kls = [0.001, 0.003] + [0.01] * 16 + [0.02, 0.03]
    assert lh.growth(steps(kls)) == pytest.approx(0.025 / 0.002)
    # 3 steps (the smoke): one step at each end
    assert lh.growth(steps([0.004, 1.0, 0.002])) == pytest.approx(0.5)
    assert lh.mixed({"zero_advantage_groups": 0.25}) == 0.75 and lh.mixed({}) is None
    assert lh.windows([1, 0, 1, 1, None], size=2) == [0.5, 1, None]


def row(finals, growths, sd=None):
    runs = [{"seed": s, "growth": g} for s, g in enumerate(growths)]
    mean = sum(finals) / len(finals)
    spread = sd if sd is not None else (sum((f - mean) ** 2 for f in finals) / (len(finals) - 1)) ** 0.5
    return {"final": finals, "mean": mean, "sd": spread, "runs": runs}


def test_verdict_follows_the_rule_fixed_before_the_runs():
    # TIS grows >= 3x in seeds 0 and 2 (not 1); ACR's growth is at most half of TIS's in both: holds
    v = lh.verdict({"int3-tis": row([0.6, 0.7, 0.5], [6.0, 2.0, 4.0]), "int3-acr": row([0.8, 0.85, 0.9], [3.0, 5.0, 2.0])})
    assert v["judged"] and v["tis_drifts"] and v["acr_holds"] and v["drifting_seeds"] == [0, 2]
    assert v["acr_beats"] and not v["tis_beats"]  # 85 vs 60, sds 5 + 10
    assert v["lines"][0].startswith("**TIS drifts** (growth factor >= 3 in 2 of 3 seeds")
    assert v["lines"][1].startswith("**ACR holds where TIS drifts**")
    # ACR's growth more than half of TIS's in one drifting seed: does not hold; accuracies within the spread
    v = lh.verdict({"int3-tis": row([0.8, 0.8, 0.9], [6.0, 2.0, 4.0]), "int3-acr": row([0.8, 0.9, 0.8], [3.0, 1.0, 2.1])})
    assert v["tis_drifts"] and v["acr_holds"] is False and not v["acr_beats"] and not v["tis_beats"]
    assert v["lines"][2].startswith("ACR and TIS end within their seed spread")
    assert not any("unquantized" in line for line in v["lines"])  # no reference rows: nothing said of them
    # the unquantized reference, all seeds finished: read beside the verdict, never part of it
    ref = row([0.9, 0.95, 1.0], [None] * 3)
    for r, sampled in zip(ref["runs"], [0.8, 0.85, 0.9]):
        r["sampled_last"] = sampled
    v2 = lh.verdict({"int3-tis": row([0.8, 0.8, 0.9], [6.0, 2.0, 4.0]),
                     "int3-acr": row([0.8, 0.9, 0.8], [3.0, 1.0, 2.1]), "bf16": ref})
    assert {k: v2[k] for k in ("tis_drifts", "acr_holds", "acr_beats")} == {k: v[k] for k in ("tis_drifts", "acr_holds", "acr_beats")}
    assert "Not judged, for reading: the unquantized rollout (Eq. 1) ends at 95.0 ± 5.0 greedy, 85.0 ± 5.0 sampled." in v2["lines"]
    # one drifting seed is not drift: said as the rule words it, and "holds" is not judged
    v = lh.verdict({"int3-tis": row([0.8] * 3, [3.5, 1.2, 0.9], sd=0.0), "int3-acr": row([0.7] * 3, [1, 1, 1], sd=0.0)})
    assert v["tis_drifts"] is False and v["acr_holds"] is None and v["tis_beats"]
    assert v["lines"][0].startswith("**TIS did not drift at this scale**")
    # fewer than 3 finished seeds: not judged
    v = lh.verdict({"int3-tis": row([0.8, 0.8], [9, 9]), "int3-acr": row([0.8] * 3, [1, 1, 1])})
    assert not v["judged"] and v["lines"] == ["Not judged yet: int3-tis has fewer than 3 finished seeds."]


def test_run_stats_read_the_fig3b_analogue_and_the_mixed_share_per_run():
    m = steps([0.002] * 10 + [0.02] * 10, zero_adv=0.6)
    m[5]["rho_max_step"] = 40.0
    m[-1]["rho_over_cap_frac"] = 0.02
    r = lh.run_stats({"summary": {"final_test_accuracy": 0.5, "config": {"seed": 1, "quant": "int3"}}, "metrics": m})
    assert r["growth"] == pytest.approx(10.0) and r["rho_max"] == 40.0 and r["seed"] == 1
    assert r["past_cap_last"] == pytest.approx(0.01) and r["mixed_min_window"] == pytest.approx(0.4)
    bf16 = lh.run_stats({"summary": {"final_test_accuracy": 0.5, "config": {"seed": 0, "quant": "none"}}, "metrics": m})
    assert bf16["growth"] is None  # no quantized sampler: its KL is rounding noise, not a growth


def test_rule_and_settings_are_pinned_in_the_script():
    assert "kl_behav_prox_k3" in lh.RULE and "TIS did not drift at this scale" in lh.RULE
    assert lh.SETTINGS["--shared-prompt"] == "true" and lh.SETTINGS["--engine-dtype"] == "float32"
    assert lh.SETTINGS["--max-number"] == "10"  # the shipped warm start's task: one base on every machine
    assert lh.ROWS["int3-tis"] == ["--quant", "int3", "--quant-group", "0", "--objective", "tis"]
    assert not math.isnan(float(lh.SETTINGS["--lr"]))


def test_report_only_with_no_runs_says_so_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, SCRIPT, "--report-only", "--out", str(tmp_path / "lh")], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(proc.stdout.strip().splitlines()) == 1 and "no runs on disk" in proc.stdout
    md = (tmp_path / "lh.md").read_text()
    assert "Rule, fixed in the script" in md and "Not judged yet" in md and not (tmp_path / "lh.png").exists()


@pytest.mark.slow
def test_long_horizon_smoke_writes_its_page_from_its_own_runs_and_remakes_it(tmp_path):
    out = tmp_path / "lh"
    proc = subprocess.run([sys.executable, SCRIPT, "--smoke", "--parallel", str(min(2, len(os.sched_getaffinity(0)))), "--out",
                           str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)  # TIS and ACR side by side
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads((tmp_path / "lh.json").read_text())
    assert set(data["stats"]) == {"int3-tis", "int3-acr"} and data["settings"]["--steps"] == "3"
    for name in ("int3-tis", "int3-acr"):
        run_dir = tmp_path / "lh_runs" / "runs" / f"{name}-seed0"
        summary = json.loads((run_dir / "summary.json").read_text())
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2, 3] and summary["config"]["shared_prompt"] is True
        s = data["stats"][name]["runs"][0]
        assert data["stats"][name]["final"] == [summary["final_test_accuracy"]]
        assert s["growth"] == pytest.approx(rows[-1]["kl_behav_prox_k3"] / rows[0]["kl_behav_prox_k3"])
        assert s["mixed_first"] == pytest.approx(1 - rows[0]["zero_advantage_groups"])
        assert not (run_dir / "checkpoints").exists()  # a finished run drops its checkpoints
    md = (tmp_path / "lh.md").read_text()
    assert "Not judged yet" in md and "](lh.png)" in md and (tmp_path / "lh.png").stat().st_size > 10_000
    # --report-only remakes the page from the runs on disk, starting none
    (tmp_path / "lh.md").unlink()
    proc = subprocess.run([sys.executable, SCRIPT, "--smoke", "--report-only", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| int3 ACR (Eq. 9, QuRL) | 0 | 3 |" in (tmp_path / "lh.md").read_text()
