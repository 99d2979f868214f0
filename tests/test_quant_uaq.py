"""Quantizer contract, fake-quant, Appendix-A statistics, and UAQ's invariance (Eq. 11-12)."""
import pytest
import torch

from qurl_mini import metrics, quant
from qurl_mini.embedded import build_char_tokenizer, tiny_qwen2_config
from qurl_mini.uaq import FOLDS, UAQError, apply_uaq, rescaled_share


def test_int8_weight_quantization_is_symmetric_per_channel():
    w = torch.tensor([[0.5, -1.27, 0.01], [0.0, 0.0, 0.0], [2.54, 1.0, -0.3]])
    q, scale = quant.quantize_weight(w, "int8")
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (3, 1)
    assert scale[0, 0].item() == pytest.approx(1.27 / 127) and scale[2, 0].item() == pytest.approx(2.54 / 127)
    assert q[0].tolist() == [50, -127, 1] and q[2].tolist() == [127, 50, -15]
    assert q[1].tolist() == [0, 0, 0] and torch.isfinite(scale).all()  # all-zero row: finite, exact
    assert torch.equal(quant.dequantize(q, scale)[1], torch.zeros(3))
    assert (quant.dequantize(q, scale) - w).abs().max() <= scale.max() / 2 + 1e-7


def test_fp8_weight_quantization_uses_e4m3_with_amax_over_448():
    w = torch.tensor([[448.0, -3.0, 0.3], [0.0, 0.0, 0.0]]) * 0.01
    q, scale = quant.quantize_weight(w, "fp8")
    assert q.dtype == torch.float8_e4m3fn and scale[0, 0].item() == pytest.approx(4.48 / 448)
    # 448 exact; -3 exact; 0.3 rounds to e4m3's nearest code 0.3125
    assert q[0].float().tolist() == [448.0, -3.0, 0.3125]
    assert torch.isfinite(quant.dequantize(q, scale)).all() and q[1].float().abs().sum() == 0


def test_per_token_activation_quantization():
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0]])
    q, scale = quant.quantize_activation(x, "int8")
    assert scale.shape == (2, 1) and scale[0, 0].item() == pytest.approx(2 / 127)
    assert q[0].tolist() == [64, -127, 32] and q[1].tolist() == [0, 0, 0]


def test_fake_quant_linear_equals_integer_matmul():
    torch.manual_seed(0)
    x, w = torch.randn(5, 16), torch.randn(8, 16)
    qx, sx = quant.quantize_activation(x, "int8")
    qw, sw = quant.quantize_weight(w, "int8")
    integer = (qx.long() @ qw.long().T).double() * sx.double() * sw.double().T  # int32 accumulate, then scale
    assert torch.allclose(quant.fake_quant_linear(x, w, None, "int8").double(), integer, atol=1e-5)


def _tiny_model(seed=0):
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(tiny_qwen2_config(build_char_tokenizer(), layers=2, hidden=64, heads=4, kv_heads=2)).eval()


def test_quant_targets_are_decoder_projections_only():
    names = quant.quant_target_names(_tiny_model())
    assert len(names) == 2 * 7 and all(".layers." in n for n in names)
    assert not any("embed" in n or "norm" in n or "lm_head" in n for n in names)


def test_fake_quantized_model_is_close_but_not_equal():
    model = _tiny_model()
    ids = torch.randint(3, 100, (2, 12))
    exact = model(ids).logits
    with quant.fake_quantized(model, "int8"):
        approx = model(ids).logits
    assert 0 < (approx - exact).abs().max() < 0.1
    assert torch.equal(model(ids).logits, exact)  # restored on exit


def test_weight_update_monitor_matches_direct_calculation():
    model = _tiny_model()
    monitor = metrics.WeightUpdateMonitor()
    _, quantized = quant.quantized_state(model, "int8")
    first = monitor.measure(model, quantized)
    weights = {n: model.get_parameter(n).detach().clone() for n in quantized}
    num = sum((quant.dequantize(*quant.quantize_weight(w, "int8")) - w).pow(2).sum() for w in weights.values())
    assert first["quant_error_norm"] == pytest.approx((num / sum(w.pow(2).sum() for w in weights.values())).item())
    assert "weight_update_norm" not in first
    name = next(iter(quantized))
    with torch.no_grad():
        model.get_parameter(name).add_(1e-3)
    _, quantized = quant.quantized_state(model, "int8")
    second = monitor.measure(model, quantized)
    w = weights[name]
    expected = w.numel() * 1e-6 / sum(v.pow(2).sum() for v in weights.values()).item()
    assert second["weight_update_norm"] == pytest.approx(expected, rel=1e-3)  # Eq. 13
    changed = (quantized[name][0] != quant.quantize_weight(w, "int8")[0]).sum().item()
    total = sum(q.numel() for q, _ in quantized.values())
    assert second["codes_changed_frac"] == pytest.approx(changed / total) and changed > 0


