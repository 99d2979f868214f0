"""Problems, answer extraction, GSM8K loading from local files, and the resumable data order."""
import os
import json
import logging

import pytest

from qurl_mini.data import (DataError, Problem, PromptOrder, extract_answer, load_local, load_problems, reward,
                            synthetic_splits)
from qurl_mini.embedded import build_char_tokenizer


def test_extract_answer_takes_the_number_after_the_last_marks():
    assert extract_answer("3+4=7\n#### 7") == 7.0
    assert extract_answer("#### 1 then #### 1,234.5 dollars") == 1234.5
    assert extract_answer("#### -3") == -3.0
    assert extract_answer("no marks 7") is None and extract_answer("#### none") is None


def test_reward_is_exact_numeric_match():
    p = Problem("q", "2+2=4\n#### 4", 4.0)
    assert reward("2+2=4\n#### 4", p) == 1.0
    assert reward("#### 4.0", p) == 1.0
    assert reward("#### 5", p) == 0.0 and reward("4", p) == 0.0


def test_synthetic_splits_are_seeded_disjoint_and_gsm8k_formatted():
    train, test = synthetic_splits(500, 50, max_number=20, seed=3)
    again, _ = synthetic_splits(500, 50, max_number=20, seed=3)
    assert train == again and len(test) == 50
    assert not {p.question for p in test} & {p.question for p in train}
    for p in train[:50]:
        a, b = map(int, p.answer.split("=")[0].replace("-", "+").split("+"))
        assert p.answer.endswith(f"#### {int(p.target)}") and reward(p.answer, p) == 1.0
        assert p.target == (a + b if "gets" in p.question else a - b) and p.target >= 0


def test_char_tokenizer_round_trips_problem_text():
    tok = build_char_tokenizer()
    text = "Q: Ann has 3 apples.\nA: 3+4=7\n#### 7"
    ids = tok.encode(text)
    assert len(ids) == len(text) and tok.decode(ids) == text
    assert tok.eos_token_id is not None and tok.eos_token_id not in ids


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


ROWS = [{"question": f"What is {i} plus 1?", "answer": f"{i}+1={i + 1}\n#### {i + 1}"} for i in range(30)]


def test_local_jsonl_and_parquet_load_alike(tmp_path):
    import datasets

    problems = load_local(_write_jsonl(tmp_path / "gsm.jsonl", ROWS))
    assert len(problems) == 30 and problems[4].target == 5.0 and problems[4].question == "What is 4 plus 1?"
    parquet = tmp_path / "gsm.parquet"
    datasets.Dataset.from_list(ROWS).to_parquet(str(parquet))
    assert load_local(str(parquet)) == problems


def test_rows_without_marks_are_skipped_counted_and_logged(tmp_path, caplog):
    rows = ROWS[:5] + [{"question": "q", "answer": "no final answer"}]
    with caplog.at_level(logging.WARNING, logger="qurl_mini"):
        problems = load_local(_write_jsonl(tmp_path / "d.jsonl", rows))
    assert len(problems) == 5
    assert "skipped 1 of 6 rows, 5 usable (first: line 6: its answer has no '#### <number>')" in caplog.text


def test_bad_files_get_one_line_errors(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_local(str(tmp_path / "missing.jsonl"))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match="empty"):
        load_local(str(tmp_path / "empty.jsonl"))
    (tmp_path / "bad.jsonl").write_text(json.dumps(ROWS[0]) + "\n{not json\n")
    with pytest.raises(DataError, match="line 2 is not JSON"):
        load_local(str(tmp_path / "bad.jsonl"))
    with pytest.raises(DataError, match="no usable rows"):
        load_local(_write_jsonl(tmp_path / "none.jsonl", [{"question": "q", "answer": "a"}]))
    with pytest.raises(DataError, match="no 'question'"):
        load_local(_write_jsonl(tmp_path / "keys.jsonl", [{"q": "q"}]))


def test_single_file_is_split_into_disjoint_train_and_test(tmp_path):
    path = _write_jsonl(tmp_path / "gsm.jsonl", ROWS)
    train, test = load_problems(path, None, n_test=200, seed=0, max_number=20)
    assert len(test) == 3 and len(train) == 27 and not set(test) & set(train)


def test_prompt_sampler_resumes_exactly_at_its_cursor():
    full = PromptOrder(10, seed=5)
    first = full.take(7) + full.take(7) + full.take(7)
    resumed = PromptOrder(10, seed=5, cursor=14)
    assert resumed.take(7) == first[14:]
    assert sorted(first[:10]) == list(range(10))  # each epoch is a permutation


