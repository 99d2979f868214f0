"""Faults done to real (tiny) runs, and what must hold afterwards: one line each, no traceback, nothing lost.

One story shares its vLLM starts (each costs tens of seconds on a CPU): run A trains; a second run into A's
folder is refused while A lives; SIGINT stops A; its newest checkpoint and its last metrics line are damaged;
the resume command A printed finishes the run; a resume of a copy under a file-size limit hits a "full disk".
"""
import contextlib
import glob
import io
import json
import os
import re
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

import eval as eval_script
import quantize
import train
from qurl_mini.infra import checkpoint
from qurl_mini.embedded import build_tiny_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, COLUMNS="1000")  # rich wraps log lines at 80 columns in a pipe


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny")), layers=1, hidden=64, heads=2, kv_heads=1)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "gsm.jsonl"
    path.write_text("".join(json.dumps({"question": f"{i}+1?", "answer": f"#### {i + 1}"}) + "\n" for i in range(40)))
    return str(path)


def tiny_flags(tiny, data_file, out_dir, *more):
    return ["--model", tiny, "--data", data_file, "--out-dir", str(out_dir), "--run-name", "r", "--quant", "int8",
            "--prompts-per-step", "4", "--group-size", "2", "--eval-size", "8", "--eval-every", "0",
            "--max-new-tokens", "8", "--sync-check-every", "0", "--save-every", "2", "--keep", "2", *more]


def start_train(flags, log_path, env=ENV, **kwargs):
    """train.py in its own process; stdout and stderr to a file (a pipe nobody reads could fill and block it)."""
    log = open(log_path, "w")
    return subprocess.Popen([sys.executable, os.path.join(REPO, "train.py"), *flags], cwd=REPO, env=env,
                            stdout=log, stderr=subprocess.STDOUT, text=True, **kwargs)


def wait_for(condition, proc, what, timeout=400):
    deadline = time.time() + timeout
    while not condition():
        assert proc.poll() is None, f"the run ended before {what}"
        assert time.time() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.1)


def steps(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["step"] for line in f]


def last_line(text):
    assert "Traceback" not in text, text[-3000:]
    return [line for line in text.strip().splitlines() if line.strip()][-1]


# ----- one run, its folder, its interruption, its resume ----------------------------------------------------------


@pytest.fixture(scope="module")
def interrupted(tiny, data_file, tmp_path_factory):
    """Run A (8 steps, a checkpoint every 2); a second run into A's folder while A lives; SIGINT to A once its
    step-4 checkpoint is complete."""
    out = tmp_path_factory.mktemp("a")
    run_dir = out / "r"
    flags = tiny_flags(tiny, data_file, out, "--steps", "8")
    a = start_train(flags, out / "a.log")
    metrics = run_dir / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and metrics.read_text().endswith("\n"), a, "first metrics row")
    rows_before, err = metrics.read_text(), io.StringIO()
    with contextlib.redirect_stderr(err):  # in-process: refused in well under one of A's steps
        second_code = train.main(flags)
    second = SimpleNamespace(code=second_code, err=err.getvalue(), lock=(run_dir / "run.lock").read_text().strip(),
                             rows_before=rows_before, rows_after=metrics.read_text())
    wait_for((run_dir / "checkpoints" / "step-000004" / "COMPLETE").exists, a, "step-4 checkpoint")
    a.send_signal(signal.SIGINT)
    code = a.wait(timeout=300)
    return SimpleNamespace(run_dir=run_dir, flags=flags, pid=a.pid, code=code, log=(out / "a.log").read_text(),
                           second=second)


def test_a_second_run_into_a_live_folder_refuses_with_one_line_and_writes_nothing(interrupted):
    second = interrupted.second
    assert second.code == 2
    assert last_line(second.err) == (f"error: {interrupted.run_dir} is in use by another run (pid {interrupted.pid});"
                                     f" wait for it to end, or choose another --run-name or --out-dir")
    assert second.lock == str(interrupted.pid)  # the owner's pid is still the one on record
    assert second.rows_after.startswith(second.rows_before)  # nothing truncated, nothing interleaved
    assert steps(interrupted.run_dir) == list(range(1, len(steps(interrupted.run_dir)) + 1))  # A's rows in order


