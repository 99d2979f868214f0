"""A few of a step's sampled responses, token by token: what the quantized sampler (pi_behav) and the full-precision
learner (pi_prox) gave each token, and what each objective of loss.py does to it at R = 1 (the first minibatch's
view, where pi_theta = pi_prox). `step_tokens` makes one step's record; `TokenLog` appends it to tokens.jsonl and
remakes tokens.html (token_page.py) from that file; `read_token_lines` reads the file back, skipping what is broken.

Every mark comes from calling the objective itself (loss.POLICY_OBJECTIVES) twice, with the run's cap C and with no
cap (C = inf): where the capped weight is 0 the token has no gradient ('masked'); where it is lower than the
uncapped one it was 'truncated'; where the upper clip bound is higher it was 'widened' (ACR); and where the surrogate
takes its clipped branch at R = 1 it is 'clipped' (only the naive objective, whose ratio there is R_hat = rho).
"""
import json
import math
import os

import torch

from .loss import POLICY_OBJECTIVES, sequence_ratio
from .metrics import MetricsLog
from .token_page import render_page

SETTINGS = ("objective", "tis_cap", "clip_low", "clip_high", "quant", "quant_group", "model", "temperature")


def float32_list(values: torch.Tensor) -> list:
    """Each value as the shortest decimal that reads back as the same float32 (numpy's str of a float32; non-finite:
    None, valid JSON)."""
    return [float(s) if math.isfinite(float(s)) else None for s in values.detach().float().cpu().numpy().astype(str)]


def compact(values: torch.Tensor):
    """One number where every token has the same (a response's advantage under GRPO), else the list."""
    flat = float32_list(values)
    return flat[0] if flat and all(v == flat[0] for v in flat) else flat


def objective_effects(prox, behav, advantages, mask, *, clip_low, clip_high, tis_cap) -> dict:
    """{objective: (weight [N, T], upper bound [N, T], lower bound [N, T], {mark: bool [N, T]})} at R = 1, from the
    objective functions themselves (module docstring), on the [N, T] tensors of the chosen rows."""
    logp = prox  # the first minibatch: pi_theta = pi_prox, so R = 1 and R_hat = rho, formed as policy_loss forms them
    R, R_hat, rho = torch.exp(logp - prox), torch.exp(logp - behav), torch.exp(prox - behav)
    seq = sequence_ratio(rho, mask)
    effects = {}
    for name, objective in POLICY_OBJECTIVES.items():
        capped = objective(R, R_hat, rho, clip_low, clip_high, tis_cap, seq=seq)
        free = objective(R, R_hat, rho, clip_low, clip_high, math.inf, seq=seq)
        weight, free_weight = (torch.as_tensor(s.weight, dtype=rho.dtype).expand_as(rho) for s in (capped, free))
        high, free_high = (torch.as_tensor(s.high, dtype=rho.dtype).expand_as(rho) for s in (capped, free))
        low = torch.as_tensor(capped.low, dtype=rho.dtype).expand_as(rho)
        marks = {"truncated": (weight > 0) & (weight < free_weight), "masked": weight == 0,
                 "widened": high > free_high,
                 "clipped": capped.clipped_above(advantages) | capped.clipped_below(advantages)}
        effects[name] = (weight, high, low, marks)
    return effects


def chosen_rows(max_abs_log_rho: list, count: int, responses: list | None = None) -> list[tuple[int, str]]:
    """(row, why): the count - 1 rows whose largest |log rho| is largest, and one typical row (its largest |log rho|
    nearest the median of all rows'); count 1: the largest only. A row given as None (no token) is left out, and so is
    a row whose tokens (`responses`: prompt and response ids) repeat one already chosen, while others are left."""
    rows = [i for i, v in enumerate(max_abs_log_rho) if v is not None]
    if count <= 0 or not rows:
        return []
    responses = responses or [(i,) for i in range(len(max_abs_log_rho))]
    seen, distinct, repeats = set(), [], []
    for i in sorted(rows, key=lambda i: -max_abs_log_rho[i]):
        (repeats if tuple(responses[i]) in seen else distinct).append(i)
        seen.add(tuple(responses[i]))
    by_size = distinct + repeats
    largest = by_size[:max(1, count - 1)]
    chosen = [(i, "largest |log rho|") for i in largest]
    rest = [i for i in by_size if i not in largest]
    if count >= 2 and rest:
        median = sorted(max_abs_log_rho[i] for i in rows)[len(rows) // 2]
        chosen.append((min(rest, key=lambda i: (i in repeats, abs(max_abs_log_rho[i] - median))), "typical"))
    return chosen


def token_pieces(tokenizer, ids: list[int]) -> list[str]:
    """Each token's text on its own (a byte-level piece of a longer character decodes to U+FFFD)."""
    return tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False)