def test_uaq_leaves_logits_unchanged_and_scales_gradients_by_s():
    s = 1.5
    torch.set_default_dtype(torch.float32)
    base, scaled = _tiny_model(), _tiny_model()
    apply_uaq(scaled, s)
    ids = torch.randint(3, 100, (2, 10))
    out_base, out_scaled = base(ids).logits, scaled(ids).logits
    assert torch.allclose(out_base, out_scaled, atol=1e-5)
    out_base.square().sum().backward()
    out_scaled.square().sum().backward()
    layer_b, layer_s = base.model.layers[1], scaled.model.layers[1]
    for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
        g_b = layer_b.get_submodule(proj).weight.grad
        g_s = layer_s.get_submodule(proj).weight.grad
        assert torch.allclose(g_s, s * g_b, rtol=1e-3, atol=1e-6), proj  # Eq. 12
        assert torch.allclose(layer_s.get_submodule(proj).weight, layer_b.get_submodule(proj).weight / s)
    assert torch.allclose(layer_s.input_layernorm.weight, s * layer_b.input_layernorm.weight)
    # o_proj / down_proj have no norm in front of them: untouched
    assert torch.equal(layer_s.self_attn.o_proj.weight, layer_b.self_attn.o_proj.weight)
    assert scaled.config.uaq_scale == s


def rescaled_codes(model) -> dict:
    """{weight name: (INT8 codes, scale)} of the projections UAQ rescales (q/k/v, gate/up)."""
    quantized = quant.quantized_state(model, "int8")[1]
    return {n: q for n, q in quantized.items() if any(f".{p}." in n for _, ps in FOLDS for p in ps)}


def test_uaq_changes_more_int8_codes_after_the_same_adamw_step():
    """Eq. 12's purpose: after UAQ (s = 1.5) the same AdamW step moves the rescaled weights as far while
    their grid step shrinks by s, so more of their INT8 codes change, about s times as many while the
    step is small against the grid (lr 1e-5: here ~2.4% of the codes at s = 1, ~3.6% at s = 1.5). The codes counted are the ones
    a sync sends (`WeightUpdateMonitor`), of the projections UAQ rescales (q/k/v, gate/up)."""
    torch.manual_seed(0)
    ids = torch.randint(3, 100, (2, 10))
    changed = {}
    for s in (1.0, 1.5):
        model = apply_uaq(_tiny_model().train(), s)
        monitor = metrics.WeightUpdateMonitor()
        monitor.measure(model, rescaled_codes(model))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)  # the trainer's optimizer
        model(ids).logits.square().mean().backward()
        opt.step()
        changed[s] = monitor.measure(model, rescaled_codes(model))["codes_changed_frac"]
    assert 0.01 < changed[1.0] < 0.2  # small steps: the count grows with update / grid step
    assert changed[1.5] / changed[1.0] == pytest.approx(1.5, rel=0.15)


@pytest.mark.parametrize("optimizer, growth", [("AdamW", 1.5), ("SGD", 1.5 ** 2)])
def test_uaq_grows_update_over_grid_step_by_s_under_adamw_and_s_squared_under_sgd(optimizer, growth):
    """AdamW's step is ~lr whatever the gradient's scale: the rescaled weights take the same step while
    their grid shrinks by s. SGD's step grows with the gradient (x s) on top: Eq. 12's s^2."""
    s, lr = 1.5, 1e-3
    torch.manual_seed(0)
    ids = torch.randint(3, 100, (2, 10))
    moved = {}
    for scale in (1.0, s):
        model = apply_uaq(_tiny_model().train(), scale)
        before = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
        opt = (torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0) if optimizer == "AdamW"  # the trainer's
               else torch.optim.SGD(model.parameters(), lr=lr))
        model(ids).logits.square().mean().backward()
        opt.step()
        step = (model.model.layers[0].self_attn.q_proj.weight.detach() - before).abs().mean()
        grid = quant.quantize_weight(before, "int8")[1].mean()  # per-channel grid step, amax / 127
        moved[scale] = (step / grid).item()
    assert moved[s] / moved[1.0] == pytest.approx(growth, rel=0.02)


def test_rescaled_share_is_the_squared_norm_share_of_q_k_v_gate_up():
    model = _tiny_model()
    norm2 = {n: p.pow(2).sum().item() for n, p in model.named_parameters() if n.endswith("proj.weight")}
    folded = [n for n in norm2 if any(f".{p}." in n for _, projs in FOLDS for p in projs)]
    assert len(norm2) == 14 and len(folded) == 10  # o_proj and down_proj of each layer are not rescaled
    assert rescaled_share(model) == pytest.approx(sum(norm2[n] for n in folded) / sum(norm2.values()), rel=1e-6)


