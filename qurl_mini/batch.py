"""One step's training data: packed prompt+response rows and the per-token tensors scored on them."""
from dataclasses import dataclass, fields, replace

import torch


@dataclass
class SequenceBatch:
    """Prompt+response rows, right-padded. Per-token tensors are [N, L-1], aligned with targets
    input_ids[:, 1:]; response_mask is 1 where the target is a response token (the picture: `pack_sequences`)."""
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor

    def __len__(self):
        return self.input_ids.shape[0]

    def __getitem__(self, rows) -> "SequenceBatch":
        return SequenceBatch(self.input_ids[rows], self.attention_mask[rows], self.response_mask[rows])

    @property
    def width(self) -> int:
        """Columns up to the last attended one of any row (at least 2, so there is one target):
        the columns beyond are attended by no row, so dropping them changes no output."""
        attended = self.attention_mask.any(0).nonzero()
        last = attended[-1].item() + 1 if len(attended) else 0
        return min(self.input_ids.shape[1], max(last, 2))

    def to(self, device) -> "SequenceBatch":
        return SequenceBatch(self.input_ids.to(device), self.attention_mask.to(device), self.response_mask.to(device))

    def trimmed(self) -> "SequenceBatch":
        w = self.width
        return SequenceBatch(self.input_ids[:, :w], self.attention_mask[:, :w], self.response_mask[:, :w - 1])


def micro_batch_slices(seq: SequenceBatch, max_rows: int, max_tokens: int | None = None) -> list[slice]:
    """Consecutive rows per micro-batch: `max_rows` of them, or (with `max_tokens`) greedily as many as
    keep rows x longest row <= max_tokens, the rows padded to their own longest; a single row longer
    than max_tokens is a micro-batch of its own."""
    n = len(seq)
    if max_tokens is None:
        return [slice(i, min(i + max_rows, n)) for i in range(0, n, max_rows)]
    columns = torch.arange(1, seq.attention_mask.shape[1] + 1)
    lengths = (seq.attention_mask.bool() * columns).amax(-1).clamp(min=2).tolist()  # last attended column + 1
    slices, start, longest = [], 0, 0
    for i, length in enumerate(lengths):
        if i > start and (i - start + 1) * max(longest, length) > max_tokens:
            slices.append(slice(start, i))
            start, longest = i, 0
        longest = max(longest, length)
    return slices + [slice(start, n)] if n else []


def pack_sequences(prompts: list[list[int]], responses: list[list[int]], pad_id: int) -> SequenceBatch:
    """Rows prompt + response, right-padded. A row with prompt p0 p1 p2 and response a0 a1 (another row is one
    token longer), and where each per-token tensor [N, L-1] has its column t:

        column t          0    1    2    3    4    5
        input_ids         p0   p1   p2   a0   a1   pad
        attention_mask    1    1    1    1    1    0
        target            p1   p2   a0   a1   pad        input_ids[:, t + 1], scored by the logit at t
        response_mask     0    0    1    1    0          where the target is a response token

    The response starts at t = len(p) - 1: the prompt's last logit (p2's) scores a0, the first response token.
    (tests/test_logprobs.py reads this picture and checks it against the code.)"""
    rows = [p + r for p, r in zip(prompts, responses)]
    width = max(map(len, rows))
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    response_mask = torch.zeros((len(rows), width - 1))
    for i, (p, r) in enumerate(zip(prompts, responses)):
        input_ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        attention[i, : len(p) + len(r)] = 1
        response_mask[i, len(p) - 1: len(p) - 1 + len(r)] = 1
    return SequenceBatch(input_ids, attention, response_mask)


def align_per_token(values: list[list[float]], prompts: list[list[int]], width: int) -> torch.Tensor:
    """Place one value per response token at its position in the [N, L-1] layout."""
    out = torch.zeros((len(values), width - 1))
    for i, (v, p) in enumerate(zip(values, prompts)):
        out[i, len(p) - 1: len(p) - 1 + len(v)] = torch.tensor(v, dtype=torch.float32)
    return out


@dataclass
class Experience:
    """Everything the update needs, row-aligned: exp[rows] selects a minibatch of all of it.

    prox_logp: pi_prox (full-precision actor before the update), behav_logp: pi_behav (the
    rollout engine), ref_logp: the frozen reference (None without KL); old_values and returns:
    PPO's critic (None otherwise)."""
    sequences: SequenceBatch
    prox_logp: torch.Tensor
    behav_logp: torch.Tensor
    advantages: torch.Tensor
    ref_logp: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    returns: torch.Tensor | None = None

    @property
    def mask(self) -> torch.Tensor:
        return self.sequences.response_mask

    def __len__(self):
        return len(self.sequences)

    def _map(self, fn) -> "Experience":
        """fn applied to every per-token tensor (all but `sequences`; None stays None)."""
        return replace(self, **{f.name: None if getattr(self, f.name) is None else fn(getattr(self, f.name))
                                for f in fields(self) if f.name != "sequences"})

    def __getitem__(self, rows) -> "Experience":
        return replace(self._map(lambda t: t[rows]), sequences=self.sequences[rows])

    def to(self, device) -> "Experience":
        return replace(self._map(lambda t: t.to(device)), sequences=self.sequences.to(device))

    def trimmed(self) -> "Experience":
        """Without the padding columns beyond the longest row (per-token tensors cut to match)."""
        w = self.sequences.width
        return replace(self._map(lambda t: t[:, :w - 1]), sequences=self.sequences.trimmed())
