"""--report-to and the console: each tracker's own store holds metrics.jsonl's rows, a tracker that is not installed
is one line before anything loads, and a run's output shows the run, not the libraries' warnings and bars."""
import json
import os
import re
import subprocess
import sys
import tomllib

import pytest

from qurl_mini.infra import trackers
from qurl_mini.config import parse_args
from qurl_mini.embedded import build_tiny_model
from qurl_mini.infra.progress import QUIET_ENV, quiet_third_parties, verbose_requested

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOISE = ("torch.set_num_threads", "Loading safetensors checkpoint shards", "NUMA binding", "LD_PRELOAD",
         "Loading weights", "Writing model shards", "Generating train split", "FutureWarning", "* Trackio",
         "Traceback")


def clean_env(**extra):
    """This environment without the quieting settings (an earlier in-process run may have set them), so a
    subprocess shows what the script itself does."""
    env = {k: v for k, v in os.environ.items() if k not in QUIET_ENV and k != "QURL_VERBOSE"}
    return {**env, "COLUMNS": "1000", **extra}  # rich wraps log lines at 80 columns in a pipe


def script(*args, **env):
    return subprocess.run([sys.executable, *args], cwd=REPO, env=clean_env(**env), capture_output=True, text=True,
                          timeout=600)


# ----- flags, install, quieting (no model) ------------------------------------------------------------------------


def test_report_to_defaults_to_none_and_takes_several_trackers():
    assert parse_args([]).report_to == ["none"]
    assert parse_args(["--report-to", "tensorboard", "trackio"]).report_to == ["tensorboard", "trackio"]


def test_an_unknown_tracker_is_one_line(capfd):
    with pytest.raises(SystemExit) as stop:
        parse_args(["--report-to", "tensorboard", "mlflow"])
    err = capfd.readouterr().err
    assert stop.value.code == 2 and err == ("error: --report-to 'mlflow': choose from "
                                            "('none', 'tensorboard', 'trackio', 'wandb')\n")


