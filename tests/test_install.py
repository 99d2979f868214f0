"""The CPU install's choice of torch source (scripts/torch_index.py + the Makefile), without the network.

The probe is a `pip install --dry-run --no-index` of torch==<pin>+cpu: it reads only pip's find-links.
Every subprocess here also gets a dead proxy, so any network access would fail rather than leak out.
"""
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.tags import sys_tags
from packaging.utils import parse_wheel_filename

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "torch_index.py"
sys.path.insert(0, str(SCRIPT.parent))
import torch_index  # noqa: E402

INDEX = torch_index.CPU_INDEX
VERSION = torch_index.torch_version()
DEAD_PROXY = "http://127.0.0.1:9"


def clean_env(**extra):
    """os.environ without a user's PIP_ARGS or an outer make's flags, with a dead proxy, plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PIP_ARGS", "MAKEFLAGS", "MFLAGS", "MAKELEVEL")
           and k.lower() not in ("no_proxy", "http_proxy", "https_proxy", "all_proxy")}
    env.update(http_proxy=DEAD_PROXY, https_proxy=DEAD_PROXY, all_proxy=DEAD_PROXY,
               HTTP_PROXY=DEAD_PROXY, HTTPS_PROXY=DEAD_PROXY, ALL_PROXY=DEAD_PROXY)
    env.update(extra)
    return env


def no_local_wheel_env(tmp_path):
    """pip reads no config file (PIP_CONFIG_FILE=os.devnull skips /etc/pip.conf, /etc/xdg/pip/pip.conf,
    ~/.config/pip/pip.conf and the venv's), its find-links is an empty folder, its indexes empty too."""
    empty = tmp_path / "empty"
    empty.mkdir()
    env = clean_env(PIP_CONFIG_FILE=os.devnull, PIP_FIND_LINKS=str(empty),
                    PIP_INDEX_URL=empty.as_uri(), PIP_EXTRA_INDEX_URL=empty.as_uri())
    env.pop("PIP_NO_INDEX", None)
    return env


def local_torch_wheels():
    """torch==VERSION wheels, installable here, in pip's configured find-links folders (config + env)."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                         env=clean_env()).stdout
    folders = [f for v in re.findall(r"find-links='([^']*)'", out) for f in v.split()]
    tags = set(sys_tags())
    return [w for f in folders if os.path.isdir(f) for w in Path(f).glob("torch-*.whl")
            if str(parse_wheel_filename(w.name)[1]) == VERSION and tags & parse_wheel_filename(w.name)[3]]


def run_script(env):
    return subprocess.run([sys.executable, str(SCRIPT), INDEX], capture_output=True, text=True,
                          env=env, timeout=120)


def test_version_comes_from_requirements(tmp_path):
    pin = re.search(r"^torch==(\S+)", (ROOT / "requirements-cpu.txt").read_text(), re.M).group(1)
    assert VERSION == (pin if "+" in pin else pin + "+cpu")
    req = tmp_path / "r.txt"
    req.write_text("-r requirements.txt\ntorch==9.8.7  # note\nvllm-cpu==1\n")
    assert torch_index.torch_version(req) == "9.8.7+cpu"


def test_adds_pytorch_index_without_local_wheel(tmp_path):
    # this venv's own torch (if any) must not count: the probe passes --ignore-installed
    r = run_script(no_local_wheel_env(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["--extra-index-url", INDEX]
    assert r.stderr.strip() == (f"torch {VERSION}: not in pip's configured sources; "
                                f"adding PyTorch's CPU wheel index {INDEX}")


def test_no_extra_index_with_local_wheel():
    if not local_torch_wheels():
        pytest.skip(f"no torch {VERSION} wheel for this platform in pip's configured find-links on this machine")
    r = run_script(clean_env())
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == []
    assert r.stderr.strip() == f"torch {VERSION}: found in pip's configured sources (local wheel); no extra index"


# --- the Makefile's wiring, run for real against a fake venv whose pip records its arguments and fails ---

needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="GNU make not installed")


def fake_venv(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    scripts = {"python": f'exec "{sys.executable}" "$@"\n',  # the probe runs with the real venv's pip
               "pip": f'printf "%s\\n" "$@" > "{venv}/pip-args"\necho "ERROR: fake pip failure" >&2\nexit 1\n'}
    for name, body in scripts.items():
        p = venv / "bin" / name
        p.write_text("#!/bin/sh\n" + body)
        p.chmod(p.stat().st_mode | stat.S_IXUSR)
    return venv


def make_install(tmp_path, env, *make_args):
    venv = fake_venv(tmp_path)
    r = subprocess.run(["make", "--no-print-directory", "install", f"VENV={venv}", "TARGET=cpu", *make_args],
                       cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    args = (venv / "pip-args").read_text().split("\n")[:-1] if (venv / "pip-args").exists() else None
    assert not (venv / ".installed-cpu").exists()
    return r, args


@needs_make
def test_make_adds_index_and_reports_failure_last(tmp_path):
    r, args = make_install(tmp_path, no_local_wheel_env(tmp_path))
    assert r.returncode != 0
    assert args == ["install", "-q", "--extra-index-url", INDEX, "-r", "requirements-cpu.txt"]
    lines = [ln for ln in r.stderr.splitlines() if not ln.startswith("make: ***")]
    assert lines[0].startswith(f"torch {VERSION}: not in pip's configured sources")
    assert lines[-2] == "ERROR: fake pip failure"
    assert lines[-1].startswith("install failed: pip could not install requirements-cpu.txt")
    assert f'PIP_ARGS="--extra-index-url URL"' in lines[-1]


@needs_make
def test_make_no_index_with_local_wheel(tmp_path):
    if not local_torch_wheels():
        pytest.skip(f"no torch {VERSION} wheel for this platform in pip's configured find-links on this machine")
    r, args = make_install(tmp_path, clean_env())
    assert args == ["install", "-q", "-r", "requirements-cpu.txt"]
    assert "no extra index" in r.stderr


@needs_make
@pytest.mark.parametrize("where", ["command line", "environment", "empty"])
def test_user_pip_args_win(tmp_path, where):
    env = no_local_wheel_env(tmp_path)  # the probe would add the index: it must not run at all
    user = [] if where == "empty" else ["--extra-index-url", "http://mirror.invalid/simple", "--pre"]
    make_args = []
    if where == "environment":
        env["PIP_ARGS"] = " ".join(user)
    else:
        make_args = [f"PIP_ARGS={' '.join(user)}"]
    r, args = make_install(tmp_path, env, *make_args)
    assert args == ["install", "-q", *user, "-r", "requirements-cpu.txt"]
    assert "torch_index.py" not in r.stdout and f"torch {VERSION}:" not in r.stderr
