"""Problems in GSM8K format ({"question", "answer": "...#### <number>"}) and their reward.

Two sources: a seeded synthetic arithmetic task (the embedded default, nothing to download)
and GSM8K itself, loaded with `datasets` from the hub or from a local jsonl/parquet file.
"""
import json
import logging
import os
import random
import re
from dataclasses import dataclass
from .infra.errors import OneLineError

log = logging.getLogger("qurl_mini")

PROMPT_TEMPLATE = "Q: {question}\nA: "
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


class DataError(OneLineError, ValueError):
    """Bad data: the message is one line that names the file and the row."""


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str  # full solution text ending in "#### <number>"
    target: float  # the number after "####"

    @property
    def prompt(self) -> str:
        return PROMPT_TEMPLATE.format(question=self.question)


def extract_answer(text: str) -> float | None:
    """The number after the last '####' (GSM8K convention), or None."""
    if "####" not in text:
        return None
    match = _NUMBER.search(text.rsplit("####", 1)[1])
    if match is None:
        return None
    try:
        return float(match.group().replace(",", ""))
    except ValueError:
        return None


def reward(response: str, problem: Problem) -> float:
    """1.0 for an exact numeric match of the '####' answer, else 0.0."""
    predicted = extract_answer(response)
    return float(predicted is not None and abs(predicted - problem.target) < 1e-6)


def decode_and_score(tokenizer, problem: Problem, responses: list[list[int]]) -> tuple[list[str], list[float]]:
    """The responses' texts (special tokens dropped) and their rewards: the rollout's and eval.py's scoring."""
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in responses]
    return texts, [reward(t, problem) for t in texts]


# ----- the embedded synthetic task -----------------------------------------------------------

_NAMES = ["Ann", "Ben", "Cat", "Dan", "Eve", "Fay", "Gus", "Ivy", "Joe", "Kim", "Leo", "Mia"]
_ITEMS = ["apples", "books", "coins", "pens", "cards", "eggs", "shells", "stamps"]


def synthetic_problem(rng: random.Random, max_number: int) -> Problem:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b = rng.randint(1, max_number), rng.randint(1, max_number)
    if rng.random() < 0.5:
        question = f"{name} has {a} {item} and gets {b} more. How many {item} now?"
        c, work = a + b, f"{a}+{b}={a + b}"
    else:
        a, b = max(a, b), min(a, b)
        question = f"{name} has {a} {item} and gives away {b}. How many {item} now?"
        c, work = a - b, f"{a}-{b}={a - b}"
    return Problem(question, f"{work}\n#### {c}", float(c))


def synthetic_splits(n_train: int, n_test: int, max_number: int, seed: int = 0):
    """Seeded train/test splits; test questions never appear in train."""
    rng = random.Random(seed)
    test, seen = [], set()
    while len(test) < n_test:
        p = synthetic_problem(rng, max_number)
        if p.question not in seen:
            seen.add(p.question)
            test.append(p)
    train = []
    while len(train) < n_train:
        p = synthetic_problem(rng, max_number)
        if p.question not in seen:
            train.append(p)
    return train, test


# ----- GSM8K (hub or local file) --------------------------------------------------------------


def rows_to_problems(rows, source: str) -> list[Problem]:
    """Rows with 'question' and 'answer'; rows whose answer lacks '####' are skipped and counted."""
    problems, skipped = [], []
    for i, row in enumerate(rows):
        if "question" not in row or "answer" not in row:
            raise DataError(f"{source}: row {i + 1} has no 'question'/'answer' field (keys: {sorted(row)})")
        target = extract_answer(str(row["answer"]))
        if target is None:
            skipped.append(i + 1)
            continue
        problems.append(Problem(str(row["question"]), str(row["answer"]), target))
    if skipped:
        log.warning("%s: skipped %d row(s) whose answer has no '#### <number>' (first: row %d)",
                    source, len(skipped), skipped[0])
    if not problems:
        raise DataError(f"{source}: no usable rows (every answer lacks '#### <number>')")
    return problems


def _check_jsonl(path: str) -> None:
    """Name the first line that is not JSON, before `datasets` gives a long traceback."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}: line {lineno} is not JSON ({e.msg})") from None


def load_local(path: str) -> list[Problem]:
    import datasets

    if not os.path.isfile(path):
        raise DataError(f"--data {path}: no such file")
    if os.path.getsize(path) == 0:
        raise DataError(f"--data {path}: the file is empty")
    kind = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(os.path.splitext(path)[1])
    if kind is None:
        raise DataError(f"--data {path}: expected a .jsonl, .json or .parquet file")
    if kind == "json":
        _check_jsonl(path)
    rows = datasets.load_dataset(kind, data_files=path, split="train")
    if len(rows) == 0:
        raise DataError(f"--data {path}: the file has no rows")
    return rows_to_problems(rows, path)


def load_gsm8k_hub(split: str) -> list[Problem]:
    import datasets

    rows = datasets.load_dataset("openai/gsm8k", "main", split=split)
    return rows_to_problems(rows, f"openai/gsm8k[{split}]")


def load_problems(data: str, test_data: str | None, n_test: int, seed: int, max_number: int):
    """(train, test) for --data {synthetic, gsm8k, FILE}; a single file is split by seed."""
    if data == "synthetic":  # a fixed held-out pool, so the train split never depends on n_test
        train, test = synthetic_splits(20000, 1000, max_number, seed=1234)
        return train, test[:n_test]
    if data == "gsm8k":
        return load_gsm8k_hub("train"), load_gsm8k_hub("test")[:n_test]
    train = load_local(data)
    if test_data:
        return train, load_local(test_data)[:n_test]
    if len(train) < 2:
        raise DataError(f"--data {data}: need at least 2 rows to hold out a test split")
    shuffled = train[:]
    random.Random(seed).shuffle(shuffled)
    n_held = min(n_test, max(1, len(shuffled) // 10))
    return shuffled[n_held:], shuffled[:n_held]


class PromptOrder:
    """Seeded, resumable data order: epoch-wise permutations read at a cursor."""

    def __init__(self, n: int, seed: int, cursor: int = 0):
        self.n, self.seed, self.cursor = n, seed, cursor
        self._epoch, self._cached = -1, []

    def _order(self, epoch: int) -> list[int]:
        if epoch != self._epoch:
            self._epoch, self._cached = epoch, list(range(self.n))
            random.Random(self.seed * 100003 + epoch).shuffle(self._cached)
        return self._cached

    def take(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            epoch, pos = divmod(self.cursor, self.n)
            out.append(self._order(epoch)[pos])
            self.cursor += 1
        return out