def test_sigint_stops_after_the_phase_with_the_last_checkpoint_and_the_resume_command(interrupted):
    assert interrupted.code == 130
    line = last_line(interrupted.log)
    logged = steps(interrupted.run_dir)
    ckpt = checkpoint.newest_loadable(str(interrupted.run_dir))[0]
    saved = int(ckpt[-6:])
    assert saved >= 4 and logged == list(range(1, len(logged) + 1)) and saved <= len(logged) < saved + 2
    prefix = f"stopped by SIGINT; the last complete checkpoint is {ckpt}; resume with: "
    assert line.startswith(prefix), line
    python, script, *args = shlex.split(line[len(prefix):])
    assert os.path.samefile(os.path.join(REPO, python), sys.executable) and script == "train.py"
    assert args == interrupted.flags + ["--resume"]
    assert not [p for p in os.listdir(interrupted.run_dir / "checkpoints") if ".tmp" in p]  # nothing half written


@pytest.fixture(scope="module")
def resumed(interrupted):
    """A's newest checkpoint truncated (its COMPLETE marker stays) and a torn last metrics line; then the resume
    command A printed, run as printed."""
    newest, _ = checkpoint.newest_loadable(str(interrupted.run_dir))
    older = checkpoint.complete_checkpoints(str(interrupted.run_dir))[-2]
    weights = os.path.join(newest, "actor", "model.safetensors")
    os.truncate(weights, os.path.getsize(weights) // 2)
    with open(interrupted.run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "reward_me')
    command = last_line(interrupted.log).split("resume with: ")[1]
    proc = subprocess.run(shlex.split(command), cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    return SimpleNamespace(proc=proc, newest=newest, older=older, run_dir=interrupted.run_dir, flags=interrupted.flags)


def test_resume_skips_a_corrupt_checkpoint_and_a_torn_metrics_line_and_reaches_the_final_step(resumed):
    out = resumed.proc.stdout + resumed.proc.stderr
    assert resumed.proc.returncode == 0, out[-3000:]
    skipped = [line for line in out.splitlines() if "skipping checkpoint" in line]
    assert len(skipped) == 1 and resumed.newest in skipped[0] and "actor/model.safetensors" in skipped[0]
    assert f"resuming from {resumed.older} instead" in skipped[0]
    assert "metrics.jsonl: dropped line" in out and "cut short" in out
    assert steps(resumed.run_dir) == list(range(1, 9))  # every step logged once, in order
    assert (resumed.run_dir / "final" / "model.safetensors").exists()


def test_a_full_disk_during_a_checkpoint_save_is_one_line_and_keeps_the_previous_checkpoint(resumed, tmp_path):
    shutil.copytree(resumed.run_dir, tmp_path / "r")
    run_dir = tmp_path / "r"
    engine_file = os.path.getsize(run_dir / "engine-init-int8" / "model.safetensors")
    actor_file = os.path.getsize(run_dir / "final" / "model.safetensors")
    assert engine_file < actor_file  # the limit lets the engine start and stops the checkpoint's first file
    limit = (engine_file + actor_file) // 2

    def file_size_limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    flags = [*resumed.flags, "--steps", "10", "--resume"]
    flags[flags.index("--out-dir") + 1] = str(tmp_path)
    # torch.compile (vLLM's sampler) builds C++ headers far past the limit: off, so only the run's own files count
    proc = start_train(flags, tmp_path / "d.log", env=dict(ENV, TORCH_COMPILE_DISABLE="1"),
                       preexec_fn=file_size_limit)
    assert proc.wait(timeout=600) == 2
    line = last_line((tmp_path / "d.log").read_text())
    target = run_dir / "checkpoints" / "step-000010"
    assert line.startswith(f"error: disk full writing {target}: it needs about "), line
    assert "MiB" in line and "run again with --resume" in line
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["step-000006", "step-000008"]  # the temporary one: gone
    assert checkpoint.newest_loadable(str(run_dir)) == (str(run_dir / "checkpoints" / "step-000008"), [])


def test_a_full_disk_at_any_other_file_of_the_run_is_one_line(resumed, tiny, data_file, tmp_path):
    """Not a checkpoint: the engine's start weights (engine-init-int8/), written before the first step."""
    limit = os.path.getsize(resumed.run_dir / "engine-init-int8" / "model.safetensors") // 2

    def file_size_limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = start_train(tiny_flags(tiny, data_file, tmp_path, "--steps", "2"), tmp_path / "f.log",
                       env=dict(ENV, TORCH_COMPILE_DISABLE="1"), preexec_fn=file_size_limit)
    assert proc.wait(timeout=600) == 2
    line = last_line((tmp_path / "f.log").read_text())
    assert line.startswith("error: disk full: "), line
    assert "free some space and run again with --resume" in line


def test_sigterm_stops_with_one_line_and_exit_143(tiny, data_file, tmp_path):
    flags = tiny_flags(tiny, data_file, tmp_path, "--steps", "8")
    proc = start_train(flags, tmp_path / "t.log")
    wait_for(lambda: (tmp_path / "r" / "run.lock").exists() and (tmp_path / "r" / "run.lock").read_text(), proc,
             "the run's lock")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=300) == 143
    line = last_line((tmp_path / "t.log").read_text())
    assert line.startswith("stopped by SIGTERM before the first checkpoint; start again with: "), line
    assert shlex.split(line.split("start again with: ")[1])[2:] == flags
    assert not (tmp_path / "r" / "checkpoints").exists()


# ----- a full disk during the final save, in-process ---------------------------------------------------------------


def test_a_full_disk_during_the_final_save_removes_the_temporary_folder_and_keeps_the_old_one(tiny, tmp_path):
    from qurl_mini.actor import load_actor

    actor, tokenizer = load_actor(tiny)
    final = str(tmp_path / "final")
    checkpoint.save_model(final, actor, tokenizer)
    before = sorted(os.listdir(final))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (50_000, hard))  # the weights file is ~180 kB
    try:
        with pytest.raises(checkpoint.DiskFullError) as e:
            checkpoint.save_model(final, actor, tokenizer)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert re.match(rf"disk full writing {re.escape(final)}: it needs about 0\.\d MiB, ", str(e.value)), str(e.value)
    assert os.listdir(tmp_path) == ["final"] and sorted(os.listdir(final)) == before
    assert checkpoint.safetensors_problem(os.path.join(final, "model.safetensors")) is None


# ----- broken paths: the same line from train.py, eval.py and quantize.py -----------------------------------------


@pytest.fixture
def read_only_dir(tmp_path):
    """A folder this process cannot write into: chmod for a user; for root (which chmod does not stop),
    a read-only tmpfs where mounting is allowed."""
    path = tmp_path / "ro"
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        yield path
        path.chmod(0o755)
        return
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=16k", "tmpfs", str(path)],
                      capture_output=True).returncode != 0:
        pytest.skip("running as root without permission to mount a read-only tmpfs: no folder root cannot write")
    yield path
    subprocess.run(["umount", str(path)], check=True)


