"""The paper's Table 1 on a real model, on a CPU: BF16 rollout (Eq. 1) vs INT8 naive (Eq. 3) / TIS (Eq. 5) / ACR (Eq. 9).

    python experiments/table1.py                    # 4 rows x 3 seeds -> docs/results/table1.{md,json,png}
    python experiments/table1.py --parallel 2       # two runs at a time, one core each
    python experiments/table1.py --report-only      # the table from the runs on disk
    python experiments/table1.py --smoke --out /tmp/t1   # 2-step runs (the test suite's)

Base: `--model smollm2-135m-arith` (SmolLM2-135M-Instruct + the shipped warm start: the same bytes on every
machine), the synthetic task in the chat format, GRPO. The INT8 rows run vLLM's real W8A8 kernel: on this
model INT8 alone puts KL(behav || prox) in the paper's range (docs/results/real_mismatch.md), no emulated
format needed. SETTINGS are fixed for every row before the first run, as is the RULE below; runs already on
disk (summary.json) are reused and a run stopped part-way resumes from its newest checkpoint (one every 10
steps), so the table fills in across sessions (metrics and summaries are committed under OUT_runs/).
"""
import argparse
import json
import os
import statistics
import sys

from runs import REPO, commit, mean_sd, one_experiment, parallel_flag, read_run, run_many, series, test_accuracy_curve

ROWS = {"bf16": ["--quant", "none", "--objective", "ppo"],
        "int8-naive": ["--quant", "int8", "--objective", "naive"],
        "int8-tis": ["--quant", "int8", "--objective", "tis"],
        "int8-acr": ["--quant", "int8", "--objective", "acr"]}
LABELS = {"bf16": "BF16 rollout (Eq. 1)", "int8-naive": "INT8 naive (Eq. 3)", "int8-tis": "INT8 TIS (Eq. 5, FlashRL)",
          "int8-acr": "INT8 ACR (Eq. 9, QuRL)"}
SEEDS = [0, 1, 2]
# fixed before the first run (the mismatch dial's choice): 4 minibatches x 2 PPO epochs and no KL penalty, so the
# ratio carries the whole sampler/learner gap; a bf16 engine on every CPU (INT8's activations are bf16 on AMX)
SETTINGS = {"--model": "smollm2-135m-arith", "--data": "synthetic", "--prompt-format": "chat", "--algo": "grpo",
            "--steps": "40", "--prompts-per-step": "8", "--group-size": "8", "--max-new-tokens": "24",
            "--lr": "1e-5", "--minibatches": "4", "--ppo-epochs": "2", "--kl-coef": "0", "--eval-every": "10",
            "--eval-size": "100", "--save-every": "10", "--engine-dtype": "bfloat16",
            "--shared-prompt": "false"}  # the path the committed runs took (docs/shared-prompt.md)
SMOKE = {"--steps": "2", "--prompts-per-step": "2", "--group-size": "2", "--minibatches": "1", "--ppo-epochs": "1",
         "--eval-every": "2", "--eval-size": "4", "--save-every": "2"}
RULE = ("with 3 seeds each: naive fails if its mean final greedy accuracy is >= 10 points under BF16's and its "
        "mean + sd is under BF16's mean - sd; ACR holds if its mean is at least BF16's mean - (BF16's sd + ACR's sd)")


def flags(row: str, seed: int, smoke: bool) -> list[str]:
    settings = {**SETTINGS, **(SMOKE if smoke else {}), "--seed": str(seed)}
    return [x for kv in settings.items() for x in kv] + ROWS[row]


def summarise(runs: list[dict]) -> dict:
    finals = [r["summary"]["final_test_accuracy"] for r in runs]
    mean, sd = mean_sd(finals)
    kl = [m["kl_behav_prox_k3"] for r in runs for m in r["metrics"]]
    return {"final": finals, "mean": mean, "sd": sd, "seed": [r["summary"]["config"]["seed"] for r in runs],
            "machine": [r["summary"].get("machine", "?") for r in runs],  # per run, as "final"
            "initial": sorted({r["summary"]["initial_test_accuracy"] for r in runs}),
            "base_hash": sorted({r["summary"].get("base_model_hash") for r in runs}, key=str),
            "kl_k3_median": statistics.median(kl), "rho_max": max(m.get("rho_max_step", 0) for r in runs for m in r["metrics"]),
            "rho_over_cap_frac": statistics.mean(m.get("rho_over_cap_frac", 0) for r in runs for m in r["metrics"]),
            "minutes": statistics.mean(sum(m["time_step"] for m in r["metrics"]) / 60 for r in runs)}


def verdict(stats: dict) -> str:
    need = [k for k in ROWS if len(stats.get(k, {}).get("final", [])) < len(SEEDS)]
    if need:
        return f"Not judged yet: {', '.join(need)} {'has' if len(need) == 1 else 'have'} fewer than {len(SEEDS)} seeds."
    bf16, naive, acr = stats["bf16"], stats["int8-naive"], stats["int8-acr"]
    fails = naive["mean"] <= bf16["mean"] - 0.10 and naive["mean"] + naive["sd"] < bf16["mean"] - bf16["sd"]
    holds = acr["mean"] >= bf16["mean"] - (bf16["sd"] + acr["sd"])
    return (f"Naive INT8 {'fails' if fails else 'does not fail'}; ACR {'holds' if holds else 'does not hold'} "
            f"(by the rule below).")


def machine_tags(machines) -> dict:
    """(a), (b), ... for each CPU the runs came from: the table and the plot's line styles use the same tags."""
    return {m: chr(ord("a") + i) for i, m in enumerate(sorted(set(machines)))}


