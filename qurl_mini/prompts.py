"""What the model sees: a problem turned into prompt text and token ids (`--prompt-format`).

    plain  "Q: {question}\\nA: "  (the embedded model's format; no chat template needed)
    chat   the tokenizer's chat template applied to the question plus the instruction to reason
           step by step and give the final answer after '####' (verl's GSM8K recipe)
    auto   chat when the tokenizer has a chat template, else plain
"""
import logging

from .data import Problem
from .infra.errors import OneLineError

log = logging.getLogger("qurl_mini")

GSM8K_INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."


class PromptError(OneLineError, ValueError):
    """The prompt format cannot be used with this tokenizer; the message is one line."""


def plain_prompt(problem: Problem, tokenizer) -> str:
    return problem.prompt


def chat_prompt(problem: Problem, tokenizer) -> str:
    messages = [{"role": "user", "content": f"{problem.question} {GSM8K_INSTRUCTION}"}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


PROMPT_FORMATS = {"plain": plain_prompt, "chat": chat_prompt}


class PromptBuilder:
    def __init__(self, fmt: str, tokenizer):
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if fmt == "auto":
            fmt = "chat" if has_template else "plain"
        if fmt not in PROMPT_FORMATS:
            raise PromptError(f"--prompt-format {fmt!r}: choose from ('auto', {', '.join(map(repr, PROMPT_FORMATS))})")
        if fmt == "chat" and not has_template:
            raise PromptError("--prompt-format chat: the tokenizer has no chat template (use plain or auto)")
        self.format, self.tokenizer = fmt, tokenizer

    def text(self, problem: Problem) -> str:
        return PROMPT_FORMATS[self.format](problem, self.tokenizer)

    def ids(self, problem: Problem) -> list[int]:
        """Token ids sent to the engine; a chat template already holds its special tokens."""
        if self.format == "chat":
            return self.tokenizer.encode(self.text(problem), add_special_tokens=False)
        return self.tokenizer.encode(self.text(problem))

    def fitting(self, problems: list[Problem], max_prompt_tokens: int | None, source: str) -> list[Problem]:
        """Problems whose prompt has at most max_prompt_tokens tokens; the rest are dropped, counted
        and named in one warning (never truncated mid-question)."""
        if max_prompt_tokens is None:
            return problems
        kept = [p for p in problems if len(self.ids(p)) <= max_prompt_tokens]
        if len(kept) < len(problems):
            log.warning("%s: dropped %d of %d problems whose prompt is longer than --max-prompt-tokens %d",
                        source, len(problems) - len(kept), len(problems), max_prompt_tokens)
        if not kept:
            raise PromptError(f"{source}: every prompt is longer than --max-prompt-tokens {max_prompt_tokens}")
        return kept
