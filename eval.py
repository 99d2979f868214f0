"""Greedy test accuracy of one or more checkpoints on the same held-out problems.

    python eval.py --model .cache/embedded-sft-XXXX runs/grpo-int8-acr/final
"""
import argparse
import json
import sys

from qurl_mini.progress import setup_logging


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", nargs="+", default=[], help="HF folders or hub ids to evaluate")
    parser.add_argument("--run", default=None, help="a train.py run folder: evaluate its start and final models "
                                                    "on that run's data and settings")
    parser.add_argument("--data", default="synthetic", help="'synthetic', 'gsm8k' or a .jsonl/.parquet file")
    parser.add_argument("--test-data", default=None, help="held-out file (default: split off --data)")
    parser.add_argument("--eval-size", type=int, default=200, help="held-out problems")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="longest response")
    parser.add_argument("--max-number", type=int, default=10, help="synthetic task: largest number")
    parser.add_argument("--seed", type=int, default=0, help="split seed (must match training for a file)")
    parser.add_argument("--show", type=int, default=3, help="example responses to print per model")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.run:
        try:
            with open(f"{args.run}/summary.json") as f:
                summary = json.load(f)
        except OSError:
            parser.error(f"--run {args.run}: no summary.json (has the run finished?)")
        cfg = summary["config"]
        args.model = [summary["base_model"], summary["final_model"]] + args.model
        args.data, args.test_data, args.seed = cfg["data"], cfg["test_data"], cfg["seed"]
        args.max_number, args.max_new_tokens, args.eval_size = cfg["max_number"], cfg["max_new_tokens"], cfg["eval_size"]
    if not args.model:
        parser.error("give --model DIR [DIR ...] or --run RUN_DIR")
    if args.eval_size < 1 or args.max_new_tokens < 1:
        parser.error("--eval-size and --max-new-tokens must be >= 1")
    setup_logging()
    from rich.console import Console
    from rich.table import Table

    from qurl_mini.actor import ModelError, load_actor
    from qurl_mini.data import DataError, load_problems
    from qurl_mini.evaluate import greedy_accuracy

    try:
        _, test = load_problems(args.data, args.test_data, args.eval_size, args.seed, args.max_number)
        results = {}
        for path in args.model:
            model, tokenizer = load_actor(path)
            acc, samples = greedy_accuracy(model, tokenizer, test, args.max_new_tokens)
            results[path] = {"accuracy": acc, "n": len(test), "examples": samples[: args.show]}
    except (DataError, ModelError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    table = Table(title=f"greedy accuracy on {len(test)} held-out problems ({args.data})")
    table.add_column("model")
    table.add_column("accuracy", justify="right")
    for path, r in results.items():
        table.add_row(path, f"{100 * r['accuracy']:.1f}%")
    console = Console()
    console.print(table)
    for path, r in results.items():
        for question, response, ok in r["examples"]:
            console.print(f"[dim]{path}[/dim] {'✓' if ok else '✗'} {question!r} -> {response!r}", markup=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
