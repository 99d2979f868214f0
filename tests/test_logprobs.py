"""Per-token log-probs in chunks equal the plain log_softmax gather, without [N, L, vocab] logits."""
import pytest
import torch
import torch.nn.functional as F

from qurl_mini.actor import token_logprobs
from qurl_mini.embedded import build_char_tokenizer, tiny_qwen2_config

VOCAB = 151_936  # Qwen2.5's


@pytest.fixture(scope="module")
def big_vocab_model():
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    config = tiny_qwen2_config(build_char_tokenizer(), layers=1, hidden=32, heads=2, kv_heads=1, vocab_size=VOCAB)
    return Qwen2ForCausalLM(config).float()


def _plain(model, ids, attention, temperature):
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
    return F.log_softmax(logits / temperature, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def _batch():
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (3, 20))
    attention = torch.ones_like(ids)
    attention[2, 14:] = 0  # a padded row
    return ids, attention


def test_chunked_logprobs_equal_the_plain_gather_and_bound_the_largest_logits(big_vocab_model):
    ids, attention = _batch()
    largest = []
    hook = big_vocab_model.lm_head.register_forward_hook(lambda m, i, out: largest.append(out.numel()))
    with torch.no_grad():
        chunked = token_logprobs(big_vocab_model, ids, attention, temperature=0.7, chunk_tokens=16)
    hook.remove()
    with torch.no_grad():
        plain = _plain(big_vocab_model, ids, attention, 0.7)
    assert chunked.dtype == torch.float32 and chunked.shape == (3, 19)
    assert torch.allclose(chunked, plain, atol=1e-5, rtol=0)
    # 57 positions in chunks of 16: the head never saw more than 16 positions at once
    assert max(largest) == 16 * VOCAB and len(largest) == 4
    # what a micro-batch of the 0.5B preset needs at the default chunk: 1024 x 151,936 fp32 = 0.58 GiB
    from qurl_mini.actor import LOGPROB_CHUNK_TOKENS

    assert LOGPROB_CHUNK_TOKENS * VOCAB * 4 / 2**30 < 0.6


def test_chunked_logprobs_give_the_same_gradient(big_vocab_model):
    ids, attention = _batch()
    weights = torch.randn(3, 19)
    params = [big_vocab_model.lm_head.weight, big_vocab_model.model.layers[0].mlp.up_proj.weight]
    chunked = token_logprobs(big_vocab_model, ids, attention, chunk_tokens=16)
    g_chunked = torch.autograd.grad((chunked * weights).sum(), params)
    g_plain = torch.autograd.grad((_plain(big_vocab_model, ids, attention, 1.0) * weights).sum(), params)
    for a, b in zip(g_chunked, g_plain):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


def test_only_the_response_positions_get_the_lm_head_and_equal_the_full_computation():
    """`only=`: the lm_head runs on the masked positions alone; there the values (and gradients) equal the full
    computation's, elsewhere they are 0."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from qurl_mini.actor import token_logprobs

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    ids = torch.randint(0, 300, (3, 20))
    attention = torch.ones_like(ids)
    only = torch.zeros(3, 19)
    only[:, 12:] = 1
    only[2, 15:] = 0
    calls = []
    head = model.get_output_embeddings()
    hook = head.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[0]))
    part = token_logprobs(model, ids, attention, only=only)
    hook.remove()
    full = token_logprobs(model, ids, attention)
    assert calls == [int(only.sum())]  # the head saw the response positions only
    assert torch.allclose(part[only > 0], full[only > 0], atol=1e-5) and (part[only == 0] == 0).all()
    g_part = torch.autograd.grad((token_logprobs(model, ids, attention, only=only) * only).sum(), head.weight)[0]
    g_full = torch.autograd.grad((token_logprobs(model, ids, attention) * only).sum(), head.weight)[0]
    assert torch.allclose(g_part, g_full, atol=1e-5)


def test_the_picture_of_a_plain_row_is_what_pack_sequences_makes():
    """batch.pack_sequences' docstring draws one row: prompt p0 p1 p2, response a0 a1, one padding column (the other
    row is a token longer); its target row and response_mask row are read back and checked here."""
    from qurl_mini.batch import pack_sequences

    names = {"p0": 10, "p1": 11, "p2": 12, "a0": 20, "a1": 21, "pad": 0}
    seq = pack_sequences([[10, 11, 12], [10, 11, 12]], [[20, 21], [30, 31, 32]], pad_id=0)
    drawn = {}
    for line in pack_sequences.__doc__.splitlines():
        cells = line.split()
        if cells and cells[0] in ("input_ids", "attention_mask", "target", "response_mask"):
            values = []
            for c in cells[1:]:  # the drawn columns, up to the words beside them
                if not (c in names or c.isdigit()):
                    break
                values.append(int(names.get(c, c)))
            drawn[cells[0]] = values
    assert drawn["input_ids"] == seq.input_ids[0].tolist() == [10, 11, 12, 20, 21, 0]
    assert drawn["attention_mask"] == seq.attention_mask[0].tolist() == [1, 1, 1, 1, 1, 0]
    assert drawn["target"] == seq.input_ids[0, 1:].tolist()  # column t's target is input_ids[t + 1]
    assert drawn["response_mask"] == seq.response_mask[0].int().tolist() == [0, 0, 1, 1, 0]


def test_the_logit_at_t_scores_the_token_at_t_plus_1():
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(2)
    model = Qwen2ForCausalLM(tiny_qwen2_config(build_char_tokenizer(), layers=1, hidden=32, heads=2, kv_heads=1))
    ids = torch.randint(3, 60, (1, 6))
    with torch.no_grad():
        logp = token_logprobs(model, ids, torch.ones_like(ids), temperature=0.7)
        logits = model(input_ids=ids).logits[0] / 0.7
    for t in range(5):
        assert logp[0, t].item() == pytest.approx(logits[t].log_softmax(-1)[ids[0, t + 1]].item(), abs=1e-5)
