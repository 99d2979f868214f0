"""Quantization of the actor for rollout (QuRL section 3, Eq. 2), and the formats of the mismatch dial.

INT8 / FP8 (the paper): weights symmetric per output channel, static; activations symmetric per token,
dynamic. This matches vLLM's W8A8 kernels and the compressed-tensors checkpoint format they load.
INT6 .. INT2 (beyond the paper): a dial of sampler/learner mismatch. Weights only, symmetric, one scale
per group of `group` input columns (0 = per output channel), always emulated: the weights are rounded
to the grid and run in an unquantized engine (the HF actor computes alike with `fake_quantized`).
"""
import contextlib
import json
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from .infra.errors import OneLineError

EPS = 1e-12  # keeps the scale of an all-zero row finite


@dataclass(frozen=True)
class QuantFormat:
    """A rollout format: its code range, and whether vLLM runs it as a real W8A8 kernel."""
    qmax: float  # largest code (the scale maps amax(|w|) here)
    qmin: float  # smallest code
    vllm_kernel: bool  # True: W8A8 (weights per channel, activations per token); False: emulated, weights only
    default_group: int  # input columns sharing one weight scale; 0 = one scale per output channel
    float_codes: bool = False  # fp8 e4m3 instead of integers

    def to_codes(self, x_over_scale: torch.Tensor) -> torch.Tensor:
        if self.float_codes:
            return x_over_scale.clamp(self.qmin, self.qmax).to(torch.float8_e4m3fn)
        return torch.round(x_over_scale).clamp(self.qmin, self.qmax).to(torch.int8)  # int2..int8 in int8 storage


def _int_format(bits: int, **kw) -> QuantFormat:
    return QuantFormat(qmax=2.0 ** (bits - 1) - 1, qmin=-2.0 ** (bits - 1), **kw)


FORMATS = {
    "int8": _int_format(8, vllm_kernel=True, default_group=0),
    "fp8": QuantFormat(qmax=448.0, qmin=-448.0, vllm_kernel=True, default_group=0, float_codes=True),
    **{f"int{bits}": _int_format(bits, vllm_kernel=False, default_group=32) for bits in (6, 5, 4, 3, 2)},
}
QMAX = {name: f.qmax for name, f in FORMATS.items()}


class QuantError(OneLineError, ValueError):
    """A quantization setting that does not fit the model; the message is one line."""


def _format(fmt: str) -> QuantFormat:
    if fmt not in FORMATS:
        raise QuantError(f"unknown quantization format {fmt!r}; choose from {tuple(FORMATS)}")
    return FORMATS[fmt]


def resolve_group(fmt: str, group: int | None) -> int:
    """--quant-group as used: the format's default when not given."""
    return _format(fmt).default_group if group is None else group


def describe(fmt: str, group: int | None = None) -> str:
    """E.g. 'int3, per output channel' or 'int2, groups of 32' (for logs and tables)."""
    group = resolve_group(fmt, group)
    return f"{fmt}, " + (f"groups of {group}" if group else "per output channel")


def quantize_weight(w: torch.Tensor, fmt: str, group: int | None = None):
    """(q, scale) for a [out, in] weight: scale = amax(|w|) / qmax per output channel, shape [out, 1],
    float32 (group > 0: per group of `group` input columns, shape [out, in / group])."""
    spec, group = _format(fmt), resolve_group(fmt, group)
    w = w.detach().float()
    if group:
        out, cols = w.shape
        if cols % group:
            raise QuantError(f"{fmt}: {cols} input columns are not a multiple of the group size {group}")
        groups = w.view(out, cols // group, group)
        scale = groups.abs().amax(dim=-1, keepdim=True).clamp(min=EPS) / spec.qmax
        return spec.to_codes(groups / scale).view(out, cols), scale.squeeze(-1)
    scale = w.abs().amax(dim=1, keepdim=True).clamp(min=EPS) / spec.qmax
    return spec.to_codes(w / scale), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if scale.shape[-1] in (1, q.shape[-1]):  # one scale per output channel [out, 1], or per element (broadcast)
        return q.float() * scale
    groups = scale.shape[-1]  # per group of columns
    return (q.float().view(*q.shape[:-1], groups, -1) * scale[..., None]).view(q.shape)


def quantize_activation(x: torch.Tensor, fmt: str):
    """Per-token dynamic quantization of [..., in] activations: one scale per row."""
    x = x.float()
    spec = _format(fmt)
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=EPS) / spec.qmax
    return spec.to_codes(x / scale), scale


def fake_quant_linear(x, weight, bias, fmt, activations: bool = True, group: int | None = None):
    """What a W8A8 kernel computes, in float: Q(x) @ Q(W)^T + b (activations=False: x @ Q(W)^T + b)."""
    x_hat = dequantize(*quantize_activation(x, fmt)) if activations else x.float()
    w_hat = dequantize(*quantize_weight(weight, fmt, group))
    out = F.linear(x_hat, w_hat, None if bias is None else bias.float())
    return out.to(x.dtype)


KEPT_ATTR = "qurl_unquantized"  # the model config's list of decoder projections the rollout engine keeps unquantized
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # vLLM runs each group as one layer


def quant_target_names(model) -> list[str]:
    """Module names of the decoder projections (not embeddings, norms or lm_head), less those kept unquantized."""
    kept = set(getattr(model.config, KEPT_ATTR, None) or ())
    return [name for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}" and "lm_head" not in name
            and name not in kept]