def test_a_tracker_that_is_not_installed_is_one_line_with_the_install_command_before_any_model_loads(tmp_path):
    # wandb made unimportable (as when it is not installed) in a real train.py process; the --model folder does
    # not exist, so the tracker's line coming first shows that nothing was loaded before the check
    block = "import runpy, sys; sys.modules['wandb'] = None; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], " \
            "run_name='__main__')"
    proc = script("-c", block, "train.py", "--report-to", "wandb", "--model", str(tmp_path / "nope"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: --report-to wandb: wandb is not installed; pip install -r requirements-track.txt "
        "(or pip install '.[track]')"]


def test_the_install_file_and_the_extra_name_the_same_trackers():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["track"]
    with open(os.path.join(REPO, "requirements-track.txt")) as f:
        listed = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    assert sorted(extra) == sorted(listed)
    assert {re.split("[<>=]", r)[0] for r in listed} == {"tensorboard", "trackio", "wandb"}


@pytest.mark.parametrize("argv, env, verbose", [
    ([], {}, False), (["--steps", "2", "--verbose"], {}, True), (["--verbose", "false"], {}, False),
    (["--verbose=true"], {}, True), ([], {"QURL_VERBOSE": "1"}, True), ([], {"QURL_VERBOSE": "0"}, False)])
def test_verbose_comes_from_the_flag_or_the_environment(argv, env, verbose, monkeypatch):
    monkeypatch.delenv("QURL_VERBOSE", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert verbose_requested(argv) is verbose


def test_quieting_leaves_a_setting_the_user_made(monkeypatch):
    for name in QUIET_ENV:  # set, then removed: the test's end restores what was there
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")
    quiet_third_parties(verbose=False)
    assert os.environ["VLLM_LOGGING_LEVEL"] == "INFO" and os.environ["TORCH_CPP_LOG_LEVEL"] == "ERROR"


def test_trackers_get_the_rows_finite_numbers_without_the_step():
    row = {"step": 3, "reward_mean": 0.5, "data_cursor": 12, "kl_behav_prox": None, "rho_max": float("inf"),
           "note": "x", "flag": True}
    assert trackers.scalars(row) == {"reward_mean": 0.5, "data_cursor": 12}


@pytest.mark.slow
def test_wandb_runs_offline_into_the_run_folder(tmp_path, monkeypatch):
    pytest.importorskip("wandb")  # requirements-track.txt has it; this checks the adapter against the real package
    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline is the default
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = trackers.Trackers(["wandb"], str(tmp_path), "r", {"steps": 2})
    run.log({"step": 0, "test_accuracy": 0.25}, 0)
    run.log({"step": 1, "reward_mean": 0.5}, 1)
    watch = run.watch()["wandb"]
    run.close()
    (offline,) = tmp_path.glob("wandb/offline-run-*")
    assert watch == f"wandb sync {offline}"
    (records,) = offline.glob("*.wandb")
    assert records.stat().st_size > 0


def test_wandb_online_without_its_server_is_one_line(tmp_path, monkeypatch):
    """What wandb raises after its wait for a server it cannot reach (measured: 30 s with init_timeout, else 100 s),
    without the wait."""
    wandb = pytest.importorskip("wandb")
    asked = {}

    def no_server(**kwargs):
        asked.update(kwargs)
        raise wandb.errors.CommError('Timed out while retrying: Post "https://api.wandb.ai/graphql": dial tcp: lookup '
                                     "api.wandb.ai: no such host")

    monkeypatch.setattr(wandb, "init", no_server)
    monkeypatch.setenv("WANDB_MODE", "online")
    with pytest.raises(trackers.TrackerError, match=r"^--report-to wandb with WANDB_MODE=online: Timed out while "
                                                     r"retrying: .* no such host; unset WANDB_MODE to log offline"):
        trackers.Trackers(["wandb"], str(tmp_path), "r", {})
    assert asked["mode"] == "online" and asked["settings"].init_timeout == 30


# ----- one tiny real run with tensorboard and trackio, and eval.py on it -------------------------------------------


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """train.py, 2 steps, --report-to tensorboard trackio (trackio's store in a temporary TRACKIO_DIR)."""
    tmp = tmp_path_factory.mktemp("tracked")
    tiny = build_tiny_model(str(tmp / "tiny"), layers=1, hidden=64, heads=2, kv_heads=1)
    data = tmp / "gsm.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}+1?", "answer": f"#### {i + 1}"}) + "\n" for i in range(40)))
    flags = ["--model", tiny, "--data", str(data), "--out-dir", str(tmp / "runs"), "--run-name", "r",
             "--quant", "int8", "--steps", "2", "--prompts-per-step", "4", "--group-size", "2", "--eval-size", "8",
             "--eval-every", "0", "--max-new-tokens", "8", "--sync-check-every", "0",
             "--report-to", "tensorboard", "trackio"]
    proc = script("train.py", *flags, TRACKIO_DIR=str(tmp / "trackio"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = tmp / "runs" / "r"
    with open(run_dir / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    with open(run_dir / "summary.json") as f:
        summary = json.load(f)
    return dict(dir=run_dir, trackio_dir=tmp / "trackio", output=proc.stdout + proc.stderr, rows=rows,
                summary=summary)


@pytest.mark.slow
def test_tensorboard_event_file_holds_each_steps_metrics_the_test_accuracy_and_the_curves(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run["dir"] / "tensorboard"), size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    scalar = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    for name in ("reward_mean", "kl_behav_prox_k3", "response_len"):  # float32 in the event file
        assert scalar[name] == [(r["step"], pytest.approx(r[name], rel=1e-6)) for r in run["rows"]]
    assert [step for step, _ in scalar["reward_mean"]] == [1, 2]
    assert scalar["test_accuracy"] == [(0, pytest.approx(run["summary"]["initial_test_accuracy"])),
                                       (2, pytest.approx(run["rows"][-1]["test_accuracy"]))]
    assert [e.step for e in events.Images("curves")] == [2]
    assert "config/text_summary" in events.Tags()["tensors"]


@pytest.mark.slow
def test_trackio_local_store_holds_each_steps_metrics_and_the_config(run):
    read = ("import json, sys; from trackio.sqlite_storage import SQLiteStorage as S; "
            "print(json.dumps([S.get_logs('qurl-mini', 'r'), S.get_run_config('qurl-mini', 'r')], default=str))")
    proc = script("-c", read, TRACKIO_DIR=str(run["trackio_dir"]))
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs, config = json.loads(proc.stdout.strip().splitlines()[-1])
    logged = {(r["step"], name): value for r in logs for name, value in r.items() if name not in ("step", "timestamp")}
    for row in run["rows"]:
        assert logged[row["step"], "reward_mean"] == pytest.approx(row["reward_mean"])
        assert logged[row["step"], "kl_behav_prox_k3"] == pytest.approx(row["kl_behav_prox_k3"])
    assert logged[0, "test_accuracy"] == pytest.approx(run["summary"]["initial_test_accuracy"])
    assert logged[2, "curves"]["_type"] == "trackio.image"
    assert config["steps"] == 2 and config["report_to"] == ["tensorboard", "trackio"]


@pytest.mark.slow
def test_the_run_shows_its_story_not_the_libraries_warnings_bars_or_the_config(run):
    out = run["output"]
    for noise in NOISE:
        assert noise not in out, f"{noise!r} in the output:\n{out[-3000:]}"
    assert '"config"' not in out and '"gpu_memory_utilization"' not in out  # the config stays in summary.json
    assert re.search(r"greedy test accuracy before RL: \d+\.\d%", out)
    s = run["summary"]
    line = re.search(r"greedy test accuracy: (\d+\.\d)% before RL -> (\d+\.\d)% after", out)
    assert line and [float(x) for x in line.groups()] == [round(100 * s["initial_test_accuracy"], 1),
                                                          round(100 * s["final_test_accuracy"], 1)]
    for where in (s["metrics"], s["plot"], s["checkpoints"], s["final_model"], "tensorboard --logdir",
                  "trackio show --project qurl-mini"):
        assert where in out
    assert "Q: " in out and "RL grpo / rollout int8: 2/2" in out  # the first prompt, the progress lines


@pytest.mark.slow
def test_eval_of_the_run_shows_its_table_without_the_libraries(run):
    proc = script("eval.py", "--run", str(run["dir"]), "--show", "0")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    for noise in NOISE:
        assert noise not in out, f"{noise!r} in the output:\n{out[-3000:]}"
    assert "Avg@1" in out and "start:" in out and "final:" in out
