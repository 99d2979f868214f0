"""Which model a run starts from: --model (a folder, or a name of `named_models`), or the embedded tiny Qwen2
after its cached SFT warm start."""
import os

from .embedded import warm_start
from .named_models import resolve_model


def base_model_path(cfg, train_problems) -> str:
    """--model's folder (a name is converted once into --cache-dir), or the embedded warm start: the synthetic
    variant on the synthetic task, the byte-fallback one (any text, 2048 positions) on real data."""
    if cfg.model is not None:
        return resolve_model(cfg.model, cfg.cache_dir)
    variant = "synthetic" if cfg.data == "synthetic" else "text"
    return warm_start(cfg.cache_dir, train_problems, variant=variant, steps=cfg.sft_steps, lr=cfg.sft_lr,
                      teacher_slip=cfg.teacher_slip, seed=0, source=os.path.basename(cfg.data))
