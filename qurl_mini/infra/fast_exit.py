"""The scripts' last line: leave the process without Python's teardown.

That teardown garbage-collects a heap of millions of objects (torch, transformers, vLLM) and takes ~3 s after every
train.py / eval.py / quantize.py on a 2-core CPU, each time after the run has ended. By the time a script's main()
returns, everything it wrote is closed: files by their `with` blocks, trackers by Trainer.close(), the engine runs
in this process (no child to wait for). A script that raises keeps Python's normal exit and its traceback."""
import logging
import os
import sys


def exit_now(code: int | str | None) -> None:
    """Flush the logs and the console, then end the process with `code` (as sys.exit takes it: None is 0, a
    message is printed and is 1)."""
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing left to say there
            pass
    os._exit(code or 0)
