"""eval.py: Avg@1 / Avg@k / pass@k through the vLLM engine, and its agreement with the trainer's
HF greedy evaluation on the same checkpoint and problems (float32 engine: almost exact; bfloat16:
within bf16 noise). The slow tests reuse the embedded warm start cached in REPO/.cache."""
import json
import os
import shutil

import pytest

import eval as eval_script
from qurl_mini.data import load_problems
from qurl_mini.embedded import build_tiny_model
from qurl_mini.evaluate import avg_at_k, mean_pass_at_k, pass_at_k, pass_at_ks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(REPO, ".cache")  # the warm start tests/test_e2e.py and the demo use: built once
N_PROBLEMS, MAX_NEW_TOKENS = 200, 24  # the trainer's defaults (--eval-size, --max-new-tokens)


def run_eval(args, capfd):
    """(exit code, stdout, stderr) of eval.py with these flags."""
    try:
        code = eval_script.main(args)
    except SystemExit as e:  # argparse
        code = e.code
    out, err = capfd.readouterr()
    return code, out, err


# ----- the metrics -----------------------------------------------------------------------------


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)  # pass@1 = share correct
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(8, 0, 4) == 0.0 and pass_at_k(8, 5, 4) == 1.0  # n - c < k: a correct one is always drawn
    assert [pass_at_k(4, c, 4) for c in range(5)] == [0.0, 1.0, 1.0, 1.0, 1.0]  # k = n: any correct
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_avg_and_pass_at_k_over_problems():
    correct = [[True, False, False, False], [False] * 4, [True] * 4]
    assert avg_at_k(correct) == pytest.approx(5 / 12)
    assert mean_pass_at_k(correct, 1) == pytest.approx(avg_at_k(correct))  # pass@1 = Avg@k
    assert mean_pass_at_k(correct, 4) == pytest.approx(2 / 3)
    assert pass_at_ks(32) == [1, 2, 4, 8, 16, 32] and pass_at_ks(6) == [1, 2, 4, 6] and pass_at_ks(1) == [1]


def test_max_model_len_fits_the_longest_prompt_and_the_response():
    """One helper sizes the engine for the trainer and for eval.py, and refuses what cannot fit."""
    from qurl_mini.engine import ContextError, context_length

    assert context_length(40, 24, positions=256) == 128  # 40 + 24 + 8 spare = 72, up to a power of two
    assert context_length(40, 24, positions=None) == 128
    assert context_length(40, 180, positions=256) == 256  # capped at the model's context
    with pytest.raises(ContextError, match="need 340 positions, more than the model's context of 256"):
        context_length(40, 300, positions=256)


# ----- bad input: one line, exit 2 -------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny")), layers=1, hidden=64, heads=2, kv_heads=1)


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    (root / "unfinished").mkdir()
    (root / "broken").mkdir()
    (root / "broken" / "summary.json").write_text("{not json")
    (root / "partial").mkdir()
    (root / "partial" / "summary.json").write_text(json.dumps({"final_test_accuracy": 0.5}))
    (root / "gone").mkdir()
    (root / "gone" / "summary.json").write_text(json.dumps({
        "base_model": str(root / "no-such-model"), "final_model": str(root / "gone" / "final"),
        "config": {"data": "synthetic", "test_data": None, "seed": 0, "max_number": 10, "max_new_tokens": 24,
                   "eval_size": 20, "out_dir": str(root), "run_name": "gone"}}))
    return root


