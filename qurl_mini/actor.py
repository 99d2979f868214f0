"""The full-precision HF actor (and PPO's critic): loading and per-token log-probs of a SequenceBatch."""
import contextlib
import os

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from .batch import micro_batch_slices
from .infra.paths import ModelError, check_model_dir, first_line


def load_actor(model: str, dtype=torch.float32):
    """(model, tokenizer) from a hub id or a local folder, with one-line errors."""
    from transformers import AutoConfig, AutoModelForCausalLM

    check_model_dir(model)  # a local folder: its config and weights are there and whole
    try:
        config = AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as e:
        raise ModelError(f"--model {model}: not a model folder or hub id ({str(e).splitlines()[0]})") from None
    quantized = (getattr(config, "quantization_config", None) or {})
    quant_method = quantized.get("quant_method") if isinstance(quantized, dict) else getattr(quantized, "quant_method", None)
    if quant_method == "compressed-tensors":
        raise ModelError(f"--model {model}: a compressed-tensors checkpoint (quantize.py's W8A8 output) holds int8/fp8 "
                         "codes for vLLM, not weights to train or score; give the model it was made from")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal_classes = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or (
            config.architectures and not causal_classes & set(config.architectures)):
        raise ModelError(f"--model {model}: a {config.model_type!r} model {config.architectures} is not a causal LM")
    try:
        tokenizer = load_tokenizer(model)
    except Exception as e:  # missing or damaged tokenizer files: transformers/tokenizers raise many kinds
        raise ModelError(f"--model {model}: the tokenizer cannot be read ({first_line(e)})") from None
    if tokenizer.eos_token_id is None:
        raise ModelError(f"--model {model}: the tokenizer has no EOS token, so responses could never end")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    actor = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
    return actor, tokenizer


def load_tokenizer(model: str):
    """AutoTokenizer, except for a generic `tokenizers` file (the embedded char tokenizer):
    transformers 5 would swap in the model type's tokenizer class and its pre-tokenizer."""
    import json

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    config_path = os.path.join(model, "tokenizer_config.json")
    if os.path.isfile(config_path) and os.path.isfile(os.path.join(model, "tokenizer.json")):
        with open(config_path) as f:
            if json.load(f).get("tokenizer_class") in ("TokenizersBackend", "PreTrainedTokenizerFast"):
                return PreTrainedTokenizerFast.from_pretrained(model)
    return AutoTokenizer.from_pretrained(model)


LOGPROB_CHUNK_TOKENS = 1024  # positions whose [chunk, vocab] fp32 logits exist at one time


