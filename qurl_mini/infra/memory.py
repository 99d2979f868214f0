"""A memory plan for one GPU, from the model's shape and the flags alone (nothing is loaded).

An ESTIMATE, part by part, of what this trainer keeps on a GPU: the fp32 actor with its gradients and
AdamW state, PPO's critic (a copy of the backbone, trained the same way), the frozen reference (bf16,
only when --kl-coef > 0), the weight monitor's copy of the quantized projections, the rollout engine's share of the GPU (vLLM takes --gpu-memory-utilization
of it for weights + KV cache; sleep level 1 hands it back during the update), one micro-batch's
activations under bf16 autocast (all of them, or with --gradient-checkpointing each layer's input plus
one layer's) and one chunk of fp32 logits.
"""
import json
import os
from dataclasses import dataclass

GIB = 2 ** 30


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool

    @property
    def head_dim(self):
        return self.hidden // self.heads

    @property
    def embedding_params(self):
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def decoder_linear_params(self):
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (attn + mlp)

    def activation_bytes_per_token_layer(self) -> int:
        """Kept for backward under bf16 autocast: the two RMSNorm inputs in fp32 (8h), attention's
        input, q/k/v and output in bf16 (~6h + 4 kv*head_dim), SwiGLU's input, gate, up, silu(gate) and
        their product in bf16 (2h + 8i)."""
        return 16 * self.hidden + 8 * self.intermediate + 4 * self.kv_heads * self.head_dim

    @property
    def params(self):
        return self.embedding_params + self.decoder_linear_params + self.layers * 2 * self.hidden + self.hidden


# hub ids the presets name (a local folder is read from its config.json instead)
KNOWN_SHAPES = {
    "Qwen/Qwen2.5-0.5B-Instruct": ModelShape(24, 896, 4864, 14, 2, 151936, tied=True),
    "Qwen/Qwen2.5-1.5B-Instruct": ModelShape(28, 1536, 8960, 12, 2, 151936, tied=True),
    "Qwen/Qwen2.5-Math-7B": ModelShape(28, 3584, 18944, 28, 4, 152064, tied=False),
}


