"""The committed evidence holds together (issue #29): each results table is one experiment (one base model,
one starting accuracy), and every file under docs/results/ is named by a page or a script."""
import glob
import json
import os
import re
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "docs", "results")


def committed() -> list[str]:
    """The files under docs/results/ that git tracks, relative to it (runs' scratch and ignored folders left out)."""
    try:
        out = subprocess.run(["git", "ls-files", "docs/results"], cwd=REPO, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the committed files are unknown")
    return [os.path.relpath(line, "docs/results") for line in out.stdout.splitlines()
            if os.path.exists(os.path.join(REPO, line))]


def summaries_by_table() -> dict[str, list[dict]]:
    """Every committed summary.json, grouped by the results folder (one table) it belongs to."""
    tables = {}
    for rel in committed():
        if os.path.basename(rel) != "summary.json":
            continue
        path, table = os.path.join(RESULTS, rel), rel.split(os.sep)[0]
        with open(path) as f:
            tables.setdefault(table, []).append({**json.load(f), "_path": path})
    return tables


def test_every_summary_names_its_base_and_each_table_has_one_base_and_one_start():
    tables = summaries_by_table()
    assert tables, "no summary.json under docs/results"
    for table, runs in tables.items():
        missing = [r["_path"] for r in runs if not r.get("base_model_hash")]
        assert not missing, f"{table}: summary.json without base_model_hash: {missing[:3]}"
        assert len({r["base_model_hash"] for r in runs}) == 1, f"{table}: runs from more than one base"
        assert len({r["initial_test_accuracy"] for r in runs}) == 1, f"{table}: more than one start accuracy"


def named_texts() -> str:
    """The pages and scripts that may name a results file, with `a.{md,json}` brace lists expanded."""
    paths = [os.path.join(REPO, "README.md"), os.path.join(REPO, "Makefile")]
    for pattern in ("docs/*.md", "docs/results/*.md", "experiments/*.py", "scripts/*.py"):
        paths += glob.glob(os.path.join(REPO, pattern))
    text = "\n".join(open(p, encoding="utf-8").read() for p in paths if os.path.isfile(p))

    def expand(m):
        return " ".join(m.group(1) + part + m.group(3) for part in m.group(2).split(","))
    return re.sub(r"([\w./-]*)\{([\w.,]+)\}([\w.]*)", expand, text)


def test_every_file_under_docs_results_is_named_somewhere():
    text = named_texts()
    unnamed = [name for name in sorted({rel.split(os.sep)[0] for rel in committed()}) if name not in text]
    assert not unnamed, f"files under docs/results/ no page or script names: {unnamed}"
