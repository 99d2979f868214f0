"""Atomic, resumable checkpoints: safetensors and JSON only (optimizer state via weights_only).

Layout of runs/<name>/checkpoints/step-000020/:
    actor/ (HF folder, safetensors)   critic.safetensors (PPO)   optimizer.pt   rng.safetensors
    trainer_state.json (step, data cursor, counters, config, UAQ scale, scheduler)   COMPLETE
A folder is written under a temporary name and renamed when complete; one without the
COMPLETE marker (a crash mid-write) is never loaded. One whose files are damaged all the same
(a truncated file after a crash of the machine) is skipped on resume for the next older one.
A full disk during a save removes the temporary folder and says how much space was needed.
"""
import contextlib
import errno
import glob
import json
import logging
import os
import random
import shutil

import torch
from safetensors.torch import load_file, save_file

from .paths import first_line, safetensors_problem
from .errors import OneLineError

MARKER = "COMPLETE"
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


class ResumeError(OneLineError, ValueError):
    """--resume finds nothing to resume from; the message is one line."""


class DiskFullError(OneLineError, OSError):
    """A save ran out of disk space (or over the file-size limit); the message is one line."""


def checkpoint_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def save_checkpoint(run_dir: str, step: int, *, actor, tokenizer, critic, optimizers: dict,
                    schedulers: dict, trainer_state: dict, keep: int) -> str:
    final = os.path.join(checkpoint_dir(run_dir), f"step-{step:06d}")
    optimizer_states = {name: opt.state_dict() for name, opt in optimizers.items()}
    size = tensor_bytes(actor.state_dict(), critic.state_dict() if critic is not None else {}, optimizer_states)
    with written_atomically(final, size) as tmp:
        actor.save_pretrained(os.path.join(tmp, "actor"), safe_serialization=True)
        tokenizer.save_pretrained(os.path.join(tmp, "actor"))
        if critic is not None:
            save_file({k: v.contiguous() for k, v in critic.state_dict().items()},
                      os.path.join(tmp, "critic.safetensors"))
        torch.save(optimizer_states, os.path.join(tmp, "optimizer.pt"))
        save_file({"torch": torch.get_rng_state()}, os.path.join(tmp, "rng.safetensors"))
        state = dict(trainer_state, step=step, python_rng=_jsonable(random.getstate()),
                     schedulers={name: s.state_dict() for name, s in schedulers.items()})
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump(state, f, indent=1)
        with open(os.path.join(tmp, MARKER), "w") as f:
            f.write(str(step))
    for old in complete_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def save_model(folder: str, actor, tokenizer) -> str:
    """The actor as a plain HF folder (the run's final model), written atomically like a checkpoint."""
    with written_atomically(folder, tensor_bytes(actor.state_dict())) as tmp:
        actor.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    return folder


@contextlib.contextmanager
def written_atomically(folder: str, size: int, then: str = "run again with --resume"):
    """Yields a temporary folder that becomes `folder` when the block ends; on any failure (an interrupt too)
    it is removed, and a full disk becomes one DiskFullError line naming `folder`, the space it needs and
    what to do `then`."""
    tmp = f"{folder}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(tmp)
        yield tmp
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(e):
            free = shutil.disk_usage(os.path.dirname(tmp)).free
            raise DiskFullError(f"disk full writing {folder}: it needs about {_size(size)}, {_size(free)} free "
                                f"there ({first_line(e)}); free some space and {then}") from None
        raise
    if os.path.exists(folder):
        shutil.rmtree(folder)
    os.replace(tmp, folder)


def is_disk_full(e: BaseException | None) -> bool:
    """ENOSPC/EFBIG/EDQUOT, also where a library kept only the message (safetensors' 'os error 28', torch's
    zip writer's 'unexpected pos' of a short write)."""
    while e is not None:
        if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS:
            return True
        if "unexpected pos" in str(e) or any(f"(os error {n})" in str(e) for n in DISK_FULL_ERRNOS):
            return True
        e = e.__cause__ or e.__context__
    return False


def tensor_bytes(*states) -> int:
    """Bytes of all tensors in nested dicts/lists (a state dict, an optimizer's): a save's size, about."""
    total = 0
    for x in states:
        if isinstance(x, torch.Tensor):
            total += x.numel() * x.element_size()
        elif isinstance(x, dict):
            total += tensor_bytes(*x.values())
        elif isinstance(x, (list, tuple)):
            total += tensor_bytes(*x)
    return total


