"""The embedded model on real text (issue #10, item 5): a tokenizer with byte fallback, 2048 positions,
a warm start on the data's own solutions (no synthetic teacher slip), and a 2-step run on real GSM8K."""
import json
import os
import re
import subprocess
import sys

import pytest

from qurl_mini.config import Config, ConfigError
from qurl_mini.data import load_problems
from qurl_mini.embedded import (BYTE_TOKENS, CHARS, EMBEDDED_VARIANTS, build_byte_fallback_tokenizer,
                                warm_start_key, warm_start_settings)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GSM8K = os.path.join(REPO, "..", "shared", "data", "gsm8k")
TRAIN, TEST = os.path.join(GSM8K, "train.jsonl"), os.path.join(GSM8K, "test.jsonl")
needs_gsm8k = pytest.mark.skipif(not os.path.isfile(TRAIN), reason="../shared/data/gsm8k is not on this machine")


def gsm8k_rows():
    rows = []
    for path in (TRAIN, TEST):
        with open(path) as f:
            rows += [json.loads(line) for line in f]
    return rows


@needs_gsm8k
def test_byte_fallback_tokenizer_round_trips_every_gsm8k_row():
    tok = build_byte_fallback_tokenizer()
    rows = gsm8k_rows()
    assert len(rows) == 8792
    longest = 0
    for row in rows:
        text = f"Q: {row['question']}\nA: {row['answer']}"
        ids = tok.encode(text)
        assert tok.unk_token_id not in ids
        assert tok.decode(ids) == text
        longest = max(longest, len(ids))
    # GSM8K needs more than the synthetic variant's 256 positions, and fits the text variant's
    assert EMBEDDED_VARIANTS["synthetic"].max_positions < longest < EMBEDDED_VARIANTS["text"].max_positions


def test_byte_fallback_ids_are_characters_then_utf8_bytes():
    tok = build_byte_fallback_tokenizer()
    byte_id = {b: tok.convert_tokens_to_ids(t) for b, t in enumerate(BYTE_TOKENS)}
    assert [tok.convert_tokens_to_ids(c) for c in "A7+"] == [3 + CHARS.index(c) for c in "A7+"]
    for text in ("\u20ac", "\t", "\r", "\U0001F600", "\u65e5\u672c", "\xa0"):  # euro, tab, CR, emoji, CJK, nbsp
        assert tok.encode(text) == [byte_id[b] for b in text.encode("utf-8")]
    odd = "tab\there\r\n\u20ac 3\u00d74 \U0001F600 <0x41> caf\u00e9"
    assert tok.decode(tok.encode(odd)) == odd  # a literal '<0x41>' stays text: characters, not a byte token
    assert len(tok) <= EMBEDDED_VARIANTS["text"].vocab_size


def test_the_synthetic_warm_start_is_unchanged():
    """The demo's and the replay's starting model (docs/results/replay.json names this cache key)."""
    cfg = Config()
    train, _ = load_problems(cfg.data, cfg.test_data, cfg.eval_size, cfg.seed, cfg.max_number)
    settings = warm_start_settings("synthetic", train, steps=EMBEDDED_VARIANTS["synthetic"].sft_steps,
                                   batch_size=EMBEDDED_VARIANTS["synthetic"].sft_batch_size, lr=cfg.sft_lr,
                                   teacher_slip=cfg.teacher_slip)
    assert cfg.teacher_slip == 0.55
    assert warm_start_key(settings) == "19737ebe26"


