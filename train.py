"""Train a policy with RL, rollout on a (quantized) vLLM engine.  `python train.py --help`"""
import json
import logging
import os
import sys
import time

from qurl_mini.infra.progress import quiet_third_parties, setup_logging, verbose_requested

if __name__ == "__main__":  # before torch and vLLM load: they read their log settings then
    quiet_third_parties(verbose_requested())

from qurl_mini.config import parse_args  # noqa: E402
from qurl_mini.infra.errors import OneLineError  # noqa: E402

def dry_run_report(cfg) -> str:
    """The resolved flags and the memory plan, without loading anything."""
    from qurl_mini.infra.memory import memory_plan, model_shape, shared_prompt_saving

    lines = ["resolved config:", json.dumps(cfg.to_dict(), indent=1),
             "where each value came from (command line > preset > task default > base default):"]
    lines += [f"  --{name.replace('_', '-'):30s} {json.dumps(value):24s} {cfg.source(name)}"
              for name, value in cfg.to_dict().items()]
    if cfg.defaults_note():
        lines.append(cfg.defaults_note())
    shape = model_shape(cfg.model)
    if shape is None:
        lines.append(f"memory estimate: unknown shape for --model {cfg.model} (not a local folder or a known hub id)")
    else:
        lines.append(f"memory estimate (GiB, an ESTIMATE from the sizes; {shape.params / 1e9:.2f}B parameters):")
        for part, gib in memory_plan(cfg, shape).items():
            lines.append(f"  {part:90s} {gib if isinstance(gib, bool) else f'{gib:7.1f}'}")
        if cfg.shared_prompt and cfg.group_size > 1:
            prompt, response, group = cfg.max_prompt_tokens or 256, cfg.max_new_tokens, cfg.group_size
            lines.append(f"--shared-prompt: a group of {group} responses of {response} tokens after a {prompt}-token prompt "
                         f"runs {prompt + group * response} tokens instead of {group * (prompt + response)}: "
                         f"{shared_prompt_saving(shape, prompt, response, group):.2f}x fewer log-prob and update FLOPs "
                         "(attention's square counted whole; a COMPUTATION from the sizes, not a measurement)")
    return "\n".join(lines)


def end_of_run(summary: dict, seconds: float) -> str:
    """The run's story in a few lines; the config stays in summary.json."""
    def pct(accuracy):
        return "-" if accuracy is None else f"{100 * accuracy:.1f}%"

    cfg = summary["config"]
    steps = f"{cfg['steps']} step{'s' if cfg['steps'] != 1 else ''}"
    lines = [f"done: {cfg['run_name']}, {steps} ({cfg['algo']}, rollout --quant {cfg['quant']}) "
             f"in {duration(seconds)}",
             f"  greedy test accuracy: {pct(summary.get('initial_test_accuracy'))} before RL -> "
             f"{pct(summary['final_test_accuracy'])} after",
             f"  metrics      {summary['metrics']}",
             f"  plot         {summary['plot']}",
             f"  checkpoints  {summary['checkpoints']}",
             f"  final model  {summary['final_model']}",
             f"  summary      {os.path.join(os.path.dirname(summary['metrics']), 'summary.json')} (and the config)"]
    lines += [f"  {name:12s} {watch}" for name, watch in summary.get("trackers", {}).items()]
    return "\n".join(lines)


def duration(seconds: float) -> str:
    minutes, s = divmod(round(seconds), 60)
    hours, m = divmod(minutes, 60)
    return f"{hours}h {m:02d}m" if hours else f"{m}m {s:02d}s" if m else f"{s}s"


def one_line(e: BaseException) -> str:
    """What failed, where: the OS error's own words and file, on one line."""
    where = f" ({e.filename})" if getattr(e, "filename", None) else ""
    return " ".join(str(getattr(e, "strerror", None) or e).split()) + where


def main(argv=None) -> int:
    t0 = time.time()
    cfg = parse_args(argv)
    if cfg.dry_run:
        print(dry_run_report(cfg))
        return 0
    setup_logging(cfg.verbose or verbose_requested(argv))  # or QURL_VERBOSE=1
    from qurl_mini.infra.signals import exit_code, stop_on_signals, stopped_message

    try:
        from qurl_mini.trainer import Trainer

        with stop_on_signals(), Trainer(cfg) as trainer:  # SIGINT/SIGTERM: stop at the next phase's end
            summary = trainer.run()
    except KeyboardInterrupt as e:  # a signal (Interrupted), or Ctrl-C before the handlers were set
        from qurl_mini.infra.checkpoint import newest_loadable

        last, _ = newest_loadable(os.path.join(cfg.out_dir, cfg.run_name))
        print(stopped_message(e, last, __file__, sys.argv[1:] if argv is None else argv), file=sys.stderr)
        return exit_code(e)
    except OneLineError as e:  # the project's own errors are one line
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # anything else keeps its traceback
        from qurl_mini.infra.checkpoint import is_disk_full

        if is_disk_full(e):  # any other file of the run (metrics, the engine's start weights, a plot)
            print(f"error: disk full: {one_line(e)}; free some space and run again with --resume", file=sys.stderr)
            return 2
        raise
    logging.getLogger("qurl_mini").info("%s", end_of_run(summary, time.time() - t0))
    return 0


if __name__ == "__main__":
    from qurl_mini.infra.fast_exit import exit_now

    exit_now(main())  # no ~3 s of interpreter teardown after the work is done