def _size(n: int) -> str:
    return f"{n / 2 ** 30:.1f} GiB" if n >= 2 ** 30 else f"{n / 2 ** 20:.1f} MiB"


def complete_checkpoints(run_dir: str) -> list[str]:
    """Finished checkpoints, oldest first; half-written ones (no marker, .tmp names) are skipped."""
    paths = [p for p in glob.glob(os.path.join(checkpoint_dir(run_dir), "step-*"))
             if ".tmp" not in os.path.basename(p) and os.path.isfile(os.path.join(p, MARKER))]
    return sorted(paths)


def latest_checkpoint(path: str) -> str | None:
    """The newest complete checkpoint in a run folder (or the path itself if it is one)."""
    if os.path.isfile(os.path.join(path, MARKER)):
        return path
    found = complete_checkpoints(path)
    return found[-1] if found else None


def newest_loadable(path: str) -> tuple[str | None, list[tuple[str, str]]]:
    """(the newest complete checkpoint whose files load, [(newer one skipped, why)]) in a run folder,
    or of `path` itself when it is a checkpoint."""
    candidates = [path] if os.path.isfile(os.path.join(path, MARKER)) else complete_checkpoints(path)[::-1]
    skipped = []
    for ckpt in candidates:
        problem = damage(ckpt)
        if problem is None:
            return ckpt, skipped
        skipped.append((ckpt, problem))
    return None, skipped


def find_resume(resume: str | None, run_dir: str) -> str | None:
    """--resume: the newest loadable checkpoint of this run ('latest') or of the folder given, saying which
    damaged ones it skipped; None without --resume. A ResumeError when there is none."""
    if resume is None:
        return None
    where = run_dir if resume == "latest" else resume
    found, damaged = newest_loadable(where)
    for ckpt, problem in damaged:
        logging.getLogger("qurl_mini").warning("skipping checkpoint %s, it cannot be loaded (%s); %s", ckpt, problem,
                    f"resuming from {found} instead" if found else "no older one")
    if found is None:
        raise ResumeError(f"--resume: no {'loadable' if damaged else 'complete'} checkpoint in {where}")
    return found


# what a checkpoint must hold to be resumed from ("complete"), besides the COMPLETE marker
REQUIRED_FILES = ("trainer_state.json", "optimizer.pt", "rng.safetensors", os.path.join("actor", "config.json"))


def damage(ckpt: str) -> str | None:
    """Why a checkpoint with its marker cannot be loaded (a file missing: copied in half; a truncated or unreadable
    file), or None. Reads only headers: safetensors headers, the JSON files, the optimizer state memory-mapped."""
    for name in REQUIRED_FILES:
        if not os.path.isfile(os.path.join(ckpt, name)):
            return f"{name} is missing (copied in half?)"
    if not glob.glob(os.path.join(ckpt, "actor", "*.safetensors")):
        return "actor/ has no weights (copied in half?)"
    try:
        with open(os.path.join(ckpt, "trainer_state.json")) as f:
            algo = json.load(f).get("config", {}).get("algo")
    except (OSError, ValueError) as e:
        return f"trainer_state.json: {first_line(e)}"
    if algo == "ppo" and not os.path.isfile(os.path.join(ckpt, "critic.safetensors")):
        return "critic.safetensors is missing (copied in half?)"
    for path in sorted(glob.glob(os.path.join(ckpt, "**", "*.safetensors"), recursive=True)):
        problem = safetensors_problem(path)
        if problem:
            return f"{os.path.relpath(path, ckpt)}: {problem}"
    for path in sorted(glob.glob(os.path.join(ckpt, "**", "*.json"), recursive=True)):
        try:
            with open(path) as f:
                json.load(f)
        except (OSError, ValueError) as e:
            return f"{os.path.relpath(path, ckpt)}: {first_line(e)}"
    try:
        torch.load(os.path.join(ckpt, "optimizer.pt"), weights_only=True, mmap=True)
    except Exception as e:  # missing, truncated (no zip central directory) or not a torch file
        return f"optimizer.pt: {first_line(e)}"
    return None