def test_saved_char_tokenizer_loads_back_identically(tmp_path):
    from qurl_mini.actor import load_actor
    from qurl_mini.embedded import build_tiny_model

    _, tok = load_actor(build_tiny_model(str(tmp_path / "m"), layers=1, hidden=64, heads=2, kv_heads=1))
    text = "Q: Ann has 3 apples.\nA: 3+4=7\n#### 7"
    assert tok.encode(text) == build_char_tokenizer().encode(text) and tok.decode(tok.encode(text)) == text


def test_synthetic_train_split_does_not_depend_on_the_test_size():
    train_a, test_a = load_problems("synthetic", None, n_test=20, seed=0, max_number=10)
    train_b, test_b = load_problems("synthetic", None, n_test=200, seed=0, max_number=10)
    assert train_a == train_b and test_b[:20] == test_a and len(test_b) == 200


def test_cpu_isa_names_the_instructions_that_decide_quantized_speed():
    from qurl_mini.infra.hardware import has_bf16_arithmetic, has_int8_dot_product, isa

    avx2 = frozenset("fpu sse4_2 avx avx2 fma".split())
    avx512 = avx2 | {"avx512f", "avx512bw", "avx512_vnni", "avx512_bf16"}
    amx = avx512 | {"amx_tile", "amx_int8", "amx_bf16"}
    assert (isa(avx2), has_int8_dot_product(avx2), has_bf16_arithmetic(avx2)) == ("AVX2", False, False)
    assert (isa(avx512), has_int8_dot_product(avx512), has_bf16_arithmetic(avx512)) == ("AVX-512 VNNI+BF16", True, True)
    assert isa(amx) == "AMX" and isa(avx2 | {"avx_vnni"}) == "AVX2+AVX-VNNI"
    assert has_int8_dot_product(avx2 | {"avx_vnni"}) and not has_bf16_arithmetic(avx2 | {"avx_vnni"})


GSM8K_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "data", "gsm8k")


@pytest.mark.skipif(not os.path.isdir(GSM8K_DIR), reason="../shared/data/gsm8k is not beside this checkout")
def test_real_gsm8k_files_load_whole_and_every_gold_answer_earns_reward_one():
    from qurl_mini.data import load_local, reward

    train = load_local(os.path.join(GSM8K_DIR, "train.jsonl"))
    test = load_local(os.path.join(GSM8K_DIR, "test.jsonl"))
    assert (len(train), len(test)) == (7473, 1319)
    assert all(reward(p.answer, p) == 1.0 for p in train + test)
    # the gold number is the one after '####', thousands separators removed
    with_commas = [p for p in train + test if "," in p.answer.rsplit("####", 1)[1]]
    assert with_commas and all(p.target == float(p.answer.rsplit("####", 1)[1].strip().replace(",", ""))
                               for p in with_commas)


def test_rows_without_a_question_or_answer_are_skipped_never_read_as_the_text_none(tmp_path, caplog):
    rows = [{"question": None, "answer": "#### 3"}, {"answer": "#### 4"}, {"question": "q", "answer": None},
            {"question": " ", "answer": "#### 5"}, [1, 2], ROWS[0]]
    with caplog.at_level(logging.WARNING, logger="qurl_mini"):
        problems = load_local(_write_jsonl(tmp_path / "d.jsonl", rows), "--test-data")
    assert problems == load_local(_write_jsonl(tmp_path / "one.jsonl", ROWS[:1]))
    assert "skipped 5 of 6 rows, 1 usable (first: line 1: its question is not text (null))" in caplog.text
    with pytest.raises(DataError, match=r"--test-data .*: no usable rows \(all 5 skipped, the first line 1: its "):
        load_local(_write_jsonl(tmp_path / "none.jsonl", rows[:5]), "--test-data")


def test_a_json_list_file_loads_and_a_damaged_parquet_is_one_line(tmp_path):
    (tmp_path / "rows.json").write_text(json.dumps(ROWS))
    assert len(load_local(str(tmp_path / "rows.json"))) == 30
    (tmp_path / "cut.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match="cut.parquet: cannot be read as parquet"):
        load_local(str(tmp_path / "cut.parquet"))


def test_test_data_is_used_with_any_data_and_a_short_test_set_is_said(tmp_path, caplog):
    test_file = _write_jsonl(tmp_path / "test.jsonl", ROWS[:5])
    with caplog.at_level(logging.WARNING, logger="qurl_mini"):
        train, test = load_problems("synthetic", test_file, n_test=8, seed=0, max_number=10)
    assert len(train) == 20000 and [p.question for p in test] == [r["question"] for r in ROWS[:5]]
    assert f"--test-data {test_file}: 5 test problems, fewer than --eval-size 8: evaluating on 5" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="qurl_mini"):
        load_problems(_write_jsonl(tmp_path / "all.jsonl", ROWS), None, n_test=8, seed=0, max_number=10)
    assert "held out a tenth of its 30 usable rows (give --test-data for more), 3 test problems, fewer than " \
           "--eval-size 8" in caplog.text
