"""A replay of the QuRL paper's comparisons at toy scale, on the embedded task (CPU, ~1 hour).

    python experiments/replay.py                    # everything, seeds 0 1 2 -> docs/results/replay*
    python experiments/replay.py --seeds 0 --only int8-naive int8-acr --steps 10   # a subset
    python experiments/replay.py --smoke --out /tmp/replay   # 2-step runs of two rows (the test suite's)

Every number comes from train.py runs this script starts (one process each, seeded, GRPO on the
embedded warm start). Three parts:
  Table 1 / Fig. 1:  final greedy test accuracy per rollout format and objective, mean and spread
                     over seeds, and learning curves.
  Fig. 2 / 3:        clip fraction (above / below the bound), max rho and KL(behav||prox) over the
                     steps for naive (Eq. 3) vs TIS (Eq. 5) vs ACR (Eq. 9).
  Fig. 9 / Table 4:  at a small learning rate, the share of quantized codes that change per step,
                     Eq. 13's update and Eq. 14's error, for UAQ s = 1, 1.5, 2 and for lr x 1.5.
FP8 is emulated on CPUs (weights on the e4m3 grid in an unquantized engine), and INT4 (4-bit
weights per group of 32, emulated) is a stress format beyond the paper: at INT8 and this size the
sampler/learner gap is tiny, so INT4 shows what a coarser sampler does to the same comparison.
"""
import argparse
import json
import os
import statistics
import sys
import time

from runs import REPO, commit, mean_sd, one_experiment, parallel_flag, read_run, run_many, series, test_accuracy_curve

# Table 1 analogue: name -> train.py flags
TABLE_ROWS = {
    "bf16": ["--quant", "none", "--objective", "ppo"],
    "int8-naive": ["--quant", "int8", "--objective", "naive"],
    "int8-eq1": ["--quant", "int8", "--objective", "ppo"],
    "int8-tis": ["--quant", "int8", "--objective", "tis"],
    "int8-acr": ["--quant", "int8", "--objective", "acr"],
    "int8-acr-uaq1.5": ["--quant", "int8", "--objective", "acr", "--uaq-scale", "1.5"],
    "fp8emu-naive": ["--quant", "fp8", "--objective", "naive"],
    "fp8emu-acr": ["--quant", "fp8", "--objective", "acr"],
    "int4emu-naive": ["--quant", "int4", "--objective", "naive"],
    "int4emu-tis": ["--quant", "int4", "--objective", "tis"],
    "int4emu-acr": ["--quant", "int4", "--objective", "acr"],
    "int4emu-acr-uaq1.5": ["--quant", "int4", "--objective", "acr", "--uaq-scale", "1.5"],
}
ROW_NOTES = {"bf16": "BF16 rollout, PPO-clip (Eq. 1)", "int8-naive": "INT8 W8A8, naive (Eq. 3)",
             "int8-eq1": "INT8 W8A8, Eq. 1 (no sampler correction)", "int8-tis": "INT8 W8A8, TIS (Eq. 5, FlashRL)",
             "int8-acr": "INT8 W8A8, ACR (Eq. 9, QuRL)", "int8-acr-uaq1.5": "INT8 W8A8, ACR + UAQ s=1.5",
             "fp8emu-naive": "FP8 (emulated), naive (Eq. 3)", "fp8emu-acr": "FP8 (emulated), ACR (Eq. 9)",
             "int4emu-naive": "INT4 g32 (emulated, beyond the paper), naive", "int4emu-tis": "INT4 g32 (emulated), TIS",
             "int4emu-acr": "INT4 g32 (emulated), ACR", "int4emu-acr-uaq1.5": "INT4 g32 (emulated), ACR + UAQ s=1.5"}
# Fig. 2/3 analogue: objective comparison per format
FIG2_GROUPS = {"INT8": ["int8-naive", "int8-tis", "int8-acr"], "INT4 (emulated)": ["int4emu-naive", "int4emu-tis", "int4emu-acr"]}
# Fig. 9 / Table 4 analogue: name -> (UAQ scale, learning-rate multiplier)
UAQ_ROWS = {"s=1": (1.0, 1.0), "s=1.5": (1.5, 1.0), "s=2": (2.0, 1.0), "s=1, lr x1.5": (1.0, 1.5)}


