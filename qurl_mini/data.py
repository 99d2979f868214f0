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
from .infra.paths import first_line

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

ROW_FORMAT = 'one JSON object a line: {"question": "...", "answer": "... #### <number>"} (or .parquet with those columns)'


def row_problem(row) -> tuple[Problem | None, str]:
    """The row as a Problem, or None and why it cannot be used: it needs a question (text) and an answer (text)
    ending in '#### <number>'."""
    if not isinstance(row, dict):
        return None, f"not a JSON object but {type(row).__name__}"
    missing = [key for key in ("question", "answer") if key not in row]
    if missing:
        return None, f"no {' or '.join(map(repr, missing))} field (keys: {', '.join(map(str, row)) or 'none'})"
    for key in ("question", "answer"):
        value = row[key]
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            return None, f"its {key} is not text ({'null' if value is None else type(value).__name__})"
        if not str(value).strip():
            return None, f"its {key} is empty"
    target = extract_answer(str(row["answer"]))
    if target is None:
        return None, "its answer has no '#### <number>'"
    return Problem(str(row["question"]), str(row["answer"]), target), ""


def rows_to_problems(rows, source: str, unit: str = "row") -> list[Problem]:
    """The usable rows of [(number, row)] as Problems; the others are skipped, counted and named in one warning
    (the first one's number and why). None usable is a DataError."""
    problems, skipped, first = [], 0, ""
    for number, row in rows:
        problem, why = row_problem(row)
        if problem is None:
            skipped, first = skipped + 1, first or f"{unit} {number}: {why}"
        else:
            problems.append(problem)
    if not problems:
        found = f"all {skipped} skipped, the first {first}" if skipped else "it has none"
        raise DataError(f"{source}: no usable rows ({found}); each row needs {ROW_FORMAT}")
    if skipped:
        log.warning("%s: skipped %d of %d rows, %d usable (first: %s)", source, skipped, skipped + len(problems),
                    len(problems), first)
    return problems


def read_rows(path: str, flag: str) -> tuple[list, str]:
    """([(number, row)], 'line' or 'row') of a local file: JSON lines (a .json file may also be one JSON list),
    or a parquet table. A line that is not JSON, or a file that cannot be read, is a DataError."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            return list(enumerate(pq.read_table(path).to_pylist(), 1)), "row"
        except Exception as e:  # not parquet, cut short: pyarrow raises several kinds
            raise DataError(f"{flag} {path}: cannot be read as parquet ({first_line(e)})") from None
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise DataError(f"{flag} {path}: not UTF-8 text (byte {e.start}); expected {ROW_FORMAT}") from None
    except OSError as e:
        raise DataError(f"{flag} {path}: cannot be read ({e.strerror})") from None
    if path.endswith(".json"):
        try:
            whole = json.loads(text)
        except ValueError:
            whole = None  # JSON lines, read below
        if isinstance(whole, list):
            return list(enumerate(whole, 1)), "row"
    rows = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append((lineno, json.loads(line)))
            except json.JSONDecodeError as e:
                raise DataError(f"{flag} {path}: line {lineno} is not JSON ({e.msg})") from None
    return rows, "line"


def load_local(path: str, flag: str = "--data") -> list[Problem]:
    """A local .jsonl / .json / .parquet file's usable problems (read here, not by `datasets`: no cache, no hub)."""
    if not os.path.isfile(path):
        raise DataError(f"{flag} {path}: {'a folder' if os.path.isdir(path) else 'no such file'}; give 'synthetic', "
                        f"'gsm8k' or a .jsonl/.parquet file")
    if os.path.getsize(path) == 0:
        raise DataError(f"{flag} {path}: the file is empty")
    if os.path.splitext(path)[1] not in (".jsonl", ".json", ".parquet"):
        raise DataError(f"{flag} {path}: expected a .jsonl, .json or .parquet file")
    rows, unit = read_rows(path, flag)
    if not rows:
        raise DataError(f"{flag} {path}: the file has no rows")
    return rows_to_problems(rows, f"{flag} {path}", unit)


def load_gsm8k_hub(split: str) -> list[Problem]:
    """openai/gsm8k from the hub (or, offline, the local hub cache); one DataError line naming the local files that
    work instead when it cannot be fetched."""
    import datasets

    from .infra.hub import no_answer, offline_reason, USE_THE_CACHE

    instead = f"use local files instead: --data train.jsonl --test-data test.jsonl, {ROW_FORMAT}"
    offline = datasets.config.HF_HUB_OFFLINE
    why = None if offline else no_answer()
    if why:
        raise DataError(f"--data gsm8k: openai/gsm8k cannot be fetched from the hub ({why}); {instead}; {USE_THE_CACHE}")
    try:
        rows = datasets.load_dataset("openai/gsm8k", "main", split=split)
    except OSError as e:  # offline and not cached, the network gone mid-way, a proxy's refusal: all OSError
        raise DataError(f"--data gsm8k: openai/gsm8k cannot be fetched from the hub "
                        f"({offline_reason() if offline else first_line(e)}); {instead}") from None
    return rows_to_problems(enumerate(rows, 1), f"openai/gsm8k[{split}]")


def load_problems(data: str, test_data: str | None, n_test: int, seed: int, max_number: int, need_train: bool = True):
    """(train, test) for --data {synthetic, gsm8k, FILE} and --test-data FILE (any --data; default: a held-out
    split of --data, a single file split by seed). Every source is read and checked here, before any model
    loads; a test set smaller than n_test (--eval-size) is said in one warning. need_train=False (evaluation): with
    --test-data, --data is not read and the training problems are []."""
    if test_data and not need_train:
        train, test, source = [], None, ""
    elif data == "synthetic":  # a fixed held-out pool, so the train split never depends on n_test
        train, test = synthetic_splits(20000, 1000, max_number, seed=1234)
        source = "--data synthetic: its held-out pool has"
    elif data == "gsm8k":
        train = load_gsm8k_hub("train")
        test = None if test_data else load_gsm8k_hub("test")
        source = "--data gsm8k: openai/gsm8k[test] has"
    else:
        train, test = load_local(data, "--data"), None
        source = ""
    if test_data:
        test, source = load_local(test_data, "--test-data"), f"--test-data {test_data}:"
    if test is None:  # a single file: hold out a tenth
        if len(train) < 2:
            raise DataError(f"--data {data}: need at least 2 usable rows to hold out a test split")
        shuffled = train[:]
        random.Random(seed).shuffle(shuffled)
        n_held = min(n_test, max(1, len(shuffled) // 10))
        train, test = shuffled[n_held:], shuffled[:n_held]
        source = f"--data {data}: held out a tenth of its {len(shuffled)} usable rows (give --test-data for more),"
    if len(test) < n_test:
        log.warning("%s %d test problems, fewer than --eval-size %d: evaluating on %d", source, len(test), n_test,
                    len(test))
    return train, test[:n_test]


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
