"""Accuracy on held-out problems: greedy with the HF model (the trainer's periodic check), and
Avg@1 / Avg@k / pass@k through the vLLM `RolloutEngine` (eval.py: fast enough for GSM8K's 1,319
test problems x 512 tokens, or 32 samples per problem).

Both paths encode a prompt the way the trainer's rollout does (its `PromptBuilder`), decode without
special tokens and score with `data.reward` (exact '####' match), so on the same checkpoint they
differ only by the engine's arithmetic: a float32 engine agrees with HF fp32 greedy decoding
almost exactly, a bfloat16 one within bf16 noise (tests/test_eval.py).
"""
import contextlib
import gc
import math
import tempfile
from dataclasses import dataclass, field

import torch

from .data import Problem, reward
from .prompts import PromptBuilder


def prompt_builder(tokenizer, prompts: PromptBuilder | None = None) -> PromptBuilder:
    """The run's PromptBuilder (prompt ids as the trainer's rollout sends them), default --prompt-format auto."""
    return prompts or PromptBuilder("auto", tokenizer)


@torch.no_grad()
def greedy_accuracy(model, tokenizer, problems: list[Problem], max_new_tokens: int, batch_size: int = 100,
                    prompts: PromptBuilder | None = None):
    """(accuracy, [(question, response, correct)]): HF greedy decoding, exact '####' match."""
    prompts = prompt_builder(tokenizer, prompts)
    was_training = model.training
    model.eval()
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    results = []
    try:
        for i in range(0, len(problems), batch_size):
            chunk = problems[i:i + batch_size]
            enc = tokenizer.pad({"input_ids": [prompts.ids(p) for p in chunk]}, return_tensors="pt").to(model.device)
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
            texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            results += [(p.question, t, reward(t, p) == 1.0) for p, t in zip(chunk, texts)]
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    return sum(r[2] for r in results) / max(1, len(results)), results


# ----- metrics ------------------------------------------------------------------------------------


def avg_at_k(correct: list[list[bool]]) -> float:
    """Avg@k: mean accuracy over all k samples of all problems (Avg@1 of greedy decoding = accuracy)."""
    flat = [c for row in correct for c in row]
    return sum(flat) / max(1, len(flat))


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021, 'Evaluating Large
    Language Models Trained on Code', Eq. 1): 1 - C(n-c, k) / C(n, k). With k == n: 'any correct'."""
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n = {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean_pass_at_k(correct: list[list[bool]], k: int) -> float:
    """pass@k averaged over problems, each estimated from all of its samples."""
    return sum(pass_at_k(len(row), sum(row), k) for row in correct) / max(1, len(correct))


def pass_at_ks(n: int) -> list[int]:
    """The k reported for n samples per problem: 1, 2, 4, ... and n itself."""
    ks = [2 ** i for i in range(n.bit_length()) if 2 ** i <= n]
    return ks if ks[-1] == n else ks + [n]


# ----- generation through the rollout engine -----------------------------------------------------


@dataclass
class EngineEval:
    """n responses per problem from the engine, scored."""
    problems: list[Problem]
    responses: list[list[str]] = field(default_factory=list)  # [problem][sample]
    correct: list[list[bool]] = field(default_factory=list)
    lengths: list[list[int]] = field(default_factory=list)  # response tokens
    truncated: list[list[bool]] = field(default_factory=list)  # hit max_new_tokens before EOS

    @property
    def accuracy(self) -> float:
        return avg_at_k(self.correct)

    @property
    def mean_length(self) -> float:
        flat = [n for row in self.lengths for n in row]
        return sum(flat) / max(1, len(flat))

    @property
    def truncated_frac(self) -> float:
        return avg_at_k(self.truncated)


def engine_samples(engine, tokenizer, problems: list[Problem], max_new_tokens: int, *, n: int = 1,
                   temperature: float = 0.0, top_p: float = 1.0, batch_sequences: int = 1024,
                   advance=None, prompts: PromptBuilder | None = None) -> EngineEval:
    """n responses per problem (temperature 0: greedy), scored with the exact '####' match.

    Problems go to the engine `batch_sequences // n` at a time (vLLM batches within each call);
    `advance(info)` is called after each call (a progress bar)."""
    prompts = prompt_builder(tokenizer, prompts)
    result = EngineEval(problems)
    per_call = max(1, batch_sequences // n)
    for i in range(0, len(problems), per_call):
        chunk = problems[i:i + per_call]
        groups = engine.generate([prompts.ids(p) for p in chunk], n=n, temperature=temperature,
                                 top_p=top_p, max_tokens=max_new_tokens, stop_token_ids=[tokenizer.eos_token_id])
        for problem, group in zip(chunk, groups):
            texts = [tokenizer.decode(r.response_ids, skip_special_tokens=True) for r in group]
            result.responses.append(texts)
            result.correct.append([reward(t, problem) == 1.0 for t in texts])
            result.lengths.append([len(r.response_ids) for r in group])
            result.truncated.append([r.truncated for r in group])
        if advance is not None:
            advance(f"{min(i + per_call, len(problems))}/{len(problems)} problems")
    return result


def engine_accuracy(engine, tokenizer, problems: list[Problem], max_new_tokens: int):
    """(Avg@1, [(question, response, correct)]) with greedy decoding on the engine: the same
    shape as `greedy_accuracy`, for comparing the two."""
    result = engine_samples(engine, tokenizer, problems, max_new_tokens)
    return result.accuracy, [(p.question, r[0], c[0]) for p, r, c in zip(problems, result.responses, result.correct)]


def start_engine(actor, tokenizer, problems: list[Problem], max_new_tokens: int, *, quant_fmt: str = "none",
                 dtype: str = "auto", seed: int = 0, platform=None, out_dir: str | None = None,
                 prompts: PromptBuilder | None = None, **engine_kwargs):
    """A `RolloutEngine` on the actor ('none' = unquantized, or a `quant.FORMATS` name as the quantized
    sampler sees it; engine_kwargs: quant_group, ...), sized for these problems. Its checkpoint goes to out_dir (default: a temp dir that
    is removed once vLLM has loaded it). Returns the engine."""
    from .engine import Platform, RolloutEngine, context_length

    platform = platform or Platform.detect()
    prompts = prompt_builder(tokenizer, prompts)
    max_len = context_length(max(len(prompts.ids(p)) for p in problems), max_new_tokens,
                             getattr(actor.config, "max_position_embeddings", None))
    temp = tempfile.TemporaryDirectory(prefix="qurl-eval-") if out_dir is None else contextlib.nullcontext(out_dir)
    with temp as where:
        engine, _ = RolloutEngine.from_actor(actor, tokenizer, where, quant_fmt=quant_fmt, platform=platform,
                                             dtype=dtype, seed=seed, max_model_len=max_len, **engine_kwargs)
    return engine


def free_engine(engine) -> None:
    """Shut the in-process vLLM engine down before the next one starts: vLLM freezes the GC heap
    at start-up, and its shutdown unfreezes it and tears down its distributed state. The caller
    then drops its reference (`del engine`) and the memory goes at the next gc.collect()."""
    core = getattr(getattr(getattr(engine, "llm", None), "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
