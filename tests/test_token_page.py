"""The token page (qurl_mini/token_records.py -> token_page.py; docs/token-page.md): on a real short int3 run, its
numbers against the trainer's own and an independent recompute, what a person sees of it in headless Chromium, the
page eval.py makes for a model pair, and bad input."""
import contextlib
import io
import json
import math
import os
import re
import statistics
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))
C, EPS = 1.1, 0.2
# int3 per channel in a float32 engine: the HF actor with int3-rounded weights computes what the engine computes, so
# pi_behav can be recomputed too. C = 1.1: on these 8 responses rho stays within ~[0.84, 1.14], so at C = 2 no
# objective would mark a token; at 1.1 each marks some.
RUN_FLAGS = ["--quant", "int3", "--quant-group", "0", "--steps", "2", "--eval-every", "1", "--prompts-per-step", "2",
             "--group-size", "4", "--eval-size", "4", "--save-every", "1", "--engine-dtype", "float32",
             "--tis-cap", str(C)]


@pytest.fixture(scope="module")
def int3_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("token-page")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "train.py"), "--cache-dir", os.path.join(REPO, ".cache"),
                           "--out-dir", str(out), "--run-name", "r", *RUN_FLAGS], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "r"


def page_data(path) -> dict:
    """The records the page carries (its <script type="application/json">), as the page's script reads them."""
    text = open(path, encoding="utf-8").read()
    (blob,) = re.findall(r'<script type="application/json" id="token-data">(.*?)</script>', text, re.S)
    return json.loads(blob)


def rows_of(path) -> list[dict]:
    return [json.loads(line) for line in open(path, encoding="utf-8")]


def ids_tensor(ids):
    return torch.tensor([ids])


def recomputed(model, response, int3: bool) -> torch.Tensor:
    """log pi of the response's tokens by `model` alone, one row, unpacked: pi_prox, or pi_behav with the weights on
    the int3 grid (what the float32 engine holds) when `int3`."""
    from qurl_mini import quant
    from qurl_mini.actor import token_logprobs

    ids = response["prompt_ids"] + response["ids"]
    with torch.no_grad(), (quant.fake_quantized(model, "int3", activations=False, group=0) if int3
                           else contextlib.nullcontext()):
        logp = token_logprobs(model, ids_tensor(ids), torch.ones(1, len(ids), dtype=torch.long))[0]
    return logp[len(response["prompt_ids"]) - 1:]


def test_the_page_holds_the_trainers_numbers_and_an_independent_recompute(int3_run):
    """Page = tokens.jsonl (the trainer's float32 tensors, exactly); pi_prox = the actor that scored them (the warm
    start at step 1, the step-1 checkpoint at step 2), pi_behav = that actor on the int3 grid, recomputed here one
    row at a time; every weight, bound and mark = its formula on those numbers."""
    from qurl_mini.actor import load_actor

    lines, page = rows_of(int3_run / "tokens.jsonl"), page_data(int3_run / "tokens.html")
    assert page["steps"] == lines and [r["step"] for r in lines] == [1, 2]
    summary = json.load(open(int3_run / "summary.json"))
    scorers = {1: summary["base_model"], 2: str(int3_run / "checkpoints" / "step-000001" / "actor")}
    metrics = {r["step"]: r for r in rows_of(int3_run / "metrics.jsonl")}
    for record in lines:
        assert record["settings"]["tis_cap"] == C and len(record["responses"]) == 4
        assert metrics[record["step"]]["time_token_page"] > 0
        model = load_actor(scorers[record["step"]])[0].eval()
        for r in record["responses"]:
            prox, behav = torch.tensor(r["prox"]), torch.tensor(r["behav"])
            assert torch.allclose(recomputed(model, r, int3=False), prox, rtol=0, atol=1e-5)
            assert torch.allclose(recomputed(model, r, int3=True), behav, rtol=0, atol=1e-5)
            check_objectives(r)


