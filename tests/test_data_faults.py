"""Data that is not there or not usable, and a hub that cannot be reached: real runs of train.py and eval.py.

Each fault ends in one line on stderr, exit 2, no traceback, before any model loads (the --cache-dir, where the
embedded warm start or a named model would be built, stays empty), and at once: no retry loop. A file with some
bad rows runs, and says how many it skipped and that its test set is smaller than --eval-size.
"""
import json
import os
import subprocess
import sys
import time

import pytest

from qurl_mini.embedded import build_tiny_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
HUB_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny")), layers=1, hidden=64, heads=2, kv_heads=1)


def write_rows(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def good(i):
    return {"question": f"{i}+1?", "answer": f"#### {i + 1}"}


def hub_env(tmp_path, how):
    """An empty hub cache, and the hub offline (the libraries' own switches) or closed (a port nobody listens
    on: the plain no-network case, on any machine)."""
    env = {k: v for k, v in os.environ.items() if k not in OFFLINE_VARS}
    env.update(HF_HOME=str(tmp_path / "hf-home"), COLUMNS="1000")
    if how == "offline":
        env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    else:
        env.update(HF_ENDPOINT="http://127.0.0.1:9")
    return env


def run(script, args, env=None, timeout=600):
    """(exit code, stderr, seconds, the log: stdout and stderr, one space between words) of a script in its own
    process."""
    t0 = time.time()
    proc = subprocess.run([sys.executable, os.path.join(REPO, script), *args], cwd=REPO, env=env or
                          dict(os.environ, COLUMNS="1000"), capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stderr, time.time() - t0, " ".join((proc.stdout + proc.stderr).split())


def one_error_line(err):
    """The one `error:` line, last on stderr, with no traceback before it."""
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert [line for line in lines if line.startswith("error:")] == lines[-1:], err[-3000:]
    return lines[-1]


def nothing_built(cache_dir):
    return not os.path.exists(cache_dir) or not os.listdir(cache_dir)


# ----- the hub cannot be reached ---------------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["offline", "closed"])
@pytest.mark.parametrize("script, args, starts, says", [
    pytest.param("train.py", ["--data", "gsm8k"], "error: --data gsm8k: openai/gsm8k cannot be fetched from the hub (",
                 "use local files instead: --data train.jsonl --test-data test.jsonl, one JSON object a line: "
                 '{"question": "...", "answer": "... #### <number>"}', id="train-data"),
    pytest.param("train.py", ["--model", HUB_MODEL], f"error: --model {HUB_MODEL}: no such folder, and as a hub id it "
                 "cannot be fetched (", "give a local model folder instead (config.json, *.safetensors and the "
                 "tokenizer's files)", id="train-model"),
    pytest.param("eval.py", ["--model", "TINY", "--data", "gsm8k"], "error: --data gsm8k: openai/gsm8k cannot be "
                 "fetched", "--data train.jsonl --test-data test.jsonl", id="eval-data"),
    pytest.param("eval.py", ["--model", HUB_MODEL], f"error: --model {HUB_MODEL}: no such folder, and as a hub id",
                 "give a local model folder instead", id="eval-model"),
])
def test_an_unreachable_hub_is_one_line_at_once_naming_the_local_alternative(script, args, starts, says, how, tiny,
                                                                             tmp_path):
    cache = str(tmp_path / "cache")
    args = [tiny if a == "TINY" else a for a in args] + ["--cache-dir", cache]
    if script == "train.py":
        args += ["--out-dir", str(tmp_path / "runs")]
    code, err, seconds, _ = run(script, args, hub_env(tmp_path, how))
    line = one_error_line(err)
    assert code == 2 and line.startswith(starts) and says in line, line
    if how == "offline":
        assert "HF_HUB_OFFLINE=1 and no copy in the local hub cache" in line, line
    else:  # one quick request said so, not the libraries' 5 retries with backoff (25 s and more)
        assert "http://127.0.0.1:9 does not answer" in line and "HF_HUB_OFFLINE=1 reads it" in line, line
    assert nothing_built(cache) and seconds < 60


# ----- data files whose rows cannot be used ----------------------------------------------------------------------

@pytest.mark.parametrize("flag", ["--data", "--test-data"])
def test_a_file_without_usable_rows_is_one_line_before_any_model_loads(flag, tmp_path):
    bad = write_rows(tmp_path / "bad.jsonl", [{"problem": "1+1?", "answer": "#### 2"}, {"question": None,
                                              "answer": "#### 3"}, {"question": "q", "answer": "no number"}])
    data = write_rows(tmp_path / "good.jsonl", [good(i) for i in range(20)])
    cache = str(tmp_path / "cache")  # the embedded model's warm start would be built here
    code, err, *_ = run("train.py", ["--data", bad if flag == "--data" else data,
                                    *(["--test-data", bad] if flag == "--test-data" else []),
                                    "--cache-dir", cache, "--out-dir", str(tmp_path / "runs")])
    line = one_error_line(err)
    assert code == 2 and line.startswith(f"error: {flag} {bad}: no usable rows (all 3 skipped, the first line 1: no "
                                         "'question' field (keys: problem, answer)); each row needs"), line
    assert nothing_built(cache) and not os.path.exists(tmp_path / "runs" / "r")


def test_eval_reads_its_problems_before_any_model(tmp_path):
    """eval.py checks --test-data before it builds a named model (with its package or without)."""
    bad = write_rows(tmp_path / "bad.jsonl", [{"question": "q", "answer": ""}])
    cache = str(tmp_path / "cache")
    code, err, *_ = run("eval.py", ["--model", "smollm2-135m", "--test-data", bad, "--cache-dir", cache])
    line = one_error_line(err)
    assert code == 2 and line.startswith(f"error: --test-data {bad}: no usable rows (all 1 skipped, the first line "
                                         "1: its answer is empty)"), line
    assert nothing_built(cache)


@pytest.mark.slow
def test_files_with_some_bad_rows_run_and_say_how_many_they_skipped(tiny, tmp_path, capfd, monkeypatch):
    data = write_rows(tmp_path / "train.jsonl", [good(i) for i in range(4)] + ["", {"question": "no answer"}] +
                      [good(i) for i in range(4, 20)] + [{"question": "q", "answer": "7"}])
    test = write_rows(tmp_path / "test.jsonl", [good(i) for i in range(30, 35)] + [["a", "list"]])
    out = tmp_path / "runs"
    code, err, _, log = run("train.py", ["--model", tiny, "--data", data, "--test-data", test, "--out-dir", str(out),
                                    "--run-name", "r", "--steps", "1", "--prompts-per-step", "2", "--group-size", "2",
                                    "--eval-size", "8", "--max-new-tokens", "8", "--sync-check-every", "0"])
    assert code == 0 and "Traceback" not in err, err[-3000:]
    assert (f"--data {data}: skipped 2 of 22 rows, 20 usable (first: line 6: no 'answer' field (keys: question))"
            in log), log[-3000:]
    assert f"--test-data {test}: skipped 1 of 6 rows, 5 usable (first: line 6: not a JSON object but list)" in log
    assert f"--test-data {test}: 5 test problems, fewer than --eval-size 8: evaluating on 5" in log
    summary = json.loads((out / "r" / "summary.json").read_text())
    assert summary["initial_test_accuracy"] is not None and summary["final_test_accuracy"] is not None

    results = tmp_path / "eval.json"
    import eval as eval_script  # in this process: its vLLM import is paid already

    monkeypatch.setenv("COLUMNS", "1000")  # the console's lines unwrapped, as run() has them
    capfd.readouterr()
    code = eval_script.main(["--model", str(out / "r" / "final"), "--test-data", test, "--eval-size", "8",
                             "--max-new-tokens", "8", "--out", str(results)])
    said = capfd.readouterr()
    err, log = said.err, " ".join((said.out + said.err).split())
    assert code == 0 and "Traceback" not in err, err[-3000:]
    assert f"--test-data {test}: skipped 1 of 6 rows" in log and "fewer than --eval-size 8: evaluating on 5" in log
    result = json.loads(results.read_text())
    assert result["settings"]["n_problems"] == 5 and [m["n_problems"] for m in result["models"].values()] == [5]
