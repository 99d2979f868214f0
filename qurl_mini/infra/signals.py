"""A clean stop on SIGINT/SIGTERM: within stop_on_signals() a signal only sets a flag; the trainer calls
stop_point() where stopping leaves nothing half written (between phases and steps), which raises Interrupted.
A second signal stops at once. The message that ends the run names the command that resumes it."""
import contextlib
import logging
import os
import shlex
import signal
import sys
import threading

log = logging.getLogger("qurl_mini")

class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped the run (a KeyboardInterrupt, so no `except Exception` swallows it)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_requested = None  # the signal that asked the run to stop, once one has


def stop_point() -> None:
    """Raise Interrupted if a stop was asked for; call where the run can stop with nothing half written."""
    if _requested is not None:
        raise Interrupted(_requested)


@contextlib.contextmanager
def stop_on_signals():
    """Within: SIGINT/SIGTERM ask for a stop at the next stop_point(); a second one stops at once."""
    if threading.current_thread() is not threading.main_thread():  # handlers can only be set there
        yield
        return

    def handler(signum, frame):
        global _requested
        if _requested is not None:
            raise Interrupted(signum)
        _requested = signum
        log.warning("%s: stopping after the current phase (send it again to stop at once)",
                    signal.Signals(signum).name)

    global _requested
    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        _requested = None


def exit_code(e: KeyboardInterrupt) -> int:
    """The shell's convention: 128 + the signal's number (130 for SIGINT, 143 for SIGTERM)."""
    return 128 + getattr(e, "signum", signal.SIGINT)


def stopped_message(e: KeyboardInterrupt, last_checkpoint: str | None, script: str, argv: list[str]) -> str:
    """One line: which signal, the last complete checkpoint, and the command that resumes from it."""
    name = signal.Signals(getattr(e, "signum", signal.SIGINT)).name
    if last_checkpoint is None:
        return f"stopped by {name} before the first checkpoint; start again with: {_command(script, argv)}"
    return (f"stopped by {name}; the last complete checkpoint is {last_checkpoint}; resume with: "
            f"{resume_command(script, argv)}")


def resume_command(script: str, argv: list[str]) -> str:
    """The command line that continues this run: the same flags, with a bare --resume (its newest checkpoint)."""
    args, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
        elif arg == "--resume":
            skip = i + 1 < len(argv) and not argv[i + 1].startswith("-")  # its optional value
        elif not arg.startswith("--resume="):
            args.append(arg)
    return _command(script, [*args, "--resume"])


def _command(script: str, argv: list[str]) -> str:
    return shlex.join([_short(sys.executable), _short(script), *argv])


def _short(path: str) -> str:
    """A path relative to the current folder when it lies under it."""
    rel = os.path.relpath(os.path.abspath(path))
    return path if rel.startswith("..") else rel