def report(out: str, stats: dict, smoke: bool) -> None:
    bases = sorted({h for s in stats.values() for h in s["base_hash"]}, key=str)
    starts = sorted({a for s in stats.values() for a in s["initial"]})
    lines = [f"# Table 1 on a real model: {SETTINGS['--model']}, INT8 rollout", "",
             f"Made by `python experiments/table1.py` at commit {commit()}. Base hash {bases[0] if bases else '-'} "
             f"(every run's summary.json), greedy test accuracy at the start {100 * starts[0]:.1f}% "
             f"(HF float32, {SETTINGS['--eval-size']} held-out problems)." if starts else "", "",
             f"**{verdict(stats)}**", "", f"Rule, fixed before the runs: {RULE}.", "",
             "Settings, the same for every row: " + " ".join(f"`{k} {v}`" for k, v in SETTINGS.items()) +
             (" (smoke: " + " ".join(f"`{k} {v}`" for k, v in SMOKE.items()) + ")" if smoke else "") +
             f"; seeds {SEEDS}.", "",
             "| row | final greedy accuracy (mean ± sd) | per seed: final (machine) | median KL(behav‖prox) k3 | "
             "max rho | rho > C | minutes / run |", "|---|---|---|---|---|---|---|"]
    # the CPU a run came from changes vLLM's INT8 kernel (sgl on AVX-512, oneDNN on AVX2): each run names it
    tag = machine_tags(m for s in stats.values() for m in s["machine"])
    for row, s in stats.items():
        spread = f" ± {100 * s['sd']:.1f}" if len(s['final']) > 1 else " (one seed)"
        per_seed = ", ".join(f"s{seed}: {100 * f:.0f} ({tag[m]})" for seed, f, m in zip(s["seed"], s["final"], s["machine"]))
        lines.append(f"| {LABELS[row]} | {100 * s['mean']:.1f}{spread} | {per_seed} | {s['kl_k3_median']:.1e} | "
                     f"{s['rho_max']:.2f} | {100 * s['rho_over_cap_frac']:.2f}% | {s['minutes']:.0f} |")
    lines += ["", "Machines: " + "; ".join(f"({t}) {m}" for m, t in tag.items()) + "." +
              (" The INT8 kernel differs between them, so a row's spread mixes seed and machine." if len(tag) > 1
               else ""), "", "Minutes / run: the steps' wall time as the runs ran on a shared 2-core machine (alone on both "
              "cores, or pinned to one core beside another run): not a benchmark (docs/real-model.md times a "
              "step alone). `--save-every` only sets the resume points.", "",
              "Curves: [table1.png](table1.png) (greedy accuracy, KL(behav‖prox), max rho and clip shares per "
              "step, one line per run: colour = row, line style = machine)."]
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


def plot(out: str, runs: dict) -> None:
    """One line per run, not a mean over seeds: the INT8 kernel, so the mismatch, depends on the run's CPU.
    Colour = row, line style = machine (the tags of the table)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("greedy test accuracy", None), ("KL(behav||prox) k3", "kl_behav_prox_k3"), ("max rho", "rho_max_step"),
              ("clip share (upper)", "clip_frac")]
    tag = machine_tags(r["summary"].get("machine", "?") for rs in runs.values() for r in rs)
    styles = {m: ["-", "--", ":", "-."][i % 4] for i, m in enumerate(tag)}
    fig, axes = plt.subplots(1, len(panels), figsize=(16, 3.8))
    for ax, (title, _) in zip(axes, panels):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")
    for colour, (row, rs) in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"], runs.items()):
        for i, r in enumerate(rs):
            style = styles[r["summary"].get("machine", "?")]
            for ax, (_, key) in zip(axes, panels):
                xs, ys = test_accuracy_curve([r]) if key is None else series([r], key)
                ax.plot(xs, ys, style, marker="o" if key is None else None, color=colour,
                        label=LABELS[row] if i == 0 else None, lw=1.0, ms=3, alpha=0.85)
    for m, t in tag.items():  # the line-style key
        axes[0].plot([], [], styles[m], color="grey", label=f"({t}) {m.split(' (')[0]}")
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out + ".png", dpi=100)


def main(argv=None) -> int:
    from qurl_mini.infra.cli import ArgumentParser  # an unknown flag: one line

    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(REPO, "docs", "results", "table1"))
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    p.add_argument("--seeds", nargs="+", type=int, default=SEEDS)
    p.add_argument("--parallel", type=parallel_flag, default=1, help="runs at a time, each pinned to one core")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    runs_dir, logs = args.out + "_runs", args.out + "_runs/logs"
    jobs = [(row, seed) for seed in args.seeds for row in args.rows]  # seed-major: each seed's table fills first
    if not args.report_only:
        run_many(runs_dir, [(f"{row}-s{seed}", flags(row, seed, args.smoke)) for row, seed in jobs], logs, args.parallel)
    runs = {row: [read_run(os.path.join(runs_dir, "runs", f"{row}-s{s}")) for s in args.seeds
                  if os.path.exists(os.path.join(runs_dir, "runs", f"{row}-s{s}", "summary.json"))] for row in args.rows}
    one_experiment(runs, {**SETTINGS, **(SMOKE if args.smoke else {})}, f"Table 1 ({runs_dir})")
    stats = {row: summarise(rs) for row, rs in runs.items() if rs}
    with open(args.out + ".json", "w") as f:
        json.dump({"settings": SETTINGS, "rule": RULE, "seeds": args.seeds, "commit": commit(), "rows": stats}, f,
                  indent=1)
    report(args.out, stats, args.smoke)
    plot(args.out, runs)
    print(open(args.out + ".md").read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
