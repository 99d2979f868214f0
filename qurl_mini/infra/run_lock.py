"""One owner per run folder: an flock on runs/<name>/run.lock (holding the owner's pid) for the run's lifetime;
the kernel drops it when the process ends, however it ends, so a lock left by a dead run is never in the way."""
import fcntl
import os

from .errors import OneLineError

LOCK_FILE = "run.lock"


class RunDirError(OneLineError, RuntimeError):
    """The run folder is in use by another run (or cannot be written); the message is one line."""


class RunLock:
    """Take the run folder for this process, or raise RunDirError naming the owner; writes nothing if refused."""

    def __init__(self, run_dir: str):
        try:
            os.makedirs(run_dir, exist_ok=True)
            self.fd = os.open(os.path.join(run_dir, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:  # what paths.check_output_dir cannot see ahead (e.g. root in /proc)
            raise RunDirError(f"{run_dir}: cannot be written ({e.strerror})") from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.read(self.fd, 32).decode(errors="replace").strip() or "unknown"
            self.release()
            raise RunDirError(f"{run_dir} is in use by another run (pid {owner}); wait for it to end, or choose "
                              f"another --run-name or --out-dir") from None
        os.ftruncate(self.fd, 0)
        os.write(self.fd, f"{os.getpid()}\n".encode())

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the last descriptor drops the flock
            self.fd = None
