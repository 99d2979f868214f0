"""The experiment runner (experiments/runs.py) carries a run across a stop: a run stopped part-way resumes from
its newest checkpoint, keeps the accuracy measured at its start, and drops its checkpoints once finished."""
import json
import os
import subprocess
import sys

import pytest

from qurl_mini.embedded import build_tiny_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "experiments"))
import runs  # noqa: E402


@pytest.mark.slow
def test_a_run_stopped_part_way_resumes_from_its_checkpoint_with_its_start_accuracy(tmp_path):
    tiny = build_tiny_model(str(tmp_path / "tiny"), layers=1, hidden=64, heads=2, kv_heads=1)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}+1?", "answer": f"#### {i + 1}"}) + "\n" for i in range(40)))
    flags = ["--model", tiny, "--data", str(data), "--quant", "int8", "--prompts-per-step", "4", "--group-size", "2",
             "--max-new-tokens", "6", "--eval-size", "8", "--eval-every", "0", "--save-every", "1"]
    out, logs = tmp_path / "work", str(tmp_path / "work" / "logs")
    run_dir = out / "runs" / "r"
    # a run stopped after its first step: its step-1 checkpoint is there, no summary
    subprocess.run([sys.executable, os.path.join(REPO, "train.py"), "--out-dir", str(out / "runs"), "--run-name", "r",
                    *flags, "--steps", "1"], cwd=REPO, check=True, capture_output=True)
    start = json.loads((run_dir / "summary.json").read_text())["initial_test_accuracy"]
    (run_dir / "summary.json").unlink()
    assert (run_dir / "checkpoints" / "step-000001" / "COMPLETE").exists()

    assert runs.run(str(out), "r", flags + ["--steps", "2"], logs) == str(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [json.loads(line)["step"] for line in open(run_dir / "metrics.jsonl")] == [1, 2]  # before and after
    assert summary["initial_test_accuracy"] == start  # measured at the start, carried by the checkpoint
    assert "resumed from" in open(os.path.join(logs, "r.log")).read()
    assert not (run_dir / "checkpoints").exists()  # a finished run's resume points go; its final model stays
    assert (run_dir / "final" / "model.safetensors").exists()


def test_runs_side_by_side_are_pinned_to_cores_this_process_may_use(tmp_path, monkeypatch):
    """--parallel N pins each run to one of the cores in this process's affinity (a container's cpuset may not
    start at 0); more runs at a time than those cores is one line."""
    pinned = []
    monkeypatch.setattr(runs, "run", lambda out_dir, name, flags, log_dir, core=None: pinned.append(core) or name)
    allowed = sorted(os.sched_getaffinity(0))
    assert runs.run_many(tmp_path, [("a", []), ("b", [])], tmp_path, parallel=1) == ["a", "b"] and pinned == [None] * 2
    if len(allowed) >= 2:
        pinned.clear()
        assert runs.run_many(tmp_path, [("a", []), ("b", []), ("c", [])], tmp_path, parallel=2) == ["a", "b", "c"]
        assert set(pinned) <= set(allowed[:2]) and len(pinned) == 3
    with pytest.raises(SystemExit, match=rf"^error: --parallel {len(allowed) + 1}: this process may run on "
                                         rf"{len(allowed)} CPU core\(s\) only$"):
        runs.run_many(tmp_path, [("a", [])], tmp_path, parallel=len(allowed) + 1)


@pytest.mark.parametrize("script", ["table1", "mismatch", "replay", "long_horizon"])
@pytest.mark.parametrize("value, says", [("0", "must be >= 1 (runs at a time), got 0"),
                                         ("-2", "must be >= 1 (runs at a time), got -2"),
                                         ("two", "not a whole number: 'two'")])
def test_parallel_below_one_or_not_a_number_is_one_line_before_any_run(script, value, says, capsys):
    """--parallel 0 used to run one at a time (or, in mismatch.py, only report) without a word."""
    import importlib

    module = importlib.import_module(script)
    with pytest.raises(SystemExit) as e:
        module.main(["--parallel", value])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[-1].endswith(f"error: argument --parallel: {says}"), err


def test_a_failed_run_stops_the_runs_after_it_from_starting(tmp_path, monkeypatch):
    """A full disk failed one run, and the driver went on to start the next ones, which failed the same way."""
    started = []

    def fake_run(out_dir, name, flags, log_dir, core=None):
        started.append(name)
        if name == "b":
            raise SystemExit("error: run b failed (exit 2); see b.log")
        return name

    monkeypatch.setattr(runs, "run", fake_run)
    with pytest.raises(SystemExit, match="run b failed"):
        runs.run_many(tmp_path, [("a", []), ("b", []), ("c", []), ("d", [])], tmp_path, parallel=1)
    assert started == ["a", "b"]
