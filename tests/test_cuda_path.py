"""The one-GPU path, checked without a GPU: the driver check, sleep mode only for the training engine, CUDA graphs
on by default, and the dtype W8A8 kernels need."""
import os
import subprocess
import sys

import pytest

from qurl_mini.engine import Platform, llm_kwargs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fake_nvidia_smi(folder, driver="535.104.05"):
    """An `nvidia-smi` that lists one H100 and reports an old driver."""
    path = folder / "nvidia-smi"
    path.write_text("#!/bin/sh\n"
                    'case "$*" in\n'
                    '  *-L*) echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0000)";;\n'
                    f'  *driver_version*) echo "{driver}";;\n'
                    "esac\n")
    path.chmod(0o755)
    return {**os.environ, "PATH": f"{folder}:{os.environ['PATH']}"}


def test_a_gpu_torch_cannot_use_stops_train_py_in_one_line_before_any_model_loads(tmp_path):
    import torch

    env = fake_nvidia_smi(tmp_path)
    proc = subprocess.run([sys.executable, "train.py", "--steps", "1", "--out-dir", str(tmp_path / "runs"),
                           "--cache-dir", str(tmp_path / "cache")], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: nvidia-smi lists 1 GPU(s)"), proc.stderr[-2000:]
    assert "535.104.05" in lines[0]  # the driver seen ...
    assert (">= 580" in lines[0]) if torch.version.cuda else ("CPU build" in lines[0])  # ... and what is needed
    assert not (tmp_path / "cache").exists()  # stopped before the warm start / any model


def test_eval_py_stops_on_it_too(tmp_path):
    env = fake_nvidia_smi(tmp_path)
    proc = subprocess.run([sys.executable, "eval.py", "--model", str(tmp_path / "absent"), "--eval-size", "2"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-2000:]


def test_only_the_training_engine_asks_vllm_for_sleep_mode():
    """vLLM's cumem allocator allows one sleep-mode engine per process: eval.py starts several in a row."""
    cuda = Platform(cuda=True, fp8_kernel=True)
    common = dict(dtype="bfloat16", seed=0, max_model_len=512)
    assert llm_kwargs("m", cuda, **common, sleep_mode=True)["enable_sleep_mode"] is True
    assert llm_kwargs("m", cuda, **common)["enable_sleep_mode"] is False  # the default: evaluation, checks
    assert "enable_sleep_mode" not in llm_kwargs("m", Platform(cuda=False, fp8_kernel=False), **common)
    trainer = open(os.path.join(REPO, "qurl_mini", "trainer.py")).read()
    assert trainer.count("sleep_mode=True") == 1
    for path in ("qurl_mini/evaluate.py", "quantize.py", "benchmarks/bench_rollout.py", "benchmarks/bench_batch.py"):
        assert "sleep_mode=True" not in open(os.path.join(REPO, path)).read(), path


def test_cuda_engines_run_with_cuda_graphs_unless_enforce_eager_and_cpu_engines_stay_eager():
    """vLLM's default compilation (CUDA graphs, torch.compile) on CUDA; --enforce-eager reaches every engine."""
    cuda, cpu = Platform(cuda=True, fp8_kernel=True), Platform(cuda=False, fp8_kernel=False)
    common = dict(dtype="bfloat16", seed=0, max_model_len=512)
    assert llm_kwargs("m", cuda, **common, sleep_mode=True)["enforce_eager"] is False  # the training engine
    assert llm_kwargs("m", cuda, **common)["enforce_eager"] is False  # evaluation, checks
    assert llm_kwargs("m", cuda, **common, enforce_eager=True)["enforce_eager"] is True
    assert llm_kwargs("m", cpu, **common)["enforce_eager"] is True
    from qurl_mini.config import parse_args

    assert parse_args([]).enforce_eager is False and parse_args(["--enforce-eager"]).enforce_eager is True
    for path in ("qurl_mini/trainer.py", "qurl_mini/evaluate.py"):  # the flag reaches the engines they start
        assert "enforce_eager=cfg.enforce_eager" in open(os.path.join(REPO, path)).read(), path


def test_a_float32_engine_with_a_w8a8_kernel_on_cuda_is_one_line():
    """vLLM's cutlass_scaled_mm asserts bf16/fp16 activations: an fp32 engine would end in its AssertionError."""
    from qurl_mini.quant import QuantError

    cuda = Platform(cuda=True, fp8_kernel=True)
    for fmt in ("int8", "fp8"):
        with pytest.raises(QuantError, match=f"--quant {fmt} with --engine-dtype float32: vLLM's W8A8 kernels on CUDA"):
            cuda.check_engine_dtype(fmt, "float32")
        cuda.check_engine_dtype(fmt, "bfloat16")
    cuda.check_engine_dtype("unquantized", "float32")  # an unquantized engine: any dtype
    Platform(cuda=True, fp8_kernel=False).check_engine_dtype("fp8-emulated", "float32")  # emulated: unquantized
    Platform(cuda=False, fp8_kernel=False).check_engine_dtype("int8", "float32")  # oneDNN on a CPU takes fp32
