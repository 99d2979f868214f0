"""The paper's long-horizon claim (Sec. 4.2, Fig. 3): over ~1,000 steps, does TIS (Eq. 5) drift while ACR (Eq. 9) holds?

    python experiments/long_horizon.py --parallel 2       # `make long-horizon`: 4 rows x 3 seeds, 1,000 steps
                                                          # -> docs/results/long_horizon.{md,json,png}
    python experiments/long_horizon.py --rows int3-tis int3-acr   # only the pair the rule judges
    python experiments/long_horizon.py --report-only      # the page from the runs on disk (finished or not)
    python experiments/long_horizon.py --pilot lr1e-5 lr3e-5 --parallel 2   # 300-step BF16 + TIS pilots
    python experiments/long_horizon.py --smoke --out /tmp/lh   # 3-step runs, tiny (the test suite's)

The paper: TIS "works well under 500 steps of training. However, at long training steps (e.g., >1000 steps), we
observe the KL divergence between the behavior policy and the proximal policy continues to increase ... from 0.002
to 0.025", and training collapses; ACR's adaptive upper bound is meant to stop that. Every comparison in this
project before this one was 40 steps long, where TIS and ACR end within each other's seed spread.

Rows, on one base (the shipped embedded warm start; `--max-number 10`, the task it was trained on: another
--max-number gives another warm-start key, i.e. an SFT made on this machine, not the shipped bytes): TIS and ACR
at `int3` per channel (static KL 5e-3 .. 9e-3 per token, docs/results/mismatch.md: the paper's range), the
unquantized rollout (Eq. 1) as the reference, and the field's strongest correction at int3 on the dial (the
sequence mask). SETTINGS, the RULE and the HEADROOM criteria are fixed here before the first
full run. Runs already on disk (summary.json) are reused; a stopped one resumes from its newest checkpoint (one
every 50 steps); their metrics.jsonl and summary.json are committed under OUT_runs/runs/.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

from runs import REPO, commit, mean_sd, one_experiment, parallel_flag, read_run, run_many, test_accuracy_curve

ROWS = {"int3-tis": ["--quant", "int3", "--quant-group", "0", "--objective", "tis"],
        "int3-acr": ["--quant", "int3", "--quant-group", "0", "--objective", "acr"],
        "bf16": ["--quant", "none", "--objective", "ppo"],
        # the strongest of the field's corrections at int3 on the dial (84.3 ± 1.5 at 40 steps, mismatch.md)
        "int3-seq-mask": ["--quant", "int3", "--quant-group", "0", "--objective", "seq-mask"]}
DEFAULT_ROWS = ["int3-tis", "int3-acr", "bf16", "int3-seq-mask"]  # a TIS/ACR pair of a seed side by side, then the rest
LABELS = {"int3-tis": "int3 TIS (Eq. 5, FlashRL)", "int3-acr": "int3 ACR (Eq. 9, QuRL)",
          "bf16": "unquantized rollout (Eq. 1)", "int3-seq-mask": "int3 sequence mask (TRL's default)"}
COLOURS = {"int3-tis": "tab:blue", "int3-acr": "tab:green", "bf16": "black", "int3-seq-mask": "tab:olive"}
SEEDS = [0, 1, 2]
# fixed before the first full run. The dial's training settings (mismatch.py: 4 minibatches x 2 PPO epochs, no KL
# penalty, so the ratio carries the whole sampler/learner gap), the shared-prompt step, the embedded task at its
# warm start's --max-number, and the learning rate the pilot chose (PILOT_NOTE; the Pilot section of the page)
SETTINGS = {"--data": "synthetic", "--max-number": "10", "--algo": "grpo", "--steps": "1000",
            "--prompts-per-step": "16", "--group-size": "8", "--max-new-tokens": "24", "--temperature": "1.0",
            "--lr": "2e-6", "--minibatches": "4", "--ppo-epochs": "2", "--kl-coef": "0", "--tis-cap": "2.0",
            "--clip-low": "0.2", "--clip-high": "0.2", "--eval-every": "50", "--eval-size": "200",
            "--save-every": "50", "--engine-dtype": "float32", "--shared-prompt": "true"}
SMOKE = {"--steps": "3", "--prompts-per-step": "2", "--group-size": "4", "--minibatches": "1", "--ppo-epochs": "1",
         "--eval-every": "2", "--eval-size": "4", "--save-every": "2"}
SMOKE_ROWS = ["int3-tis", "int3-acr"]
# the pilot: BF16 and TIS at seed 0, PILOT_STEPS steps, SETTINGS with a candidate's overrides
PILOT_ROWS = ["bf16", "int3-tis"]
PILOT_STEPS = 300
PILOT_CANDIDATES = {"lr1e-5": {"--lr": "1e-5"}, "lr3e-6": {"--lr": "3e-6"}, "lr1e-6": {"--lr": "1e-6"}}
# what the pilot showed and why SETTINGS are what they are (written after the pilot, before the first full run)
PILOT_NOTE = (
    "**What the pilot showed, and the settings chosen.** (1) The greedy half of the criteria cannot be met on this "
    "base: greedy test accuracy goes from 37% to 94-96.5% within the first 50 steps at every learning rate tried "
    "(1e-6, 3e-6, 1e-5) and sits at 97-100% from step 150 on; the warm start's greedy error is one shared slip "
    "(docs/embedded-task.md), which RL removes in tens of steps. The sampled (T = 1) accuracy is the one with "
    "headroom (83% at step 300 at 3e-6, still rising), so the page reports it beside the greedy one. (2) The "
    "mixed-reward share is the binding constraint: at 1e-5 it falls to 36-38% by step 300 and would be under 30% "
    "long before step 1,000; at 3e-6 it is 65-68% at step 300; at 1e-6, 90-94% at step 158. How far a run has "
    "learned goes with lr x steps (3e-6's window at steps 251-300 matches 1e-5's at 51-100), so 3e-6 over 1,000 "
    "steps would end near 1e-5's step 300 (36-38%: at the 30% line within the seed spread) and 2e-6 near 1e-5's "
    "step 200 (49-53%). **--lr 2e-6** is pinned: the largest rate whose projected mixed share stays clearly above "
    "30% to step 1,000 (not piloted itself; between the two that were). (3) At 3e-6 and 1e-6 PPO's clip never "
    "bound (0.000% of tokens clipped above) and at 1e-5 it bound on 0.015%, while rho > C on 0.05-0.07%: ACR's "
    "loss differs from TIS's only on tokens with both (A > 0, ratio past 1+eps, rho > C), so at this scale ACR "
    "may compute TIS's gradients at every step; the page counts the steps where it did not. (4) KL(behav‖prox) "
    "at int3 over the pilot's TIS runs: 3.2e-3 -> 2.1e-3 (1e-5), 3.2e-3 -> 2.8e-3 (3e-6), 3.0e-3 -> 3.7e-3 "
    "(1e-6, 158 steps): no drift within 300 steps. (5) Cost: median 3.5-4.2 s per step (16 prompts x 8, 4 "
    "minibatches x 2 PPO epochs, shared-prompt step), each run pinned to one core beside the other and beside "
    "other jobs on this 2-core machine (load average up to 23); in a quieter stretch 2.0 s. 1,000 steps: 35-70 "
    "min per run, 9 runs two at a time 3-6 h. The 1e-6 pilot was stopped twice by a SIGTERM from outside this "
    "script, at step 158 (its checkpoint at step 150 resumes it); its numbers are those 158 steps."
)
TIS_CAP = float(SETTINGS["--tis-cap"])
EDGE = 0.10  # the first / last 10% of a run's steps
DRIFT = 3.0  # KL growth factor that counts as drift
RULE = ("a run's KL growth factor is the median of its per-step KL(behav‖prox) (k3, metrics key "
        "kl_behav_prox_k3) over its last 10% of steps divided by the median over its first 10%. "
        "**TIS drifts** if its growth factor is >= 3 in at least 2 of the 3 seeds. "
        "**ACR holds where TIS drifts** if TIS drifts and, in every seed where TIS drifts, ACR's growth factor (same "
        "seed) is at most half of TIS's. **ACR beats TIS** if ACR's mean final greedy accuracy exceeds TIS's by "
        "more than the sum of their sds (and **TIS beats ACR** the other way round); otherwise they are within "
        "their seed spread. Judged only with all 3 seeds of TIS and ACR finished at the full step count; if TIS "
        "does not drift, the page says \"TIS did not drift at this scale\"")
WINDOW = 50  # steps per window of the headroom check
HEADROOM = ("the share of groups with mixed rewards (1 - zero_advantage_groups: not all G responses scored the "
            "same) averages >= 30% in every 50-step window of every run, and BF16's greedy test accuracy at step "
            "300 is <= 95% (below its ceiling: the task can still be learned)")


# ----- one run's numbers --------------------------------------------------------------------------


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def edges(metrics: list[dict], key: str, stat=_median) -> tuple:
    """(first 10%, last 10%) of a run's steps (at least one step each), `stat` of metrics[key] over each."""
    n = max(1, math.ceil(EDGE * len(metrics)))
    return stat(m.get(key) for m in metrics[:n]), stat(m.get(key) for m in metrics[-n:])


