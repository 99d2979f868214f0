"""Expensive commands that only write files, run beside the suite: started when collection ends, read by their tests.

The suite runs one test at a time, and most of that work is one process on one core. The commands registered here
run meanwhile, one after another, pinned to the last CPU core this process may use (the real model's runs take
~5.5 GB each: never two of them at once from here). A test selected alone starts its command when it asks for it.

    @background.command("test_name")    # in the test's module: (a fresh folder) -> (argv, cwd)
    proc, folder = background.result("test_name")   # in the test: waits for it
"""
import os
import subprocess
import sys
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor

COMMANDS = {}  # test function name -> make(folder) -> (argv, cwd)
_futures: dict[str, Future] = {}
_pool: ThreadPoolExecutor | None = None
_running: list[subprocess.Popen] = []
_base = None  # where each command's folder goes (the session's temporary folder)
TIMEOUT_S = 1800  # a command that hangs fails its test instead of holding the suite
# the child pins itself to the core, then becomes the command: everything it starts inherits the pin
PIN = "import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])}); os.execv(sys.argv[2], sys.argv[2:])"


def command(test_name: str):
    """Register make(folder) -> (argv, cwd) as the command whose output `test_name` reads."""
    def register(make):
        COMMANDS[test_name] = make
        return make
    return register


def start(test_names, base=None) -> None:
    """Queue the commands of these tests (in this order) on the background core."""
    global _pool, _base
    _base = _base or base
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="background")
    for name in test_names:
        if name not in _futures:
            _futures[name] = _pool.submit(_run, name)


def result(test_name: str) -> tuple[subprocess.CompletedProcess, str]:
    """(the finished process, its folder) of the test's command; raises what making it raised (e.g. a skip)."""
    start([test_name])
    return _futures[test_name].result()


def stop() -> None:
    """At the session's end: drop the commands not started, end the one running (a run stopped by -x)."""
    if _pool is not None:
        _pool.shutdown(wait=False, cancel_futures=True)
    for proc in _running:
        if proc.poll() is None:
            proc.kill()


def _run(name: str):
    folder = tempfile.mkdtemp(prefix=name[:40] + "-", dir=_base)
    argv, cwd = COMMANDS[name](folder)
    core = sorted(os.sched_getaffinity(0))[-1]
    proc = subprocess.Popen([sys.executable, "-c", PIN, str(core), *argv], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    _running.append(proc)
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        stderr += f"\n(background.py: killed after {TIMEOUT_S} s)"
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr), folder