@pytest.mark.parametrize("flags, message", [
    ([], "give --model DIR [DIR ...] or --run RUN_DIR"),
    (["--model", "./no-such-folder"], "--model ./no-such-folder: no such folder"),
    (["--model", "TINY", "--k", "0"], "--k must be >= 1, got 0"),
    (["--model", "TINY", "--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
    (["--model", "TINY", "--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
    (["--model", "TINY", "--temperature", "-1"], "--temperature must be >= 0 (0 = greedy), got -1.0"),
    (["--model", "TINY", "--temperature", "nan"], "--temperature must be >= 0 (0 = greedy), got nan"),
    (["--model", "TINY", "--eval-size", "0"], "--eval-size must be >= 1"),
    (["--model", "TINY", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--model", "TINY", "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1)"),
    (["--model", "TINY", "--out", "/no/such/dir/r.json"], "--out /no/such/dir/r.json: no such folder"),
    (["--model", "TINY", "--quant", "int1"], "argument --quant: invalid choice: 'int1'"),
    (["--model", "TINY", "--quant", "int3", "--quant-group", "-4"], "--quant-group must be >= 0 (0 = one scale per "
                                                                      "output channel), got -4"),
    (["--model", "TINY", "--quant", "int8", "--quant-group", "32"], "--quant int8 is vLLM's W8A8 kernel"),
    (["--model", "TINY", "--k", "four"], "argument --k: invalid int value: 'four'"),
    (["--run", "RUNS/missing"], "--run RUNS/missing: no such folder"),
    (["--run", "RUNS/unfinished"], "--run RUNS/unfinished: no summary.json (has the run finished?)"),
    (["--run", "RUNS/broken"], "--run RUNS/broken: summary.json is not JSON"),
    (["--run", "RUNS/partial"], "--run RUNS/partial: summary.json lacks 'config'"),
    (["--run", "RUNS/gone"], "no such folder (named in --run RUNS/gone/summary.json)"),
    (["--model", "TINY", "--max-new-tokens", "300"], "more than the model's context of 256"),
])
def test_bad_input_is_one_line_and_exit_2(flags, message, tiny, bad_runs, capfd):
    flags = [f.replace("TINY", tiny).replace("RUNS", str(bad_runs)) for f in flags]
    code, _, err = run_eval(flags, capfd)
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert message.replace("RUNS", str(bad_runs)) in lines[-1], err


def test_a_runs_data_files_are_found_from_where_train_py_ran(tmp_path, monkeypatch):
    from qurl_mini.evaluate import read_run

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "t.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n')
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({
        "base_model": "m", "final_model": "runs/r/final",
        "config": {"data": "data/t.jsonl", "test_data": "data/t.jsonl", "seed": 0, "max_number": 10,
                   "max_new_tokens": 8, "eval_size": 4, "out_dir": "runs", "run_name": "r"}}))
    monkeypatch.chdir(tmp_path / "data")  # not where train.py ran (tmp_path), where its paths hold
    settings, _ = read_run(str(run))
    assert settings["data"] == settings["test_data"] == str(tmp_path / "data" / "t.jsonl")


# ----- the engine against the trainer's HF greedy evaluation (slow: vLLM engines) -----------------


@pytest.fixture(scope="module")
def warm_start():
    """The embedded SFT warm start (~37% greedy accuracy): train.py's own, from the shared cache."""
    from qurl_mini.config import Config
    from qurl_mini.base_model import base_model_path

    cfg = Config(cache_dir=CACHE)
    train, _ = load_problems(cfg.data, cfg.test_data, cfg.eval_size, cfg.seed, cfg.max_number)
    return base_model_path(cfg, train)


@pytest.fixture(scope="module")
def hf_greedy(warm_start):
    """What the trainer's periodic evaluation computes: HF greedy, fp32 actor, on its held-out problems."""
    from qurl_mini.actor import load_actor
    from qurl_mini.evaluate import greedy_accuracy

    _, test = load_problems("synthetic", None, N_PROBLEMS, 0, 10)
    actor, tokenizer = load_actor(warm_start)
    accuracy, results = greedy_accuracy(actor, tokenizer, test, MAX_NEW_TOKENS)
    return test, accuracy, results


@pytest.mark.slow
@pytest.mark.parametrize("dtype, min_agreement, max_gap", [("float32", 0.99, 0.01), ("bfloat16", 0.90, 0.04)])
def test_engine_avg1_matches_the_trainers_greedy_accuracy(warm_start, hf_greedy, dtype, min_agreement, max_gap):
    from qurl_mini.actor import load_actor
    from qurl_mini.evaluate import engine_samples, free_engine, start_engine

    test, hf_accuracy, hf_results = hf_greedy
    assert 0.2 <= hf_accuracy <= 0.8  # a model with a non-trivial accuracy, or agreement means little
    actor, tokenizer = load_actor(warm_start)
    engine = start_engine(actor, tokenizer, test, MAX_NEW_TOKENS, dtype=dtype)
    try:
        greedy = engine_samples(engine, tokenizer, test, MAX_NEW_TOKENS)  # the shape of greedy_accuracy's results:
        accuracy = greedy.accuracy
        results = [(p.question, r[0], c[0]) for p, r, c in zip(test, greedy.responses, greedy.correct)]
        if dtype == "float32":  # top_p reaches the sampler: a tiny nucleus is the argmax token, i.e. greedy
            nucleus = engine_samples(engine, tokenizer, test[:20], MAX_NEW_TOKENS, n=3, temperature=1.0, top_p=1e-6)
            assert nucleus.responses == [[r[1]] * 3 for r in results[:20]]
    finally:
        free_engine(engine)
        del engine
    same_response = sum(a[1] == b[1] for a, b in zip(hf_results, results)) / len(test)
    same_verdict = sum(a[2] == b[2] for a, b in zip(hf_results, results)) / len(test)
    print(f"{dtype} engine: Avg@1 {accuracy:.3f} vs HF greedy {hf_accuracy:.3f}; same response "
          f"{same_response:.1%}, same verdict {same_verdict:.1%}")
    assert same_response >= min_agreement
    assert abs(accuracy - hf_accuracy) <= max_gap


@pytest.mark.slow
def test_eval_run_folder_reports_avg1_avgk_passk_and_json(warm_start, hf_greedy, tmp_path, capfd, monkeypatch):
    """--run on a train.py-style run folder whose paths are relative to where train.py ran (not here);
    its start and final models are the same weights, so both agree with the HF greedy numbers."""
    test, _, hf_results = hf_greedy
    n = 60
    hf_accuracy = sum(r[2] for r in hf_results[:n]) / n  # the held-out set is a prefix of the pool
    project = tmp_path / "project"
    run_dir = project / "runs" / "r"
    run_dir.mkdir(parents=True)
    shutil.copytree(warm_start, run_dir / "final")
    summary = {"base_model": os.path.relpath(warm_start, project), "final_model": "runs/r/final",
               "initial_test_accuracy": hf_accuracy, "final_test_accuracy": hf_accuracy,
               "config": {"data": "synthetic", "test_data": None, "seed": 0, "max_number": 10,
                          "max_new_tokens": MAX_NEW_TOKENS, "eval_size": n, "temperature": 1.0,
                          "engine_dtype": "float32", "out_dir": "runs", "run_name": "r"}}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    monkeypatch.chdir(tmp_path)
    code, out, err = run_eval(["--run", "project/runs/r", "--k", "4", "--out", "results.json"], capfd)
    assert code == 0, err[-3000:]
    assert "Traceback" not in err
    assert "Avg@4" in out and "pass@4" in out and "train.py greedy (HF)" in out

    results = json.loads((tmp_path / "results.json").read_text())
    settings = results["settings"]
    assert settings["n_problems"] == n and settings["k"] == 4 and settings["temperature"] == 1.0
    assert settings["engine_dtype"] == "float32"  # the run's
    models = results["models"]
    assert len(models) == 2
    for path, r in models.items():
        assert os.path.isdir(path)
        assert r["engine_format"] == "unquantized" and r["engine_dtype"] == "float32" and r["n_problems"] == n
        assert abs(r["avg@1"] - hf_accuracy) <= 0.01, (path, r["avg@1"], hf_accuracy)
        assert 0 < r["avg@4"] <= r["pass@4"] <= 1
        assert r["pass@"]["1"] == pytest.approx(r["avg@4"])
        assert r["pass@"]["1"] <= r["pass@"]["2"] <= r["pass@"]["4"] == r["pass@4"]
        assert sum(r["greedy_correct"]) == round(n * r["avg@1"])
        assert sum(r["sampled_correct_counts"]) == round(4 * n * r["avg@4"])
        assert len(r["examples"]) == 3 and len(r["examples"][0]["samples"]) == 4
    start, final = models.values()
    assert start["greedy_correct"] == final["greedy_correct"]  # same weights, greedy: same answers


@pytest.mark.slow
def test_eval_int8_engine_is_what_the_quantized_sampler_produces(warm_start, hf_greedy, tmp_path, capfd):
    test, _, hf_results = hf_greedy
    n = 50
    hf_accuracy = sum(r[2] for r in hf_results[:n]) / n
    code, out, err = run_eval(["--model", warm_start, "--quant", "int8", "--eval-size", str(n), "--k", "2",
                               "--temperature", "0", "--out", str(tmp_path / "int8.json")], capfd)
    assert code == 0, err[-3000:]
    assert "--temperature 0 with --k 2" in out + err  # greedy samples are all alike: said, and not generated
    (r,) = json.loads((tmp_path / "int8.json").read_text())["models"].values()
    print(f"INT8 engine Avg@1 {r['avg@1']:.3f} vs HF fp32 greedy {hf_accuracy:.3f} on {n} problems")
    assert r["engine_format"] == "int8"
    assert r["avg@2"] == r["pass@2"] == r["avg@1"] and "sampled" not in r["time_s"]
    assert abs(r["avg@1"] - hf_accuracy) <= 0.15  # W8A8 moves a few answers, not the model
