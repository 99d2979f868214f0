"""The shared-prompt step (--shared-prompt): a group's prompt once, its responses after it, in one row.

An exact speed-up, to read after the plain path (actor.token_logprobs, batch.micro_batch_slices). The G
responses of a prompt share it token for token, so the actor can run the prompt once and let each response
attend to it. Each response sees the prompt and its own earlier tokens, never another response, at the
positions it would have in its own row: every log-prob is the same sum as in the plain rows, in another order
(docs/shared-prompt.md). actor.shared_prompt_logprobs gives them back in the plain [N, L-1] layout, so nothing
after the actor knows which layout ran; tests/test_shared_prompt.py checks that the two agree.
"""
from dataclasses import dataclass

import torch

from .batch import SequenceBatch


@dataclass
class PackedRows:
    """Packed rows and where each response token's log-prob comes from and goes back to.

    input_ids, position_ids: [R, W]; attention_bias: [R, 1, W, W], 0 where a query may attend a key, the dtype's
    min elsewhere (additive, as HF's eager and sdpa attention take a 4D mask as it is); hidden_index: [T] flat
    index into [R * W] of the hidden state that scores each response token; target_ids: [T] that token;
    out_index: [T] flat index into the unshared [n, L-1] layout; out_shape: (n, L-1)."""
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_bias: torch.Tensor
    hidden_index: torch.Tensor
    target_ids: torch.Tensor
    out_index: torch.Tensor
    out_shape: tuple

    def to(self, device) -> "PackedRows":
        return PackedRows(*(t.to(device) for t in (self.input_ids, self.position_ids, self.attention_bias,
                                                    self.hidden_index, self.target_ids, self.out_index)), self.out_shape)

    def gather(self, per_position: torch.Tensor) -> torch.Tensor:
        """[R, W, ...] -> [T, ...]: the entry that scores each response token. index_select, not indexing: the
        prompt's last position is taken G times, and indexing's backward adds those G gradients with atomic adds
        in a thread-timed order on a CPU (not reproducible from run to run); index_select's adds them in order."""
        return per_position.flatten(0, 1).index_select(0, self.hidden_index)

    def unpack(self, per_token: torch.Tensor) -> torch.Tensor:
        """[T] values of the response tokens -> the unshared [n, L-1] layout (0 elsewhere)."""
        out = per_token.new_zeros(self.out_shape[0] * self.out_shape[1])
        return out.index_put((self.out_index,), per_token).view(self.out_shape)


def row_spans(seq: SequenceBatch) -> list[tuple[int, int]]:
    """(prompt length, response length) of each row: its response tokens are the targets under response_mask,
    right after the prompt (a row without response tokens is all prompt)."""
    spans = []
    for attended, response in zip(seq.attention_mask.sum(-1).tolist(), seq.response_mask.sum(-1).tolist()):
        spans.append((int(attended - response), int(response)))
    return spans


def prompt_groups(seq: SequenceBatch) -> list[int]:
    """Sizes of the runs of consecutive rows that share their prompt token for token (a step's groups)."""
    sizes, previous = [], None
    for row, (prompt, _) in zip(seq.input_ids, row_spans(seq)):
        key = tuple(row[:prompt].tolist())
        if sizes and key == previous:
            sizes[-1] += 1
        else:
            sizes.append(1)
        previous = key
    return sizes


def split_groups(seq: SequenceBatch, group_sizes: list[int], max_rows: int, max_tokens: int | None = None) -> list[int]:
    """The groups cut where one packed row `[prompt | responses]` would hold more than max_rows responses, or
    (max_tokens given: it overrides max_rows) more than max_tokens tokens: sub-rows `[prompt | some responses]`,
    each with at least one response."""
    spans, pieces, start = row_spans(seq), [], 0
    for size in group_sizes:
        count, width = 0, spans[start][0]
        for prompt, response in spans[start:start + size]:
            if count and (width + response > max_tokens if max_tokens is not None else count == max_rows):
                pieces.append(count)
                count, width = 0, prompt
            count, width = count + 1, width + response
        pieces.append(count)
        start += size
    return pieces