def check_objectives(r):
    """What each objective does at R = 1, by its formula on the page's own numbers (loss.py is not asked)."""
    log_rho = [p - b for p, b in zip(r["prox"], r["behav"])]
    rho = [math.exp(x) for x in log_rho]
    n, obj = len(rho), r["objectives"]
    rewards = r["group_rewards"]
    advantage = (r["reward"] - statistics.mean(rewards)) / (statistics.stdev(rewards) + 1e-6)
    assert r["advantage"] == pytest.approx(advantage, rel=1e-5, abs=1e-5)
    assert r["seq_log_ratio"] == pytest.approx(sum(log_rho), rel=1e-4, abs=1e-5)

    def marked(name, mark):
        where = obj[name].get(mark, [])
        return set(range(n)) if where == "all" else set(where)

    def at(value, i):
        return value[i] if isinstance(value, list) else value

    for i, x in enumerate(rho):
        assert at(obj["tis"]["weight"], i) == pytest.approx(min(x, C), rel=1e-5)
        assert at(obj["acr"]["high"], i) == pytest.approx((1 + EPS) * max(1.0, x / C), rel=1e-5)
        assert at(obj["decoupled"]["weight"], i) == pytest.approx(x, rel=1e-5)
    assert marked("tis", "truncated") == marked("acr", "truncated") == {i for i, x in enumerate(rho) if x > C}
    assert marked("acr", "widened") == {i for i, x in enumerate(rho) if x > C}
    assert marked("icepop", "masked") == {i for i, x in enumerate(rho) if not 1 / C <= x <= C}
    prod, geo = math.exp(sum(log_rho)), math.exp(sum(log_rho) / n)
    assert marked("seq-mask", "masked") == (set(range(n)) if not 1 / C <= prod <= C else set())
    assert marked("seq-tis", "truncated") == (set(range(n)) if prod > C else set())
    assert marked("geo-tis", "truncated") == (set(range(n)) if geo > C else set())
    a = r["advantage"]  # naive's ratio at R = 1 is rho: clipped on the side of the advantage's sign
    assert marked("naive", "clipped") == {i for i, x in enumerate(rho) if (a > 0 and x > 1 + EPS) or (a < 0 and x < 1 - EPS)}
    assert not any(obj["ppo"].get(m) for m in ("truncated", "masked", "widened", "clipped"))


# ----- in a browser ------------------------------------------------------------------------------------------------

SHOWN = {" ": "\u2423", "\n": "\u21b5", "\t": "\u21e5", "\r": "\u240d"}


def shown(piece: str) -> str:
    """A piece as the page writes it: whitespace visible, other control characters as \\xNN."""
    if piece == "":
        return "\u2205"
    return "".join(SHOWN.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x20 or 0x7f <= ord(c) <= 0x9f else c) for c in piece)


def browser():
    from headless_chromium import BrowserError, Chromium, find_browser

    if find_browser() is None:  # fail, not skip: CI (.ci/run) installs it
        pytest.fail("no chromium on PATH: this test opens the token page in a real browser; .ci/run installs it "
                    "(apt-get install chromium)")
    try:
        return Chromium(width=1200, height=900)
    except BrowserError as e:
        pytest.fail(f"chromium does not start: {e}")


def marked_tokens(page) -> set:
    return {tuple(x) for x in page.js("[...document.querySelectorAll('#responses .tok')].filter(t => "
                                      "[...t.classList].some(c => c.startsWith('m-'))).map(t => [+t.dataset.r, +t.dataset.i])")}


def expected_marks(record, objective) -> set:
    out = set()
    for k, r in enumerate(record["responses"]):
        for mark in ("truncated", "masked", "widened", "clipped"):
            where = r["objectives"][objective].get(mark, [])
            out |= {(k, i) for i in (range(len(r["ids"])) if where == "all" else where)}
    return out