def step_tokens(step: int, experience, samples, tokenizer, cfg, label: str | None = None) -> dict:
    """One step's record: cfg.token_page_responses responses (`chosen_rows`), per token its id, text piece,
    log pi_behav, log pi_prox and advantage; per objective its weight, clip bounds and marks (`objective_effects`);
    per response its reward (and its group's), question and sequence log-ratio sum_t log rho_t. cfg: anything with
    token_page_responses, clip_low, clip_high, tis_cap and objective (and, for the page, the SETTINGS)."""
    seq, mask = experience.sequences, experience.mask
    present = mask > 0
    log_rho = torch.where(present, experience.prox_logp - experience.behav_logp, torch.zeros_like(mask))
    lengths = present.sum(-1).tolist()
    largest = [log_rho[i].abs().max().item() if n else None for i, n in enumerate(lengths)]
    rows = chosen_rows(largest, cfg.token_page_responses, [ids[a > 0].tolist() for ids, a in zip(seq.input_ids,
                                                                                               seq.attention_mask)])
    rewards = torch.cat(samples.rewards).tolist()
    questions = [p.question for p, group in zip(samples.problems, samples.groups) for _ in group]
    group_rewards = [r.tolist() for r, group in zip(samples.rewards, samples.groups) for _ in group]
    picked = torch.tensor([i for i, _ in rows], dtype=torch.long)
    effects = objective_effects(experience.prox_logp[picked], experience.behav_logp[picked],
                                experience.advantages[picked], mask[picked], clip_low=cfg.clip_low,
                                clip_high=cfg.clip_high, tis_cap=cfg.tis_cap)
    responses = []
    for k, (row, why) in enumerate(rows):
        where = present[row].nonzero().squeeze(-1)  # target input_ids[row, t + 1] is a response token
        ids = seq.input_ids[row, where + 1].tolist()
        objectives = {}
        for name, (weight, high, low, marks) in effects.items():
            flagged = {mark: flags[k, where].nonzero().squeeze(-1).tolist() for mark, flags in marks.items()}
            objectives[name] = {"weight": compact(weight[k, where]), "high": compact(high[k, where]),
                                "low": compact(low[k, where]),
                                **{mark: ("all" if len(t) == len(ids) else t) for mark, t in flagged.items() if t}}
        responses.append({
            "row": row, "why": why, "question": questions[row] if row < len(questions) else "",
            "reward": rewards[row] if row < len(rewards) else None,
            "group_rewards": group_rewards[row] if row < len(group_rewards) else None,
            "prompt_ids": seq.input_ids[row, :where[0] + 1].tolist(), "ids": ids, "pieces": token_pieces(tokenizer, ids),
            "behav": float32_list(experience.behav_logp[row, where]), "prox": float32_list(experience.prox_logp[row, where]),
            "advantage": compact(experience.advantages[row, where]),
            "seq_log_ratio": float32_list(log_rho[row].sum().reshape(1))[0], "objectives": objectives})
    return {"step": step, "label": label or f"step {step}", "responses": responses,
            "settings": {name: getattr(cfg, name, None) for name in SETTINGS},
            "responses_in_step": len(lengths), "tokens_in_step": int(sum(lengths)),
            "empty_responses": sum(n == 0 for n in lengths)}


# ----- tokens.jsonl and tokens.html in a run folder ----------------------------------------------------------


class TokenLog:
    """The run folder's tokens.jsonl (a line per saved step; cut back on resume and cleared on a fresh start, like
    metrics.jsonl) and tokens.html, remade from it at each save."""

    def __init__(self, run_dir: str, cfg, resume_after_step: int | None = None):
        self.cfg, self.title = cfg, f"{cfg.run_name}: where the sampler and the learner disagree, token by token"
        self.lines = MetricsLog(os.path.join(run_dir, "tokens.jsonl"), resume_after_step=resume_after_step)
        self.page = os.path.join(run_dir, "tokens.html")
        if resume_after_step is None and os.path.exists(self.page):
            os.remove(self.page)  # an earlier run's
        elif resume_after_step is not None and os.path.exists(self.lines.path):
            write_page(self.lines.path, self.page, self.title)  # without the steps past the checkpoint

    def save(self, step: int, experience, samples, tokenizer) -> None:
        self.lines.write(step_tokens(step, experience, samples, tokenizer, self.cfg))
        write_page(self.lines.path, self.page, self.title)