def growth(metrics: list[dict]) -> float | None:
    """The rule's KL growth factor: median KL(behav‖prox) over the last 10% of steps / over the first 10%."""
    first, last = edges(metrics, "kl_behav_prox_k3")
    if first is None or last is None:
        return None
    return last / first if first > 0 else math.inf


def mixed(m: dict) -> float | None:
    """The share of a step's groups with mixed rewards (some right, some wrong): 1 - zero_advantage_groups."""
    z = m.get("zero_advantage_groups")
    return None if z is None else 1.0 - z


def windows(values: list, size: int = WINDOW) -> list:
    """Means over consecutive windows of `size` steps (the last one may be shorter)."""
    out = []
    for i in range(0, len(values), size):
        chunk = [v for v in values[i:i + size] if v is not None]
        out.append(statistics.mean(chunk) if chunk else None)
    return out


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.mean(xs) if xs else None


def run_stats(r: dict) -> dict:
    m, config = r["metrics"], r["summary"].get("config", {})
    quantized = config.get("quant", "none") != "none"
    mixed_share = [mixed(x) for x in m]
    mixed_windows = [w for w in windows(mixed_share) if w is not None]
    kl_first, kl_last = edges(m, "kl_behav_prox_k3")
    cap_first, cap_last = edges(m, "rho_over_cap_frac", _mean)
    mixed_first, mixed_last = edges([{"v": v} for v in mixed_share], "v", _mean)
    sampled_first, sampled_last = edges(m, "accuracy", _mean)
    return {"seed": config.get("seed"),
            "steps": len(m), "final": r["summary"].get("final_test_accuracy"),
            "sampled_first": sampled_first, "sampled_last": sampled_last,
            "kl_first": kl_first, "kl_last": kl_last, "growth": growth(m) if quantized else None,
            "rho_max": max((x.get("rho_max_step", 1.0) for x in m), default=None),
            "past_cap_first": cap_first, "past_cap_last": cap_last,
            "mixed_first": mixed_first, "mixed_last": mixed_last,
            "mixed_min_window": min(mixed_windows) if mixed_windows else None,
            # where ACR's loss differs from TIS's (A > 0, ratio past 1+eps, rho > C: the bound widened to (1+eps)/r);
            # 0 on every step: an ACR run computes TIS's gradients
            "rescued": _mean(x.get("clip_rescued_frac") for x in m),
            "rescued_steps": sum(1 for x in m if (x.get("clip_rescued_frac") or 0) > 0),
            "clip_upper": _mean(x.get("clip_frac_upper") for x in m),
            "sec_per_step": _mean(x.get("time_step") for x in m),
            "minutes": sum(x.get("time_step", 0) for x in m) / 60}


