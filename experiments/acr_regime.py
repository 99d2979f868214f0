"""When does ACR (Eq. 9) differ from TIS (Eq. 5)? The regime where its widened bound binds: a pilot, then a comparison.

    python experiments/acr_regime.py --pilot                 # `make acr-pilot`: the toy grid -> OUT_pilot.{json,md}
    python experiments/acr_regime.py --pilot --real          # + real INT8 on SmolLM2-135M (slow: minutes a step)
    python experiments/acr_regime.py --parallel 2            # `make acr-regime`: the comparison at the pilot's choice
    python experiments/acr_regime.py --report-only           # the pages from the runs on disk (finished or not)
    python experiments/acr_regime.py --smoke --out /tmp/ar   # tiny runs (the test suite's)

OUT is docs/results/acr_regime: the pilot's page docs/results/acr_regime_pilot.{md,json} and its runs in
docs/results/acr_regime_pilot_runs (toy) and docs/results/acr_regime_pilot_real_runs (SmolLM2: another base); the
comparison's page docs/results/acr_regime.{md,json,png} and its runs in docs/results/acr_regime_runs.

ACR's loss differs from TIS's only on a token where three things hold at once: A > 0, rho = pi_prox / pi_behav > C
(TIS truncates the weight, ACR widens the bound to (1+eps)/r) and R = pi / pi_prox past 1 + eps (PPO's clip would
stop the gradient): `clip_rescued_frac`. At the settings used so far the three met on <= 0.04% of tokens. The pilot
drives them up with the levers a user has: more off-policy updates per rollout (--ppo-epochs x --minibatches), a
larger lr, a coarser rollout (int3, int2 groups of 32; real INT8 on the real model), and measures per setting the
share of each condition, of all three, ACR's gradient against TIS's on the same minibatches
(`--measure-acr-gap`: ||g_ACR - g_TIS|| / ||g_TIS||) and the KL(behav||prox) growth. PILOT_RULE picks the
comparison's setting; VERDICT_RULE judges it. Both are fixed here before their runs.
"""
import argparse
import json
import os
import sys
import time

from long_horizon import edges, growth
from runs import REPO, commit, mean_sd, one_experiment, parallel_flag, read_run, run_many

# every run: GRPO, no KL penalty (the ratio carries the whole sampler/learner gap), the dial's batch
TOY = {"--data": "synthetic", "--max-number": "10", "--algo": "grpo", "--prompts-per-step": "16", "--group-size": "8",
       "--max-new-tokens": "24", "--temperature": "1.0", "--kl-coef": "0", "--tis-cap": "2.0", "--clip-low": "0.2",
       "--clip-high": "0.2", "--eval-size": "200", "--engine-dtype": "float32", "--shared-prompt": "true"}
REAL = {"--model": "smollm2-135m-arith", "--data": "synthetic", "--prompt-format": "chat", "--algo": "grpo",
        "--prompts-per-step": "8", "--group-size": "8", "--max-new-tokens": "24", "--temperature": "1.0",
        "--kl-coef": "0", "--tis-cap": "2.0", "--clip-low": "0.2", "--clip-high": "0.2", "--eval-size": "100",
        "--mismatch-warn-kl": "0.2", "--shared-prompt": "true"}
# format -> (base settings, its flags, learning rates a decade apart, schedules: PPO epochs x minibatches)
FORMATS = {"int3": (TOY, ["--quant", "int3", "--quant-group", "0"], ["1e-5", "1e-4"], ["2x4", "4x8", "8x8"]),
           "int2g32": (TOY, ["--quant", "int2", "--quant-group", "32"], ["1e-5", "1e-4"], ["2x4", "4x8", "8x8"]),
           "int8-smollm2": (REAL, ["--quant", "int8"], ["1e-6", "1e-5"], ["2x4", "8x8"])}
