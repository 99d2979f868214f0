"""Prompt formats: the exact text and token ids a chat model is sent for a real GSM8K question."""
import logging

import pytest

from qurl_mini.data import Problem
from qurl_mini.embedded import build_char_tokenizer
from qurl_mini.prompts import GSM8K_INSTRUCTION, PromptBuilder, PromptError

# Qwen2.5's chat template, reduced to its plain-message path (system prompt, user turns, generation prompt)
CHATML = ("{%- if messages[0]['role'] != 'system' %}"
          "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
          "{%- for message in messages %}"
          "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
          "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
# GSM8K test.jsonl, row 1
QUESTION = ("Janet’s ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins for her "
            "friends every day with four. She sells the remainder at the farmers' market daily for $2 per fresh duck "
            "egg. How much in dollars does she make every day at the farmers' market?")


def chatml_tokenizer():
    """A byte-level BPE tokenizer (no merges: one token per byte) with ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer, tok.decoder = byte_level, decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHATML
    return fast


def test_chat_prompt_is_the_template_applied_to_question_and_instruction():
    tok = chatml_tokenizer()
    builder = PromptBuilder("auto", tok)
    assert builder.format == "chat"
    problem = Problem(QUESTION, "... #### 18", 18.0)
    expected = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n" + QUESTION +
                " Let's think step by step and output the final answer after \"####\".<|im_end|>\n"
                "<|im_start|>assistant\n")
    assert builder.text(problem) == expected
    ids = builder.ids(problem)
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids.count(im_start) == 3 and ids.count(im_end) == 2  # special tokens are single ids, added once
    assert ids[0] == im_start and tok.decode(ids) == expected  # lossless, the ’ included
    assert "####" in GSM8K_INSTRUCTION


def test_plain_prompt_is_the_embedded_format_and_auto_picks_it_without_a_template():
    tok = build_char_tokenizer()
    builder = PromptBuilder("auto", tok)
    problem = Problem("Ann has 3 apples and gets 4 more. How many apples now?", "3+4=7\n#### 7", 7.0)
    assert builder.format == "plain" and builder.text(problem) == problem.prompt
    assert builder.ids(problem) == tok.encode(problem.prompt)
    with pytest.raises(PromptError, match="no chat template"):
        PromptBuilder("chat", tok)


def test_long_prompts_are_dropped_and_counted_never_truncated(caplog):
    tok = build_char_tokenizer()
    builder = PromptBuilder("plain", tok)
    problems = [Problem("x" * n, "#### 1", 1.0) for n in (5, 50, 10)]
    with caplog.at_level(logging.WARNING, logger="qurl_mini"):
        kept = builder.fitting(problems, max_prompt_tokens=20, source="train")
    assert [len(p.question) for p in kept] == [5, 10]
    assert "dropped 1 of 3 problems" in caplog.text
    with pytest.raises(PromptError, match="every prompt is longer"):
        builder.fitting(problems, max_prompt_tokens=3, source="train")