def summarise(runs: list[dict]) -> dict:
    per_run = [run_stats(r) for r in runs]
    finals = [s["final"] for s in per_run]
    mean, sd = mean_sd(finals)
    return {"final": finals, "mean": mean, "sd": sd, "seed": [s["seed"] for s in per_run],
            "initial": sorted({r["summary"]["initial_test_accuracy"] for r in runs}),
            "base_hash": sorted({r["summary"].get("base_model_hash") for r in runs}, key=str),
            "machine": [r["summary"].get("machine", "?") for r in runs], "runs": per_run}


# ----- the verdict ----------------------------------------------------------------------------------


def verdict(stats: dict, seeds=SEEDS) -> dict:
    """The RULE applied to {row: summarise(...)}: {'judged', 'lines', 'tis_drifts', 'acr_holds', 'acr_beats',
    'tis_beats'} (None where not judged)."""
    out = {"judged": False, "tis_drifts": None, "acr_holds": None, "acr_beats": None, "tis_beats": None}
    tis, acr = stats.get("int3-tis"), stats.get("int3-acr")
    missing = [row for row, s in (("int3-tis", tis), ("int3-acr", acr)) if not s or len(s["final"]) < len(seeds)]
    if missing:
        out["lines"] = [f"Not judged yet: {' and '.join(missing)} {'has' if len(missing) == 1 else 'have'} fewer "
                        f"than {len(seeds)} finished seeds."]
        return out
    g_tis = {s["seed"]: s["growth"] for s in tis["runs"]}
    g_acr = {s["seed"]: s["growth"] for s in acr["runs"]}
    drifting = [seed for seed, g in g_tis.items() if g is not None and g >= DRIFT]
    tis_drifts = len(drifting) >= 2
    acr_holds = tis_drifts and all(g_acr.get(seed) is not None and g_acr[seed] <= g_tis[seed] / 2 for seed in drifting)
    acr_beats = acr["mean"] - tis["mean"] > acr["sd"] + tis["sd"]
    tis_beats = tis["mean"] - acr["mean"] > acr["sd"] + tis["sd"]
    factors = lambda g: ", ".join(f"s{seed}: {_x(v)}" for seed, v in sorted(g.items()))  # noqa: E731
    lines = [f"**TIS drifts** (growth factor >= {DRIFT:g} in {len(drifting)} of {len(g_tis)} seeds; {factors(g_tis)})."
             if tis_drifts else
             f"**TIS did not drift at this scale** (growth factor >= {DRIFT:g} in {len(drifting)} of {len(g_tis)} seeds; "
             f"{factors(g_tis)})."]
    if tis_drifts:
        lines.append(("**ACR holds where TIS drifts**" if acr_holds else "**ACR does not hold where TIS drifts**") +
                     f" (ACR's growth factor: {factors(g_acr)}; at most half of TIS's in seeds "
                     f"{', '.join(f's{seed}' for seed in drifting)} is the rule).")
    else:
        acr_drifting = [seed for seed, g in g_acr.items() if g is not None and g >= DRIFT]
        lines.append(f"ACR's growth factor: {factors(g_acr)}" + (f" (>= {DRIFT:g} in {len(acr_drifting)} seeds: ACR "
                     f"drifts where TIS does not)" if len(acr_drifting) >= 2 else "") + ".")
    spread = (f"ACR {100 * acr['mean']:.1f} ± {100 * acr['sd']:.1f} vs TIS {100 * tis['mean']:.1f} ± "
              f"{100 * tis['sd']:.1f}")
    lines.append(f"**ACR beats TIS** on final greedy accuracy ({spread})." if acr_beats else
                 f"**TIS beats ACR** on final greedy accuracy ({spread})." if tis_beats else
                 f"ACR and TIS end within their seed spread ({spread}).")
    # reported beside the verdict, not part of it: greedy accuracy sits at its ceiling within 50 steps on this
    # task (the pilot), the sampled accuracy does not; and whether ACR's loss differed from TIS's at all
    sampled = {row: [r.get("sampled_last") for r in s["runs"]] for row, s in (("ACR", acr), ("TIS", tis))}
    if all(x is not None for xs in sampled.values() for x in xs):
        lines.append("Not judged, for reading: sampled (T = 1) accuracy over the last 10% of steps " + " vs ".join(
            f"{row} {100 * mean_sd(xs)[0]:.1f} ± {100 * mean_sd(xs)[1]:.1f}" for row, xs in sampled.items()) + ".")
    for row, other in stats.items():  # the rows the rule does not judge (the reference, the field's correction)
        if row in ("int3-tis", "int3-acr") or len(other["final"]) < len(seeds):
            continue
        said = f"{100 * other['mean']:.1f} ± {100 * other['sd']:.1f} greedy"
        other_sampled = [r.get("sampled_last") for r in other["runs"]]
        if all(x is not None for x in other_sampled):
            said += ", {:.1f} ± {:.1f} sampled".format(*(100 * x for x in mean_sd(other_sampled)))
        lines.append(f"Not judged, for reading: the {LABELS.get(row, row)} ends at {said}.")
    binds = [r.get("rescued_steps") for r in acr["runs"]]
    if all(b is not None for b in binds):
        n_steps = f"{sum(binds)} step" + ("" if sum(binds) == 1 else "s")
        lines.append(f"ACR's widened bound took effect (its loss differed from TIS's) on {n_steps} over "
                     f"{len(binds)} seeds" + (": ACR computed TIS's gradients at every step, the two rows differ only "
                                             "by run-to-run noise." if sum(binds) == 0 else "."))
    return {"judged": True, "tis_drifts": tis_drifts, "acr_holds": acr_holds if tis_drifts else None,
            "acr_beats": acr_beats, "tis_beats": tis_beats, "drifting_seeds": drifting, "lines": lines}


