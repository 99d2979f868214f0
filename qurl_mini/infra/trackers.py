"""Experiment trackers for `--report-to`: each gets the resolved config at the start, metrics.jsonl's
per-step row (same names; the greedy test accuracy when measured, at step 0 for the start) and curves.png
at the end. Their packages are optional (requirements-track.txt), imported only when a run asks for one.

    python train.py --report-to tensorboard trackio      # then: tensorboard --logdir runs / trackio show
"""
import contextlib
import importlib.util
import io
import json
import logging
import math
import os
from .errors import OneLineError
from .paths import first_line

log = logging.getLogger("qurl_mini")

PROJECT = "qurl-mini"  # the trackio / wandb project (their TRACKIO_PROJECT / WANDB_PROJECT override it)
INSTALL = "pip install -r requirements-track.txt (or pip install '.[track]')"


def scalars(row: dict) -> dict:
    """The row's finite numbers, less the step (trackers take it apart)."""
    return {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(v)}


class TensorBoard:
    """Event files in runs/<name>/tensorboard: `tensorboard --logdir runs` shows every run side by side."""
    package = "tensorboard"
    folder = "tensorboard"  # in the run folder

    def __init__(self, run_dir: str, run_name: str, config: dict, resume: bool):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(os.path.join(run_dir, self.folder))
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=1) + "\n```")
        self.watch = f"tensorboard --logdir {os.path.dirname(os.path.normpath(run_dir)) or '.'}"

    def log(self, values: dict, step: int) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def image(self, name: str, path: str, step: int) -> None:
        import numpy as np
        from PIL import Image

        self.writer.add_image(name, np.asarray(Image.open(path).convert("RGB")), step, dataformats="HWC")

    def close(self) -> None:
        self.writer.close()


class Trackio:
    """A local SQLite store (TRACKIO_DIR, default ~/.cache/huggingface/trackio); `trackio show` serves it."""
    package = "trackio"

    def __init__(self, run_dir: str, run_name: str, config: dict, resume: bool):
        import trackio

        self.trackio, project = trackio, os.environ.get("TRACKIO_PROJECT", PROJECT)
        with contextlib.redirect_stdout(io.StringIO()):  # its banner; the line below says what matters
            trackio.init(project=project, name=run_name, config=config, resume="allow" if resume else "never",
                         auto_log_cpu=False, embed=False)
        where = f"TRACKIO_DIR={os.environ['TRACKIO_DIR']} " if os.environ.get("TRACKIO_DIR") else ""
        self.watch = f"{where}trackio show --project {project}"

    def log(self, values: dict, step: int) -> None:
        self.trackio.log(values, step=step)

    def image(self, name: str, path: str, step: int) -> None:
        self.trackio.log({name: self.trackio.Image(path)}, step=step)

    def close(self) -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            self.trackio.finish()


class WandB:
    """Offline unless WANDB_MODE=online: the run in runs/<name>/wandb, uploaded later by `wandb sync`."""
    package = "wandb"
    folder = "wandb"

    def __init__(self, run_dir: str, run_name: str, config: dict, resume: bool):
        import wandb

        self.wandb, mode = wandb, os.environ.get("WANDB_MODE", "offline")
        try:  # online: wandb's own wait for its server is 90 s; 30 s is ample for an answer
            self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", PROJECT), name=run_name, config=config,
                                  dir=run_dir, mode=mode, settings=wandb.Settings(init_timeout=30))
        except wandb.errors.Error as e:  # online: no network, no API key, a server that refuses
            raise TrackerError(f"--report-to wandb with WANDB_MODE={mode}: {first_line(e)}; unset WANDB_MODE to log "
                               "offline into the run folder (wandb sync uploads it later)") from None
        self.watch = f"wandb sync {os.path.dirname(self.run.dir)}" if mode == "offline" else self.run.url

    def log(self, values: dict, step: int) -> None:
        self.run.log(values, step=step)

    def image(self, name: str, path: str, step: int) -> None:
        self.run.log({name: self.wandb.Image(path)}, step=step)

    def close(self) -> None:
        self.run.finish()


TRACKERS = {"tensorboard": TensorBoard, "trackio": Trackio, "wandb": WandB}


class TrackerError(OneLineError, RuntimeError):
    """A tracker cannot start (its package is broken); the message is one line."""


def not_installed(names) -> str | None:
    """One line naming the first asked-for tracker whose package is missing, and the install command."""
    for name in names:
        tracker = TRACKERS.get(name)
        if tracker is not None and importlib.util.find_spec(tracker.package) is None:
            return f"--report-to {name}: {tracker.package} is not installed; {INSTALL}"
    return None


class Trackers:
    """The run's trackers, called as one; with no names (or only `none`) it does nothing."""

    def __init__(self, names, run_dir: str, run_name: str, config: dict, resume: bool = False):
        self.trackers = {}
        for name in dict.fromkeys(n for n in names if n != "none"):
            folder = getattr(TRACKERS[name], "folder", None)
            if folder and os.path.exists(os.path.join(run_dir, folder)) and not os.path.isdir(os.path.join(run_dir, folder)):
                self.close()
                raise TrackerError(f"--report-to {name}: {os.path.join(run_dir, folder)} is a file, where the tracker "
                                   "writes its folder; move it away")
            try:
                self.trackers[name] = TRACKERS[name](run_dir, run_name, config, resume)
            except BaseException as e:  # the ones already started are closed
                self.close()
                if isinstance(e, ImportError):
                    raise TrackerError(f"--report-to {name}: {e}; {INSTALL}") from None
                raise
            log.info("%s: watch the run with: %s", name, self.trackers[name].watch)

    def watch(self) -> dict:
        """{name: how to watch the run}"""
        return {name: tracker.watch for name, tracker in self.trackers.items()}

    def log(self, row: dict, step: int) -> None:
        values = scalars(row)
        for tracker in self.trackers.values():
            tracker.log(values, step)

    def image(self, name: str, path: str, step: int) -> None:
        for tracker in self.trackers.values():
            tracker.image(name, path, step)

    def close(self) -> None:
        for tracker in self.trackers.values():
            tracker.close()
        self.trackers = {}