def test_a_browser_shows_the_tokens_their_numbers_and_each_objectives_marks(int3_run):
    from matplotlib.image import imread

    records = rows_of(int3_run / "tokens.jsonl")
    with browser() as page:
        page.open(str(int3_run / "tokens.html"), ready="document.body.dataset.ready === '1'")
        for index, record in enumerate(records):
            page.js(f"(() => {{ const s = document.getElementById('step'); s.value = '{index}'; "
                    f"s.dispatchEvent(new Event('change')); }})()")
            texts = page.js("[...document.querySelectorAll('#responses .card')].map(c => "
                            "[...c.querySelectorAll('.tok')].map(t => t.textContent))")
            assert texts == [[shown(p) for p in r["pieces"]] for r in record["responses"]]

            # hover the token the sampler and the learner disagree on most: its rho shows
            k, i, log_rho = max(((k, i, p - b) for k, r in enumerate(record["responses"])
                                 for i, (p, b) in enumerate(zip(r["prox"], r["behav"]))), key=lambda t: abs(t[2]))
            box = page.js(f"(() => {{ const t = document.querySelector('#responses .tok[data-r=\"{k}\"][data-i=\"{i}\"]');"
                          f" t.scrollIntoView({{block: 'center'}}); return t.getBoundingClientRect().toJSON(); }})()")
            page.hover(1, 1)
            page.hover(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
            assert page.js("getComputedStyle(document.getElementById('info')).display") == "block"
            assert float(page.js("document.getElementById('info-rho').textContent")) == pytest.approx(
                math.exp(log_rho), rel=1e-4)

            seen = {}
            for objective in ("ppo", "tis", "acr", "icepop", "seq-mask", "naive"):
                page.js(f"(() => {{ const s = document.getElementById('objective'); s.value = '{objective}'; "
                        f"s.dispatchEvent(new Event('change')); }})()")
                seen[objective] = marked_tokens(page)
                assert seen[objective] == expected_marks(record, objective), objective
            assert seen["ppo"] == set() and seen["icepop"], "the selector changes which tokens are marked"
        png = page.screenshot()
    pixels = imread(io.BytesIO(png))[..., :3]
    assert pixels.shape[:2] == (900, 1200)
    not_white = (pixels < 0.95).any(-1).mean()
    colours = len({tuple(p) for p in (pixels.reshape(-1, 3)[::97] * 255).astype(int).tolist()})
    assert not_white > 0.02 and colours > 20, (not_white, colours)


# ----- eval.py: a model pair, without training -------------------------------------------------------------------


def test_eval_writes_the_page_for_a_quantized_engine_and_its_model(int3_run, tmp_path):
    from qurl_mini.actor import load_actor

    final, out = str(int3_run / "final"), tmp_path / "int3.html"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "eval.py"), "--model", final, "--quant", "int3",
                           "--quant-group", "0", "--engine-dtype", "float32", "--eval-size", "4",
                           "--token-page", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (record,) = page_data(out)["steps"]
    assert record["settings"]["quant"] == "int3" and record["settings"]["objective"] == "acr"
    assert final in record["label"] and 1 <= len(record["responses"]) <= 4
    model = load_actor(final)[0].eval()
    for r in record["responses"]:
        assert torch.allclose(recomputed(model, r, int3=False), torch.tensor(r["prox"]), rtol=0, atol=1e-5)
        assert torch.allclose(recomputed(model, r, int3=True), torch.tensor(r["behav"]), rtol=0, atol=1e-5)


# ----- bad input ---------------------------------------------------------------------------------------------------


def a_response(pieces, **over):
    n = len(pieces)
    return {"row": 0, "why": "largest |log rho|", "question": "Q <b>?</b>", "reward": 1.0, "prompt_ids": [1],
            "ids": list(range(n)), "pieces": pieces, "behav": [-1.0] * n, "prox": [-0.5] * n, "advantage": 0.5,
            "seq_log_ratio": 0.5 * n, "objectives": {"tis": {"weight": 1.6487, "high": 1.2, "low": 0.8}}, **over}


