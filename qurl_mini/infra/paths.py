"""Can a path from the command line be used? The model-folder and output-path checks of train.py, eval.py and
quantize.py, in one place; each problem is one line (ModelError, PathError). Light: no torch import."""
import glob
import hashlib
import json
import os

from .errors import OneLineError


class ModelError(OneLineError, ValueError):
    """--model cannot be used; the message is one line."""


class PathError(OneLineError, ValueError):
    """An output path cannot be used; the message is one line."""


def looks_like_path(model: str) -> bool:
    """A local folder rather than a hub id ('Qwen/Qwen2.5-0.5B')."""
    return model.startswith((".", "/", "~")) or model.count("/") > 1 or os.path.exists(model)


LOCAL_MODEL = "give a local model folder instead (config.json, *.safetensors and the tokenizer's files)"


def check_model_dir(model: str, flag: str = "--model") -> None:
    """A local model folder has a readable config.json and complete weights; a hub id, that the hub answers (or,
    offline, that its config is in the local hub cache): the rest is left to transformers."""
    if not looks_like_path(model):
        from huggingface_hub.constants import is_offline_mode

        from .hub import USE_THE_CACHE, model_unavailable

        why = model_unavailable(model)
        if why:
            raise ModelError(f"{flag} {model}: no such folder, and as a hub id it cannot be fetched ({why}); "
                             f"{LOCAL_MODEL}{'' if is_offline_mode() else f'; {USE_THE_CACHE}'}")
        return
    folder = os.path.expanduser(model)
    if not os.path.isdir(folder):
        raise ModelError(f"{flag} {model}: no such folder")
    problem = _unreadable_json(os.path.join(folder, "config.json"))
    if problem:
        raise ModelError(f"{flag} {model}: {problem}, so not a model folder")
    problem = weights_problem(folder)
    if problem:
        raise ModelError(f"{flag} {model}: {problem}")


def weights_problem(folder: str) -> str | None:
    """Why the folder's weights cannot be loaded: none there (a half-copied download), a shard named in the
    index missing, or a truncated safetensors file. None when they look whole."""
    files = glob.glob(os.path.join(folder, "*.safetensors")) + glob.glob(os.path.join(folder, "pytorch_model*.bin"))
    for index in glob.glob(os.path.join(folder, "*.index.json")):
        try:
            with open(index) as f:
                shards = set(json.load(f)["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError) as e:
            return f"{os.path.basename(index)} cannot be read ({first_line(e)})"
        missing = sorted(s for s in shards if not os.path.isfile(os.path.join(folder, s)))
        if missing:
            return f"{missing[0]} (named in {os.path.basename(index)}) is missing; a half-copied download?"
    if not files:
        return "no weights (*.safetensors or pytorch_model*.bin); a half-copied download?"
    for path in sorted(files):
        problem = safetensors_problem(path) if path.endswith(".safetensors") else None
        if problem:
            return f"{os.path.basename(path)} is damaged ({problem})"
    return None


def safetensors_problem(path: str) -> str | None:
    """Why a safetensors file cannot be opened (truncated, not safetensors), or None; reads only its header."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="np"):
            return None
    except Exception as e:  # SafetensorError, OSError: the file is cut short or not safetensors
        return first_line(e)


def check_outputs_apart(outputs: dict, inputs: dict) -> None:
    """No output is, contains or sits inside an input ({flag: path}; None and hub ids skipped): a command never
    writes over what it reads (quantize.py --out = --model would replace the model with its own INT8 copy).
    Checked before anything is written."""
    def real(path):
        return os.path.realpath(os.path.expanduser(path))

    for out_flag, out in outputs.items():
        for in_flag, source in inputs.items():
            if not out or not source or not os.path.exists(source):
                continue
            o, i = real(out), real(source)
            if o == i or i.startswith(o + os.sep) or o.startswith(i + os.sep):
                how = "is" if o == i else "contains" if i.startswith(o + os.sep) else "is inside"
                raise PathError(f"{out_flag} {out} {how} {in_flag} {source}: the command would write over its own "
                                "input; choose another output")


def check_output_dir(path: str, flag: str) -> None:
    """A folder that is or can be made here: not a file, nor under one, and writable."""
    _check_writable(path, flag, path)


def check_output_file(path: str, flag: str) -> None:
    """A file that can be written: not a folder, in an existing, writable folder."""
    if os.path.isdir(path):
        raise PathError(f"{flag} {path}: is a folder, not a file")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.exists(parent):
        raise PathError(f"{flag} {path}: no such folder {parent}")
    _check_writable(parent, flag, path)


def _check_writable(folder: str, flag: str, given: str) -> None:
    """The nearest existing part of `folder` is a folder this process may write into."""
    existing = os.path.abspath(folder)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    named = "" if existing == os.path.abspath(given) else f"{existing} "  # the path given, or a part of it
    if not os.path.isdir(existing):
        raise PathError(f"{flag} {given}: {named}is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PathError(f"{flag} {given}: {named or 'the folder '}is not writable")


def _unreadable_json(path: str) -> str | None:
    if not os.path.isfile(path):
        return f"no {os.path.basename(path)}"
    try:
        with open(path) as f:
            json.load(f)
    except (OSError, ValueError) as e:
        return f"{os.path.basename(path)} cannot be read ({first_line(e)})"
    return None


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def file_sha256(path: str) -> str:
    """The sha256 of a file's bytes (hex), read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
