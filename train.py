"""Train a policy with RL, rollout on a (quantized) vLLM engine.  `python train.py --help`"""
import json
import logging
import sys

from qurl_mini.config import parse_args
from qurl_mini.progress import setup_logging

ONE_LINE_ERRORS = ("ConfigError", "DataError", "ModelError", "UAQError", "TrainingError")


def main(argv=None) -> int:
    cfg = parse_args(argv)
    setup_logging()
    from qurl_mini.trainer import Trainer

    try:
        summary = Trainer(cfg).run()
    except Exception as e:  # the project's own errors are one line; anything else keeps its traceback
        if type(e).__name__ in ONE_LINE_ERRORS:
            print(f"error: {e}", file=sys.stderr)
            return 2
        raise
    logging.getLogger("qurl_mini").info("done: %s", json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