def write_bad_run(folder) -> str:
    """A tokens.jsonl holding every kind of damage: hostile and broken pieces, a torn line, invalid UTF-8 bytes, a
    line that is not a step, a response with 0 tokens and one whose lists differ, a NaN; and a 512-token response."""
    hostile = ["</script>", "<!--", "<script>alert(1)</script>", "&amp;", " ", "\n", "\t", "", "\x00", "\udc80", "ok"]
    good = {"step": 1, "label": "step 1", "settings": {"tis_cap": 2.0}, "responses_in_step": 3,
            "responses": [a_response(hostile), a_response([]), a_response(["a", "b"], behav=[-1.0])]}
    nan = {"step": 2, "label": "step 2 </script>", "settings": {}, "responses": [a_response(["x"], advantage=float("nan"))]}
    words = " Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.\n".split(" ")
    long = {"step": 4, "label": "512 tokens", "settings": {}, "responses": [a_response(([" " + w for w in words] * 26)[:512])]}
    path = os.path.join(folder, "tokens.jsonl")
    with open(path, "wb") as f:
        f.write((json.dumps(good) + "\n").encode())
        f.write(json.dumps(nan).encode() + b"\n")
        f.write(b'{"step": 3, "responses": [{"ids": [1], "pieces": ["\xff\xfe"], "behav": [-1], "prox": [-1]}]}\n')
        f.write(b"[1, 2, 3]\n")
        f.write(json.dumps(long).encode() + b"\n")
        f.write(json.dumps(good).encode()[:100] + b"\n")  # torn: the process ended mid-write
    return path


def test_bad_input_still_makes_a_page_that_says_what_it_skipped(tmp_path):
    from qurl_mini.token_records import read_token_lines, write_page

    page = write_page(str(tmp_path / "none.jsonl"), str(tmp_path / "none.html"), "no run")
    assert "no saved tokens" in open(page, encoding="utf-8").read() and page_data(page)["steps"] == []

    page = write_page(write_bad_run(str(tmp_path)), str(tmp_path / "tokens.html"), "bad </script> run")
    text = open(page, encoding="utf-8").read()
    assert text.count("<script") == text.count("</script>") == 2  # no piece ends or opens a script
    assert "<!--" not in text.split('id="token-data">')[1]
    notes = " ".join(read_token_lines(str(tmp_path / "tokens.jsonl"))[1])
    for said in ("line 3: not valid UTF-8", "line 4: not a saved step", "line 6: not JSON", "has 0 tokens",
                 "lists differ in length"):
        assert said in notes and said in text
    data = page_data(page)
    assert [s["step"] for s in data["steps"]] == [1, 2, 3, 4]
    first = data["steps"][0]["responses"]
    assert len(first) == 1 and first[0]["pieces"][:4] == ["</script>", "<!--", "<script>alert(1)</script>", "&amp;"]
    assert data["steps"][1]["responses"][0]["advantage"] is None  # NaN: null, JSON that JavaScript reads
    assert data["steps"][2]["responses"][0]["pieces"] == ["\ufffd\ufffd"]


def test_a_browser_shows_hostile_pieces_as_text(tmp_path):
    from qurl_mini.token_records import write_page

    page_path = write_page(write_bad_run(str(tmp_path)), str(tmp_path / "tokens.html"), "bad run")
    with browser() as page:
        page.open(page_path, hash="step=1", ready="document.body.dataset.ready === '1'")
        texts = page.js("[...document.querySelectorAll('#responses .tok')].map(t => t.textContent)")
        assert texts == [shown(p) for p in ["</script>", "<!--", "<script>alert(1)</script>", "&amp;", " ", "\n", "\t", "",
                                             "\x00"]] + [page.js("String.fromCharCode(0xdc80)"), "ok"]
        assert page.js("document.querySelectorAll('#responses script, #responses b').length") == 0
        assert "has 0 tokens" in page.js("document.getElementById('notes').textContent")
        shown_steps = []
        for index in range(4):  # the NaN step and the one read from invalid UTF-8 draw too (an error would raise)
            shown_steps.append(page.js(f"document.getElementById('step').value = '{index}'; draw(); "
                                       "[...document.querySelectorAll('#responses .tok')].map(t => t.textContent)"))
        assert shown_steps[1:3] == [["x"], ["\ufffd\ufffd"]] and len(shown_steps[3]) == 512
        # 512 tokens wrap inside the page's width, a line per newline token at least
        assert page.js("document.documentElement.scrollWidth <= window.innerWidth")
        lines = page.js("new Set([...document.querySelectorAll('#responses .tok')].map(t => t.offsetTop)).size")
        assert 512 // 20 <= lines < 200