def headroom(stats: dict) -> str:
    """The HEADROOM criteria on the finished runs, in one line."""
    worst = [(row, s["seed"], s["mixed_min_window"]) for row, st in stats.items() for s in st["runs"]
             if s["mixed_min_window"] is not None]
    if not worst:
        return "Headroom: no run logged zero_advantage_groups."
    row, seed, low = min(worst, key=lambda x: x[2])
    bf16_300 = [a for r in stats.get("bf16", {}).get("_curves", []) for step, a in zip(*r) if step == 300]
    said = (f"lowest 50-step mean of the mixed-reward share {100 * low:.0f}% ({row} seed {seed}): "
            f"{'>= 30%, held' if low >= 0.30 else 'under 30%: the task saturated'}")
    if bf16_300:
        said += (f"; BF16's greedy accuracy at step 300 {', '.join(f'{100 * a:.1f}%' for a in bf16_300)} "
                 f"({'below' if max(bf16_300) <= 0.95 else 'at'} its ceiling)")
    return "Headroom: " + said + "."


def _x(g):
    return "-" if g is None else ("inf" if math.isinf(g) else f"{g:.1f}x")


def _pct(x, digits=0):
    return "-" if x is None else f"{100 * x:.{digits}f}%"


def _e(x):
    return "-" if x is None else f"{x:.1e}"


# ----- the page ---------------------------------------------------------------------------------------