def read_token_lines(path: str) -> tuple[list[dict], list[str]]:
    """(records, notes): each whole line of a tokens.jsonl, the last record of a step winning (a step redone after a
    resume); a torn or foreign line, a response that is not whole, or one with no tokens is left out, said in a note."""
    if not os.path.exists(path):
        return [], [f"{os.path.basename(path)}: no saved tokens (no step saved yet, or --token-page-responses 0)"]
    records, notes = {}, []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            text = raw.decode("utf-8", errors="replace")
            if "\ufffd" in text and b"\xef\xbf\xbd" not in raw:
                notes.append(f"line {number}: not valid UTF-8; its bad bytes are shown as \ufffd")
            try:
                record = json.loads(text)
            except (json.JSONDecodeError, RecursionError):
                notes.append(f"line {number}: not JSON (a write cut short?), skipped")
                continue
            if not isinstance(record, dict) or not isinstance(record.get("responses"), list):
                notes.append(f"line {number}: not a saved step (no 'responses' list), skipped")
                continue
            record["responses"] = whole_responses(record, f"line {number}", notes)
            records[str(record.get("step", number))] = record
    return list(records.values()), notes


RESPONSE_LISTS = ("ids", "pieces", "behav", "prox")


def whole_responses(record: dict, source: str, notes: list[str]) -> list[dict]:
    """The responses of a record that the page can show: a dict whose per-token lists are all there, equally long and
    not empty; each other one said in a note."""
    kept = []
    for i, response in enumerate(record["responses"]):
        where = f"{source} ({record.get('label', 'step ?')}), response {i + 1}"
        lists = [response.get(key) if isinstance(response, dict) else None for key in RESPONSE_LISTS]
        if not all(isinstance(values, list) for values in lists):
            notes.append(f"{where}: lacks its per-token lists {RESPONSE_LISTS}, skipped")
        elif len({len(values) for values in lists}) > 1:
            notes.append(f"{where}: its per-token lists differ in length, skipped")
        elif not lists[0]:
            notes.append(f"{where}: has 0 tokens, skipped")
        else:
            kept.append(response)
    return kept


def write_page(lines_path: str, page_path: str, title: str) -> str:
    """tokens.html from tokens.jsonl: a page that says what it skipped."""
    records, notes = read_token_lines(lines_path)
    return save_page(records, notes, page_path, title)


def save_page(records: list[dict], notes: list[str], page_path: str, title: str) -> str:
    """The page written whole (a temporary file renamed), so a run stopped mid-write leaves the last one."""
    tmp = page_path + ".tmp"
    with open(tmp, "w", encoding="utf-8", errors="replace") as f:
        f.write(render_page(records, notes, title))
    os.replace(tmp, page_path)
    return page_path


def save_records_page(records: list[dict], page_path: str, title: str) -> str:
    """The page of records made here and now (eval.py), numbered 1, 2, ... in their order."""
    notes = []
    for number, record in enumerate(records, 1):
        record["step"] = number
        record["responses"] = whole_responses(record, f"model {number}", notes)
    return save_page(records, notes, page_path, title)


# ----- eval.py --token-page: a model pair on held-out problems, without training ------------------------------

EVAL_PROBLEMS, EVAL_GROUP = 8, 4  # the first 8 held-out problems, 4 responses each


@torch.no_grad()
def engine_vs_actor(engine, actor, tokenizer, prompts, problems, cfg, step: int, label: str) -> dict:
    """A step's record without the step: EVAL_GROUP responses to each of the first EVAL_PROBLEMS problems from the
    (quantized) engine at cfg.temperature, with pi_behav; pi_prox from the full-precision actor; group-normalized
    advantages of their exact-match rewards (GRPO's). cfg: as `step_tokens` wants it."""
    from .actor import batched_logprobs
    from .advantages import grpo_advantages
    from .batch import Experience, align_per_token, pack_sequences
    from .data import decode_and_score
    from .sampling import Samples

    chosen, samples = problems[:EVAL_PROBLEMS], Samples()
    groups = engine.generate([prompts.ids(p) for p in chosen], n=EVAL_GROUP, temperature=cfg.temperature,
                             max_tokens=cfg.max_new_tokens, stop_token_ids=[tokenizer.eos_token_id])
    for problem, group in zip(chosen, groups):
        rewards = torch.tensor(decode_and_score(tokenizer, problem, [r.response_ids for r in group])[1])
        samples.add(problem, group, rewards, rewards)
    rollouts = samples.rollouts()
    prompt_ids = [r.prompt_ids for r in rollouts]
    sequences = pack_sequences(prompt_ids, [r.response_ids for r in rollouts], tokenizer.pad_token_id)
    behav = align_per_token([r.behav_logprobs for r in rollouts], prompt_ids, sequences.input_ids.shape[1])
    prox = batched_logprobs(actor, sequences, micro_batch_size=EVAL_GROUP, temperature=cfg.temperature)
    advantages = grpo_advantages(torch.cat(samples.rewards), EVAL_GROUP)[:, None] * sequences.response_mask
    return step_tokens(step, Experience(sequences, prox, behav, advantages), samples, tokenizer, cfg, label)
