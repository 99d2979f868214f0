"""Progress bars (rich), phase timers, logging set-up and the third parties' output, shared by the scripts."""
import argparse
import contextlib
import logging
import os
import time
import warnings

from rich.logging import RichHandler
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

# Off unless --verbose (or QURL_VERBOSE=1): what the libraries read from the environment when they load.
# A value set by the user wins.
QUIET_ENV = {
    "TORCH_CPP_LOG_LEVEL": "ERROR",  # C++ warnings of torch extensions: vLLM's "[W...] NUMA binding" (read at import)
    "VLLM_LOGGING_LEVEL": "ERROR",  # vLLM's start-up warnings: thread binding, LD_PRELOAD, torch.set_num_threads
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # transformers' "Loading weights" and "Writing model shards" bars
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",  # "Generating train split"
    "TRANSFORMERS_VERBOSITY": "error",
    "WANDB_SILENT": "true",
}
THIRD_PARTY_LOGGERS = ("vllm", "transformers", "datasets", "huggingface_hub", "torch", "trackio", "httpx", "urllib3")


def verbose_requested(argv=None) -> bool:
    """--verbose among the flags (default sys.argv[1:]; read before they are parsed, as torch must not be imported
    yet), or QURL_VERBOSE=1 in the environment."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--verbose", nargs="?", const="true", default="false")
    flag = pre.parse_known_args(argv)[0].verbose
    return flag.lower() in ("true", "1", "yes") or os.environ.get("QURL_VERBOSE", "0").lower() not in ("", "0", "false")


def quiet_third_parties(verbose: bool) -> None:
    """Third-party warnings and progress bars off unless verbose; errors still show. The scripts call it first,
    before torch and vLLM are imported (they read their settings then), and setup_logging() again."""
    if verbose:
        return
    for name, value in QUIET_ENV.items():
        os.environ.setdefault(name, value)
    warnings.filterwarnings("ignore")  # Python warnings (FutureWarning, UserWarning, ...) of the libraries


def setup_logging(verbose: bool = False, level=logging.INFO) -> None:
    """The run's own lines (logger "qurl_mini") through rich; the libraries' only from ERROR up, unless verbose."""
    quiet_third_parties(verbose)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # verbose: its INFO lines come every step
    logging.basicConfig(level=level, format="%(message)s", datefmt="[%X]",
                        handlers=[RichHandler(show_path=False, markup=False)], force=True)
    for name in THIRD_PARTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING if verbose else logging.ERROR)
    if not verbose:  # in case transformers was loaded before the environment said so
        import transformers

        transformers.utils.logging.disable_progress_bar()


@contextlib.contextmanager
def progress_bar(description: str, total: int):
    """Yields advance(text='') which moves the bar one step and shows `text` beside it."""
    columns = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[info]}")]
    log = logging.getLogger("qurl_mini")
    with Progress(*columns, transient=False) as progress:
        task = progress.add_task(description, total=total, info="")
        done, every = 0, max(1, total // 10)

        def advance(info: str = "") -> None:
            nonlocal done
            done += 1
            progress.update(task, advance=1, info=info)
            if not progress.console.is_terminal and (done % every == 0 or done == total):
                log.info("%s: %d/%d %s", description, done, total, info)  # logs and CI get lines too

        yield advance


class Timer:
    """`with timer("phase"): ...` adds the phase's seconds to timer.times["time_phase"]."""

    def __init__(self):
        self.times = {}

    @contextlib.contextmanager
    def __call__(self, name):
        t0 = time.perf_counter()
        yield
        self.times[f"time_{name}"] = self.times.get(f"time_{name}", 0.0) + time.perf_counter() - t0