def table_markdown(stats: dict) -> str:
    lines = ["| row | seed | steps | final greedy accuracy | sampled accuracy first → last 10% | KL(behav‖prox) first 10% → last 10% (median) | growth "
             "| max rho | share rho > C first → last 10% | mixed-reward groups first → last 10% (lowest 50-step mean) "
             "| clipped above | ACR's bound binds: tokens (steps) | s / step |", "|---" * 13 + "|"]
    for row, st in stats.items():
        for s in st["runs"]:
            quantized = row != "bf16"
            lines.append(f"| {LABELS[row]} | {s['seed']} | {s['steps']} | {_pct(s['final'], 1)} | "
                         f"{_pct(s['sampled_first'])} → {_pct(s['sampled_last'])} | "
                         + (f"{_e(s['kl_first'])} → {_e(s['kl_last'])} | {_x(s['growth'])} | {s['rho_max']:.1f} | "
                            f"{_pct(s['past_cap_first'], 2)} → {_pct(s['past_cap_last'], 2)} | " if quantized else
                            "(no quantized sampler) | - | - | - | ")
                         + f"{_pct(s['mixed_first'])} → {_pct(s['mixed_last'])} ({_pct(s['mixed_min_window'])}) | "
                         f"{_pct(s['clip_upper'], 3)} | "
                         + (f"{_pct(s['rescued'], 4)} ({s['rescued_steps']}) | " if row.endswith("-acr") else "- | ")
                         + f"{s['sec_per_step']:.2f} |")
        if len(st["final"]) > 1:
            lines.append(f"| **{LABELS[row]}** | mean ± sd | | **{100 * st['mean']:.1f} ± {100 * st['sd']:.1f}** "
                         "| | | | | | | | | |")
    return "\n".join(lines)


def _yes(x, unknown="not reached"):
    return unknown if x is None else ("yes" if x else "no")


def pilot_markdown(pilot: dict | None) -> list[str]:
    head = ["## Pilot\n"]
    if not pilot:
        return head + ["No pilot on disk (`python experiments/long_horizon.py --pilot NAME ...` writes "
                       "`long_horizon_pilot.json`).", ""]
    lines = head + [
        f"{pilot['steps']} steps of {', '.join(LABELS[r] for r in pilot['rows'])} at seed 0, on "
        f"{pilot.get('machine', 'a CPU')} ({pilot.get('parallel', 1)} runs at a time, each pinned to one core), "
        f"with SETTINGS and each candidate's overrides; runs (metrics.jsonl, summary.json) in "
        f"`{pilot.get('work', 'docs/results/long_horizon_pilot_runs')}/runs/`, the numbers also in "
        f"[long_horizon_pilot.json](long_horizon_pilot.json). Criteria, fixed before the pilot: {HEADROOM}.", "",
        "Per 50-step window (steps 1-50, 51-100, ...): the share of groups with mixed rewards, the sampled (T = 1) "
        "training accuracy and the median KL(behav‖prox) (k3); greedy test accuracy at step 0, 50, 100, ...; "
        "s / step: median of the steps' wall time.", "",
        "| candidate | row | steps run | s / step | mixed-reward groups | sampled accuracy | greedy test accuracy "
        "| KL(behav‖prox) | rho > C | max rho | clipped above | int3 codes changed per step | mixed >= 30% "
        "| greedy <= 95% at 300 |", "|---" * 14 + "|"]
    for name, c in pilot["candidates"].items():
        for row, s in c["rows"].items():
            quantized = row != "bf16"
            lines.append(
                f"| `{name}` ({' '.join(f'{k} {v}' for k, v in c['overrides'].items())}) | {LABELS[row]} | "
                f"{s['steps']}{'' if s.get('finished', True) else ' (stopped)'} | "
                f"{s.get('median_sec_per_step', s['sec_per_step']):.2f} | "
                f"{' '.join(_pct(x) for x in s['mixed_windows'])} | "
                f"{' '.join(_pct(x) for x in s['train_accuracy_windows'])} | "
                f"{' '.join(_pct(a, 1 if a < 1 else 0) for _, a in s['test_accuracy'])} | "
                + (f"{' '.join(_e(x) for x in s.get('kl_windows', []))} | {_pct(s.get('rho_over_cap'), 3)} | "
                   f"{s['rho_max']:.1f}" if quantized else "- | - | -")
                + f" | {_pct(s.get('clip_upper'), 3)} | "
                + (f"{_pct(s.get('codes_changed'), 3)}" if quantized else "-")
                + f" | {_yes(c.get('mixed_ok', c.get('meets')))} | {_yes(c.get('greedy_ok'))} |")
    if pilot.get("note"):
        lines += ["", pilot["note"]]
    return lines + [""]