def broken_model(tiny, tmp_path, fault):
    folder = shutil.copytree(tiny, tmp_path / fault)
    if fault == "no-weights":  # a half-copied download: config and tokenizer, no weights
        os.remove(folder / "model.safetensors")
    elif fault == "no-config":
        os.remove(folder / "config.json")
    elif fault == "bad-tokenizer":
        (folder / "tokenizer.json").write_text('{"version": "1.0", "trunc')
    return str(folder)


SCRIPTS = {  # script: (main, flags with MODEL and OUT, what OUT is)
    "train.py": (train.main, ["--model", "MODEL", "--data", "DATA", "--out-dir", "OUT", "--run-name", "r"], "dir"),
    "eval.py": (eval_script.main, ["--model", "MODEL", "--data", "DATA", "--eval-size", "4", "--out", "OUT"], "file"),
    "quantize.py": (quantize.main, ["--model", "MODEL", "--fmt", "int8", "--out", "OUT"], "dir"),
}


def run_script(script, model, out, data_file, capfd):
    main, flags, _ = SCRIPTS[script]
    flags = [{"MODEL": model, "OUT": str(out), "DATA": data_file}.get(f, f) for f in flags]
    code = main(flags)
    return code, last_line(capfd.readouterr().err)


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("fault, message", [
    ("no-weights", "no weights (*.safetensors or pytorch_model*.bin); a half-copied download?"),
    ("no-config", "no config.json, so not a model folder"),
    ("bad-tokenizer", "the tokenizer cannot be read ("),
])
def test_a_broken_model_folder_is_one_line_in_every_script(script, fault, message, tiny, data_file, tmp_path,
                                                           capfd):
    model = broken_model(tiny, tmp_path, fault)
    out = tmp_path / "out" / ("r.json" if SCRIPTS[script][2] == "file" else "o")
    (tmp_path / "out").mkdir()
    code, line = run_script(script, model, out, data_file, capfd)
    assert code == 2 and line.startswith(f"error: --model {model}: {message}"), line