TOY_FORMATS, REAL_FORMATS = ["int3", "int2g32"], ["int8-smollm2"]
PILOT_STEPS = {"toy": 12, "real": 4}
# the field's strongest correction at each format: the highest final accuracy among icepop / seq-tis / geo-tis /
# seq-mask on the dial (docs/results/mismatch.md; tests/test_acr_regime.py reads it back from mismatch.json)
FIELD_BEST = {"int3": "seq-mask", "int2g32": "seq-tis"}
OBJECTIVE_ROWS = {"bf16": ["--quant", "none", "--objective", "ppo"], "naive": ["--objective", "naive"],
                  "tis": ["--objective", "tis", "--measure-acr-gap", "true"],
                  "acr": ["--objective", "acr", "--measure-acr-gap", "true"], "field": []}
LABELS = {"bf16": "unquantized rollout (Eq. 1)", "naive": "naive (Eq. 3)", "tis": "TIS (Eq. 5, FlashRL)",
          "acr": "ACR (Eq. 9, QuRL)", "field": "the field's strongest correction"}
COLOURS = {"bf16": "black", "naive": "tab:red", "tis": "tab:blue", "acr": "tab:green", "field": "tab:olive"}
SEEDS = [0, 1, 2]
COMPARE_STEPS = 100
LEARNS = 0.10  # BF16 "still learns": final greedy accuracy >= the warm start's + 10 points
COLLAPSE = 0.10  # a run collapses: final greedy accuracy < the warm start's - 10 points
PILOT_RULE = ("each toy setting (format x lr x PPO epochs x minibatches) runs ACR (seed 0) for the pilot's steps; "
              "BF16 (Eq. 1) runs at each lr x schedule. **Eligible**: settings whose BF16 run ends at >= the warm "
              "start's greedy accuracy + 10 points (BF16 still learns). **Chosen**: the eligible setting with the "
              "largest mean share of tokens where all three conditions hold (clip_rescued_frac, mean over steps); a tie "
              "goes to the larger ||g_ACR - g_TIS|| / ||g_TIS||. The real-model rows (INT8 on SmolLM2) are measured "
              "for the same shares; their comparison, if run, is at the real setting with the largest share")
VERDICT_RULE = ("at the chosen setting, 3 seeds a row, 100 steps, one base. **ACR beats TIS** if ACR's mean final "
                "greedy accuracy exceeds TIS's by more than the sum of their sds; **TIS beats ACR** the other way "
                "round; else they are within their seed spread. A run **collapses** if its final greedy accuracy is "
                "more than 10 points below the warm start's; a row collapses if 2 of its 3 seeds do. Judged only "
                "with all seeds of TIS and ACR finished; the sampled accuracy (last 10% of steps) is reported, not "
                "judged")


def setting_flags(fmt: str, lr: str, schedule: str, quantized: bool = True) -> list[str]:
    """The setting's train.py flags: base, rollout format (BF16: none, `OBJECTIVE_ROWS['bf16']`), lr, schedule."""
    epochs, minibatches = schedule.split("x")
    base, quant, _, _ = FORMATS[fmt]
    return [x for kv in base.items() for x in kv] + (quant if quantized else []) + [
        "--lr", lr, "--ppo-epochs", epochs, "--minibatches", minibatches]


def pilot_jobs(formats: list[str], smoke: bool) -> list[tuple[str, list[str]]]:
    """ACR with --measure-acr-gap at every setting, BF16 at every toy lr x schedule; seed 0."""
    jobs, bf16 = [], {}
    for fmt in formats:
        base, _, lrs, schedules = FORMATS[fmt]
        steps = str(2 if smoke else PILOT_STEPS["toy" if base is TOY else "real"])
        run = ["--steps", steps, "--eval-every", steps, "--save-every", steps, "--seed", "0"] + (SMOKE if smoke else [])
        for lr in lrs[-1:] if smoke else lrs:
            for schedule in schedules[:1] if smoke else schedules:
                jobs.append((f"{fmt}_lr{lr}_{schedule}_acr", setting_flags(fmt, lr, schedule) + run
                             + ["--objective", "acr", "--measure-acr-gap", "true"]))
                if base is TOY:
                    bf16[f"toy_lr{lr}_{schedule}_bf16"] = setting_flags(fmt, lr, schedule, quantized=False) + run + OBJECTIVE_ROWS["bf16"]
    return jobs + list(bf16.items())


