"""Greedy accuracy on held-out problems (full-precision HF model, batched)."""
import torch

from .data import Problem, reward


@torch.no_grad()
def greedy_accuracy(model, tokenizer, problems: list[Problem], max_new_tokens: int, batch_size: int = 100):
    """(accuracy, [(question, response, correct)]): greedy decoding, exact '####' match."""
    was_training = model.training
    model.eval()
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    results = []
    try:
        for i in range(0, len(problems), batch_size):
            chunk = problems[i:i + batch_size]
            enc = tokenizer([p.prompt for p in chunk], return_tensors="pt", padding=True, add_special_tokens=False)
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
            texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            results += [(p.question, t, reward(t, p) == 1.0) for p, t in zip(chunk, texts)]
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    return sum(r[2] for r in results) / max(1, len(results)), results