def test_uaq_refuses_a_model_it_cannot_fold_naming_the_layer():
    model = _tiny_model()
    model.model.layers[1].post_attention_layernorm = torch.nn.LayerNorm(64)
    with pytest.raises(UAQError, match=r"model.layers.1.post_attention_layernorm"):
        apply_uaq(model, 1.5)
    with pytest.raises(UAQError, match="no model.layers"):
        apply_uaq(torch.nn.Linear(2, 2), 1.5)
    good = _tiny_model()
    apply_uaq(good, 1.5)
    with pytest.raises(UAQError, match="already applied"):
        apply_uaq(good, 1.5)
    with pytest.raises(UAQError, match="must be > 0"):
        apply_uaq(_tiny_model(), 0.0)


def test_int4_groups_have_their_own_scale_and_stay_on_the_grid():
    from qurl_mini.quant import FORMATS, dequantize, quantize_weight

    INT4_GROUP = FORMATS["int4"].default_group
    assert INT4_GROUP == 32

    torch.manual_seed(0)
    w = torch.randn(6, 4 * INT4_GROUP)
    w[:, :INT4_GROUP] *= 100  # one loud group must not coarsen the others
    q, scale = quantize_weight(w, "int4")
    assert q.dtype == torch.int8 and q.min() >= -8 and q.max() <= 7 and scale.shape == (6, 4)
    expected_scale = w.view(6, 4, INT4_GROUP).abs().amax(-1) / 7
    assert torch.allclose(scale, expected_scale)
    w_hat = dequantize(q, scale)
    err = (w_hat - w).abs().view(6, 4, INT4_GROUP)
    assert (err <= scale[..., None] / 2 + 1e-6).all()  # round-to-nearest: at most half a step per group
    assert err[:, 1:].max() < 0.2 * err[:, 0].max()
    with pytest.raises(ValueError, match="not a multiple of the group size"):
        quantize_weight(torch.randn(4, INT4_GROUP + 1), "int4")


@pytest.mark.parametrize("fmt, levels", [("int6", 64), ("int5", 32), ("int4", 16), ("int3", 8), ("int2", 4)])
@pytest.mark.parametrize("group", [0, 16])
def test_dial_formats_round_to_their_grid(fmt, levels, group):
    """b bits: codes in [-2^(b-1), 2^(b-1) - 1], the scale maps each channel's (or group's) amax to the
    largest code, and round-to-nearest leaves at most half a step: checked against a hand-made grid."""
    from qurl_mini.quant import dequantize, quantize_weight

    torch.manual_seed(1)
    w = torch.randn(5, 64)
    q, scale = quantize_weight(w, fmt, group)
    qmax = levels // 2 - 1
    assert q.min() >= -(levels // 2) and q.max() <= qmax
    cols = group or 64
    blocks = w.view(5, 64 // cols, cols)
    expected_scale = blocks.abs().amax(-1) / qmax
    assert torch.allclose(scale.view(5, -1), expected_scale)
    # the nearest point of the grid {k * scale : k in [qmin, qmax]}, by brute force
    grid = torch.arange(-(levels // 2), qmax + 1).float()
    points = expected_scale[..., None, None] * grid  # [5, blocks, 1, levels]
    nearest = points.squeeze(-2).gather(-1, (blocks[..., None] - points).abs().argmin(-1))
    assert torch.allclose(dequantize(q, scale), nearest.view(5, 64), atol=1e-6)
    assert len(torch.unique(q)) <= levels


def test_coarser_dial_formats_disagree_more():
    """Mean squared rounding error grows as bits fall (per channel), and groups reduce it."""
    from qurl_mini.quant import dequantize, quantize_weight

    torch.manual_seed(2)
    w = torch.randn(64, 128)
    err = {(f, g): (dequantize(*quantize_weight(w, f, g)) - w).pow(2).mean().item()
           for f in ("int8", "int6", "int5", "int4", "int3", "int2") for g in (0, 32) if not (f == "int8" and g)}
    per_channel = [err[(f, 0)] for f in ("int8", "int6", "int5", "int4", "int3", "int2")]
    assert per_channel == sorted(per_channel)
    assert all(err[(f, 32)] < err[(f, 0)] for f in ("int6", "int5", "int4", "int3", "int2"))


def test_check_group_names_the_columns():
    from qurl_mini.quant import QuantError, check_group

    model = _tiny_model()
    check_group(model, "int3", 0)
    check_group(model, "int3", 32)
    with pytest.raises(QuantError, match="--quant-group 48 does not divide"):
        check_group(model, "int3", 48)
    with pytest.raises(QuantError, match="per output channel"):
        check_group(model, "int8", 32)