SMOKE = ["--prompts-per-step", "2", "--group-size", "4", "--eval-size", "4"]


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def run_numbers(r: dict) -> dict:
    """One run: the three conditions' shares and all three's, ACR's gradient gap, KL growth, accuracy."""
    m = r["metrics"]
    kl_first, kl_last = edges(m, "kl_behav_prox_k3")
    return {"steps": len(m), "initial": r["summary"].get("initial_test_accuracy"),
            "final": r["summary"].get("final_test_accuracy"),
            "adv_positive": _mean(x.get("adv_positive_frac") for x in m),
            "ratio_over": _mean(x.get("ratio_over_frac") for x in m),
            "rho_over_cap": _mean(x.get("tis_trunc_frac") for x in m),
            "all_three": _mean(x.get("clip_rescued_frac") for x in m),
            "steps_binding": sum(1 for x in m if (x.get("clip_rescued_frac") or 0) > 0),
            "grad_gap": _mean(x.get("acr_grad_gap") for x in m),
            "grad_gap_max": max((x["acr_grad_gap"] for x in m if x.get("acr_grad_gap") is not None), default=None),
            "kl_first": kl_first, "kl_last": kl_last, "kl_growth": growth(m),
            "rho_max": max((x.get("rho_max_step", 1.0) for x in m), default=None),
            "sampled_last": edges(m, "accuracy", _mean)[1], "sec_per_step": _mean(x.get("time_step") for x in m)}


def choose(pilot: dict) -> str | None:
    """PILOT_RULE on {run name: run_numbers}: the chosen toy setting's name ('int2g32_lr1e-4_8x8'), or None."""
    def learns(setting):
        fmt, lr, schedule = setting.split("_")
        b = pilot.get(f"toy_{lr}_{schedule}_bf16")
        return b is not None and b["final"] is not None and b["final"] >= b["initial"] + LEARNS

    eligible = {name[:-4]: n for name, n in pilot.items() if name.endswith("_acr") and name.split("_")[0] in
                TOY_FORMATS and n["all_three"] is not None and learns(name[:-4])}
    if not eligible:
        return None
    return max(eligible, key=lambda s: (eligible[s]["all_three"], eligible[s]["grad_gap"] or 0))


def compare_rows(setting: str) -> dict[str, list[str]]:
    fmt, lr, schedule = setting.split("_")
    flags = setting_flags(fmt, lr[2:], schedule)
    rows = {row: flags + extra for row, extra in OBJECTIVE_ROWS.items() if row not in ("field", "bf16")}
    rows = {"bf16": setting_flags(fmt, lr[2:], schedule, quantized=False) + OBJECTIVE_ROWS["bf16"], **rows}
    rows["field"] = flags + ["--objective", FIELD_BEST[fmt]]
    return rows


def verdict(table: dict, seeds: list[int]) -> list[str]:
    """VERDICT_RULE on {row: [run_numbers]} (finished runs)."""
    tis, acr = table.get("tis", []), table.get("acr", [])
    if len(tis) < len(seeds) or len(acr) < len(seeds):
        return [f"Not judged yet: TIS has {len(tis)}, ACR {len(acr)} of {len(seeds)} finished seeds."]
    (a, a_sd), (t, t_sd) = mean_sd([n["final"] for n in acr]), mean_sd([n["final"] for n in tis])
    spread = f"ACR {100 * a:.1f} ± {100 * a_sd:.1f} vs TIS {100 * t:.1f} ± {100 * t_sd:.1f}"
    lines = [f"**ACR beats TIS** ({spread})." if a - t > a_sd + t_sd else f"**TIS beats ACR** ({spread})."
             if t - a > a_sd + t_sd else f"**ACR and TIS end within their seed spread** ({spread})."]
    for row, runs in table.items():
        fallen = [n for n in runs if n["final"] < n["initial"] - COLLAPSE]
        if len(runs) == len(seeds):
            lines.append(f"{LABELS[row]}: " + ("**collapses**" if len(fallen) >= 2 else "does not collapse")
                         + f" ({len(fallen)} of {len(runs)} seeds more than 10 points under the warm start).")
    shares = [n["all_three"] for n in acr if n["all_three"] is not None]
    gaps = [n["grad_gap"] for n in acr if n["grad_gap"] is not None]
    if shares:
        lines.append(f"In the ACR runs the three conditions held together on {100 * _mean(shares):.3f}% of tokens "
                     f"(mean over steps and seeds); ||g_ACR - g_TIS|| / ||g_TIS|| averaged {_mean(gaps) or 0:.3f} "
                     "per minibatch.")
    return lines


