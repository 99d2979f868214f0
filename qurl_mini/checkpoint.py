"""Atomic, resumable checkpoints: safetensors and JSON only (optimizer state via weights_only).

Layout of runs/<name>/checkpoints/step-000020/:
    actor/ (HF folder, safetensors)   critic.safetensors (PPO)   optimizer.pt   rng.safetensors
    trainer_state.json (step, data cursor, counters, config, UAQ scale, scheduler)   COMPLETE
A folder is written under a temporary name and renamed when complete; one without the
COMPLETE marker (a crash mid-write) is never loaded.
"""
import glob
import json
import os
import random
import shutil

import torch
from safetensors.torch import load_file, save_file

MARKER = "COMPLETE"


def checkpoint_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def save_checkpoint(run_dir: str, step: int, *, actor, tokenizer, critic, optimizers: dict,
                    schedulers: dict, trainer_state: dict, keep: int) -> str:
    root = checkpoint_dir(run_dir)
    final = os.path.join(root, f"step-{step:06d}")
    tmp = f"{final}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    actor.save_pretrained(os.path.join(tmp, "actor"), safe_serialization=True)
    tokenizer.save_pretrained(os.path.join(tmp, "actor"))
    if critic is not None:
        save_file({k: v.contiguous() for k, v in critic.state_dict().items()}, os.path.join(tmp, "critic.safetensors"))
    torch.save({name: opt.state_dict() for name, opt in optimizers.items()}, os.path.join(tmp, "optimizer.pt"))
    save_file({"torch": torch.get_rng_state()}, os.path.join(tmp, "rng.safetensors"))
    state = dict(trainer_state, step=step, python_rng=_jsonable(random.getstate()),
                 schedulers={name: s.state_dict() for name, s in schedulers.items()})
    with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
        json.dump(state, f, indent=1)
    with open(os.path.join(tmp, MARKER), "w") as f:
        f.write(str(step))
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in complete_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


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