def report(args, table: dict, stats: dict, in_progress: list[str], pilot: dict | None, png: str | None,
           minutes: float) -> None:
    from qurl_mini.infra.hardware import describe_cpu

    bases = sorted({h for s in stats.values() for h in s["base_hash"]}, key=str)
    starts = sorted({a for s in stats.values() for a in s["initial"]})
    settings = {**SETTINGS, **(SMOKE if args.smoke else {})}
    v = verdict(stats)
    md = [f"# The long horizon: does TIS drift while ACR holds? ({settings['--steps']} steps)\n",
          f"Made by `python experiments/long_horizon.py{' --smoke' if args.smoke else ''}"
          f"{' --report-only' if args.report_only else ''}` at commit {commit()} in {minutes:.0f} min (runs on disk "
          f"are reused; this page on {describe_cpu()}). Rows: `train.py` + SETTINGS + the row's flags, seeds "
          f"{args.seeds}; runs in `{os.path.relpath(args.work, REPO)}/runs/`. "
          + (f"Base hash {bases[0]} (every run's summary.json), greedy test accuracy at the start "
             f"{100 * starts[0]:.1f}% ({settings['--eval-size']} held-out problems)." if bases else ""), "",
          "The paper (Sec. 4.2, Fig. 3): TIS \"works well under 500 steps of training. However, at long training "
          "steps (e.g., >1000 steps), we observe the KL divergence between the behavior policy and the proximal "
          "policy continues to increase ... from 0.002 to 0.025, which is 12x higher\", and training collapses; "
          "ACR (Eq. 9) widens the upper clip bound to (1+eps)/r where pi_behav was truncated, to stop it.", "",
          "## Verdict\n", *[f"- {line}" for line in v["lines"]], "",
          f"Rule, fixed in the script and on this page before the first full run: {RULE}.", "",
          f"Headroom criteria (the pilot's): {HEADROOM}.", "",
          "Settings, the same for every row: " + " ".join(f"`{k} {val}`" for k, val in settings.items()) +
          "; the rows add " + "; ".join(f"{LABELS[r]}: `{' '.join(ROWS[r])}`" for r in args.rows) + ". " +
          "The base is the shipped embedded warm start (`--model` unset): `--max-number 10` is the task it was "
          "trained on; another --max-number changes its key, i.e. an SFT made on this machine, not one base "
          "shared by every machine.", ""]
    if stats:
        md += ["## Per run\n",
               f"KL(behav‖prox) is the k3 estimator over each step's sampled tokens (medians over the first / last "
               f"10% of steps, as the rule reads them); max rho = pi_prox / pi_behav over all steps (Fig. 3(b)'s "
               f"analogue); share rho > C (C = {TIS_CAP:g}): the tokens TIS truncates and ACR's bound widens at "
               f"(means over the first / last 10%); mixed-reward groups: 1 - zero_advantage_groups (means); sampled accuracy: the training responses' "
               f"(T = 1) share correct (means); clipped above: "
               f"the share of tokens PPO's clip stops (mean); ACR's bound binds: the share of tokens where ACR's loss "
               f"differs from TIS's at all (A > 0, ratio past 1+eps and rho > C: clip_rescued_frac, mean) and the steps "
               f"with any (where it is 0, an ACR step computes TIS's gradient exactly).\n",
               table_markdown(stats), "", headroom(stats), ""]
    if in_progress:
        md += [f"In progress (not in the verdict): {', '.join(in_progress)}.", ""]
    if not stats and not in_progress:
        md += ["No runs on disk yet: the rule and settings above are fixed before the first full run.", ""]
    if png:
        md += [f"Curves, one line per run (colour = row, line style = seed; finished and in-progress runs): "
               f"[{os.path.basename(png)}]({os.path.basename(png)}).", "", f"![curves]({os.path.basename(png)})", ""]
    md += pilot_markdown(pilot)
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(md) + "\n")
    clean = {row: {k: val for k, val in s.items() if not k.startswith("_")} for row, s in stats.items()}
    with open(args.out + ".json", "w") as f:
        json.dump({"settings": settings, "rows": {r: ROWS[r] for r in args.rows}, "seeds": args.seeds,
                   "rule": RULE, "headroom_criteria": HEADROOM, "commit": commit(), "verdict": v, "stats": clean,
                   "in_progress": in_progress, "pilot": "long_horizon_pilot.json" if pilot else None}, f, indent=1)


def _rolling_median(values, width=20):
    out = []
    for i in range(len(values)):
        chunk = [v for v in values[max(0, i - width + 1):i + 1] if v is not None]
        out.append(statistics.median(chunk) if chunk else None)
    return out


PANELS = [("greedy test accuracy (%)", None), ("KL(behav‖prox) per token, k3 (20-step running median)",
          "kl_behav_prox_k3"), ("max rho = pi_prox / pi_behav per step", "rho_max_step"),
          ("share of tokens with rho > C (20-step running mean)", "rho_over_cap_frac"),
          ("groups with mixed rewards (20-step running mean)", "mixed")]


