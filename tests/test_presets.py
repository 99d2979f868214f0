"""Presets as data, --dry-run's memory plan, and lengths that do not fit the model."""
import json
import os
import subprocess
import sys

import pytest

import train
from qurl_mini.config import load_preset, parse_args, presets
from qurl_mini.infra.memory import KNOWN_SHAPES, memory_plan

PEAK = "peak (resident + max(rollout, update); sleep frees the engine)"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_preset_parses_and_flags_given_still_win():
    assert {"gsm8k-ppo-qwen2.5-0.5b", "gsm8k-grpo-quick", "dapo-qwen2.5-math-7b"} <= set(presets())
    for name in presets():
        parse_args(["--preset", name])  # every key is a flag with a valid value
    cfg = parse_args(["--preset", "gsm8k-ppo-qwen2.5-0.5b", "--quant", "fp8", "--steps", "3"])
    assert (cfg.algo, cfg.quant, cfg.steps, cfg.prompts_per_step, cfg.max_new_tokens, cfg.lr) == \
        ("ppo", "fp8", 3, 256, 512, 1e-5)
    assert cfg.objective == "acr" and parse_args(["--preset", "gsm8k-ppo-qwen2.5-0.5b", "--quant", "none"]).objective == "ppo"
    dapo = parse_args(["--preset", "dapo-qwen2.5-math-7b"])
    assert (dapo.clip_low, dapo.clip_high, dapo.kl_coef, dapo.group_size, dapo.prompts_per_step) == (0.2, 0.28, 0.0, 16, 512)


def test_the_table1_preset_is_the_papers_run():
    values = load_preset("gsm8k-ppo-qwen2.5-0.5b")
    assert values["model"] == "Qwen/Qwen2.5-0.5B-Instruct" and values["steps"] == 435
    assert 15 * (7473 // values["prompts_per_step"]) == 435 and values["eval_size"] == 1319  # 15 epochs of full batches


def test_dry_run_prints_config_and_memory_plan_without_loading_anything():
    proc = subprocess.run([sys.executable, "train.py", "--preset", "gsm8k-ppo-qwen2.5-0.5b", "--dry-run"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert '"model": "Qwen/Qwen2.5-0.5B-Instruct"' in proc.stdout and "memory estimate (GiB" in proc.stdout
    assert "actor (fp32 weights + grads + AdamW)" in proc.stdout and "fits one 80 GiB GPU" in proc.stdout
    assert "vllm" not in proc.stderr.lower()  # no engine started


def test_memory_plan_parts_follow_from_the_sizes():
    shape = KNOWN_SHAPES["Qwen/Qwen2.5-0.5B-Instruct"]
    assert 0.49e9 < shape.params < 0.50e9  # Qwen2.5-0.5B: 494M parameters (without biases)
    cfg = parse_args(["--preset", "gsm8k-ppo-qwen2.5-0.5b"])
    plan = memory_plan(cfg, shape)
    assert plan["actor (fp32 weights + grads + AdamW)"] == pytest.approx(16 * shape.params / 2**30)
    assert plan["reference (bf16, frozen; none when --kl-coef 0)"] == pytest.approx(2 * shape.params / 2**30)
    assert plan["fits one 80 GiB GPU"]
    monitor = next(v for k, v in plan.items() if k.startswith("weight monitor"))
    linear = 24 * (896 * 64 * (2 * 14 + 2 * 2) + 3 * 896 * 4864)  # q, k, v, o and gate, up, down of 24 layers
    assert monitor == pytest.approx(5 * linear / 2**30) and 1.6 < monitor < 1.7  # fp32 copy + int8 codes
    none = memory_plan(parse_args(["--preset", "gsm8k-ppo-qwen2.5-0.5b", "--quant", "none"]), shape)
    assert next(v for k, v in none.items() if k.startswith("weight monitor")) == 0.0
    assert plan[PEAK] == pytest.approx(none[PEAK] + monitor)
    activations = next(v for k, v in plan.items() if k.startswith("update: activations of one 16384-token"))
    per_token_layer = 16 * 896 + 8 * 4864 + 4 * 2 * 64  # bf16 autocast, fp32 norm inputs (memory.py)
    assert activations == pytest.approx(16384 * 24 * per_token_layer / 2**30)
    checkpointed = memory_plan(parse_args(["--preset", "gsm8k-ppo-qwen2.5-0.5b", "--gradient-checkpointing"]), shape)
    kept = next(v for k, v in checkpointed.items() if "gradient checkpointing" in k)
    assert kept == pytest.approx(16384 * (24 * 4 * 896 + per_token_layer) / 2**30) and kept < activations / 9
    dapo = memory_plan(parse_args(["--preset", "dapo-qwen2.5-math-7b"]), KNOWN_SHAPES["Qwen/Qwen2.5-Math-7B"])
    assert not dapo["fits one 80 GiB GPU"]  # the preset's note says so: it belongs on a distributed engine


def test_bad_presets_get_one_line(tmp_path, capfd, monkeypatch):
    with pytest.raises(SystemExit):
        train.main(["--preset", "no-such"])
    assert "--preset 'no-such': no such preset" in capfd.readouterr().err.strip().splitlines()[-1]
    import qurl_mini.config as config

    (tmp_path / "typo.json").write_text(json.dumps({"stpes": 3}))
    monkeypatch.setattr(config, "PRESETS_DIR", str(tmp_path))
    with pytest.raises(SystemExit):
        train.main(["--preset", "typo"])
    assert "sets unknown flags ['stpes']" in capfd.readouterr().err


def test_real_problems_start_from_task_defaults_that_can_learn_and_the_console_names_them():
    """--data gsm8k (or a file) without a preset: responses long enough for a worked answer, the paper's lr range;
    the synthetic task keeps the toy's values; a preset or a flag given wins."""
    toy = parse_args([])
    assert (toy.max_new_tokens, toy.lr) == (24, 1e-4)  # the toy is unchanged
    real = parse_args(["--data", "problems.jsonl"])
    assert real.max_new_tokens >= 256 and real.lr <= 1e-5
    given = parse_args(["--data", "gsm8k", "--lr", "3e-6"])
    assert given.lr == 3e-6 and given.defaults_note().startswith("real problems (--data gsm8k): --max-new-tokens 512 (")
    assert parse_args(["--preset", "gsm8k-grpo-quick"]).defaults_note() is None  # the preset sets both
    proc = subprocess.run([sys.executable, "train.py", "--data", "gsm8k", "--model", "Qwen/Qwen2.5-0.5B-Instruct",
                           "--dry-run"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert '"max_new_tokens": 512' in proc.stdout and '"lr": 1e-06' in proc.stdout
    assert ("real problems (--data gsm8k): --max-new-tokens 512, --lr 1e-06 (task defaults; pass the flags to change "
            "them)") in proc.stdout.splitlines()


def test_a_preset_that_is_not_an_object_of_flags_is_one_line(tmp_path, monkeypatch):
    from qurl_mini import config

    monkeypatch.setattr(config, "PRESETS_DIR", str(tmp_path))
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "bytes.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(config.ConfigError, match=r"list.json holds a JSON list, not an object of flags$"):
        load_preset("list")
    with pytest.raises(config.ConfigError, match=r"bytes.json is not UTF-8 text \(byte 0\)$"):
        load_preset("bytes")