def pack_groups(seq: SequenceBatch, group_sizes: list[int]) -> PackedRows:
    """One row per group of consecutive rows sharing a prompt: `[prompt | r1 | ... | rk]`, right-padded.

    The mask of a group of two responses a (2 tokens) and b (3 tokens) after a 3-token prompt p
    (query down, key across; 1 = attends):

                p0 p1 p2 a0 a1 b0 b1 b2
            p0   1
            p1   1  1
            p2   1  1  1
            a0   1  1  1  1
            a1   1  1  1  1  1
            b0   1  1  1  .  .  1
            b1   1  1  1  .  .  1  1
            b2   1  1  1  .  .  1  1  1
      positions  0  1  2  3  4  3  4  5

    a0 and b0 are scored from p2's hidden state (the prompt's last), a1 from a0's, b1 from b0's, and so on."""
    spans, n, targets = row_spans(seq), len(seq), seq.response_mask.shape[1]
    rows, positions, segments, hidden_index, target_ids, out_index = [], [], [], [], [], []
    start = 0
    for r, size in enumerate(group_sizes):
        prompt = spans[start][0]
        ids, pos, seg = seq.input_ids[start, :prompt].tolist(), list(range(prompt)), [0] * prompt
        for k, i in enumerate(range(start, start + size), start=1):
            p, length = spans[i]
            if p != prompt or seq.input_ids[i, :p].tolist() != ids[:prompt]:
                raise ValueError(f"row {i} does not share row {start}'s prompt: it cannot be packed with it")
            at = len(ids)  # where this response starts in the packed row
            ids += seq.input_ids[i, p:p + length].tolist()
            pos += range(p, p + length)
            seg += [k] * length
            for j in range(length):
                hidden_index.append((prompt - 1 if j == 0 else at + j - 1, r))
                target_ids.append(ids[at + j])
                out_index.append(i * targets + p - 1 + j)
        rows.append(ids)
        positions.append(pos)
        segments.append(seg)
        start += size
    width = max(map(len, rows))
    input_ids = torch.zeros((len(rows), width), dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    segment = torch.full((len(rows), width), -1, dtype=torch.long)  # -1: padding
    for r, (ids, pos, seg) in enumerate(zip(rows, positions, segments)):
        input_ids[r, :len(ids)], position_ids[r, :len(pos)], segment[r, :len(seg)] = (
            torch.tensor(ids), torch.tensor(pos), torch.tensor(seg))
    query, key = segment[:, :, None], segment[:, None, :]
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    allowed = causal & (key >= 0) & ((key == 0) | (key == query))
    allowed |= torch.eye(width, dtype=torch.bool)  # padding queries attend themselves: no all-masked row
    bias = torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)[:, None]
    flat_hidden = torch.tensor([r * width + c for c, r in hidden_index], dtype=torch.long)
    return PackedRows(input_ids, position_ids, bias, flat_hidden, torch.tensor(target_ids, dtype=torch.long),
                      torch.tensor(out_index, dtype=torch.long), (n, targets))


def packed_micro_batches(seq: SequenceBatch, max_rows: int, max_tokens: int | None = None) -> list[slice]:
    """Micro-batches of whole packed rows, as consecutive rows of `seq`. A micro-batch holds at most max_rows
    sequences, or (with max_tokens) packed rows x its longest packed row <= max_tokens; a group that alone is over
    either is split into sub-rows (`split_groups`). Two sub-rows of one group never share a micro-batch (together
    they would be over), so `prompt_groups` of a micro-batch gives its packed rows again."""
    pieces = split_groups(seq, prompt_groups(seq), max_rows, max_tokens)
    spans, batches, start, first = row_spans(seq), [], 0, 0
    current, longest = [], 0
    for size in pieces:
        width = spans[start][0] + sum(r for _, r in spans[start:start + size])
        over_rows = sum(current) + size > max_rows
        over_tokens = max_tokens is not None and (len(current) + 1) * max(longest, width) > max_tokens
        if current and (over_tokens if max_tokens is not None else over_rows):
            batches.append(slice(first, start))
            current, longest, first = [], 0, start
        current.append(size)
        longest = max(longest, width)
        start += size
    return batches + [slice(first, start)] if current else batches
