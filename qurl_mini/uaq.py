"""Update-Aware Quantization (QuRL section 4.3): a one-time invariant rescaling before training.

    W X = (W / s) (s X)                                            (Eq. 11)

The factor s on the activations is folded into the RMSNorm that feeds the projections, so
the network computes exactly the same function. What changes is the quantization picture:
the weights shrink by s (quantization error shrinks by s) while their gradient grows by s
(dL/dW' = s * dL/dW), so one optimizer step moves them s times further (Eq. 12).
"""
import torch

# (norm that feeds the projections, the projections it feeds) in a Qwen2/Llama-style layer
FOLDS = (
    ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
)


class UAQError(ValueError):
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