# ----- the pages --------------------------------------------------------------------------------------------


def _pct(x, digits=2):
    return "-" if x is None else f"{100 * x:.{digits}f}%"


def _num(x, fmt=".3f"):
    return "-" if x is None else format(x, fmt)


def pilot_page(args, pilot: dict, chosen: str | None, missing: list[str]) -> None:
    from qurl_mini.infra.hardware import describe_cpu

    lines = [f"# ACR's regime, the pilot\n",
             f"Made by `python experiments/acr_regime.py{' --pilot' if args.pilot else ''}{' --real' if args.real else ''}"
             f"{' --report-only' if args.report_only else ''}` at commit {commit()} (runs on disk are reused; this "
             f"page on {describe_cpu()}). Toy rows: {PILOT_STEPS['toy']} steps, `train.py` + "
             + " ".join(f"`{k} {v}`" for k, v in TOY.items()) + f"; real rows: {PILOT_STEPS['real']} steps, "
             + " ".join(f"`{k} {v}`" for k, v in REAL.items()) + "; each adds its format, `--lr`, `--ppo-epochs`, "
             "`--minibatches`, and `--objective acr --measure-acr-gap true` (BF16: `--quant none --objective ppo`). "
             f"Runs in `{os.path.relpath(args.work_pilot, REPO)}/runs/` (toy) and "
             f"`{os.path.relpath(args.work_real, REPO)}/runs/` (real: another base, so another folder).", "",
             f"Rule, fixed before the pilot's runs: {PILOT_RULE}.", "",
             f"**Chosen: `{chosen}`.**" if chosen else "**Nothing chosen yet** (no eligible finished setting).", "",
             "Shares are of response tokens, means over the run's steps (each step's share is a mean over its "
             "minibatches and epochs): A > 0; R > 1 + eps; rho > C; all three (where ACR's loss differs from "
             "TIS's); grad gap: ||g_ACR - g_TIS|| / ||g_TIS|| per minibatch (mean, max); KL growth: median "
             "KL(behav‖prox) (k3) over the last 10% of steps / first 10%.", "",
             "| run | steps | greedy start → end | A > 0 | R > 1+eps | rho > C | all three (steps with any) | grad gap "
             "mean / max | KL first → last (growth) | max rho | s / step |", "|---" * 11 + "|"]
    for name, n in pilot.items():
        lines.append(f"| `{name}` | {n['steps']} | {_pct(n['initial'], 1)} → {_pct(n['final'], 1)} | "
                     f"{_pct(n['adv_positive'], 1)} | {_pct(n['ratio_over'])} | {_pct(n['rho_over_cap'])} | "
                     f"{_pct(n['all_three'], 3)} ({n['steps_binding']}) | {_num(n['grad_gap'])} / "
                     f"{_num(n['grad_gap_max'])} | {_num(n['kl_first'], '.1e')} → {_num(n['kl_last'], '.1e')} "
                     f"({_num(n['kl_growth'], '.1f')}x) | {_num(n['rho_max'], '.1f')} | {_num(n['sec_per_step'], '.1f')} |")
    if missing:
        lines += ["", f"Not run (yet): {', '.join(missing)}. Resume: `python experiments/acr_regime.py --pilot"
                      f"{' --real' if any(m.startswith('int8') for m in missing) else ''}` (finished runs are reused)."]
    with open(args.out + "_pilot.md", "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(args.out + "_pilot.json", "w") as f:
        json.dump({"rule": PILOT_RULE, "steps": PILOT_STEPS, "toy": TOY, "real": REAL, "chosen": chosen,
                   "commit": commit(), "machine": describe_cpu(), "runs": pilot, "not_run": missing}, f, indent=1)


def plot(path: str, curves: dict) -> str:
    """curves: {row: [(seed, metrics)]}; one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("greedy test accuracy (%)", "test_accuracy"), ("KL(behav‖prox) per token, k3", "kl_behav_prox_k3"),
              ("max rho per step", "rho_max_step"), ("tokens where ACR's bound binds (all three)", "clip_rescued_frac")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6))
    for ax, (title, key) in zip(axes, panels):
        ax.set_title(title, fontsize=8)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        for row, runs in curves.items():
            for i, (seed, m) in enumerate(runs):
                pts = [(x["step"], x[key]) for x in m if x.get(key) is not None]
                if pts:
                    ax.plot(*zip(*pts), ["-", "--", ":"][i % 3], color=COLOURS[row], lw=1,
                            marker="o" if key == "test_accuracy" else None, ms=2, label=f"{row} s{seed}")
    axes[1].set_yscale("log")
    axes[2].set_yscale("log")
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def compare_page(args, setting: str, table: dict, curves: dict, going: list[str]) -> None:
    from qurl_mini.infra.hardware import describe_cpu

    png = plot(args.out + ".png", curves) if curves else None
    lines = [f"# When does ACR differ from TIS? The comparison at `{setting}`\n",
             f"Made by `python experiments/acr_regime.py{' --report-only' if args.report_only else ''}` at commit "
             f"{commit()} (this page on {describe_cpu()}). Rows: `train.py` + the setting's flags + the row's, "
             f"{COMPARE_STEPS} steps, seeds {args.seeds}; the field's row is `{FIELD_BEST[setting.split('_')[0]]}`. "
             f"Runs in `{os.path.relpath(args.work, REPO)}/runs/`. The pilot: [acr_regime_pilot.md](acr_regime_pilot.md).",
             "", "## Verdict\n", *[f"- {x}" for x in verdict(table, args.seeds)], "",
             f"Rule, fixed before the comparison's runs: {VERDICT_RULE}.", "",
             "All three: the share of tokens where ACR's loss differs from TIS's, as the run's own objective logs it "
             "(0 under TIS, whose bound never widens); grad gap: ||g_ACR - g_TIS|| / ||g_TIS|| on each minibatch, "
             "measured in both rows (mean over steps); KL: median KL(behav‖prox) (k3) over the first / last 10% of "
             "steps.", "",
             "| row | seed | greedy start → end | sampled, last 10% | all three | grad gap | KL first → last | max rho "
             "| s / step |", "|---" * 9 + "|"]
    for row, runs in table.items():
        for seed, n in zip(args.seeds, runs):
            lines.append(f"| {LABELS[row]} | {seed} | {_pct(n['initial'], 1)} → {_pct(n['final'], 1)} | "
                         f"{_pct(n['sampled_last'], 1)} | {_pct(n['all_three'], 3)} | {_num(n['grad_gap'])} | "
                         f"{_num(n['kl_first'], '.1e')} → {_num(n['kl_last'], '.1e')} | {_num(n['rho_max'], '.1f')} | "
                         f"{_num(n['sec_per_step'], '.1f')} |")
    if going:
        lines += ["", f"In progress or not started (not in the verdict): {', '.join(going)}. Resume: "
                      "`make acr-regime` (finished runs are reused, a stopped one resumes from its checkpoint)."]
    if png:
        lines += ["", f"![per step]({os.path.basename(png)})"]
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(args.out + ".json", "w") as f:
        json.dump({"setting": setting, "rule": VERDICT_RULE, "seeds": args.seeds, "steps": COMPARE_STEPS,
                   "commit": commit(), "verdict": verdict(table, args.seeds), "runs": table, "in_progress": going},
                  f, indent=1)


# ----- main -------------------------------------------------------------------------------------------------


def read(work: str, name: str) -> dict | None:
    """A finished run's {summary, metrics}, or a stopped one's metrics so far (summary {}), or None."""
    from qurl_mini.metrics import read_metrics

    run_dir = os.path.join(work, "runs", name)
    if os.path.exists(os.path.join(run_dir, "summary.json")):
        return read_run(run_dir)
    path = os.path.join(run_dir, "metrics.jsonl")
    rows = read_metrics(path) if os.path.exists(path) else []
    return {"summary": {}, "metrics": rows} if rows else None


def main(argv=None) -> int:
    from qurl_mini.infra.cli import ArgumentParser  # an unknown flag: one line

    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(REPO, "docs", "results", "acr_regime"),
                   help="writes OUT.{md,json,png} and OUT_pilot.{md,json}; runs in OUT_runs, OUT_pilot_runs")
    p.add_argument("--pilot", action="store_true", help="the pilot grid (toy formats; --real adds SmolLM2 INT8)")
    p.add_argument("--real", action="store_true", help="with --pilot: also the real model's rows (minutes a step)")
    p.add_argument("--setting", default=None, help="compare at this setting instead of the pilot's choice")
    p.add_argument("--seeds", nargs="+", type=int, default=SEEDS)
    p.add_argument("--parallel", type=parallel_flag, default=1, help="runs at a time, each pinned to one CPU core")
    p.add_argument("--report-only", action="store_true", help="start no run: the pages from the runs on disk")
    p.add_argument("--smoke", action="store_true", help="tiny runs: the pilot at one toy setting, 2 steps")
    args = p.parse_args(argv)
    args.out = os.path.abspath(args.out)
    args.work, args.work_pilot = args.out + "_runs", args.out + "_pilot_runs"
    args.work_real = args.out + "_pilot_real_runs"
    where = lambda name: args.work_real if name.split("_")[0] in REAL_FORMATS else args.work_pilot  # noqa: E731
    t0 = time.time()
    formats = TOY_FORMATS[-1:] if args.smoke else TOY_FORMATS + (REAL_FORMATS if args.real else [])
    jobs = pilot_jobs(formats, args.smoke)
    if (args.pilot or args.smoke) and not args.report_only:
        print(f"acr regime pilot: {len(jobs)} runs -> {args.work_pilot}, {args.work_real}", flush=True)
        for work in (args.work_pilot, args.work_real):
            mine = [job for job in jobs if where(job[0]) == work]
            if mine:
                run_many(work, mine, os.path.join(work, "logs"), args.parallel)
    found = {name: r for name, _ in pilot_jobs(TOY_FORMATS + REAL_FORMATS, args.smoke)
             if (r := read(where(name), name)) is not None}
    finished = {name: r for name, r in found.items() if r["summary"]}
    one_experiment({name: [r] for name, r in finished.items() if name.startswith(tuple(TOY_FORMATS + ["toy"]))},
                   {}, f"acr regime pilot ({args.work_pilot})")
    pilot = {name: run_numbers(r) for name, r in finished.items()}
    chosen = choose(pilot)
    setting = args.setting or chosen
    if args.pilot or args.smoke or args.report_only or setting is None:  # the comparison leaves the pilot's page
        pilot_page(args, pilot, chosen, [name for name, _ in jobs if name not in finished])
        print(open(args.out + "_pilot.md").read())
    if args.pilot or args.smoke or setting is None:
        print(f"acr_regime: pilot page {args.out}_pilot.md in {(time.time() - t0) / 60:.0f} min"
              + ("" if setting else "; no setting chosen yet, so no comparison"))
        return 0
    rows = compare_rows(setting)
    compare_jobs = [(f"{row}-seed{seed}", rows[row] + ["--steps", str(COMPARE_STEPS), "--eval-every", "25",
                                                       "--save-every", "25", "--seed", str(seed)])
                    for pair in (("tis", "acr"), ("bf16", "naive", "field")) for seed in args.seeds for row in pair]
    if not args.report_only:
        print(f"acr regime: {len(rows)} rows x {len(args.seeds)} seeds at {setting} -> {args.work}", flush=True)
        run_many(args.work, compare_jobs, os.path.join(args.work, "logs"), args.parallel)
    table, curves, going = {}, {}, []
    for row in rows:
        for seed in args.seeds:
            r = read(args.work, f"{row}-seed{seed}")
            if r is None or not r["summary"]:
                going.append(f"{row} seed {seed}" + (f" at step {r['metrics'][-1]['step']}" if r else ""))
            else:
                table.setdefault(row, []).append(run_numbers(r))
            if r is not None:
                curves.setdefault(row, []).append((seed, r["metrics"]))
    compare_page(args, setting, table, curves, going)
    print(open(args.out + ".md").read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