def model_shape(model: str | None) -> ModelShape | None:
    if model is None:  # the embedded default
        return ModelShape(4, 192, 512, 6, 2, 128, tied=True)
    if model in KNOWN_SHAPES:
        return KNOWN_SHAPES[model]
    path = os.path.join(os.path.expanduser(model), "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        c = json.load(f)
    return ModelShape(c["num_hidden_layers"], c["hidden_size"], c["intermediate_size"], c["num_attention_heads"],
                      c.get("num_key_value_heads", c["num_attention_heads"]), c["vocab_size"],
                      tied=c.get("tie_word_embeddings", False))


def micro_batch_tokens(cfg) -> int:
    """Padded tokens of one micro-batch: --max-tokens-per-micro-batch, else its sequences at their longest
    (--shared-prompt: each group's prompt once)."""
    prompt, response = cfg.max_prompt_tokens or 256, cfg.max_new_tokens
    if cfg.max_tokens_per_micro_batch:
        return cfg.max_tokens_per_micro_batch
    if getattr(cfg, "shared_prompt", False):
        groups = max(1, cfg.micro_batch_size // cfg.group_size)
        return groups * packed_row_tokens(prompt, response, min(cfg.group_size, cfg.micro_batch_size))
    return cfg.micro_batch_size * (prompt + response)


def budget_below_one_sequence(max_tokens: int | None, longest_prompt: int, max_new_tokens: int) -> str | None:
    """One line where --max-tokens-per-micro-batch is below the longest prompt plus its response: what runs then."""
    if max_tokens is None or max_tokens >= longest_prompt + max_new_tokens:
        return None
    return (f"--max-tokens-per-micro-batch {max_tokens} is below the longest prompt plus --max-new-tokens "
            f"({longest_prompt} + {max_new_tokens} tokens): a sequence (with --shared-prompt, a prompt and one "
            f"response) longer than it runs alone in its micro-batch, over the budget; nothing is dropped or cut")


def packed_row_tokens(prompt: int, response: int, group: int) -> int:
    """Tokens of one packed row `[prompt | r1 | ... | rG]`."""
    return prompt + group * response


def group_forward_flops(shape: ModelShape, prompt: int, response: int, group: int, shared: bool) -> float:
    """Forward FLOPs of one group's log-probs: the decoder's matmuls on every token it runs, attention's two
    products on every (query, key) pair the kernel computes (the whole square of a row: a masked pair still
    costs), the lm_head on the response tokens only. Unshared: G rows of prompt + response; shared: one packed row."""
    attention_per_pair = 4 * shape.layers * shape.heads * shape.head_dim
    if shared:
        width = packed_row_tokens(prompt, response, group)
        tokens, pairs = width, width ** 2
    else:
        tokens, pairs = group * (prompt + response), group * (prompt + response) ** 2
    head = shape.vocab * shape.hidden
    return 2 * shape.decoder_linear_params * tokens + attention_per_pair * pairs + 2 * head * group * response


def shared_prompt_saving(shape: ModelShape, prompt: int, response: int, group: int) -> float:
    """How many times fewer forward (and backward) FLOPs a group costs with --shared-prompt."""
    return (group_forward_flops(shape, prompt, response, group, shared=False)
            / group_forward_flops(shape, prompt, response, group, shared=True))


def memory_plan(cfg, shape: ModelShape, gpu_gib: float = 80.0, logprob_chunk_tokens: int = 1024) -> dict:
    """GiB per part; 'peak' = what is resident during the update plus the larger of the two phases."""
    p = shape.params
    trained = 4 + 4 + 8  # fp32 weights, fp32 gradients, AdamW's two fp32 moments (bytes per parameter)
    tokens = micro_batch_tokens(cfg)
    one_layer = shape.activation_bytes_per_token_layer()
    if cfg.gradient_checkpointing:  # each layer's fp32 input is kept, one layer is recomputed at a time
        activations = tokens * (shape.layers * 4 * shape.hidden + one_layer)
    else:
        activations = tokens * shape.layers * one_layer
    logits = 3 * logprob_chunk_tokens * shape.vocab * 4  # one chunk: logits, softmax, gradient
    checkpointing = "gradient checkpointing" if cfg.gradient_checkpointing else "all layers kept"
    rows = max(1, tokens // packed_row_tokens(cfg.max_prompt_tokens or 256, cfg.max_new_tokens, cfg.group_size))
    mask = rows * min(tokens, packed_row_tokens(cfg.max_prompt_tokens or 256, cfg.max_new_tokens, cfg.group_size)) ** 2 * 6
    plan = {
        "actor (fp32 weights + grads + AdamW)": p * trained / GIB,
        "critic (PPO: backbone copy, trained)": (p - (shape.vocab * shape.hidden if not shape.tied else 0)) * trained / GIB
        if cfg.algo == "ppo" else 0.0,
        "reference (bf16, frozen; none when --kl-coef 0)": p * 2 / GIB if cfg.kl_coef > 0 else 0.0,
        # metrics.WeightUpdateMonitor keeps the last sync's projections for Eq. 13-14: fp32 weights + 1-byte codes
        "weight monitor (fp32 copy + codes of each quantized projection; none when --quant none)":
            shape.decoder_linear_params * (4 + 1) / GIB if cfg.quant != "none" else 0.0,
        f"rollout engine ({cfg.quant}; weights + KV cache, --gpu-memory-utilization)": cfg.gpu_memory_utilization * gpu_gib,
        f"update: activations of one {tokens}-token micro-batch (bf16 autocast, {checkpointing})": activations / GIB,
        "update: fp32 logits of one log-prob chunk": logits / GIB,
        # pack_groups' fp32 additive mask, and its bf16 copy inside attention under autocast
        "update: block attention mask of one micro-batch's packed rows (--shared-prompt)":
            mask / GIB if getattr(cfg, "shared_prompt", False) else 0.0,
    }
    resident = sum(v for k, v in plan.items() if k.startswith(("actor", "critic", "reference", "weight monitor")))
    rollout = plan[next(k for k in plan if k.startswith("rollout engine"))]
    update = sum(v for k, v in plan.items() if k.startswith("update"))
    plan["peak (resident + max(rollout, update); sleep frees the engine)"] = resident + max(rollout, update)
    plan[f"fits one {gpu_gib:.0f} GiB GPU"] = plan["peak (resident + max(rollout, update); sleep frees the engine)"] <= gpu_gib
    return plan
