"""The embedded default: a character tokenizer, a tiny Qwen2 model and its SFT warm start.

Two variants (`EMBEDDED_VARIANTS`): `synthetic`, the default, reads the synthetic task's printable-ASCII
text in 256 positions; `text`, used when --data is a real dataset (GSM8K) and no --model is given, has
a tokenizer with byte fallback (any UTF-8 text, losslessly) and 2048 positions, and is warm-started on
the dataset's own solutions, without the sloppy teacher (its slip is the synthetic task's).

Nothing is downloaded: the tokenizer is built with `tokenizers`, the model from a
`Qwen2Config`, and a short supervised fine-tune on the synthetic train split gives the
starting policy. The result is a normal HF model folder, cached. The default synthetic warm start
ships (`SHIPPED_WARM_STARTS`, in qurl_mini/assets/): an SFT on each CPU, even with another thread count,
rounds differently and gives other bytes (and a few points of other accuracy), so every machine starts
from the shipped ones; other settings (--sft-steps, --sft-lr, --teacher-slip, the text variant) are
trained here, on first use.

The SFT demonstrations come from a *sloppy teacher*: in a fraction `teacher_slip` of them it
miscounts by one (writes C+1 for both the work and the answer). Imitating it, the model
learns the arithmetic but also the slip, so its greedy answer is often one too many: greedy
accuracy lands around 30%, with the right answer still likely under sampling. Only RL, which
is rewarded on the true answer, can remove a bias the demonstrations themselves carry; and
because the slip is shared by all problems, what RL fixes carries over to held-out ones.
(Without the slip, a tiny model's remaining errors are per-fact arithmetic gaps, which RL
fills about as slowly as more SFT would: too slow to show within minutes on a CPU.)
"""
import fcntl
import hashlib
import json
import logging
import math
import os
import random
import shutil
import string
from dataclasses import dataclass
from typing import Callable

import torch

from .data import Problem
from .infra.paths import ModelError, file_sha256
from .infra.progress import progress_bar

log = logging.getLogger("qurl_mini")

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
CHARS = sorted(set(string.printable) - set("\t\r\x0b\x0c"))
BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]  # the byte-fallback names `tokenizers` looks up


def build_char_tokenizer():
    """One token per character, saved and loaded as a normal HF fast tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([PAD, EOS, UNK] + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK)


def build_byte_fallback_tokenizer():
    """One token per printable-ASCII character; any other character (a tab, '€', an emoji) as its
    UTF-8 bytes, <0xE2><0x82><0xAC>: every text encodes, and decodes back to itself."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([PAD, EOS, UNK] + CHARS + BYTE_TOKENS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK)


@dataclass(frozen=True)
class EmbeddedVariant:
    tokenizer: Callable
    vocab_size: int
    max_positions: int
    sft_steps: int  # default warm-start length (--sft-steps overrides)
    sft_batch_size: int
    teacher_slips: bool  # whether the sloppy teacher (--teacher-slip) applies
    about: str


EMBEDDED_VARIANTS = {
    "synthetic": EmbeddedVariant(build_char_tokenizer, 128, 256, 400, 64, True,
                                 "printable-ASCII characters, 256 positions"),
    "text": EmbeddedVariant(build_byte_fallback_tokenizer, 384, 2048, 60, 16, False,
                            "characters with byte fallback, 2048 positions"),
}


def tiny_qwen2_config(tokenizer, layers=4, hidden=192, heads=6, kv_heads=2, intermediate=None, vocab_size=128,
                      max_positions=256):
    """The embedded shape by default; other shapes (e.g. Qwen2.5-0.5B's, for benchmarks) by keyword."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate or hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions, tie_word_embeddings=True, rope_theta=10000.0,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.eos_token_id, torch_dtype="float32",
    )


def build_tiny_model(out_dir: str, seed: int = 0, variant: str = "synthetic", **config_kwargs) -> str:
    """A randomly initialised tiny Qwen2 + its tokenizer, saved as an HF folder (for tests)."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    shape = EMBEDDED_VARIANTS[variant]
    tokenizer = shape.tokenizer()
    config_kwargs = {"vocab_size": shape.vocab_size, "max_positions": shape.max_positions, **config_kwargs}
    model = Qwen2ForCausalLM(tiny_qwen2_config(tokenizer, **config_kwargs))
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def teacher_demonstration(problem: Problem, rng: random.Random, slip: float) -> Problem:
    """The problem as the sloppy teacher solves it: with probability `slip`, off by one."""
    if rng.random() >= slip or "=" not in problem.answer:
        return problem
    wrong = int(problem.target) + 1
    work = problem.answer.split("=")[0]
    return Problem(problem.question, f"{work}={wrong}\n#### {wrong}", problem.target)