def plot(path: str, curves: dict) -> str:
    """curves: {row: [(seed, run)]}, run = {summary, metrics} (finished or in progress). One line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 3.8))
    for ax, (title, key) in zip(axes, PANELS):
        ax.set_title(title, fontsize=8)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for row, runs in curves.items():
        for i, (seed, r) in enumerate(runs):
            colour, style, label = COLOURS[row], styles[i % len(styles)], f"{LABELS[row]} s{seed}"
            steps = [m["step"] for m in r["metrics"]]
            for ax, (_, key) in zip(axes, PANELS):
                if key is None:
                    xs, ys = test_accuracy_curve([r]) if "initial_test_accuracy" in r["summary"] else (
                        [m["step"] for m in r["metrics"] if m.get("test_accuracy") is not None],
                        [m["test_accuracy"] for m in r["metrics"] if m.get("test_accuracy") is not None])
                    ax.plot(xs, [100 * y for y in ys], style, marker="o", ms=2, color=colour, label=label, lw=1)
                    continue
                if row == "bf16" and key != "mixed":
                    continue  # no quantized sampler: rho = 1, KL ~1e-13
                if key == "mixed":
                    ys = [mixed(m) for m in r["metrics"]]
                else:
                    ys = [m.get(key) for m in r["metrics"]]
                if key == "rho_max_step":
                    ax.plot(steps, ys, style, color=colour, lw=0.6, alpha=0.7)
                    continue
                smooth = _rolling_median(ys) if key == "kl_behav_prox_k3" else [
                    _mean(ys[max(0, j - 19):j + 1]) for j in range(len(ys))]
                ax.plot(steps, smooth, style, color=colour, lw=1)
    axes[1].set_yscale("log")
    axes[2].set_yscale("log")
    axes[4].axhline(0.30, color="grey", lw=0.8, ls="--")
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ----- runs -----------------------------------------------------------------------------------------


def flags(settings: dict, row: str, seed: int) -> list[str]:
    return [x for kv in settings.items() for x in kv] + ROWS[row] + ["--seed", str(seed)]


def partial_run(run_dir: str) -> dict | None:
    """A run still going (or stopped): its metrics so far, no summary."""
    from qurl_mini.metrics import read_metrics

    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    rows = read_metrics(path)
    return {"summary": {}, "metrics": rows} if rows else None


def collect(work: str, rows: list[str], seeds: list[int]) -> tuple[dict, dict, list[str]]:
    """({row: [finished run]}, {row: [(seed, run)]} finished and in progress, ['row seed N at step S'])."""
    table, curves, going = {}, {}, []
    for row in rows:
        for seed in seeds:
            run_dir = os.path.join(work, "runs", f"{row}-seed{seed}")
            if os.path.exists(os.path.join(run_dir, "summary.json")):
                r = read_run(run_dir)
                table.setdefault(row, []).append(r)
            elif (r := partial_run(run_dir)) is not None:
                going.append(f"{row} seed {seed} at step {r['metrics'][-1]['step']}")
            else:
                continue
            curves.setdefault(row, []).append((seed, r))
    return table, curves, going


# ----- the pilot --------------------------------------------------------------------------------------


def pilot(args) -> int:
    work = args.out + "_pilot_runs"
    jobs = [(f"{name}-{row}-seed0", flags({**SETTINGS, **PILOT_CANDIDATES[name], "--steps": str(args.pilot_steps)},
                                          row, 0))
            for name in args.pilot for row in PILOT_ROWS]
    if not args.report_only:
        print(f"pilot: {len(jobs)} runs of {args.pilot_steps} steps -> {work}", flush=True)
        run_many(work, jobs, os.path.join(work, "logs"), args.parallel)
    return write_pilot(args, work)


def write_pilot(args, work: str) -> int:
    """OUT_pilot.json from the pilot runs on disk: finished ones, and ones stopped part-way (their steps so far,
    marked; not judged)."""
    from qurl_mini.infra.hardware import describe_cpu

    path = args.out + "_pilot.json"
    old = json.load(open(path)) if os.path.exists(path) else {}
    candidates, table, found = {}, {}, {}
    for name in PILOT_CANDIDATES:
        for row in PILOT_ROWS:
            run_dir = os.path.join(work, "runs", f"{name}-{row}-seed0")
            if os.path.exists(os.path.join(run_dir, "summary.json")):
                found.setdefault(name, {})[row] = read_run(run_dir)
                table[f"{name}-{row}"] = [found[name][row]]
            elif (r := partial_run(run_dir)) is not None:
                found.setdefault(name, {})[row] = r
    if table:
        one_experiment(table, {k: v for k, v in SETTINGS.items() if k not in ("--steps", "--lr")},
                       f"long-horizon pilot ({work})")
    start = next((r[0]["summary"]["initial_test_accuracy"] for r in table.values()), None)
    for name, rows in found.items():
        out = {}
        for row, r in rows.items():
            m = r["metrics"]
            if "initial_test_accuracy" not in r["summary"] and start is not None:
                r["summary"]["initial_test_accuracy"] = start  # one base: the finished runs' start
            kl_first, kl_last = edges(m, "kl_behav_prox_k3")
            out[row] = {"sec_per_step": _mean(x["time_step"] for x in m),
                        "median_sec_per_step": _median(x["time_step"] for x in m),
                        "mixed_windows": windows([mixed(x) for x in m]),
                        "train_accuracy_windows": windows([x["accuracy"] for x in m]),
                        "test_accuracy": list(zip(*test_accuracy_curve([r]))), "kl_first": kl_first,
                        "kl_last": kl_last, "kl_windows": [_median(x["kl_behav_prox_k3"] for x in m[i:i + WINDOW])
                                                           for i in range(0, len(m), WINDOW)],
                        "rho_max": max(x["rho_max_step"] for x in m), "steps": len(m),
                        "finished": "config" in r["summary"],
                        "rho_over_cap": _mean(x["rho_over_cap_frac"] for x in m),
                        "clip_upper": _mean(x["clip_frac_upper"] for x in m),
                        "codes_changed": _mean(x.get("codes_changed_frac") for x in m)}
        mixed_ok = all(w is not None and w >= 0.30 for s in out.values() for w in s["mixed_windows"])
        bf16_at = dict(out["bf16"]["test_accuracy"]) if "bf16" in out else {}
        greedy_ok = bf16_at[args.pilot_steps] <= 0.95 if args.pilot_steps in bf16_at else None
        finished = len(out) == len(PILOT_ROWS) and all(s["finished"] for s in out.values())
        candidates[name] = {"overrides": PILOT_CANDIDATES[name], "rows": out, "mixed_ok": mixed_ok,
                            "greedy_ok": greedy_ok, "finished": finished,
                            "meets": (mixed_ok and greedy_ok) if finished else None}
    pilot_json = {"steps": args.pilot_steps, "rows": PILOT_ROWS, "work": os.path.relpath(work, REPO),
                  "criteria": HEADROOM, "machine": describe_cpu(),
                  "parallel": old.get("parallel", args.parallel) if args.report_only else args.parallel,
                  "commit": commit(), "candidates": candidates, "chosen": {"--lr": SETTINGS["--lr"]},
                  "settings": SETTINGS, "note": PILOT_NOTE}
    with open(path, "w") as f:
        json.dump(pilot_json, f, indent=1)
    print("\n".join(pilot_markdown(pilot_json)))
    print(f"wrote {path}")
    return 0


# ----- main -------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    from qurl_mini.infra.cli import ArgumentParser  # an unknown flag: one line

    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(REPO, "docs", "results", "long_horizon"),
                   help="writes OUT.md, OUT.json, OUT.png (and OUT_pilot.json with --pilot)")
    p.add_argument("--work", default=None, help="where the runs go (default OUT_runs)")
    p.add_argument("--rows", nargs="+", default=None, choices=list(ROWS),
                   help=f"rows to run (default {' '.join(DEFAULT_ROWS)})")
    p.add_argument("--seeds", nargs="+", type=int, default=SEEDS)
    p.add_argument("--parallel", type=parallel_flag, default=1, help="runs at a time, each pinned to one CPU core")
    p.add_argument("--report-only", action="store_true", help="start no run: the page from the runs on disk")
    p.add_argument("--smoke", action="store_true", help="3-step runs of TIS and ACR, one seed, tiny sizes")
    p.add_argument("--pilot", nargs="+", default=None, choices=list(PILOT_CANDIDATES),
                   help="run these candidates' pilots (BF16 + TIS, seed 0) and write OUT_pilot.json")
    p.add_argument("--pilot-steps", type=int, default=PILOT_STEPS)
    args = p.parse_args(argv)
    args.out = os.path.abspath(args.out)
    args.work = os.path.abspath(args.work or args.out + "_runs")
    if args.pilot:
        return pilot(args)
    if args.smoke:
        args.seeds, args.rows = args.seeds[:1], args.rows or SMOKE_ROWS
    args.rows = args.rows or DEFAULT_ROWS
    settings = {**SETTINGS, **(SMOKE if args.smoke else {})}
    t0 = time.time()
    if not args.report_only:
        jobs = [(f"{row}-seed{seed}", flags(settings, row, seed)) for seed in args.seeds for row in args.rows]
        print(f"long horizon: {len(args.rows)} rows x {len(args.seeds)} seeds, {settings['--steps']} steps each "
              f"-> {args.work}", flush=True)
        run_many(args.work, jobs, os.path.join(args.work, "logs"), args.parallel)
    table, curves, going = collect(args.work, args.rows, args.seeds)
    nothing = not table and not going
    one_experiment(table, settings, f"long horizon ({args.work})")
    stats = {row: summarise(rs) for row, rs in table.items()}
    for row, rs in table.items():
        stats[row]["_curves"] = [test_accuracy_curve([r]) for r in rs]
    pilot_path = args.out + "_pilot.json"
    pilot_json = json.load(open(pilot_path)) if os.path.exists(pilot_path) else None
    png = plot(args.out + ".png", curves) if curves else None
    report(args, table, stats, going, pilot_json, png, (time.time() - t0) / 60)
    if nothing:  # one line
        print(f"long_horizon: no runs on disk under {args.work}/runs: wrote {args.out}.md with the rule and settings "
              f"only")
        return 0
    print(open(args.out + ".md").read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