# ----- the record of a step, on hand-made numbers --------------------------------------------------------------------


def test_a_steps_record_marks_what_each_objective_does_at_R_1():
    """Rows: rho = (3, 0.4, 1) with A > 0; no token; (1.105, 1.105) with A < 0; (0.7, 1) with A < 0; C = 2."""
    from types import SimpleNamespace

    from qurl_mini.batch import Experience, align_per_token, pack_sequences
    from qurl_mini.token_records import step_tokens

    prompts, responses = [[5, 6]] * 4, [[1, 2, 3], [], [4, 5], [6, 7]]
    log_rho = [[math.log(3), math.log(0.4), 0.0], [], [0.1, 0.1], [math.log(0.7), 0.0]]
    seq = pack_sequences(prompts, responses, pad_id=0)
    width = seq.input_ids.shape[1]
    behav = align_per_token([[-1.0] * len(r) for r in responses], prompts, width)
    prox = align_per_token([[-1.0 + x for x in row] for row in log_rho], prompts, width)
    advantages = torch.tensor([1.0, 0.0, -1.0, -1.0])[:, None] * seq.response_mask
    samples = SimpleNamespace(rewards=[torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0])],
                              problems=[SimpleNamespace(question="q0"), SimpleNamespace(question="q1")],
                              groups=[[0, 1], [2, 3]])
    tokenizer = SimpleNamespace(batch_decode=lambda seqs, **kw: [chr(96 + s[0]) for s in seqs])
    cfg = SimpleNamespace(token_page_responses=2, clip_low=0.2, clip_high=0.2, tis_cap=2.0, objective="acr")
    record = step_tokens(7, Experience(seq, prox, behav, advantages), samples, tokenizer, cfg)

    assert (record["step"], record["label"], record["empty_responses"], record["tokens_in_step"]) == (7, "step 7", 1, 7)
    first, typical = record["responses"]
    assert (first["row"], first["why"], typical["row"], typical["why"]) == (0, "largest |log rho|", 3, "typical")
    assert first["ids"] == [1, 2, 3] and first["pieces"] == ["a", "b", "c"] and first["prompt_ids"] == [5, 6]
    assert first["question"] == "q0" and first["reward"] == 1.0 and first["group_rewards"] == [1.0, 0.0]
    assert first["advantage"] == 1.0 and first["seq_log_ratio"] == pytest.approx(math.log(1.2), rel=1e-6)
    o = first["objectives"]
    assert o["tis"]["weight"] == pytest.approx([2.0, 0.4, 1.0]) and o["tis"]["truncated"] == [0]
    assert o["acr"]["high"] == pytest.approx([1.2 * 1.5, 1.2, 1.2]) and o["acr"]["widened"] == [0]
    assert o["icepop"]["masked"] == [0, 1] and o["icepop"]["weight"] == pytest.approx([0.0, 0.0, 1.0])
    assert o["naive"]["clipped"] == [0]  # ratio rho = 3 > 1.2 with A > 0
    assert o["ppo"] == {"weight": 1.0, "high": 1.2, "low": 0.8} and "masked" not in o["seq-mask"]
    assert typical["objectives"]["naive"]["clipped"] == [0]  # rho = 0.7 < 0.8 with A < 0
    assert typical["question"] == "q1" and typical["advantage"] == -1.0


def test_chosen_rows_are_the_largest_and_a_typical_one_distinct_where_they_can_be():
    from qurl_mini.token_records import chosen_rows

    largest = [0.5, None, 3.0, 3.0, 0.1, 1.0, 2.0]
    same = [[1], [], [2], [2], [4], [5], [6]]  # rows 2 and 3 hold the same tokens
    assert chosen_rows(largest, 4, same) == [(2, "largest |log rho|"), (6, "largest |log rho|"),
                                             (5, "largest |log rho|"), (0, "typical")]
    assert chosen_rows(largest, 1, same) == [(2, "largest |log rho|")]
    assert chosen_rows(largest, 0, same) == [] and chosen_rows([None, None], 4) == []
    assert [r for r, _ in chosen_rows([1.0, 2.0], 4)] == [1, 0]