def encode_sft_batch(tokenizer, problems: list[Problem], prompt_ids=None):
    """input_ids, attention_mask and labels (-100 on the prompt and the padding). prompt_ids(problem): the prompt's
    token ids (default: the plain prompt, encoded); the answer ends with EOS, a trained token."""
    rows, labels = [], []
    for p in problems:
        prompt = prompt_ids(p) if prompt_ids else tokenizer.encode(p.prompt)
        answer = tokenizer.encode(p.answer, add_special_tokens=False) + [tokenizer.eos_token_id]
        rows.append(prompt + answer)
        labels.append([-100] * len(prompt) + answer)
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    attention = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    label_ids = torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels])
    return input_ids, attention, label_ids


def sft(model, tokenizer, problems, steps, batch_size, lr, seed, teacher_slip=0.0, prompt_ids=None, params=None,
        betas=(0.9, 0.98)):
    """Plain next-token cross-entropy on the (teacher's) answers, AdamW with a cosine schedule (params: the ones
    trained, default all; prompt_ids: see encode_sft_batch)."""
    rng, teacher_rng = random.Random(seed), random.Random(seed + 1)
    params = list(model.parameters()) if params is None else params
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=betas, foreach=True)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    model.train()
    with progress_bar("SFT warm start", steps) as advance:
        for step in range(steps):
            demos = [teacher_demonstration(p, teacher_rng, teacher_slip) for p in rng.sample(problems, batch_size)]
            input_ids, attention, labels = encode_sft_batch(tokenizer, demos, prompt_ids)
            loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            advance(f"loss {loss.item():.3f}")
    model.eval()
    return model


def warm_start_settings(variant: str, train: list[Problem], *, steps: int, batch_size: int, lr: float,
                        teacher_slip: float, seed: int = 0, source: str = "synthetic") -> dict:
    """What decides the warm-started model (its cache key is their hash)."""
    settings = dict(steps=steps, batch_size=batch_size, lr=lr, seed=seed, n_train=len(train),
                    teacher_slip=teacher_slip, first=train[0].question, version=2)
    if variant != "synthetic":  # the synthetic key predates the variants and stays as it was
        settings.update(variant=variant, source=source)
    return settings


def warm_start_key(settings: dict) -> str:
    return hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]


def describe_warm_start(variant: str, settings: dict, n_params: float, skipped: int = 0) -> str:
    """One line: what the warm start did."""
    shape = EMBEDDED_VARIANTS[variant]
    teacher = (f"a sloppy teacher off by one in {settings['teacher_slip']:.0%} of the demonstrations"
               if shape.teacher_slips else "their own solutions (no teacher slip: that is the synthetic task's)")
    dropped = f", {skipped} too long for {shape.max_positions} positions left out" if skipped else ""
    return (f"SFT of a {n_params / 1e6:.2f}M-parameter Qwen2 ({shape.about}) on {settings['n_train']} "
            f"{settings.get('source', 'synthetic')} problems{dropped}, with {teacher}: "
            f"{settings['steps']} steps x {settings['batch_size']}, lr {settings['lr']:g}")


def _cached_description(out_dir: str) -> str:
    """What a cached warm start did, from its sft_settings.json (older caches have no description)."""
    try:
        with open(os.path.join(out_dir, "sft_settings.json")) as f:
            return json.load(f)["description"]
    except (OSError, ValueError, KeyError):
        return "its settings: sft_settings.json"


# warm-start key -> (its model.safetensors under qurl_mini/assets/, that file's sha256); made by
# `python scripts/build_warm_start.py --embedded` (the SFT below, on an AMD EPYC with 2 threads)
ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
SHIPPED_WARM_STARTS = {
    "19737ebe26": ("embedded-sft-19737ebe26.safetensors",
                   "603f10a0be3ea294894db38f580197781e211749307b2abfe06f296cb81023e3"),
}


