"""docs/symbols.md: every code name and flag of the symbol table exists, and every cell of the gradient table is what
autograd gives on the token it describes."""
import dataclasses
import importlib
import inspect
import math
import re
from pathlib import Path

import pytest
import torch

from qurl_mini.config import Config
from qurl_mini.loss import OBJECTIVES, policy_objective

DOC = (Path(__file__).resolve().parent.parent / "docs" / "symbols.md").read_text()
SYMBOLS, GRADIENTS = DOC.split("## Which tokens get a gradient")


def table_rows(text: str) -> list[list[str]]:
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("|---")]
    return [[cell.strip() for cell in re.split(r"(?<!\\)\|", row)[1:-1]] for row in rows]


def resolve(dotted: str):
    """'loss.objective_acr' or 'update.Updater._micro_loss' -> the object in qurl_mini."""
    module, *attrs = dotted.split(".")
    obj = importlib.import_module(f"qurl_mini.{module}")
    for attr in attrs:
        obj = getattr(obj, attr)
    return obj


def test_every_name_in_the_symbol_table_is_in_the_code():
    header, *rows = table_rows(SYMBOLS)
    assert header[2] == "in the code" and len(rows) >= 25
    checked = 0
    for row in rows:
        for part in filter(None, (p.strip() for p in row[2].split(";"))):
            if " in `" in part:  # `name`, `name` in `module.function`: the names are in its source
                names, where = part.split(" in `", 1)
                source = inspect.getsource(resolve(where.split("`")[0]))
                for name in re.findall(r"`([^`]+)`", names):
                    assert re.search(rf"\b{re.escape(name)}\b", source), (name, where)
                    checked += 1
            else:
                for dotted in re.findall(r"`([^`]+)`", part):
                    resolve(dotted)
                    checked += 1
    assert checked >= 30


def test_every_flag_in_the_doc_is_a_config_flag():
    fields = {f.name for f in dataclasses.fields(Config)}
    flags = set(re.findall(r"`(--[a-z][a-z-]*)`", DOC))
    assert {"--tis-cap", "--clip-low", "--clip-high", "--uaq-scale", "--kl-coef", "--loss-agg"} <= flags
    assert {flag for flag in flags if flag[2:].replace("-", "_") not in fields} == set()


def gradient_table() -> list[dict]:
    header, *rows = table_rows(GRADIENTS)
    names = [h.strip("`") for h in header]
    assert names[:5] == ["token", "A", "R", "rho", "where it lies"] and sorted(names[5:]) == sorted(OBJECTIVES)
    return [dict(zip(names, row)) for row in rows]


def test_the_gradient_tables_cells_are_what_autograd_gives():
    """Each token its own one-token response (prod_t rho_t = rho); pi_prox = 0.1, pi_behav = pi_prox / rho,
    pi_theta = R * pi_prox. d(objective)/d(log pi_theta) = weight * ratio * A, ratio R_hat = R * rho for naive."""
    rows = gradient_table()
    assert len(rows) >= 9
    A, R, rho = (torch.tensor([[float(row[k])] for row in rows]) for k in ("A", "R", "rho"))
    prox = torch.full_like(R, math.log(0.1))
    behav, mask = prox - torch.log(rho), torch.ones_like(R)
    checked = 0
    for objective in OBJECTIVES:
        logp = (prox + torch.log(R)).requires_grad_(True)
        per_token = policy_objective(logp, prox, behav, A, mask, objective=objective, clip_low=0.2, clip_high=0.2,
                                     tis_cap=2.0)
        grad, = torch.autograd.grad(per_token.sum(), logp)
        ratio = R * rho if objective == "naive" else R
        for k, row in enumerate(rows):
            weight = float(row[f"{objective}"])
            expected = weight * ratio[k, 0].item() * A[k, 0].item()
            assert grad[k, 0].item() == pytest.approx(expected, rel=1e-5, abs=1e-7), (row["token"], objective)
            assert (grad[k, 0].item() == 0) == (weight == 0 or A[k, 0].item() == 0), (row["token"], objective)
            checked += 1
    assert checked == 9 * len(OBJECTIVES)


def test_the_worked_token_is_the_one_acr_rescues():
    """Row c of the table is loss.py's worked number: rho = 5, R = 1.5, A = +1: TIS 0, ACR weight 2."""
    c = next(row for row in gradient_table() if row["token"] == "c")
    assert (c["A"], c["R"], c["rho"], c["tis"], c["acr"]) == ("+1", "1.5", "5", "0", "2")
