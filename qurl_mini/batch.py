"""One step's training data: packed prompt+response rows and the per-token tensors scored on them."""
from dataclasses import dataclass, fields, replace

import torch


@dataclass
class SequenceBatch:
    """Prompt+response rows, right-padded. Per-token tensors are [N, L-1], aligned with targets
    input_ids[:, 1:]; response_mask is 1 where the target is a response token."""
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor

    def __len__(self):
        return self.input_ids.shape[0]


def pack_sequences(prompts: list[list[int]], responses: list[list[int]], pad_id: int) -> SequenceBatch:
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

    def __getitem__(self, rows) -> "Experience":
        seq = self.sequences
        picked = {f.name: (None if getattr(self, f.name) is None else getattr(self, f.name)[rows])
                  for f in fields(self) if f.name != "sequences"}
        return replace(self, sequences=SequenceBatch(seq.input_ids[rows], seq.attention_mask[rows],
                                                     seq.response_mask[rows]), **picked)

    def split(self, size: int) -> list["Experience"]:
        """Consecutive chunks of `size` rows (micro-batches)."""
        return [self[i:i + size] for i in range(0, len(self), size)]