def token_logprobs(model, input_ids, attention_mask, temperature: float = 1.0,
                   chunk_tokens: int = LOGPROB_CHUNK_TOKENS, only=None) -> torch.Tensor:
    """log pi(input_ids[:, t+1] | input_ids[:, :t+1]) for every t, float32, [N, L-1].

    Never materialises [N, L, vocab] logits (tens of GB for a 152k vocabulary): the lm_head runs on
    `chunk_tokens` positions at a time, each reduced at once to logit(target) - logsumexp(logits);
    under autograd each chunk is recomputed in the backward pass instead of being kept.
    only: an [N, L-1] mask (the response tokens): the lm_head runs there alone and the rest is 0. With a chat
    template's system prompt most positions are prompt, and the lm_head is a fifth of a small model's FLOPs."""
    if getattr(model.config, "final_logit_softcapping", None) or hasattr(model.config, "logit_scale"):
        # the head does more than a linear map (Gemma 2, Cohere): take the model's own logits
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float() / temperature
        logp = logits.log_softmax(-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
        return logp if only is None else logp * (only > 0)
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, :-1]
    targets = input_ids[:, 1:]
    head = model.get_output_embeddings()

    def chunk_logprobs(h, t):
        logits = head(h).float() / temperature
        return logits.gather(-1, t[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)

    flat_hidden, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    where = None if only is None else only.reshape(-1).nonzero().squeeze(-1)
    if where is not None:
        flat_hidden, flat_targets = flat_hidden[where], flat_targets[where]
    pieces = []
    for i in range(0, flat_targets.numel(), chunk_tokens):
        h, t = flat_hidden[i:i + chunk_tokens], flat_targets[i:i + chunk_tokens]
        pieces.append(torch.utils.checkpoint.checkpoint(chunk_logprobs, h, t, use_reentrant=False)
                      if torch.is_grad_enabled() and h.requires_grad else chunk_logprobs(h, t))
    flat = torch.cat(pieces) if pieces else hidden.new_zeros(0, dtype=torch.float32)
    if where is None:
        return flat.view(targets.shape) if pieces else hidden.new_zeros(targets.shape, dtype=torch.float32)
    return hidden.new_zeros(targets.numel(), dtype=torch.float32).index_put((where,), flat).view(targets.shape)


def device_of(model) -> torch.device:
    return next(model.parameters()).device


def autocast_context(device_type: str):
    """The one place that picks the forward passes' precision: bf16 autocast on CUDA (weights,
    gradients and AdamW state stay fp32; token_logprobs reduces in fp32), nothing elsewhere (CPUs
    without bf16 arithmetic only emulate it). UNTESTED HERE: this project has had no GPU."""
    if device_type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def frozen_reference_dtype(device_type: str) -> torch.dtype:
    """The frozen reference: bf16 on CUDA (half the memory, no gradients to keep), fp32 elsewhere."""
    return torch.bfloat16 if device_type == "cuda" else torch.float32


def enable_gradient_checkpointing(*models) -> None:
    """HF gradient checkpointing (non-reentrant), once per model; recomputes each decoder layer in the
    backward pass instead of keeping its activations. Active in train() mode only."""
    for model in models:
        if model is not None and not model.is_gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _per_micro_batch(fn, batch, micro_batch_size: int, max_tokens: int | None, device) -> torch.Tensor:
    """fn(input_ids, attention_mask, response_mask) -> [n, w-1] on each (trimmed) micro-batch, on `device`,
    zero-padded back to the batch's [N, L-1] on the batch's device."""
    pieces = []
    for rows in micro_batch_slices(batch.attention_mask, micro_batch_size, max_tokens):
        micro = batch[rows].trimmed()
        with autocast_context(device.type):
            out = fn(micro.input_ids.to(device), micro.attention_mask.to(device), micro.response_mask.to(device)).float()
        pieces.append(F.pad(out, (0, batch.input_ids.shape[1] - micro.input_ids.shape[1])).to(batch.input_ids.device))
    return torch.cat(pieces)


@torch.no_grad()
def batched_logprobs(model, batch, micro_batch_size: int, temperature: float, max_tokens: int | None = None):
    """token_logprobs of the response tokens over micro-batches of --micro-batch-size rows or
    --max-tokens-per-micro-batch tokens; prompt and padding positions come back as 0."""
    return _per_micro_batch(lambda ids, attention, response: token_logprobs(model, ids, attention, temperature,
                                                                            only=response),
                            batch, micro_batch_size, max_tokens, device_of(model))


class Critic(torch.nn.Module):
    """PPO's value model: the actor's backbone (a copy) with a scalar head."""

    def __init__(self, causal_lm):
        super().__init__()
        import copy

        self.backbone = copy.deepcopy(causal_lm.model)
        self.value_head = torch.nn.Linear(causal_lm.config.hidden_size, 1)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids, attention_mask):
        """V(prefix up to t) for each t, [N, L-1] (aligned with the targets)."""
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        with torch.autocast(hidden.device.type, enabled=False):  # the value head in fp32, also under autocast
            return self.value_head(hidden[:, :-1].float()).squeeze(-1)


@torch.no_grad()
def batched_values(critic, batch, micro_batch_size: int, max_tokens: int | None = None):
    return _per_micro_batch(lambda ids, attention, response: critic(ids, attention), batch, micro_batch_size,
                            max_tokens, device_of(critic))