IDENTITY = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers")
# The flags a resumed run may change: where and when it ends, saves, evaluates, measures and reports (each step
# reseeds from (seed, step), so an evaluation or a save draws no randomness that a later step reads;
# --measure-acr-gap's extra gradient goes to no update), and gradient checkpointing (the same forward recomputed:
# bit-equal gradients). Any other flag that differs from the one the checkpoint was saved with refuses
# (`changed_flags`): the layout flags too (--shared-prompt changes which rows share a minibatch; --micro-batch-size
# and --max-tokens-per-micro-batch sum each gradient in another order: equal up to rounding, not bit for bit).
RESUME_FREE = ("steps", "eval_every", "save_every", "keep", "resume", "max_bad_steps", "mismatch_warn_kl",
               "measure_acr_gap", "token_page_responses", "preset", "dry_run", "run_name", "out_dir", "cache_dir",
               "report_to", "verbose", "gradient_checkpointing")


def check_resumable(ckpt: str, config: dict, base_model: str) -> None:
    """One ResumeError line where the checkpoint belongs to another kind of run: another --algo (its critic and
    optimizer state differ), another model than this run's base (another vocabulary or shape), or any flag outside
    RESUME_FREE set otherwise (its steps would mix two settings in one run)."""
    algo = config["algo"]
    state = load_trainer_state(ckpt)
    saved_algo = state.get("config", {}).get("algo")
    if saved_algo and saved_algo != algo:
        raise ResumeError(f"--resume {ckpt}: a --algo {saved_algo} run's checkpoint, and this run is --algo {algo}; "
                          f"resume with --algo {saved_algo} or start a new run")
    base_config = os.path.join(base_model, "config.json")
    if os.path.isfile(base_config):  # a local model (a hub id: nothing local to compare with)
        with open(os.path.join(ckpt, "actor", "config.json")) as f:
            saved = json.load(f)
        with open(base_config) as f:
            base = json.load(f)
        differ = [k for k in IDENTITY if saved.get(k) != base.get(k)]
        if differ:
            raise ResumeError(f"--resume {ckpt}: its model ({', '.join(f'{k} {saved.get(k)}' for k in differ)}) is "
                              f"not this run's {base_model} ({', '.join(f'{k} {base.get(k)}' for k in differ)}); give "
                              f"the --model that run used")
    changed = changed_flags(state.get("config", {}), config)
    if changed:
        was, now = (" ".join(flag_value(name, values[i]) for name, values in changed.items()) for i in (0, 1))
        raise ResumeError(f"--resume {ckpt}: saved with {was}, and this run has {now}: its steps would mix two "
                          f"settings in one run; resume with {was} or start a new run")


def changed_flags(saved: dict, config: dict) -> dict:
    """{flag: (saved value, this run's)} of the flags outside RESUME_FREE that differ; a flag the checkpoint does not
    record (it is older than the flag) is not compared."""
    return {name: (saved[name], value) for name, value in config.items()
            if name not in RESUME_FREE and name in saved and saved[name] != value}


def flag_value(name: str, value) -> str:
    """'--max-tokens-per-micro-batch 8', '--shared-prompt false', 'no --quant-keep'."""
    flag = f"--{name.replace('_', '-')}"
    return f"no {flag}" if value is None else f"{flag} {str(value).lower() if isinstance(value, bool) else value}"


def load_trainer_state(ckpt: str) -> dict:
    with open(os.path.join(ckpt, "trainer_state.json")) as f:
        return json.load(f)


def restore(ckpt: str, *, critic, optimizers: dict, schedulers: dict, state: dict) -> None:
    """Load everything but the actor weights (those load from ckpt/actor as an HF folder)."""
    if critic is not None:
        critic.load_state_dict(load_file(os.path.join(ckpt, "critic.safetensors")))
    saved = torch.load(os.path.join(ckpt, "optimizer.pt"), weights_only=True)
    for name, opt in optimizers.items():
        opt.load_state_dict(saved[name])
    for name, sched in schedulers.items():
        sched.load_state_dict(state["schedulers"][name])
    torch.set_rng_state(load_file(os.path.join(ckpt, "rng.safetensors"))["torch"])
    random.setstate(_tupled(state["python_rng"]))


def _jsonable(x):
    return [_jsonable(v) for v in x] if isinstance(x, (tuple, list)) else x


def _tupled(x):
    return tuple(_tupled(v) for v in x) if isinstance(x, list) else x