@pytest.mark.parametrize("script", SCRIPTS)
def test_an_output_path_that_is_a_file_or_a_folder_is_one_line_in_every_script(script, tiny, data_file, tmp_path,
                                                                                capfd):
    wants_file = SCRIPTS[script][2] == "file"
    out = tmp_path / "taken"
    out.mkdir() if wants_file else out.write_text("")
    code, line = run_script(script, tiny, out, data_file, capfd)
    flag = "--out-dir" if script == "train.py" else "--out"
    shown = out / "r" if script == "train.py" else out  # train.py writes into --out-dir/--run-name
    what = "is a folder, not a file" if wants_file else "is a file, not a folder"
    assert code == 2 and line == f"error: {flag} {shown}: {'' if shown == out else f'{out} '}{what}", line


@pytest.mark.parametrize("script", SCRIPTS)
def test_an_output_path_that_is_not_writable_is_one_line_in_every_script(script, tiny, data_file, read_only_dir,
                                                                         capfd):
    out = read_only_dir / ("r.json" if SCRIPTS[script][2] == "file" else "o")
    code, line = run_script(script, tiny, out, data_file, capfd)
    flag = "--out-dir" if script == "train.py" else "--out"
    shown = out / "r" if script == "train.py" else out
    assert code == 2 and line == f"error: {flag} {shown}: {read_only_dir} is not writable", line


WARM_START_SCRIPT = """
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(message)s")
from qurl_mini.data import synthetic_splits
from qurl_mini.embedded import warm_start
train, _ = synthetic_splits(64, 0, 20)
print("DIR", warm_start(sys.argv[1], train, steps=10, lr=1e-3, teacher_slip=0.5))
"""


