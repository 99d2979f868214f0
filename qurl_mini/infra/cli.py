"""A flag that does not exist is one line naming it and the closest real flag(s) (exit 2), in every entry script.

    from qurl_mini.infra.cli import ArgumentParser      # argparse.ArgumentParser with that line
    from qurl_mini.infra.cli import hf_argument_parser  # transformers' HfArgumentParser with that line

TRL's GRPOConfig names are translated (`--learning_rate` -> `--lr`): TRL_NAMES, the one table. Light: stdlib only.
"""
import argparse
import difflib
import sys

# TRL GRPOConfig (and its scripts') name -> (this project's flag, what differs; "" where nothing does).
# Same name in both, so never unknown: temperature, seed, max_grad_norm, report_to, gradient_checkpointing.
TRL_NAMES = {
    "learning_rate": ("--lr", ""),
    "num_generations": ("--group-size", ""),
    "beta": ("--kl-coef", "TRL's default 0; here 1e-3 for GRPO and PPO, 0 for DAPO"),
    "max_completion_length": ("--max-new-tokens", ""),
    "max_prompt_length": ("--max-prompt-tokens", "a longer prompt is dropped and counted, not truncated"),
    "per_device_train_batch_size": ("--micro-batch-size", "sequences per forward/backward; the rollout batch is "
                                                          "--prompts-per-step x --group-size"),
    "generation_batch_size": ("--prompts-per-step", "prompts per rollout batch, each sampled --group-size times"),
    "steps_per_generation": ("--minibatches", "optimizer steps per rollout batch"),
    "num_iterations": ("--ppo-epochs", ""),
    "epsilon": ("--clip-low", ""),
    "epsilon_high": ("--clip-high", "default 0.2 here (0.28 for DAPO), not --clip-low's value"),
    "loss_type": ("--loss-agg", "grpo = seq-mean-token-mean, dapo = token-mean"),
    "vllm_importance_sampling_correction": ("--objective", "tis is TRL's truncated IS; acr is the default with "
                                                           "a quantized rollout"),
    "vllm_importance_sampling_mode": ("--objective", "token_truncate = tis, token_mask = icepop, "
                                                     "sequence_truncate = seq-tis, sequence_mask = seq-mask"),
    "vllm_importance_sampling_cap": ("--tis-cap", ""),
    "vllm_gpu_memory_utilization": ("--gpu-memory-utilization", ""),
    "max_steps": ("--steps", "RL steps, one rollout batch each"),
    "num_train_epochs": ("--steps", "RL steps, one rollout batch each; no epochs"),
    "output_dir": ("--out-dir", "the run goes to --out-dir/--run-name"),
    "save_steps": ("--save-every", ""),
    "save_total_limit": ("--keep", ""),
    "eval_steps": ("--eval-every", ""),
    "resume_from_checkpoint": ("--resume", ""),
    "model_name_or_path": ("--model", ""),
    "dataset_name": ("--data", ""),
}


def _dashed(option: str) -> str:
    return "--" + option.lstrip("-").replace("_", "-")


def unknown_flags(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """The option strings in argv that name no flag of parser (argparse's unambiguous abbreviations are flags)."""
    known = parser._option_string_actions
    unknown = []
    for token in argv:
        if token == "--":
            break
        name = token.split("=", 1)[0]
        if not token.startswith("-") or token == "-" or _is_number(token) or name in known:
            continue
        if parser.allow_abbrev and name.startswith("--") and any(o.startswith(name) for o in known):
            continue  # an abbreviation (argparse says so itself where it is ambiguous)
        unknown.append(name)
    return unknown


def given_flags(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The dests of the flags given in argv (argparse's unambiguous abbreviations resolved): what --dry-run calls
    'command line'."""
    known, given = parser._option_string_actions, set()
    for token in argv:
        if token == "--":
            break
        name = token.split("=", 1)[0]
        if not token.startswith("--"):
            continue
        matches = [known[name]] if name in known else [a for o, a in known.items() if o.startswith(name)]
        if len({a.dest for a in matches}) == 1:
            given.add(matches[0].dest)
    return given


def _is_number(token: str) -> bool:
    try:
        float(token)
        return True
    except ValueError:
        return False


def suggestion(parser: argparse.ArgumentParser, flag: str) -> str:
    """'; did you mean --x?' with TRL's name translated, the closest flags by spelling, or where the flags are."""
    options = sorted({_dashed(o) for o in parser._option_string_actions if o.startswith("--")})
    trl = TRL_NAMES.get(flag.lstrip("-").replace("-", "_"))
    if trl and trl[0] in options:
        note = f"; {trl[1]}" if trl[1] else ""
        return f"; did you mean {trl[0]}? (TRL's {flag.lstrip('-').replace('-', '_')}{note})"
    close = difflib.get_close_matches(_dashed(flag), options, n=3, cutoff=0.6)
    if close:
        return f"; did you mean {' or '.join([', '.join(close[:-1]), close[-1]] if len(close) > 1 else close)}?"
    return f" ({parser.prog} --help lists the flags)"


def unknown_flags_line(parser: argparse.ArgumentParser, flags: list[str]) -> str:
    return "error: " + "; ".join(f"unknown flag {flag}{suggestion(parser, flag)}" for flag in flags)


class OneLineUnknownFlags:
    """Mixin for an argparse parser: a flag that does not exist ends the parse with one line, before argparse's
    own checks (a --modle typo is named, not the --model it leaves missing)."""

    def parse_known_args(self, args=None, namespace=None):
        unknown = unknown_flags(self, sys.argv[1:] if args is None else list(args))
        if unknown:
            self.exit(2, unknown_flags_line(self, unknown) + "\n")
        return super().parse_known_args(args, namespace)


class ArgumentParser(OneLineUnknownFlags, argparse.ArgumentParser):
    """argparse.ArgumentParser whose unknown flag is one line (exit 2)."""


def hf_argument_parser(dataclass_types, **kwargs):
    """transformers.HfArgumentParser whose unknown flag is one line (exit 2), not its ValueError traceback."""
    from transformers import HfArgumentParser

    class OneLineHfArgumentParser(OneLineUnknownFlags, HfArgumentParser):
        pass

    return OneLineHfArgumentParser(dataclass_types, **kwargs)
