"""The full-precision HF actor (and PPO's critic): loading, and per-token log-probs of a SequenceBatch.

The plain path, each row on its own, is the one to read: `batched_logprobs` -> `token_logprobs` -> the model.
--shared-prompt swaps in `shared_prompt_logprobs` (and `shared_prompt_values`, `packing.packed_micro_batches`):
the same inputs and outputs with each group's prompt run once, an exact speed-up to read second."""
import contextlib
import os

import torch
import torch.utils.checkpoint

from .batch import SequenceBatch, micro_batch_slices
from .packing import pack_groups, packed_micro_batches, prompt_groups
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
    try:
        actor = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
    except OSError as e:  # a hub id's weights not fetched (the network gone, offline and not cached), unreadable
        raise ModelError(f"--model {model}: the weights cannot be loaded ({first_line(e)})") from None
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
    """log pi(input_ids[:, t+1] | input_ids[:, :t+1]) for every t, float32, [N, L-1]: the logit at position t
    scores the token at t + 1 (the picture of a row: `batch.pack_sequences`), over `temperature`.

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
    flat_hidden, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    where = None if only is None else only.reshape(-1).nonzero().squeeze(-1)
    if where is None:
        return head_logprobs(model, flat_hidden, flat_targets, temperature, chunk_tokens).view(targets.shape)
    flat = head_logprobs(model, flat_hidden[where], flat_targets[where], temperature, chunk_tokens)
    return flat.new_zeros(targets.numel()).index_put((where,), flat).view(targets.shape)


def head_logprobs(model, hidden, targets, temperature: float = 1.0, chunk_tokens: int = LOGPROB_CHUNK_TOKENS):
    """log pi(target | hidden state) for [T, H] hidden states and [T] targets, float32 [T]: the lm_head on
    `chunk_tokens` of them at a time, each reduced at once to logit(target) - logsumexp(logits)."""
    head = model.get_output_embeddings()

    def chunk_logprobs(h, t):
        logits = head(h).float() / temperature
        return logits.gather(-1, t[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)

    pieces = []
    for i in range(0, targets.numel(), chunk_tokens):
        h, t = hidden[i:i + chunk_tokens], targets[i:i + chunk_tokens]
        pieces.append(torch.utils.checkpoint.checkpoint(chunk_logprobs, h, t, use_reentrant=False)
                      if torch.is_grad_enabled() and h.requires_grad else chunk_logprobs(h, t))
    return torch.cat(pieces) if pieces else hidden.new_zeros(0, dtype=torch.float32)


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
        """V(prefix up to t) for each t, [N, L-1], aligned with the targets."""
        return self.head(self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, :-1])

    def head(self, hidden):
        with torch.autocast(hidden.device.type, enabled=False):  # the value head in fp32, also under autocast
            return self.value_head(hidden.float()).squeeze(-1)


@torch.no_grad()
def batched_logprobs(model, seq, micro_batch_size: int, temperature: float, max_tokens: int | None = None,
                     shared: bool = False) -> torch.Tensor:
    """log pi of every response token of `seq` (0 elsewhere), [N, L-1] on its device: token_logprobs on
    micro-batches of --micro-batch-size rows or --max-tokens-per-micro-batch tokens, each cut to its longest row.
    shared (--shared-prompt): shared_prompt_logprobs on micro-batches of whole groups, the same numbers."""
    out = torch.zeros(seq.response_mask.shape, device=seq.input_ids.device)
    plan = packed_micro_batches if shared else micro_batch_slices  # rows, or whole packed groups
    for rows in plan(seq, micro_batch_size, max_tokens):
        micro = seq[rows].trimmed().to(device_of(model))
        inputs, only = (model, micro.input_ids, micro.attention_mask, temperature), micro.response_mask
        with autocast_context(micro.input_ids.device.type):
            logp = shared_prompt_logprobs(*inputs, only=only) if shared else token_logprobs(*inputs, only=only)
        out[rows, :logp.shape[1]] = logp.float().to(out.device)
    return out


@torch.no_grad()
def batched_values(critic, seq, micro_batch_size: int, max_tokens: int | None = None, shared: bool = False):
    """PPO's V_old, [N, L-1] (every position; shared: the response positions), micro-batched as batched_logprobs."""
    out = torch.zeros(seq.response_mask.shape, device=seq.input_ids.device)
    plan = packed_micro_batches if shared else micro_batch_slices  # rows, or whole packed groups
    for rows in plan(seq, micro_batch_size, max_tokens):
        micro = seq[rows].trimmed().to(device_of(critic))
        inputs = (critic, micro.input_ids, micro.attention_mask)
        with autocast_context(micro.input_ids.device.type):
            values = shared_prompt_values(*inputs, only=micro.response_mask) if shared else critic(*inputs[1:])
        out[rows, :values.shape[1]] = values.float().to(out.device)
    return out


# ----- --shared-prompt: the same inputs and outputs as token_logprobs and Critic, each group's prompt run once -----
# (an exact speed-up: every log-prob is the same sum in another order, docs/shared-prompt.md; the packing: packing.py)


def shared_prompt_logprobs(model, input_ids, attention_mask, temperature: float = 1.0,
                           chunk_tokens: int = LOGPROB_CHUNK_TOKENS, only=None) -> torch.Tensor:
    """token_logprobs of the response tokens (`only`: the response mask, required), [n, w-1], 0 elsewhere: each
    run of rows sharing a prompt packed into one row `[prompt | responses]` (packing.pack_groups)."""
    seq = SequenceBatch(input_ids, attention_mask, only)
    packed = pack_groups(seq, prompt_groups(seq)).to(device_of(model))
    inputs = dict(input_ids=packed.input_ids, attention_mask=packed.attention_bias, position_ids=packed.position_ids)
    if getattr(model.config, "final_logit_softcapping", None) or hasattr(model.config, "logit_scale"):
        logits = packed.gather(model(**inputs).logits).float() / temperature  # the model's own head
        return packed.unpack(logits.log_softmax(-1).gather(-1, packed.target_ids[:, None]).squeeze(-1))
    hidden = packed.gather(model.base_model(**inputs).last_hidden_state)
    return packed.unpack(head_logprobs(model, hidden, packed.target_ids, temperature, chunk_tokens))


def shared_prompt_values(critic, input_ids, attention_mask, only=None) -> torch.Tensor:
    """The critic's values at the response positions (`only`, required; all that GAE and the value loss read),
    [n, w-1], 0 elsewhere: each group's prompt run once."""
    seq = SequenceBatch(input_ids, attention_mask, only)
    packed = pack_groups(seq, prompt_groups(seq)).to(device_of(critic))
    hidden = critic.backbone(input_ids=packed.input_ids, attention_mask=packed.attention_bias,
                             position_ids=packed.position_ids).last_hidden_state
    return packed.unpack(critic.head(packed.gather(hidden)))
