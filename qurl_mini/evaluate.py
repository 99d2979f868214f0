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
import json
import math
import os
import tempfile
import time
from dataclasses import dataclass, field, replace

import torch

from .config import ConfigError, need
from .data import DataError, Problem, decode_and_score, reward
from .prompts import PromptBuilder


def prompt_builder(tokenizer, prompts: PromptBuilder | None = None) -> PromptBuilder:
    """The run's PromptBuilder (prompt ids as the trainer's rollout sends them), default --prompt-format auto."""
    return prompts or PromptBuilder("auto", tokenizer)


@torch.no_grad()
def greedy_accuracy(model, tokenizer, problems: list[Problem], max_new_tokens: int, batch_size: int = 100,
                    prompts: PromptBuilder | None = None):
    """(accuracy, [(question, response, correct)]): HF greedy decoding, exact '####' match."""
    some_problems(problems)
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


def some_problems(problems: list[Problem]) -> None:
    """An accuracy needs problems: on none it would be a number measured on nothing (load_problems never gives
    none; this guards every other caller)."""
    if not problems:
        raise DataError("no test problems to evaluate: an accuracy on none would be a number measured on nothing")


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

    def repeated(self, k: int) -> "EngineEval":
        """Each response k times: the k samples of greedy decoding (temperature 0), without generating them."""
        return replace(self, **{name: [row * k for row in getattr(self, name)]
                                for name in ("responses", "correct", "lengths", "truncated")})


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
            texts, rewards = decode_and_score(tokenizer, problem, [r.response_ids for r in group])
            result.responses.append(texts)
            result.correct.append([r == 1.0 for r in rewards])
            result.lengths.append([len(r.response_ids) for r in group])
            result.truncated.append([r.truncated for r in group])
        if advance is not None:
            advance(f"{min(i + per_call, len(problems))}/{len(problems)} problems")
    return result


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


