"""Train a policy with RL, rollout on a (quantized) vLLM engine.  `python train.py --help`"""
import json
import logging
import os
import sys

from qurl_mini.config import parse_args
from qurl_mini.progress import setup_logging

ONE_LINE_ERRORS = ("ConfigError", "DataError", "ModelError", "UAQError", "TrainingError", "PromptError", "SyncError", "EngineError",
                   "QuantError", "PathError", "RunDirError", "DiskFullError")


def dry_run_report(cfg) -> str:
    """The resolved flags and the memory plan, without loading anything."""
    from qurl_mini.memory import memory_plan, model_shape

    lines = ["resolved config:", json.dumps(cfg.to_dict(), indent=1)]
    shape = model_shape(cfg.model)
    if shape is None:
        lines.append(f"memory estimate: unknown shape for --model {cfg.model} (not a local folder or a known hub id)")
    else:
        lines.append(f"memory estimate (GiB, an ESTIMATE from the sizes; {shape.params / 1e9:.2f}B parameters):")
        for part, gib in memory_plan(cfg, shape).items():
            lines.append(f"  {part:90s} {gib if isinstance(gib, bool) else f'{gib:7.1f}'}")
    return "\n".join(lines)


def main(argv=None) -> int:
    cfg = parse_args(argv)
    if cfg.dry_run:
        print(dry_run_report(cfg))
        return 0
    setup_logging()
    from qurl_mini.run_dir import exit_code, stop_on_signals, stopped_message

    try:
        from qurl_mini.trainer import Trainer

        with stop_on_signals(), Trainer(cfg) as trainer:  # SIGINT/SIGTERM: stop at the next phase's end
            summary = trainer.run()
    except KeyboardInterrupt as e:  # a signal (Interrupted), or Ctrl-C before the handlers were set
        from qurl_mini.checkpoint import newest_loadable

        last, _ = newest_loadable(os.path.join(cfg.out_dir, cfg.run_name))
        print(stopped_message(e, last, __file__, sys.argv[1:] if argv is None else argv), file=sys.stderr)
        return exit_code(e)
    except Exception as e:  # the project's own errors are one line; anything else keeps its traceback
        if type(e).__name__ in ONE_LINE_ERRORS:
            print(f"error: {e}", file=sys.stderr)
            return 2
        raise
    logging.getLogger("qurl_mini").info("done: %s", json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
