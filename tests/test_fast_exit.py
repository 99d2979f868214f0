"""The scripts' last line (qurl_mini/infra/fast_exit.py): the exit code as sys.exit gives it, and nothing printed or
logged is lost by leaving without Python's teardown, even into a pipe (block-buffered)."""
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = """
import logging, sys
from qurl_mini.infra.fast_exit import exit_now
logging.basicConfig(filename=sys.argv[2], level=logging.INFO, format="%(message)s")
logging.getLogger("qurl_mini").info("logged before the exit")
print("printed " * 2000, end="")  # more than one buffer's worth, still in the buffer at the exit
print("to stderr", file=sys.stderr)
exit_now({code})
"""


@pytest.mark.parametrize("code, rc, said", [("0", 0, ""), ("2", 2, ""), ("None", 0, ""),
                                            ("'error: a message'", 1, "error: a message")])
def test_exit_now_keeps_the_exit_code_the_output_and_the_log(tmp_path, code, rc, said):
    log = tmp_path / "run.log"
    proc = subprocess.run([sys.executable, "-c", SCRIPT.format(code=code), "-", str(log)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == rc
    assert proc.stdout == "printed " * 2000
    assert proc.stderr.splitlines() == ["to stderr"] + ([said] if said else [])
    assert log.read_text() == "logged before the exit\n"
