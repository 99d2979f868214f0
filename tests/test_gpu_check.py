"""The GPU acceptance check's CPU half (scripts/gpu_check.py --cpu-half) from a plain clone, and its parity
check's self-test: a 10% weight-scale error between the engine and the actor fails it."""
import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

import background

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(REPO, ".cache")  # named models converted once, shared with the other tests


def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(REPO, "scripts", "gpu_check.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def plain_clone(dest):
    """This working tree's files as a clone would have them (tracked, and new files not ignored), without .venv,
    .cache, runs/ or any folder beside the checkout."""
    if not os.path.exists(os.path.join(REPO, ".git")):
        pytest.skip("not a git checkout: no list of the files a clone would have")
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout
    for path in filter(None, listed.split("\0")):
        if os.path.isfile(os.path.join(REPO, path)):  # not one deleted in the working tree
            os.makedirs(os.path.dirname(os.path.join(dest, path)), exist_ok=True)
            shutil.copy2(os.path.join(REPO, path), os.path.join(dest, path))
    return dest


@background.command("test_the_cpu_half_passes_in_a_plain_clone_and_reports_each_check")
def cpu_half(folder):
    """The CPU half in a plain clone, nothing beside it (the shipped GSM8K sample is the data); 1 train-int8 step."""
    clone = plain_clone(os.path.join(folder, "clone"))
    os.makedirs(os.path.join(folder, "tmp"))  # its temporary files, to see that it leaves none of its own
    return ["/usr/bin/env", f"TMPDIR={os.path.join(folder, 'tmp')}", sys.executable, "scripts/gpu_check.py", "--cpu-half", "--out-dir", os.path.join(folder, "out"),
            "--cache-dir", CACHE, "--max-new-tokens", "16", "--steps", "1", "--prompts", "2", "--group", "2"], clone


@pytest.mark.slow
def test_the_cpu_half_passes_in_a_plain_clone_and_reports_each_check():
    proc, folder = background.result("test_the_cpu_half_passes_in_a_plain_clone_and_reports_each_check")
    assert not os.path.exists(os.path.join(folder, "shared"))  # nothing beside the checkout
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(os.path.join(folder, "out", "gpu-check.json")) as f:
        report = json.load(f)
    assert {n: r["status"] for n, r in report.items()} == {
        "cuda": "skipped", "parity-int8": "pass", "parity-fp8": "pass", "train-int8": "pass", "throughput": "skipped"}
    limits = gpu_check().PARITY_LIMIT
    for name in ("parity-int8", "parity-fp8"):  # under the bound, and a 10% weight-scale error over it
        assert 0 < report[name]["value"] < limits[report[name]["engine"]] < report[name]["value_at_10pct_error"], \
            report[name]
    assert report["train-int8"]["value"] > 0
    left = [n for n in os.listdir(os.path.join(folder, "tmp")) if n.startswith("gpu-check-")]
    assert left == []  # train-int8's run (~2 GB: a checkpoint, the final model) went with its check
    assert "RL grpo / rollout int8: 1/1" in open(os.path.join(folder, "out", "gpu-check-train-int8.log")).read()
    lines = [line for line in proc.stdout.splitlines() if line.split()[:1] and line.split()[0] in report]
    assert len(lines) == len(report)  # one line per check


def test_train_int8_without_its_data_is_skipped_with_the_reason(tmp_path):
    result = gpu_check().check_train(argparse.Namespace(data=str(tmp_path / "absent.jsonl"), test_data=None))
    assert result["status"] == "skipped"
    assert result["detail"].startswith(f"no data: --data {tmp_path / 'absent.jsonl'}: no such file"), result


@pytest.mark.parametrize("gaps, status, blind", [((0.26, 0.74), "pass", False), ((0.60, 0.74), "fail", False),
                                                  ((0.26, 0.40), "fail", True)])
def test_the_parity_check_fails_a_gap_over_the_bound_and_a_check_blind_to_a_10_percent_error(monkeypatch, gaps,
                                                                                             status, blind):
    module = gpu_check()
    monkeypatch.setattr(module, "parity_gaps", lambda fmt, cache_dir, **kw: (*gaps, "int8"))
    result = module.parity_result("int8", CACHE)
    assert result["status"] == status and ("the check is blind" in result["detail"]) == blind, result
