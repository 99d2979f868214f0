"""The real model's experiments, tiny: Table 1's runner (2-step runs of all four rows) and the mismatch table."""
import json
import os
import sys

import pytest

import background

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "experiments"))
import table1  # noqa: E402


def stats(mean, sd, seeds=3):
    return {"mean": mean, "sd": sd, "final": [mean] * seeds}


def test_table1_verdict_follows_the_rule_fixed_before_the_runs():
    rows = {"bf16": stats(0.80, 0.02), "int8-tis": stats(0.78, 0.02)}
    assert table1.verdict({**rows, "int8-naive": stats(0.60, 0.03), "int8-acr": stats(0.79, 0.02)}) == \
        "Naive INT8 fails; ACR holds (by the rule below)."
    assert table1.verdict({**rows, "int8-naive": stats(0.72, 0.08), "int8-acr": stats(0.70, 0.01)}) == \
        "Naive INT8 does not fail; ACR does not hold (by the rule below)."
    assert table1.verdict({**rows, "int8-naive": stats(0.6, 0.0, seeds=2), "int8-acr": stats(0.8, 0.0)}).startswith(
        "Not judged yet: int8-naive")


def _run(row_seed, base="h1", start=0.5, lr=1e-5):
    return {"summary": {"base_model_hash": base, "initial_test_accuracy": start,
                        "config": {"seed": row_seed, "lr": lr, "model": "smollm2-135m-arith"}}}


def test_a_results_table_refuses_runs_from_other_bases_or_settings_in_one_line():
    from runs import one_experiment

    settings = {"--lr": "1e-5", "--model": "smollm2-135m-arith"}
    assert one_experiment({"a": [_run(0), _run(1)], "b": [_run(0)]}, settings, "t") == "h1"
    for table, says in [({"a": [_run(0)], "b": [_run(0, base="h2")]}, "do not start from one recorded base"),
                        ({"a": [_run(0)], "b": [_run(1, start=0.4)]}, "base h1 at 40.0%: b seed 1"),
                        ({"a": [_run(0, base=None)]}, "base not recorded at 50.0%: a seed 0"),
                        ({"a": [_run(0)], "b": [_run(2, lr=1e-4)]}, "other settings than this script's: b seed 2 (--lr")]:
        with pytest.raises(SystemExit) as e:
            one_experiment(table, settings, "t")
        assert says in str(e.value) and "\n" not in str(e.value), e.value


def test_table1_rows_differ_only_in_the_rollout_format_and_the_objective():
    """The four rows' flags: the settings, then each row's --quant and --objective (the objectives themselves are
    test_trainer_behaviour.py's and test_loss.py's; the smoke below runs two rows on the real model)."""
    settings = [x for kv in {**table1.SETTINGS, "--seed": "1"}.items() for x in kv]
    for row, (quant, objective) in {"bf16": ("none", "ppo"), "int8-naive": ("int8", "naive"),
                                    "int8-tis": ("int8", "tis"), "int8-acr": ("int8", "acr")}.items():
        assert table1.flags(row, 1, smoke=False) == settings + ["--quant", quant, "--objective", objective]
    smoke = table1.flags("int8-acr", 0, smoke=True)
    assert smoke[smoke.index("--steps") + 1] == "2" and smoke[smoke.index("--model") + 1] == "smollm2-135m-arith"


SMOKE_ROWS = ["bf16", "int8-acr"]  # the two whose mismatch the smoke compares


@background.command("test_table1_smoke_runs_on_the_real_model_and_reports_one_base")
def table1_smoke(folder):
    """Its two runs one after the other, on the background core (tests/background.py)."""
    return [sys.executable, "experiments/table1.py", "--smoke", "--seeds", "0", "--rows", *SMOKE_ROWS, "--parallel",
            "1", "--out", os.path.join(folder, "t1")], REPO


@pytest.mark.slow
def test_table1_smoke_runs_on_the_real_model_and_reports_one_base():
    proc, folder = background.result("test_table1_smoke_runs_on_the_real_model_and_reports_one_base")
    out = os.path.join(folder, "t1")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(open(out + ".json").read())
    assert set(result["rows"]) == set(SMOKE_ROWS)
    hashes = {h for r in result["rows"].values() for h in r["base_hash"]}
    assert hashes == {"98d8fdd03f66ac15"}  # the shipped warm start, every row
    assert len({a for r in result["rows"].values() for a in r["initial"]}) == 1  # one start, one experiment
    # INT8 W8A8's gap is ~10x the bf16 engine's on this model (1.5e-2 vs 1.6e-3 per token over 64 responses); two
    # smoke steps of 4 responses are a noisy sample of it, so only the order is asserted
    assert result["rows"]["int8-acr"]["kl_k3_median"] > result["rows"]["bf16"]["kl_k3_median"]
    assert os.path.getsize(out + ".png") > 10_000 and "Not judged yet" in open(out + ".md").read()


@background.command("test_real_mismatch_smoke_writes_the_table_with_the_emulation_check")
def real_mismatch_smoke(folder):
    return [sys.executable, "experiments/real_mismatch.py", "--smoke", "--out", os.path.join(folder, "rm")], REPO


@pytest.mark.slow
def test_real_mismatch_smoke_writes_the_table_with_the_emulation_check():
    proc, folder = background.result("test_real_mismatch_smoke_writes_the_table_with_the_emulation_check")
    out = os.path.join(folder, "rm")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(open(out + ".json").read())["rows"]
    assert rows["int8"]["kl_k3_per_token"] > 10 * rows["bf16"]["kl_k3_per_token"]  # INT8 W8A8 >> bf16 here
    # the engine's INT8 mismatch is the format's: the HF emulation measures it within a factor of 3
    assert 1 / 3 < rows["int8"]["emulation"]["kl_k3_per_token"] / rows["int8"]["kl_k3_per_token"] < 3
    assert "| int8 |" in open(out + ".md").read()