def warm_start(cache_dir: str, train: list[Problem], *, variant: str = "synthetic", steps: int | None = None,
               lr: float, teacher_slip: float, seed: int = 0, source: str = "synthetic") -> str:
    """Path of the SFT'd embedded model, cached by its settings: the shipped bytes where its settings are the
    shipped ones (a cache of other bytes under that key, an SFT made here before, is replaced), else built
    here on first use."""
    shape = EMBEDDED_VARIANTS[variant]
    teacher_slip = teacher_slip if shape.teacher_slips else 0.0
    settings = warm_start_settings(variant, train, steps=steps or shape.sft_steps, batch_size=shape.sft_batch_size,
                                   lr=lr, teacher_slip=teacher_slip, seed=seed, source=source)
    key = warm_start_key(settings)
    out_dir = os.path.join(cache_dir, f"embedded-sft-{key}")
    weights = os.path.join(out_dir, "model.safetensors")
    shipped = SHIPPED_WARM_STARTS.get(key) if variant == "synthetic" else None
    os.makedirs(cache_dir, exist_ok=True)
    with open(out_dir + ".lock", "w") as lock:  # runs started together (make contrast) build it once:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the others wait here, then reuse it; the kernel drops it on any exit
        if os.path.isfile(weights) and (shipped is None or file_sha256(weights) == shipped[1]):
            log.info("warm start: reusing %s (%s)", out_dir, _cached_description(out_dir))
        elif shipped:
            _save(out_dir, settings, variant, train, shipped_weights=checked_asset(*shipped))
        else:
            _save(out_dir, settings, variant, train)
    return out_dir


def checked_asset(name: str, sha256: str) -> str:
    """The shipped file under ASSETS, or a ModelError naming it: missing (a partial checkout) or other bytes."""
    path = os.path.join(ASSETS, name)
    if not os.path.isfile(path):
        raise ModelError(f"the shipped warm start {path} is missing (a partial checkout?); restore it with git checkout")
    if file_sha256(path) != sha256:
        raise ModelError(f"the shipped warm start {path} is damaged (its sha256 is not the pinned one); restore it "
                         f"with git checkout")
    return path


def _save(out_dir: str, settings: dict, variant: str, train: list[Problem], shipped_weights: str | None = None) -> None:
    """The warm start itself, written whole (or not at all) to out_dir: SFT of a fresh tiny Qwen2 with `settings`,
    or, given shipped_weights, the fresh model's config and tokenizer with those (the same SFT, made once)."""
    from transformers import Qwen2ForCausalLM

    from .infra.checkpoint import tensor_bytes, written_atomically

    shape = EMBEDDED_VARIANTS[variant]
    torch.manual_seed(settings["seed"])
    tokenizer = shape.tokenizer()
    model = Qwen2ForCausalLM(tiny_qwen2_config(tokenizer, vocab_size=shape.vocab_size,
                                               max_positions=shape.max_positions))
    fitting = [p for p in train if len(tokenizer.encode(p.prompt + p.answer)) < shape.max_positions]
    description = describe_warm_start(variant, settings, sum(p.numel() for p in model.parameters()),
                                      skipped=len(train) - len(fitting))
    if shipped_weights:
        log.info("warm start: the shipped %s (%s); cached in %s", os.path.basename(shipped_weights), description,
                 out_dir)
    else:
        log.info("warm start: %s, trained on this machine (another CPU or thread count gives slightly other bytes); "
                 "cached in %s", description, out_dir)
        sft(model, tokenizer, fitting, settings["steps"], settings["batch_size"], settings["lr"], settings["seed"],
            settings["teacher_slip"])
    with written_atomically(out_dir, tensor_bytes(model.state_dict()), then="run again") as tmp_dir:
        if shipped_weights:  # the model's config, and the shipped file itself, byte for byte
            model.config.save_pretrained(tmp_dir)
            model.generation_config.save_pretrained(tmp_dir)
            shutil.copyfile(shipped_weights, os.path.join(tmp_dir, "model.safetensors"))
        else:
            model.save_pretrained(tmp_dir)
        tokenizer.save_pretrained(tmp_dir)
        with open(os.path.join(tmp_dir, "sft_settings.json"), "w") as f:
            json.dump({**settings, "description": description}, f, indent=1)
