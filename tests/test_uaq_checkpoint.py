"""`quantize.py --fmt none --uaq-scale s`: a UAQ-rescaled, unquantized HF checkpoint any trainer (verl) starts from."""
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import quantize
from qurl_mini.embedded import build_char_tokenizer, tiny_qwen2_config


def write_model(path, dtype, seed=0):
    """A tiny Qwen2 with non-trivial RMSNorm weights (so the fold changes numbers), saved in `dtype`."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    tokenizer = build_char_tokenizer()
    model = Qwen2ForCausalLM(tiny_qwen2_config(tokenizer, layers=2, hidden=64, heads=4, kv_heads=2))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight"):
                p.uniform_(0.5, 1.5)
    model.to(dtype).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def run(args, capfd):
    try:
        code = quantize.main(args)
    except SystemExit as e:
        code = e.code
    out, err = capfd.readouterr()
    assert "Traceback" not in err, err
    return code, out, err


def logits(path, ids):
    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(ids).logits


def test_uaq_only_checkpoint_has_the_same_logits_in_float32(tmp_path, capfd):
    src, out = write_model(tmp_path / "in", torch.float32), str(tmp_path / "uaq")
    code, stdout, _ = run(["--model", src, "--fmt", "none", "--uaq-scale", "1.5", "--out", out, "--check"], capfd)
    assert code == 0 and f"wrote UAQ-rescaled (s=1.5) float32 HF checkpoint (not quantized) to {out}" in stdout
    assert "check (HF model before vs after UAQ, float32): |log p_uaq - log p_in| max 0.0000, mean 0.0000" in stdout
    config = json.load(open(f"{out}/config.json"))
    assert config["uaq_scale"] == 1.5 and "quantization_config" not in config
    before, after = load_file(f"{src}/model.safetensors"), load_file(f"{out}/model.safetensors")
    assert all(t.dtype == torch.float32 for t in after.values())
    for i in range(2):  # Eq. 11: the norms absorb s, the projections they feed are divided by it
        layer = f"model.layers.{i}."
        for norm, projs in (("input_layernorm", ("q", "k", "v")), ("post_attention_layernorm", ("gate", "up"))):
            torch.testing.assert_close(after[layer + norm + ".weight"], 1.5 * before[layer + norm + ".weight"])
            for proj in projs:
                name = layer + ("self_attn." if proj in "qkv" else "mlp.") + f"{proj}_proj.weight"
                torch.testing.assert_close(after[name], before[name] / 1.5)
        for name in (layer + "self_attn.o_proj.weight", layer + "mlp.down_proj.weight"):
            assert torch.equal(after[name], before[name])
    ids = torch.randint(3, 100, (2, 24), generator=torch.Generator().manual_seed(0))
    want, got = logits(src, ids), logits(out, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_uaq_only_keeps_bfloat16(tmp_path, capfd):
    src, out = write_model(tmp_path / "in", torch.bfloat16), str(tmp_path / "uaq")
    code, stdout, _ = run(["--model", src, "--fmt", "none", "--uaq-scale", "1.5", "--out", out], capfd)
    assert code == 0 and "bfloat16 HF checkpoint" in stdout
    assert all(t.dtype == torch.bfloat16 for t in load_file(f"{out}/model.safetensors").values())
    assert json.load(open(f"{out}/config.json"))["uaq_scale"] == 1.5
    ids = torch.randint(3, 100, (2, 24), generator=torch.Generator().manual_seed(0))
    want, got = logits(src, ids), logits(out, ids)
    # the same function up to bf16 rounding of the rescaled weights (8 bits of mantissa: ~0.4% each)
    assert (got - want).abs().max() < 0.02 * want.abs().max()


@pytest.mark.parametrize("flags, message", [
    ([], "error: --fmt none only applies UAQ: give --uaq-scale s != 1 (1.5 recommended)"),
    (["--uaq-scale", "0"], "error: --uaq-scale must be > 0, got 0.0"),
])
def test_uaq_only_bad_input_is_one_line(tmp_path, capfd, flags, message):
    src = write_model(tmp_path / "in", torch.float32)
    code, _, err = run(["--model", src, "--fmt", "none", "--out", str(tmp_path / "o"), *flags], capfd)
    assert code == 2 and err.strip().splitlines()[-1] == message


def test_uaq_is_one_time(tmp_path, capfd):
    src, once = write_model(tmp_path / "in", torch.float32), str(tmp_path / "once")
    assert run(["--model", src, "--fmt", "none", "--uaq-scale", "1.5", "--out", once], capfd)[0] == 0
    code, _, err = run(["--model", once, "--fmt", "none", "--uaq-scale", "1.5", "--out", str(tmp_path / "twice")],
                       capfd)
    assert code == 2 and err.strip().splitlines()[-1] == \
        "error: UAQ was already applied to this model (uaq_scale=1.5); it is one-time"
