"""experiments/acr_regime.py: the pilot's choice rule, the verdict rule, the field's row, and a tiny pilot run."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "experiments"))

import acr_regime  # noqa: E402


def _numbers(final=0.8, initial=0.37, all_three=0.0, grad_gap=0.0):
    return {"final": final, "initial": initial, "all_three": all_three, "grad_gap": grad_gap}


def test_choice_is_the_largest_binding_share_where_bf16_still_learns():
    pilot = {"int3_lr1e-4_8x8_acr": _numbers(all_three=0.004), "int2g32_lr1e-4_8x8_acr": _numbers(all_three=0.009),
             "int2g32_lr1e-5_2x4_acr": _numbers(all_three=0.0001),
             "toy_lr1e-4_8x8_bf16": _numbers(final=0.80), "toy_lr1e-5_2x4_bf16": _numbers(final=0.60)}
    assert acr_regime.choose(pilot) == "int2g32_lr1e-4_8x8"
    pilot["toy_lr1e-4_8x8_bf16"] = _numbers(final=0.45)  # BF16 gains 8 points only: not "still learns"
    assert acr_regime.choose(pilot) == "int2g32_lr1e-5_2x4"
    del pilot["toy_lr1e-5_2x4_bf16"]
    assert acr_regime.choose(pilot) is None


def test_a_tie_goes_to_the_larger_gradient_gap():
    pilot = {"int3_lr1e-4_4x8_acr": _numbers(all_three=0.002, grad_gap=0.3),
             "int2g32_lr1e-4_4x8_acr": _numbers(all_three=0.002, grad_gap=0.1), "toy_lr1e-4_4x8_bf16": _numbers()}
    assert acr_regime.choose(pilot) == "int3_lr1e-4_4x8"


def test_verdict_rule():
    seeds = [0, 1, 2]
    acr = [_numbers(final=f) for f in (0.90, 0.92, 0.91)]
    tis = [_numbers(final=f) for f in (0.80, 0.81, 0.79)]
    assert acr_regime.verdict({"acr": acr, "tis": tis}, seeds)[0].startswith("**ACR beats TIS**")
    assert acr_regime.verdict({"acr": tis, "tis": acr}, seeds)[0].startswith("**TIS beats ACR**")
    wide = [_numbers(final=f) for f in (0.70, 0.95, 0.85)]
    assert "within their seed spread" in acr_regime.verdict({"acr": wide, "tis": tis}, seeds)[0]
    fallen = [_numbers(final=f) for f in (0.20, 0.26, 0.80)]  # 2 of 3 seeds more than 10 points under 37%
    lines = acr_regime.verdict({"acr": acr, "tis": tis, "naive": fallen}, seeds)
    assert any(line.startswith("naive (Eq. 3): **collapses**") for line in lines)
    assert acr_regime.verdict({"acr": acr[:2], "tis": tis}, seeds)[0].startswith("Not judged yet")


def test_field_row_is_the_dials_best_correction():
    with open(os.path.join(REPO, "docs", "results", "mismatch.json")) as f:
        training = json.load(f)["training"]
    for fmt, best in acr_regime.FIELD_BEST.items():
        field = {o: training[f"{fmt}-{o}"]["mean"] for o in ("icepop", "seq-tis", "geo-tis", "seq-mask")}
        assert max(field, key=field.get) == best


def test_a_tiny_pilot_measures_the_three_conditions(tmp_path):
    out = tmp_path / "ar"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "experiments", "acr_regime.py"), "--smoke",
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    pilot = json.loads((tmp_path / "ar_pilot.json").read_text())
    acr = pilot["runs"]["int2g32_lr1e-4_2x4_acr"]
    assert acr["steps"] == 2 and 0 < acr["adv_positive"] < 1
    assert acr["all_three"] <= min(acr["adv_positive"], acr["ratio_over"], acr["rho_over_cap"])
    assert acr["grad_gap"] is not None and acr["grad_gap"] >= 0
    assert "toy_lr1e-4_2x4_bf16" in pilot["runs"] and "Rule, fixed before" in (tmp_path / "ar_pilot.md").read_text()