def keep_unquantized(model, pattern: str | None) -> list[str]:
    """Keep the decoder projections whose name matches `pattern` (a regex, searched) unquantized in the rollout
    engine: the field's repair for layers with outlier activations (NeMo-RL keeps the first and last layers in
    bf16, FlashRL the lm_head in fp32). Recorded in the model's config, so checkpoints carry it."""
    import re

    model.config.__dict__.pop(KEPT_ATTR, None)
    if not pattern:
        return []
    try:
        regex = re.compile(pattern)
    except re.error as e:
        raise QuantError(f"--quant-keep {pattern!r} is not a regular expression ({e})") from None
    kept = [n for n in quant_target_names(model) if regex.search(n)]
    if not kept:
        raise QuantError(f"--quant-keep {pattern!r} matches no decoder projection (e.g. {quant_target_names(model)[0]})")
    for group in FUSED:
        for name in kept:
            prefix, _, leaf = name.rpartition(".")
            siblings = {f"{prefix}.{g}" for g in group}
            if leaf in group and not siblings <= set(kept) and all(model.get_submodule(s) for s in siblings):
                raise QuantError(f"--quant-keep {pattern!r} keeps {name} but not all of {sorted(siblings)}: vLLM runs "
                                 "them as one fused layer, quantized or not")
    setattr(model.config, KEPT_ATTR, kept)
    return kept


def check_group(model, fmt: str, group: int | None) -> None:
    """One line if a group size does not divide the input columns of every decoder projection."""
    group = resolve_group(fmt, group)
    if group < 0:
        raise QuantError(f"--quant-group must be >= 0 (0 = one scale per output channel), got {group}")
    if group and FORMATS[fmt].vllm_kernel:
        raise QuantError(f"--quant {fmt} is vLLM's W8A8 kernel, per output channel: --quant-group must be 0, got {group}")
    columns = {model.get_submodule(n).in_features for n in quant_target_names(model)}
    if group and any(c % group for c in columns):
        fitting = [g for g in (8, 16, 32, 64, 128, 256) if all(c % g == 0 for c in columns)]
        raise QuantError(f"--quant-group {group} does not divide the decoder projections' input columns "
                         f"{sorted(columns)}; use 0 (per output channel) or one of {fitting}")


@contextlib.contextmanager
def fake_quantized(model, fmt: str, activations: bool = True, group: int | None = None):
    """Inside the block the HF model computes like the W8A8 engine (weights and activations;
    activations=False: weights only, like an engine that emulates the format)."""
    modules = [model.get_submodule(n) for n in quant_target_names(model)]
    originals = [m.forward for m in modules]
    for m in modules:
        m.forward = (lambda mod: lambda x: fake_quant_linear(x, mod.weight, mod.bias, fmt, activations, group))(m)
    try:
        yield model
    finally:
        for m, forward in zip(modules, originals):
            m.forward = forward


@contextlib.contextmanager
def rounded_weights(model, dtype: torch.dtype, keep: set[str] = frozenset()):
    """Inside the block every parameter but those named in `keep` is rounded to `dtype` (and back), as an engine
    of that dtype holds it; restored exactly afterwards. An update smaller than dtype's resolution vanishes
    here as it does in the engine (a bf16 engine does not see a 1e-7 step of a norm weight)."""
    saved = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name not in keep and p.dtype != dtype:
                saved[name] = p.detach().clone()
                p.copy_(p.to(dtype))
    try:
        yield model
    finally:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in saved:
                    p.copy_(saved[name])


# ----- checkpoint format (compressed-tensors) --------------------------------------------------


def quantized_state(model, fmt: str, dtype=torch.bfloat16, emulate: bool = False, group: int | None = None):
    """(name, tensor) pairs in checkpoint format: `*.weight` codes + `*.weight_scale` for each
    decoder projection, everything else as `dtype`. Also returns {name: (codes, scale)}.
    emulate=True instead gives those weights rounded to the grid, as `dtype` (the emulated formats)."""
    targets = {f"{n}.weight" for n in quant_target_names(model)}
    pairs, quantized = [], {}
    for name, tensor in model.state_dict().items():
        if name not in targets:
            pairs.append((name, tensor.detach().to(dtype)))
            continue
        q, scale = quantized[name] = quantize_weight(tensor, fmt, group)
        if emulate:
            pairs.append((name, dequantize(q, scale).to(dtype)))
        else:
            pairs += [(name, q), (name.removesuffix("weight") + "weight_scale", scale)]
    return pairs, quantized


def compressed_tensors_config(fmt: str) -> dict:
    kind = {"int8": "int", "fp8": "float"}[fmt]
    return {
        "quant_method": "compressed-tensors",
        "format": {"int8": "int-quantized", "fp8": "float-quantized"}[fmt],
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": kind, "symmetric": True, "strategy": "channel",
                        "dynamic": False, "group_size": None, "observer": "minmax"},
            "input_activations": {"num_bits": 8, "type": kind, "symmetric": True, "strategy": "token",
                                  "dynamic": True, "group_size": None, "observer": None},
            "output_activations": None,
        }},
        "ignore": ["lm_head"],
    }


def save_quantized_checkpoint(model, tokenizer, out_dir: str, fmt: str, pairs=None) -> str:
    """An HF folder that plain `vllm.LLM(model=out_dir)` loads as a W8A8 model, written into out_dir
    (`pairs`: the model's `quantized_state`, when the caller already has it)."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    if pairs is None:
        pairs, _ = quantized_state(model, fmt)
    tied = getattr(model.config, "tie_word_embeddings", False)
    tensors = {n: t.contiguous() for n, t in pairs if not (tied and n == "lm_head.weight")}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["quantization_config"] = compressed_tensors_config(fmt)
    config["quantization_config"]["ignore"] += list(getattr(model.config, KEPT_ATTR, None) or ())
    config["torch_dtype"] = "bfloat16"
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return out_dir