def plots(table, uaq, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    # learning curves: greedy test accuracy (start, every --eval-every, end) per row, mean over seeds
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for name, runs in table.items():
        style = "--" if name.startswith("int4") else (":" if name.startswith("fp8") else "-")
        axes[0].plot(*test_accuracy_curve(runs), style, marker="o", ms=3, label=name)
        steps, reward = series(runs, "reward_mean")
        axes[1].plot(steps, reward, style, label=name)
    axes[0].set_title("greedy test accuracy (mean over seeds)")
    axes[1].set_title("training reward (mean of samples, mean over seeds)")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    paths.append(out + "_accuracy.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    # Fig. 2/3 analogue
    groups = {g: [n for n in names if n in table] for g, names in FIG2_GROUPS.items()}
    groups = {g: names for g, names in groups.items() if names}
    if groups:
        fig, axes = plt.subplots(len(groups), 3, figsize=(15, 4 * len(groups)), squeeze=False)
        for row, (group, names) in enumerate(groups.items()):
            for name in names:
                steps, upper = series(table[name], "clip_frac_upper")
                _, lower = series(table[name], "clip_frac_lower")
                line, = axes[row][0].plot(steps, upper, label=f"{name} above")
                axes[row][0].plot(steps, [-x if x is not None else None for x in lower], ":", color=line.get_color(),
                                  label=f"{name} below (negated)")
                axes[row][1].plot(steps, series(table[name], "rho_max")[1], label=name)
                axes[row][2].plot(steps, series(table[name], "kl_behav_prox")[1], label=name)
            axes[row][0].set_title(f"{group}: share of tokens clipped")
            axes[row][1].set_title(f"{group}: max rho = pi_prox / pi_behav")
            axes[row][2].set_title(f"{group}: KL(behav || prox) per token")
            for ax in axes[row]:
                ax.set_xlabel("step")
                ax.grid(alpha=0.3)
                ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(out + "_clip_rho_kl.png")
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)

    if uaq:
        fig, axes = plt.subplots(1, 3, figsize=(15, 4))
        for name, r in uaq.items():
            steps = [m["step"] for m in r["metrics"]]
            for ax, key in zip(axes, ("codes_changed_frac", "weight_update_norm", "quant_error_norm")):
                ax.plot(steps, [m.get(key) for m in r["metrics"]], marker="o", ms=3, label=name)
        for ax, title in zip(axes, ("share of INT8 codes changed per step", "Eq. 13: ||dW||^2 / ||W||^2",
                                    "Eq. 14: ||Q(W) - W||^2 / ||W||^2")):
            ax.set_title(title)
            ax.set_xlabel("step")
            ax.set_yscale("log")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(out + "_uaq.png")
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths


# what the table's columns are computed from, kept per step in replay.json (the runs' folders are not committed)
STEP_KEYS = ("step", "accuracy", "test_accuracy", "kl_behav_prox", "kl_behav_prox_k3", "rho_max", "rho_max_step",
             "clip_frac_upper", "clip_frac_lower")


def table_markdown(table, args) -> str:
    lines = [f"| row | rollout / objective | greedy test accuracy, start | final (mean ± sd, {len(args.seeds)} seeds) | "
             "per seed | median KL(behav‖prox) | max rho | mean clip frac (above / below) |",
             "|---|---|---|---|---|---|---|---|"]
    for name, runs in table.items():
        finals = [r["summary"]["final_test_accuracy"] for r in runs]
        starts = [r["summary"]["initial_test_accuracy"] for r in runs]
        m, sd = mean_sd(finals)
        metrics = [x for r in runs for x in r["metrics"]]
        kls = sorted(x["kl_behav_prox"] for x in metrics)
        above = statistics.mean(x["clip_frac_upper"] for x in metrics)
        below = statistics.mean(x["clip_frac_lower"] for x in metrics)
        lines.append(f"| `{name}` | {ROW_NOTES.get(name, '')} | {100 * statistics.mean(starts):.1f}% | "
                     f"**{100 * m:.1f}% ± {100 * sd:.1f}** | {' / '.join(f'{100 * f:.1f}' for f in finals)} | "
                     f"{kls[len(kls) // 2]:.1e} | {max(x['rho_max'] for x in metrics):.2f} | "
                     f"{100 * above:.2f}% / {100 * below:.2f}% |")
    return "\n".join(lines)


def uaq_markdown(uaq) -> str:
    lines = ["| UAQ row | lr | share of INT8 codes changed / step | Eq. 13 update | Eq. 14 error | update / error |",
             "|---|---|---|---|---|---|"]
    for name, r in uaq.items():
        rows = [m for m in r["metrics"] if m.get("weight_update_norm") is not None]
        changed = statistics.mean(m["codes_changed_frac"] for m in rows)
        update = statistics.mean(m["weight_update_norm"] for m in rows)
        error = statistics.mean(m["quant_error_norm"] for m in rows)
        lines.append(f"| {name} | {r['summary']['config']['lr']:.1e} | {100 * changed:.2f}% | {update:.2e} | "
                     f"{error:.2e} | {update / error:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    from qurl_mini.infra.cli import ArgumentParser  # an unknown flag: one line

    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--only", nargs="+", default=None, choices=list(TABLE_ROWS), help="Table 1 rows to run")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prompts-per-step", type=int, default=16)
    p.add_argument("--eval-size", type=int, default=200)
    p.add_argument("--uaq-steps", type=int, default=8)
    p.add_argument("--uaq-lr", type=float, default=1e-5, help="the small learning rate of the UAQ rows")
    p.add_argument("--no-uaq", action="store_true", help="skip the Fig. 9 / Table 4 rows")
    p.add_argument("--smoke", action="store_true", help="2 steps of bf16 and int8-acr, one seed, tiny eval")
    p.add_argument("--parallel", type=parallel_flag, default=1, help="runs at a time, each pinned to one CPU core")
    p.add_argument("--out", default=os.path.join(REPO, "docs", "results", "replay"),
                   help="writes OUT.md, OUT.json and OUT_*.png; runs go to OUT_work/")
    args = p.parse_args(argv)
    if args.smoke:
        args.seeds, args.only, args.steps, args.eval_size, args.prompts_per_step = [0], ["bf16", "int8-acr"], 2, 10, 4
        args.uaq_steps = 2
    rows = args.only or list(TABLE_ROWS)
    work = args.out + "_work"
    os.makedirs(os.path.join(work, "logs"), exist_ok=True)
    common = ["--algo", "grpo", "--steps", str(args.steps), "--prompts-per-step", str(args.prompts_per_step),
              "--eval-every", str(max(1, args.steps // 2)), "--eval-size", str(args.eval_size),
              "--save-every", str(args.steps), "--shared-prompt", "false"]  # the path the committed runs took
    t0 = time.time()
    print(f"replay: {len(rows)} rows x {len(args.seeds)} seeds, {args.steps} steps each -> {work}", flush=True)
    jobs = [(f"{name}-seed{s}", common + TABLE_ROWS[name] + ["--seed", str(s)]) for name in rows for s in args.seeds]
    uaq_jobs = {}
    if not args.no_uaq:
        uaq_common = ["--algo", "grpo", "--quant", "int8", "--objective", "acr", "--steps", str(args.uaq_steps),
                      "--prompts-per-step", str(args.prompts_per_step), "--eval-every", "0", "--eval-size",
                      str(min(args.eval_size, 20)), "--save-every", str(args.uaq_steps), "--seed", str(args.seeds[0]),
                      "--shared-prompt", "false"]
        for name, (s, lr_mult) in list(UAQ_ROWS.items())[:2 if args.smoke else None]:
            uaq_jobs[name] = ("uaq-" + name.replace(" ", "").replace(",", "-"),
                              uaq_common + ["--uaq-scale", str(s), "--lr", f"{args.uaq_lr * lr_mult:g}"])
    run_many(work, jobs + list(uaq_jobs.values()), os.path.join(work, "logs"), args.parallel)
    table = {name: [read_run(os.path.join(work, "runs", f"{name}-seed{s}")) for s in args.seeds] for name in rows}
    settings_flags = dict(zip(common[::2], common[1::2]))
    base_hash = one_experiment(table, settings_flags, f"replay ({work})")
    uaq = {name: read_run(os.path.join(work, "runs", run_name)) for name, (run_name, _) in uaq_jobs.items()}
    if uaq:
        odd = [n for n, r in uaq.items() if r["summary"].get("base_model_hash") != base_hash]
        if odd:
            raise SystemExit(f"error: replay ({work}): the UAQ rows {', '.join(odd)} start from another base than the "
                             f"table's ({base_hash}); remove them and run again")
    pngs = plots(table, uaq, args.out)
    settings = (f"GRPO on the embedded task, {args.steps} steps x {args.prompts_per_step} prompts x 8 samples, "
                f"greedy test accuracy on {args.eval_size} held-out problems, seeds {args.seeds}; "
                f"UAQ rows: INT8 + ACR, lr {args.uaq_lr:g}, {args.uaq_steps} steps, seed {args.seeds[0]}")
    from qurl_mini.infra.hardware import describe_cpu

    md = [f"# Replay of the paper's comparisons at toy scale\n\nMade by `python experiments/replay.py "
          f"{' '.join(argv if argv is not None else sys.argv[1:])}` at commit {commit()} in "
          f"{(time.time() - t0) / 60:.0f} min (runs already on disk are reused) on {describe_cpu()}.\n{settings}.\n",
          "## Table 1 analogue\n", table_markdown(table, args), ""]
    if uaq:
        md += ["## Fig. 9 / Table 4 analogue (UAQ)\n", uaq_markdown(uaq), ""]
    md += [f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in pngs]
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(md) + "\n")
    with open(args.out + ".json", "w") as f:
        json.dump({"settings": settings, "base_model_hash": base_hash,
                   "table": {n: [{**r["summary"], "config": None, "steps": [{k: m.get(k) for k in STEP_KEYS}
                                                                             for m in r["metrics"]]} for r in runs]
                             for n, runs in table.items()},
                   "uaq": {n: r["metrics"] for n, r in uaq.items()}}, f, indent=1)
    print(f"wrote {args.out}.md, {args.out}.json, " + ", ".join(pngs))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    sys.exit(main())