def test_two_runs_starting_together_build_the_warm_start_once(tmp_path):
    """make contrast starts two runs at once on a fresh clone: the second waits for the first's warm start
    and reuses it (before, both wrote the same .tmp folder and one crashed on the rename)."""
    cache = tmp_path / "cache"
    procs = [subprocess.Popen([sys.executable, "-c", WARM_START_SCRIPT, str(cache)], cwd=REPO, env=ENV, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for _ in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    built = [o for o in outs if re.search(r"warm start: .*cached in", o)]
    reused = [o for o in outs if "warm start: reusing" in o]
    assert len(built) == 1 and len(reused) == 1, outs
    dirs = {line.split()[1] for o in outs for line in o.splitlines() if line.startswith("DIR ")}
    (model_dir,) = dirs
    assert os.path.isfile(os.path.join(model_dir, "model.safetensors"))
    assert not [p.name for p in cache.iterdir() if p.name.endswith(".tmp")]
    assert not [p.name for p in cache.iterdir() if ".tmp" in p.name]  # written_atomically's .tmp<pid> too


def _folder_bytes(folder) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.mark.parametrize("script", SCRIPTS)
def test_no_script_writes_over_its_own_input_model(script, tiny, data_file, tmp_path, capfd):
    """--out (or the run folder) that is, or sits inside, the model folder: one line, exit 2, the model's bytes
    untouched (quantize.py --out = --model used to replace the float32 model with its INT8 checkpoint)."""
    model = tmp_path / "runs" / "r" / "final"
    shutil.copytree(tiny, model)
    before = _folder_bytes(model)
    out = {"train.py": tmp_path / "runs", "eval.py": model / "results.json", "quantize.py": model}[script]
    code, line = run_script(script, str(model), out, data_file, capfd)
    assert code == 2 and "the command would write over its own input; choose another output" in line, line
    assert _folder_bytes(model) == before and sorted(os.listdir(model)) == sorted(before)


def test_a_checkpoint_copied_in_half_is_skipped_for_the_newest_complete_one(resumed, tmp_path):
    copy = tmp_path / "r"
    shutil.copytree(resumed.run_dir, copy)
    older, newest = checkpoint.complete_checkpoints(str(copy))[-2:]
    for weights in glob.glob(os.path.join(newest, "actor", "*.safetensors")):
        os.remove(weights)  # the marker and every other file are there
    found, skipped = checkpoint.newest_loadable(str(copy))
    assert found == older and skipped == [(newest, "actor/ has no weights (copied in half?)")]
    os.remove(os.path.join(older, "rng.safetensors"))
    found, skipped = checkpoint.newest_loadable(str(copy))
    assert skipped[-1] == (older, "rng.safetensors is missing (copied in half?)")


def test_resume_as_another_algo_or_from_another_models_run_is_one_line(resumed, tiny, data_file, tmp_path, capfd):
    copy = tmp_path / "r"
    shutil.copytree(resumed.run_dir, copy)
    flags = tiny_flags(tiny, data_file, tmp_path, "--steps", "12", "--resume")
    assert train.main([*flags, "--algo", "ppo"]) == 2
    line = last_line(capfd.readouterr().err)
    assert line.startswith("error: --resume ") and line.endswith(
        "a --algo grpo run's checkpoint, and this run is --algo ppo; resume with --algo grpo or start a new run"), line
    other = build_tiny_model(str(tmp_path / "other"), layers=1, hidden=128, heads=2, kv_heads=1)
    flags = tiny_flags(other, data_file, tmp_path, "--steps", "12", "--resume")
    assert train.main(flags) == 2
    line = last_line(capfd.readouterr().err)
    assert line.startswith("error: --resume ") and "(hidden_size 64) is not this run's" in line, line


@pytest.mark.parametrize("script", ["train.py", "eval.py"])
def test_a_quantized_checkpoint_as_model_is_one_line(script, tiny, data_file, tmp_path, capfd):
    int8 = tmp_path / "int8"
    assert quantize.main(["--model", tiny, "--fmt", "int8", "--out", str(int8)]) == 0
    capfd.readouterr()
    (tmp_path / "out").mkdir()
    code, line = run_script(script, str(int8), tmp_path / "out" / "o", data_file, capfd)
    assert code == 2 and "a compressed-tensors checkpoint (quantize.py's W8A8 output)" in line, line


def test_a_trackers_folder_taken_by_a_file_is_one_line(tiny, data_file, tmp_path, capfd):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "tensorboard").write_text("not a folder")
    code = train.main(tiny_flags(tiny, data_file, tmp_path, "--steps", "1", "--report-to", "tensorboard"))
    line = last_line(capfd.readouterr().err)
    assert code == 2 and line.endswith("tensorboard is a file, where the tracker writes its folder; move it away"), line
    assert (tmp_path / "r" / "tensorboard").read_text() == "not a folder"
