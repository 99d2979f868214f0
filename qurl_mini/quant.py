"""INT8 / FP8 quantization of the actor for rollout (QuRL section 3, Eq. 2).

Weights: symmetric, per output channel, static.  Activations: symmetric, per token, dynamic.
This matches vLLM's W8A8 kernels and the compressed-tensors checkpoint format they load.
INT4 (beyond the paper, a stress format that makes the sampler/learner gap visible at toy scale):
weights only, symmetric per group of INT4_GROUP input columns, always emulated in an unquantized engine.
"""
import contextlib
import json
import os
import shutil

import torch
import torch.nn.functional as F

FORMATS = ("int8", "fp8", "int4")
QMAX = {"int8": 127.0, "fp8": 448.0, "int4": 7.0}  # largest code: int8, float8_e4m3fn, int4
INT4_GROUP = 32  # input columns sharing one int4 scale
EPS = 1e-12  # keeps the scale of an all-zero row finite


def _to_codes(x_over_scale: torch.Tensor, fmt: str) -> torch.Tensor:
    if fmt == "int8":
        return torch.round(x_over_scale).clamp(-128, 127).to(torch.int8)
    if fmt == "int4":  # held in int8 storage
        return torch.round(x_over_scale).clamp(-8, 7).to(torch.int8)
    if fmt == "fp8":
        return x_over_scale.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    raise ValueError(f"unknown quantization format {fmt!r}; choose from {FORMATS}")


def quantize_weight(w: torch.Tensor, fmt: str):
    """(q, scale) for a [out, in] weight: scale = amax(|w|, dim=1) / qmax, shape [out, 1], float32
    (int4: one scale per group of INT4_GROUP columns, shape [out, in / INT4_GROUP])."""
    if fmt not in QMAX:
        raise ValueError(f"unknown quantization format {fmt!r}; choose from {FORMATS}")
    w = w.detach().float()
    if fmt == "int4":
        out, cols = w.shape
        if cols % INT4_GROUP:
            raise ValueError(f"int4: {cols} input columns are not a multiple of the group size {INT4_GROUP}")
        groups = w.view(out, cols // INT4_GROUP, INT4_GROUP)
        scale = groups.abs().amax(dim=-1, keepdim=True).clamp(min=EPS) / QMAX[fmt]
        return _to_codes(groups / scale, fmt).view(out, cols), scale.squeeze(-1)
    scale = w.abs().amax(dim=1, keepdim=True).clamp(min=EPS) / QMAX[fmt]
    return _to_codes(w / scale, fmt), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if scale.shape[-1] in (1, q.shape[-1]):  # per channel
        return q.float() * scale
    groups = scale.shape[-1]  # per group of columns
    return (q.float().view(*q.shape[:-1], groups, -1) * scale[..., None]).view(q.shape)


def quantize_activation(x: torch.Tensor, fmt: str):
    """Per-token dynamic quantization of [..., in] activations: one scale per row."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=EPS) / QMAX[fmt]
    return _to_codes(x / scale, fmt), scale


def fake_quant_linear(x, weight, bias, fmt, activations: bool = True):
    """What a W8A8 kernel computes, in float: Q(x) @ Q(W)^T + b (activations=False: x @ Q(W)^T + b)."""
    x_hat = dequantize(*quantize_activation(x, fmt)) if activations else x.float()
    w_hat = dequantize(*quantize_weight(weight, fmt))
    out = F.linear(x_hat, w_hat, None if bias is None else bias.float())
    return out.to(x.dtype)


def quant_target_names(model) -> list[str]:
    """Module names of the decoder projections (not embeddings, norms or lm_head)."""
    return [name for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}" and "lm_head" not in name]


@contextlib.contextmanager
def fake_quantized(model, fmt: str, activations: bool = True):
    """Inside the block the HF model computes like the W8A8 engine (weights and activations;
    activations=False: weights only, like an engine that emulates the format)."""
    modules = [model.get_submodule(n) for n in quant_target_names(model)]
    originals = [m.forward for m in modules]
    for m in modules:
        m.forward = (lambda mod: lambda x: fake_quant_linear(x, mod.weight, mod.bias, fmt, activations))(m)
    try:
        yield model
    finally:
        for m, forward in zip(modules, originals):
            m.forward = forward


# ----- checkpoint format (compressed-tensors) --------------------------------------------------


def quantized_state(model, fmt: str, dtype=torch.bfloat16, emulate: bool = False):
    """(name, tensor) pairs in checkpoint format: `*.weight` codes + `*.weight_scale` for each
    decoder projection, everything else as `dtype`. Also returns {name: (codes, scale)}.
    emulate=True instead gives those weights rounded to the grid, as `dtype` (FP8 emulation)."""
    targets = {f"{n}.weight" for n in quant_target_names(model)}
    pairs, quantized = [], {}
    for name, tensor in model.state_dict().items():
        if name not in targets:
            pairs.append((name, tensor.detach().to(dtype)))
            continue
        q, scale = quantized[name] = quantize_weight(tensor, fmt)
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
    """An HF folder that plain `vllm.LLM(model=out_dir)` loads as a W8A8 model
    (`pairs`: the model's `quantized_state`, when the caller already has it)."""
    from safetensors.torch import save_file

    tmp_dir = out_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    os.makedirs(tmp_dir)
    if pairs is None:
        pairs, _ = quantized_state(model, fmt)
    tied = getattr(model.config, "tie_word_embeddings", False)
    tensors = {n: t.contiguous() for n, t in pairs if not (tied and n == "lm_head.weight")}
    save_file(tensors, os.path.join(tmp_dir, "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["quantization_config"] = compressed_tensors_config(fmt)
    config["torch_dtype"] = "bfloat16"
    with open(os.path.join(tmp_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp_dir)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp_dir, out_dir)
    return out_dir


# ----- Appendix A statistics ------------------------------------------------------------------


class WeightUpdateMonitor:
    """Per sync: Eq. 13 normalized update, Eq. 14 normalized quantization error, and the
    fraction of quantized codes that changed (how much of the update survives quantization)."""

    def __init__(self):
        self.previous_weights = None
        self.previous_codes = None

    @torch.no_grad()
    def measure(self, model, quantized: dict) -> dict:
        """`quantized` is {weight name: (codes, scale)} of the weights just synced."""
        weights = {n: model.get_parameter(n).detach().float().clone() for n in quantized}
        norm2 = sum(w.pow(2).sum().item() for w in weights.values())
        error2 = sum((dequantize(q, s) - weights[n]).pow(2).sum().item() for n, (q, s) in quantized.items())
        stats = {"quant_error_norm": error2 / norm2}  # Eq. 14
        codes = {n: q.view(torch.uint8) for n, (q, _) in quantized.items()}
        if self.previous_weights is not None:
            prev_norm2 = sum(w.pow(2).sum().item() for w in self.previous_weights.values())
            update2 = sum((weights[n] - self.previous_weights[n]).pow(2).sum().item() for n in weights)
            stats["weight_update_norm"] = update2 / prev_norm2  # Eq. 13
            changed = sum((codes[n] != self.previous_codes[n]).sum().item() for n in codes)
            stats["codes_changed_frac"] = changed / sum(c.numel() for c in codes.values())
        self.previous_weights, self.previous_codes = weights, codes
        return stats
