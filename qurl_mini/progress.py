"""Progress bars (rich) and logging set-up shared by the scripts."""
import contextlib
import logging

from rich.logging import RichHandler
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def setup_logging(level=logging.INFO) -> None:
    import os

    # vLLM configures its own logger at import and logs INFO lines every step: warnings only
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    logging.basicConfig(level=level, format="%(message)s", datefmt="[%X]",
                        handlers=[RichHandler(show_path=False, markup=False)], force=True)
    for noisy in ("vllm", "transformers", "datasets", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


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
