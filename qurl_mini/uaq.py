"""Update-Aware Quantization (QuRL section 4.3): a one-time invariant rescaling before training.

    W X = (W / s) (s X)                                            (Eq. 11)

The factor s on the activations is folded into the RMSNorm that feeds the projections, so the
network computes exactly the same function. Only projections right after an RMSNorm can take it: q/k/v after
input_layernorm (the paper's Fig. 5, whose caption names Q/K/V only) and, by the same argument, gate/up after
post_attention_layernorm (this project's extension).
o_proj and down_proj have no norm in front of them and are not rescaled (`FOLDS`).

What changes is the quantization picture. The rescaled weights shrink by s, and with them their
per-channel grid step (amax / qmax) and their quantization error. Their gradient grows by s
(dL/dW' = s dL/dW). Under SGD the step grows with it, so update / grid step grows by s^2: that is
Eq. 12's argument. This trainer uses AdamW, whose step is about lr whatever the gradient's scale
(it divides by the gradient's running RMS). The step stays and the grid shrinks, so update / grid
step grows by about s. For Eq. 13, a ratio of squared norms over all quantized weights, that
predicts a growth of 1 / (f / s^2 + 1 - f), f = `rescaled_share(model)`.
"""
import torch
from .infra.errors import OneLineError

# (norm that feeds the projections, the projections it feeds) in a Qwen2/Llama-style layer
FOLDS = (
    ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
)


class UAQError(OneLineError, ValueError):
    """The model cannot be folded; the message names the layer."""


def _get(module, dotted: str):
    for part in dotted.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


def _decoder_layers(model):
    layers = _get(model, "model.layers")
    if layers is None:
        raise UAQError(f"UAQ cannot fold {type(model).__name__}: it has no model.layers decoder stack")
    return layers


def _check_foldable(model) -> None:
    for i, layer in enumerate(_decoder_layers(model)):
        for norm_name, proj_names in FOLDS:
            norm = _get(layer, norm_name)
            if norm is None or not isinstance(getattr(norm, "weight", None), torch.Tensor):
                raise UAQError(f"UAQ cannot fold model.layers.{i}: no {norm_name} with a weight to absorb s")
            if getattr(norm, "bias", None) is not None:
                raise UAQError(f"UAQ cannot fold model.layers.{i}.{norm_name}: a norm with a bias is not RMSNorm")
            for proj_name in proj_names:
                if not isinstance(_get(layer, proj_name), torch.nn.Linear):
                    raise UAQError(f"UAQ cannot fold model.layers.{i}: no linear {proj_name} after {norm_name}")


@torch.no_grad()
def apply_uaq(model, s: float):
    """In place, once: norm.weight *= s and the following projections' input columns /= s."""
    if not s > 0:
        raise UAQError(f"--uaq-scale must be > 0, got {s}")
    if s == 1.0:  # off
        return model
    _check_foldable(model)
    already = getattr(model.config, "uaq_scale", 1.0)
    if already != 1.0:
        raise UAQError(f"UAQ was already applied to this model (uaq_scale={already}); it is one-time")
    for layer in _decoder_layers(model):
        for norm_name, proj_names in FOLDS:
            _get(layer, norm_name).weight.mul_(s)  # s * X, absorbed by the norm
            for proj_name in proj_names:
                _get(layer, proj_name).weight.div_(s)  # W / s, column-wise (Eq. 11)
    model.config.uaq_scale = float(s)
    return model


@torch.no_grad()
def rescaled_share(model) -> float:
    """Share of the decoder layers' squared linear-weight norm that sits in the projections UAQ rescales."""
    rescaled = total = 0.0
    for layer in _decoder_layers(model):
        folded = {id(_get(layer, p)) for _, projs in FOLDS for p in projs}
        for module in layer.modules():
            if isinstance(module, torch.nn.Linear):
                norm2 = module.weight.float().pow(2).sum().item()
                total += norm2
                rescaled += norm2 if id(module) in folded else 0.0
    return rescaled / total