def evaluate_checkpoint(path: str, problems: list[Problem], cfg, platform) -> dict:
    """eval.py's numbers for one checkpoint: Avg@1 (and with cfg.k > 1 Avg@k, pass@k), lengths, times and
    examples, on the problems whose prompt fits cfg.max_prompt_tokens. Its engine is shut down before returning."""
    from .actor import load_actor
    from .infra.progress import progress_bar
    from .token_records import engine_vs_actor

    some_problems(problems)
    t0 = time.time()
    actor, tokenizer = load_actor(path)
    prompts = PromptBuilder(cfg.prompt_format, tokenizer)
    problems = prompts.fitting(problems, cfg.max_prompt_tokens, "test problems")
    engine = start_engine(actor, tokenizer, problems, cfg.max_new_tokens, quant_fmt=cfg.quant,
                          quant_group=cfg.quant_group, dtype=cfg.engine_dtype, seed=cfg.seed, platform=platform,
                          prompts=prompts, kv_cache_gib=cfg.kv_cache_gib,
                          gpu_memory_utilization=cfg.gpu_memory_utilization, enforce_eager=cfg.enforce_eager)
    if not getattr(cfg, "token_page", None):  # eval.py --token-page scores the engine's samples with it, below
        actor = None  # the engine holds its own copy
    gc.collect()
    times = {"load_and_start_engine": round(time.time() - t0, 2)}
    k, sampling = cfg.k, cfg.k > 1 and cfg.temperature > 0
    calls = math.ceil(len(problems) / cfg.batch_size) + (math.ceil(len(problems) / max(1, cfg.batch_size // k))
                                                         if sampling else 0)
    try:
        with progress_bar(f"eval {os.path.basename(os.path.normpath(path)) or path}", calls) as advance:
            t1 = time.time()
            greedy = engine_samples(engine, tokenizer, problems, cfg.max_new_tokens, batch_sequences=cfg.batch_size,
                                    advance=lambda info: advance(f"greedy {info}"), prompts=prompts)
            times["greedy"], t1 = round(time.time() - t1, 2), time.time()
            sampled = greedy.repeated(k)  # temperature 0: k copies of the greedy response
            if sampling:
                sampled = engine_samples(engine, tokenizer, problems, cfg.max_new_tokens, n=k,
                                         temperature=cfg.temperature, top_p=cfg.top_p, batch_sequences=cfg.batch_size,
                                         advance=lambda info: advance(f"k={k} samples {info}"), prompts=prompts)
                times["sampled"] = round(time.time() - t1, 2)
        engine_format, engine_dtype = engine.engine_format, engine.dtype
        if actor is not None:
            token_record = engine_vs_actor(engine, actor, tokenizer, prompts, problems, cfg.token_settings(path), 0,
                                           f"{path} ({engine_format} engine vs the fp32 model)")
    finally:
        free_engine(engine)
        del engine
        gc.collect()
    result = {"avg@1": greedy.accuracy, "n_problems": len(problems), "engine_format": engine_format,
              "engine_dtype": engine_dtype, "greedy_mean_response_tokens": greedy.mean_length,
              "greedy_truncated_frac": greedy.truncated_frac, "time_s": times,
              "greedy_correct": [int(c[0]) for c in greedy.correct]}
    if actor is not None:
        result["token_page_record"] = token_record  # eval.py takes it out for the page
    if k > 1:
        result.update({f"avg@{k}": sampled.accuracy, f"pass@{k}": mean_pass_at_k(sampled.correct, k),
                       "pass@": {str(j): mean_pass_at_k(sampled.correct, j) for j in pass_at_ks(k)},
                       "sampled_mean_response_tokens": sampled.mean_length,
                       "sampled_truncated_frac": sampled.truncated_frac,
                       "sampled_correct_counts": [sum(c) for c in sampled.correct]})
    result["examples"] = [
        {"question": p.question, "target": p.target, "greedy": greedy.responses[i][0],
         "greedy_correct": greedy.correct[i][0],
         **({"samples": [{"response": r, "correct": c} for r, c in
                         list(zip(sampled.responses[i], sampled.correct[i]))[:4]]} if sampling else {})}
        for i, p in enumerate(problems[: cfg.show])]
    return result


def print_results(results: dict, cfg, n_problems: int, run_models: dict) -> None:
    """eval.py's table: a row per checkpoint (run_models: {path: (role, train.py's HF greedy accuracy)}), then
    the examples' greedy answers."""
    from rich.console import Console
    from rich.table import Table

    k, first = cfg.k, next(iter(results.values()))
    caption = "Avg@1: greedy (temperature 0)"
    if k > 1:
        caption += (f"; Avg@{k}: mean over {k} samples per problem (T={cfg.temperature:g}, top-p={cfg.top_p:g}); "
                    f"pass@{k}: unbiased estimator (Chen et al. 2021) from {k} samples = any correct")
    table = Table(title=f"{cfg.data}: {n_problems} held-out problems, <= {cfg.max_new_tokens} new tokens, vLLM engine "
                        f"{first['engine_format']} / {first['engine_dtype']}", caption=caption)
    columns = ["model", "Avg@1", *([f"Avg@{k}", f"pass@{k}"] if k > 1 else []), "problems", "mean len", "truncated",
               *(["train.py greedy (HF)"] if run_models else []), "time"]
    for name in columns:
        table.add_column(name, **({"overflow": "fold"} if name == "model" else {"justify": "right"}))
    for path, r in results.items():
        row = [f"{run_models[path][0]}: {path}" if path in run_models else path, f"{100 * r['avg@1']:.1f}%"]
        if k > 1:
            row += [f"{100 * r[f'avg@{k}']:.1f}%", f"{100 * r[f'pass@{k}']:.1f}%"]
        row += [str(r["n_problems"]), f"{r['greedy_mean_response_tokens']:.1f}", f"{100 * r['greedy_truncated_frac']:.0f}%"]
        if run_models:
            hf = run_models.get(path, (None, None))[1]
            row.append("-" if hf is None else f"{100 * hf:.1f}%")
        table.add_row(*row, f"{sum(r['time_s'].values()):.1f}s")
    console = Console()
    if not console.is_terminal:  # a log file or a pipe: no need to squeeze the table into 80 columns
        console.width = max(console.width, 160)
    console.print(table)
    for path, r in results.items():
        for ex in r["examples"]:
            console.print(f"[dim]{path}[/dim] {'✓' if ex['greedy_correct'] else '✗'} {ex['question']!r} -> "
                          f"{ex['greedy']!r}", markup=True, highlight=False)


# ----- a train.py run's summary, for eval.py --run ----------------------------------------------

RUN_PROBLEMS = ("data", "test_data", "seed", "max_number", "max_new_tokens", "eval_size")  # the run's held-out set
RUN_SETTINGS = ("temperature", "engine_dtype", "prompt_format", "max_prompt_tokens")


def read_run(run: str) -> tuple[dict, dict]:
    """A train.py run's summary.json: (its settings as flag values: its held-out problems, temperature, engine dtype
    and prompts; {model path as seen from here: (role, train.py's HF greedy accuracy)} of its start and final)."""
    path = os.path.join(run, "summary.json")
    need(os.path.isdir(run), f"--run {run}: no such folder")
    need(os.path.isfile(path), f"--run {run}: no summary.json (has the run finished?)")
    try:
        with open(path) as f:
            summary = json.load(f)
        train = summary["config"]
        settings = {name: train[name] for name in RUN_PROBLEMS}
        models = {summary["base_model"]: ("start", summary.get("initial_test_accuracy")),
                  summary["final_model"]: ("final", summary.get("final_test_accuracy"))}
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"--run {run}: summary.json is not JSON ({e})") from None
    except (KeyError, TypeError) as e:
        raise ConfigError(f"--run {run}: summary.json lacks {e} (not a train.py summary?)") from None
    settings.update({name: train[name] for name in RUN_SETTINGS if name in train})
    inside = os.path.join(train.get("out_dir", "runs"), train.get("run_name", os.path.basename(os.path.normpath(run))))
    for name in ("data", "test_data"):  # a file's path is relative to where train.py ran, as the models' are
        if isinstance(settings[name], str) and settings[name] not in ("synthetic", "gsm8k"):
            settings[name] = _seen_from_here(settings[name], run, inside)
    return settings, {_seen_from_here(model, run, inside): role for model, role in models.items()}


def _seen_from_here(path: str, run: str, inside: str) -> str:
    """A path from summary.json, relative to where train.py ran (the folder holding `inside` = out_dir/run_name,
    when `run` ends with it), or to the run folder itself (a moved run's final model); else as it is (a hub id)."""
    run, inside = os.path.normpath(run), os.path.normpath(inside)
    candidates = [path, os.path.join(run, os.path.relpath(path, inside))]
    if run.endswith(inside):
        candidates.insert(1, os.path.join(run[:-len(inside)] or ".", path))
    return next((os.path.normpath(c) for c in candidates if os.path.exists(c)), path)