def test_the_default_warm_start_is_the_shipped_bytes_on_every_machine(tmp_path, monkeypatch, caplog):
    """No SFT runs for the default settings: the cache holds the shipped file (its sha256 pinned), the model
    loads, and a cache of other bytes under the same key (an SFT made on this machine before) is replaced."""
    from qurl_mini import embedded
    from qurl_mini.actor import load_actor
    from qurl_mini.base_model import base_model_path
    from qurl_mini.named_models import weights_hash

    monkeypatch.setattr(embedded, "sft", lambda *a, **k: pytest.fail("the shipped warm start was trained again"))
    cfg = Config(cache_dir=str(tmp_path))
    train, _ = load_problems(cfg.data, cfg.test_data, cfg.eval_size, cfg.seed, cfg.max_number)
    folder = base_model_path(cfg, train)
    weights = os.path.join(folder, "model.safetensors")
    name, sha = embedded.SHIPPED_WARM_STARTS["19737ebe26"]
    assert folder.endswith("embedded-sft-19737ebe26") and embedded.file_sha256(weights) == sha
    assert embedded.file_sha256(os.path.join(embedded.ASSETS, name)) == sha
    assert weights_hash(folder) == "44c033a1dc805494"  # what every summary.json of a toy run records
    actor, tokenizer = load_actor(folder)
    assert sum(p.numel() for p in actor.parameters()) == pytest.approx(1.6e6, rel=0.01)
    assert tokenizer.decode(tokenizer.encode("7+3=10")) == "7+3=10"

    with open(weights, "r+b") as f:  # other bytes under the key: an old machine-made SFT
        f.seek(-4, os.SEEK_END)
        f.write(b"\0\0\0\0")
    assert embedded.file_sha256(weights) != sha
    assert base_model_path(cfg, train) == folder
    assert embedded.file_sha256(weights) == sha


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_a_missing_or_damaged_shipped_warm_start_is_one_line_naming_the_file(tmp_path, monkeypatch, damage):
    import shutil

    from qurl_mini import embedded
    from qurl_mini.base_model import base_model_path
    from qurl_mini.infra.paths import ModelError

    assets = tmp_path / "assets"
    assets.mkdir()
    if damage == "truncated":  # a half-copied checkout
        name = embedded.SHIPPED_WARM_STARTS["19737ebe26"][0]
        shutil.copyfile(os.path.join(embedded.ASSETS, name), assets / name)
        with open(assets / name, "r+b") as f:
            f.truncate(1000)
    monkeypatch.setattr(embedded, "ASSETS", str(assets))
    monkeypatch.setattr(embedded, "sft", lambda *a, **k: pytest.fail("no SFT in place of the shipped warm start"))
    cfg = Config(cache_dir=str(tmp_path / "cache"))
    train, _ = load_problems(cfg.data, cfg.test_data, cfg.eval_size, cfg.seed, cfg.max_number)
    with pytest.raises(ModelError, match="the shipped warm start .*embedded-sft-19737ebe26.safetensors is "
                                         + ("missing" if damage == "missing" else "damaged")) as e:
        base_model_path(cfg, train)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "cache" / "embedded-sft-19737ebe26").exists()  # nothing half-written left behind


def test_teacher_slip_belongs_to_the_synthetic_task():
    assert Config(data=TRAIN).teacher_slip is None
    with pytest.raises(ConfigError, match="--teacher-slip belongs to the synthetic task"):
        Config(data=TRAIN, teacher_slip=0.3)
    assert not EMBEDDED_VARIANTS["text"].teacher_slips


def _run(cmd, timeout=900):
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "COLUMNS": "400"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.slow
@needs_gsm8k
def test_two_steps_on_real_gsm8k_with_the_embedded_model(tmp_path, capfd):
    """The plumbing on real text: warm start without the slip, INT8 rollout of prompts longer than 256
    tokens, 2 RL steps, the sync probe, then eval.py through vLLM on the run's held-out problems."""
    cache, runs = tmp_path / "cache", tmp_path / "runs"
    proc = _run([sys.executable, "train.py", "--data", TRAIN, "--test-data", TEST, "--steps", "2",
                 "--quant", "int8", "--sft-steps", "2", "--prompts-per-step", "8", "--group-size", "2",
                 "--eval-size", "16", "--max-new-tokens", "16", "--cache-dir", str(cache), "--out-dir", str(runs)])
    log_text = proc.stdout + proc.stderr
    warm_lines = [line for line in log_text.splitlines() if re.search(r"INFO\s+warm start:", line)]
    assert len(warm_lines) == 1, warm_lines
    assert "byte fallback, 2048 positions" in warm_lines[0] and "no teacher slip" in warm_lines[0]
    assert "7473 train.jsonl problems" in warm_lines[0]
    (model_dir,) = [p for p in cache.iterdir() if p.is_dir() and p.name.startswith("embedded-sft-")]
    settings = json.loads((model_dir / "sft_settings.json").read_text())
    assert settings["teacher_slip"] == 0.0 and settings["variant"] == "text"
    assert "Natalia sold clips" in log_text  # the first training prompt, printed as the model sees it
    assert "dropped" not in log_text  # no prompt was too long for the engine

    run_dir = runs / "grpo-int8-acr"
    with open(run_dir / "metrics.jsonl") as f:
        steps = [json.loads(line) for line in f if '"step"' in line]
    assert [s["step"] for s in steps if "policy_loss" in s] == [1, 2]
    first = next(s for s in steps if s["step"] == 1)
    assert first["sync_probe_gap"] < 0.05 and first["response_len"] > 0

    out = tmp_path / "eval.json"
    import eval as eval_script  # in this process: its vLLM import is paid already

    assert eval_script.main(["--run", str(run_dir), "--out", str(out)]) == 0, capfd.readouterr().err[-3000:]
    results = json.loads(out.read_text())
    assert os.path.realpath(results["settings"]["test_data"]) == os.path.realpath(TEST)  # the run's own test file
    assert [m["n_problems"] for m in results["models"].values()] == [16, 16]
    assert all(0.0 <= m["avg@1"] <= 1.0 for m in results["models"].values())
