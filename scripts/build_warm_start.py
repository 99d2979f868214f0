"""Rebuild a warm start this repository ships: the real model's (`--model smollm2-135m-arith`) or the embedded one's.

    python scripts/build_warm_start.py              # ~5 min on 2 cores -> qurl_mini/assets/smollm2-135m-arith.*
    python scripts/build_warm_start.py --embedded   # ~6 min -> qurl_mini/assets/embedded-sft-<key>.safetensors

The embedded warm start (the default model, the synthetic task) is the SFT in `qurl_mini/embedded.py` with its
default settings; the file it writes replaces the shipped one only with `SHIPPED_WARM_STARTS`'s sha256 updated
to the printed one (and every toy result made again from it).

SmolLM2-135M-Instruct cannot do the synthetic task as it comes (greedy 0%: it reasons in prose and seldom ends
with '#### N' in time), so GRPO would get no reward. A short SFT teaches the format: 80 steps of 16 synthetic
problems in the chat format, answered by the sloppy teacher (off by one in 55% of the demonstrations, as for the
embedded model: RL, rewarded on the true answer, has a bias to remove). Only the last 4 decoder layers and the
final norm are trained (14.2M of 135M parameters), so what changes ships in 28 MB: their weights in bf16, which
`resolve_model` puts into the base folder. Every machine then starts from the same bytes, where an SFT run on
each CPU would give slightly different ones (its matmuls round differently). Running this script again on
another CPU gives a close but not bit-identical file: commit it only with the results made from it.
"""
import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

SETTINGS = dict(base="smollm2-135m", trained_layers=4, steps=80, batch_size=16, lr=2e-4, betas=(0.9, 0.999),
                seed=0, teacher_slip=0.55, n_train=2000, max_number=10, data_seed=0, stored_dtype="bfloat16")


def main(argv=None) -> int:
    from qurl_mini.infra.cli import ArgumentParser  # an unknown flag: one line

    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--embedded", action="store_true", help="the embedded model's warm start instead")
    p.add_argument("--name", default="smollm2-135m-arith")
    p.add_argument("--out", default=None, help="default: qurl_mini/assets/<name>.safetensors")
    args = p.parse_args(argv)
    if args.embedded:
        return build_embedded(args.out)

    import torch
    from safetensors.torch import save_file

    from qurl_mini.actor import load_actor
    from qurl_mini.data import synthetic_splits
    from qurl_mini.embedded import sft
    from qurl_mini.infra.hardware import describe_cpu
    from qurl_mini.named_models import ASSETS, resolve_model
    from qurl_mini.infra.progress import setup_logging
    from qurl_mini.prompts import PromptBuilder

    setup_logging()
    s = SETTINGS
    out = args.out or os.path.join(ASSETS, f"{args.name}.safetensors")
    torch.manual_seed(s["seed"])
    actor, tokenizer = load_actor(resolve_model(s["base"], os.path.join(REPO, ".cache")))
    n = actor.config.num_hidden_layers
    trained = [name for name, _ in actor.named_parameters()
               if name == "model.norm.weight" or any(name.startswith(f"model.layers.{i}.") for i in range(n - s["trained_layers"], n))]
    for name, param in actor.named_parameters():
        param.requires_grad_(name in trained)
    train, _ = synthetic_splits(s["n_train"], 200, s["max_number"], seed=s["data_seed"])
    chat = PromptBuilder("chat", tokenizer)
    sft(actor, tokenizer, train, s["steps"], s["batch_size"], s["lr"], s["seed"], s["teacher_slip"],
        prompt_ids=chat.ids, params=[actor.get_parameter(name) for name in trained], betas=s["betas"])
    tensors = {name: actor.get_parameter(name).detach().to(getattr(torch, s["stored_dtype"])).contiguous()
               for name in trained}
    os.makedirs(os.path.dirname(out), exist_ok=True)
    save_file(tensors, out, metadata={"format": "pt"})
    with open(out.removesuffix(".safetensors") + ".json", "w") as f:
        json.dump({**s, "trained": len(trained), "trained_params": sum(t.numel() for t in tensors.values()),
                   "built_on": describe_cpu()}, f, indent=1)
    print(f"wrote {out} ({os.path.getsize(out) / 2 ** 20:.0f} MiB, {len(tensors)} tensors)")
    return 0


def build_embedded(out: str | None) -> int:
    """The embedded SFT with the trainer's defaults, trained here; writes its model.safetensors to `out`."""
    import shutil
    import tempfile

    from qurl_mini import embedded
    from qurl_mini.config import Config
    from qurl_mini.data import load_problems
    from qurl_mini.infra.progress import setup_logging

    setup_logging()
    cfg = Config()
    train, _ = load_problems(cfg.data, cfg.test_data, cfg.eval_size, cfg.seed, cfg.max_number)
    shape = embedded.EMBEDDED_VARIANTS["synthetic"]
    settings = embedded.warm_start_settings("synthetic", train, steps=cfg.sft_steps or shape.sft_steps,
                                            batch_size=shape.sft_batch_size, lr=cfg.sft_lr,
                                            teacher_slip=cfg.teacher_slip, seed=0)
    key = embedded.warm_start_key(settings)
    out = out or os.path.join(embedded.ASSETS, f"embedded-sft-{key}.safetensors")
    with tempfile.TemporaryDirectory() as tmp:
        embedded._save(os.path.join(tmp, "sft"), settings, "synthetic", train)
        shutil.copyfile(os.path.join(tmp, "sft", "model.safetensors"), out)
    print(f"wrote {out} (key {key}, sha256 {embedded.file_sha256(out)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
