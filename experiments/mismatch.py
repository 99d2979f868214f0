"""The mismatch dial: how far the quantized sampler and the full-precision learner disagree, format by
format, and what that does to naive (Eq. 3), TIS (Eq. 5) and ACR (Eq. 9) training on the embedded task.

    python experiments/mismatch.py                  # the sweep -> docs/results/mismatch.{md,json}, *.png
    python experiments/mismatch.py --contrast       # `make contrast`: BF16 vs naive / TIS / ACR at the format
                                                    # where naive breaks, one seed (~15-25 min on 2 cores)
    python experiments/mismatch.py --smoke --out /tmp/m   # 2-step runs, tiny (the test suite's)

(a) static: per dial format, KL(q || fp) per token, rho = pi_fp / pi_q at its extremes and the share of
    tokens with |log rho| > 0.2, for responses sampled from the quantized copy (HF, weights rounded as the
    engine rounds them), at the warm start and at the end of the BF16 run (the policy has sharpened).
(b) training: GRPO runs of BF16 rollout (Eq. 1) and, per format in TRAIN_FORMATS, naive / TIS / ACR, over
    seeds. SETTINGS are fixed for every row; runs already on disk (summary.json) are reused, so the sweep
    resumes where it stopped (the runs' metrics and summaries are committed under OUT_runs/).
(c) plots: final greedy accuracy against the measured KL (dose-response), and per-step curves (accuracy,
    KL, max rho, rho > C, clipping, gradient norm) at the most mismatched format that still trains.
(d) OUT.md + OUT.json + PNGs, naming the seeds, commit and CPU.
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import time
from collections import Counter

from runs import REPO, commit, fail, mean_sd, one_experiment, parallel_flag, read_run, run_many, series, test_accuracy_curve

# the dial, finest to coarsest: label -> (--quant, --quant-group)
DIAL = {"int8": ("int8", 0), "fp8": ("fp8", 0), "int6": ("int6", 0), "int5": ("int5", 0),
        "int4g32": ("int4", 32), "int4": ("int4", 0), "int3g32": ("int3", 32), "int3": ("int3", 0),
        "int2g32": ("int2", 32)}
# trained formats, in run order (the contrast's first): they bracket static KL 1e-4 .. 5e-2
TRAIN_FORMATS = ["int2g32", "int3", "int4g32"]
CONTRAST_FORMAT = "int2g32"
OBJECTIVES = {"naive": "naive (Eq. 3)", "tis": "TIS (Eq. 5, FlashRL)", "acr": "ACR (Eq. 9, QuRL)"}
# the corrections the field uses today (loss.CORRECTION_FNS), at the formats where a correction matters
FIELD_OBJECTIVES = {"icepop": "IcePop token mask (verl, NeMo-RL)", "seq-tis": "sequence TIS (TRL, slime)",
                    "geo-tis": "geometric-mean TIS (slime)", "seq-mask": "sequence mask (TRL's default)"}
FIELD_FORMATS = ["int3", "int2g32"]
ALL_OBJECTIVES = {**OBJECTIVES, **FIELD_OBJECTIVES}
# fixed before the first run, the same for every row: several minibatches and 2 PPO epochs per batch and
# no KL penalty, so that naive's ratio carries the whole sampler/learner gap. The engine computes in fp32 on
# every CPU (the first runs were made on an AVX2-only CPU, where `--engine-dtype auto` is float32), so runs
# made on different machines are one sweep: the gap comes from the dial's rounding alone
SETTINGS = {"--algo": "grpo", "--steps": "40", "--prompts-per-step": "16", "--group-size": "8", "--minibatches": "4",
            "--ppo-epochs": "2", "--kl-coef": "0", "--eval-every": "10", "--eval-size": "200", "--save-every": "40",
            "--engine-dtype": "float32", "--shared-prompt": "false"}  # the path the committed runs took
SMOKE = {"--steps": "2", "--prompts-per-step": "4", "--group-size": "4", "--minibatches": "1", "--ppo-epochs": "1",
         "--eval-every": "2", "--eval-size": "8", "--save-every": "2"}
TIS_CAP = 2.0  # train.py's default C


def row_flags(row: str) -> list[str]:
    if row == "bf16":
        return ["--quant", "none", "--objective", "ppo"]
    fmt, objective = row.split("-", 1)
    quant, group = DIAL[fmt]
    return ["--quant", quant, "--quant-group", str(group), "--objective", objective]


# ----- (a) static mismatch ---------------------------------------------------------------------


def static_mismatch(model_dir: str, problems, *, prompts: int, samples: int, tokens: int, seed: int = 0) -> dict:
    """Per dial format: sample from the quantized copy (T = 1), score the tokens under it and under the
    full-precision model. INT8 rounds activations per token too (the W8A8 kernel); the others are weights only."""
    import torch

    from qurl_mini.actor import load_actor, token_logprobs
    from qurl_mini.batch import pack_sequences
    from qurl_mini.loss import sampler_mismatch
    from qurl_mini.prompts import PromptBuilder
    from qurl_mini.quant import FORMATS, fake_quantized

    model, tokenizer = load_actor(model_dir)
    model.eval()
    builder = PromptBuilder("auto", tokenizer)
    prompt_ids = [builder.ids(p) for p in problems[:prompts] for _ in range(samples)]
    width = max(map(len, prompt_ids))
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    left_padded = torch.tensor([[pad] * (width - len(p)) + p for p in prompt_ids])
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
    out = {}
    for label, (fmt, group) in DIAL.items():
        torch.manual_seed(seed)
        with torch.no_grad(), fake_quantized(model, fmt, activations=FORMATS[fmt].vllm_kernel and fmt == "int8",
                                             group=group):
            generated = sample(model, left_padded, attention, tokens, eos, pad)
            responses = [r[:r.index(eos) + 1] if eos in r else r for r in generated]
            batch = pack_sequences(prompt_ids, responses, pad)
            q_logp = token_logprobs(model, batch.input_ids, batch.attention_mask)
        with torch.no_grad():
            fp_logp = token_logprobs(model, batch.input_ids, batch.attention_mask)
        stats = sampler_mismatch(fp_logp, q_logp, batch.response_mask, TIS_CAP)
        log_rho = (fp_logp - q_logp)[batch.response_mask > 0]
        out[label] = {"kl_k3": stats["kl_behav_prox_k3"], "kl_k1": stats["kl_behav_prox"],
                      "rho_max": stats["rho_max_step"], "rho_min": stats["rho_min_step"],
                      "rho_over_cap_frac": stats["rho_over_cap_frac"],
                      "log_rho_over_0.2_frac": (log_rho.abs() > 0.2).float().mean().item(),
                      "tokens": int(log_rho.numel())}
    return out


def sample(model, input_ids, attention_mask, tokens: int, eos: int, pad: int) -> list[list[int]]:
    """Ancestral sampling at T = 1 from left-padded prompts, with the model's KV cache; rows stop after EOS."""
    import torch

    done = torch.zeros(len(input_ids), dtype=torch.bool)
    new, past, step_ids = [], None, input_ids
    for _ in range(tokens):
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1]:]
        out = model(input_ids=step_ids, attention_mask=attention_mask, position_ids=positions, past_key_values=past,
                    use_cache=True)
        past = out.past_key_values
        token = torch.multinomial(out.logits[:, -1].float().softmax(-1), 1).squeeze(-1).masked_fill(done, pad)
        new.append(token)
        step_ids = token[:, None]
        attention_mask = torch.cat([attention_mask, (~done).long()[:, None]], 1)
        done |= token == eos
        if done.all():
            break
    return torch.stack(new, 1).tolist()


def static_markdown(static: dict) -> str:
    lines = ["| format | weights | KL(q‖fp) per token (k3) | max rho = pi_fp / pi_q | min rho | share abs(log rho) > 0.2 "
             "| share rho > C |", "|---|---|---|---|---|---|---|"]
    for label, s in static.items():
        fmt, group = DIAL[label]
        what = "W8A8, per channel / per token" if fmt == "int8" else (f"per group of {group}" if group else "per channel")
        lines.append(f"| `{label}` | {what} | {s['kl_k3']:.1e} | {s['rho_max']:.2f} | {s['rho_min']:.3f} | "
                     f"{100 * s['log_rho_over_0.2_frac']:.2f}% | {100 * s['rho_over_cap_frac']:.2f}% |")
    return "\n".join(lines)


# ----- (b) training runs and their summary -----------------------------------------------------


def run_summary(runs: list[dict]) -> dict:
    """Final greedy accuracy over seeds, and the sampler/learner gap over all steps of all seeds."""
    finals = [r["summary"]["final_test_accuracy"] for r in runs]
    steps = [m for r in runs for m in r["metrics"]]
    kls = sorted(m["kl_behav_prox_k3"] for m in steps)
    mean, sd = mean_sd(finals)
    return {"final": finals, "mean": mean, "sd": sd, "start": runs[0]["summary"]["initial_test_accuracy"],
            "kl_k3_median": kls[len(kls) // 2], "kl_k3_last10": statistics.mean(
                m["kl_behav_prox_k3"] for r in runs for m in r["metrics"][-10:]),
            "rho_max": max(m["rho_max_step"] for m in steps),
            "rho_over_cap_frac": statistics.mean(m["rho_over_cap_frac"] for m in steps),
            "clip_upper": statistics.mean(m["clip_frac_upper"] for m in steps),
            "clip_lower": statistics.mean(m["clip_frac_lower"] for m in steps)}


def training_markdown(table: dict, stats: dict) -> str:
    bf16 = stats["bf16"]
    lines = ["| rollout | objective | final greedy accuracy (mean ± sd) | per seed | vs BF16 | median KL(behav‖prox) (k3) "
             "| KL, last 10 steps | max rho | rho > C | clipped above / below |", "|---|---|---|---|---|---|---|---|---|---|"]
    lines[0] = lines[0].replace("| per seed |", "| per seed (seeds) |")
    for row, s in stats.items():
        fmt, objective = (("none (BF16 row)", "PPO-clip (Eq. 1)") if row == "bf16" else
                          (row.split("-", 1)[0], ALL_OBJECTIVES[row.split("-", 1)[1]]))
        lines.append(f"| `{fmt}` | {objective} | **{100 * s['mean']:.1f} ± {100 * s['sd']:.1f}** | "
                     f"{' / '.join(f'{100 * f:.1f}' for f in s['final'])} ({len(s['final'])}) | "
                     f"{100 * (s['mean'] - bf16['mean']):+.1f} | "
                     f"{s['kl_k3_median']:.1e} | {s['kl_k3_last10']:.1e} | {s['rho_max']:.1f} | "
                     f"{100 * s['rho_over_cap_frac']:.2f}% | {100 * s['clip_upper']:.2f}% / {100 * s['clip_lower']:.2f}% |")
    return "\n".join(lines)


def headline(stats: dict, formats: list[str]) -> str:
    """The question of the sweep, answered from the numbers: a format where naive ends >= 10 points under
    BF16, beyond the seed spread, while ACR ends within the seed spread of BF16."""
    bf16 = stats["bf16"]
    rule = ("with >= 3 seeds each, naive's mean is >= 10 points under BF16's and naive's mean + sd is under "
            "BF16's mean - sd; ACR's mean is at least BF16's mean - (BF16's sd + ACR's sd)")
    found, notes = [], []
    for fmt in formats:
        naive, tis, acr = (stats.get(f"{fmt}-{o}") for o in ("naive", "tis", "acr"))
        if not (naive and acr):
            continue
        if min(len(naive["final"]), len(acr["final"]), len(bf16["final"])) < 3:
            notes.append(f"`{fmt}`: fewer than 3 seeds finished, not judged")
            continue
        naive_breaks = naive["mean"] <= bf16["mean"] - 0.10 and naive["mean"] + naive["sd"] < bf16["mean"] - bf16["sd"]
        acr_holds = acr["mean"] >= bf16["mean"] - (bf16["sd"] + acr["sd"])
        if naive_breaks and acr_holds:
            found.append(fmt)
        if all(s["mean"] <= bf16["mean"] - 0.10 for s in (naive, tis, acr) if s):
            notes.append(f"at `{fmt}` every objective ends >= 10 points under BF16")
        if tis and abs(tis["mean"] - acr["mean"]) > max(tis["sd"], acr["sd"]):
            notes.append(f"at `{fmt}` TIS and ACR differ by more than their seed spread "
                         f"({100 * tis['mean']:.1f} vs {100 * acr['mean']:.1f})")
    if found:
        best = found[0]
        answer = (f"**Yes: `{best}`.** Naive (Eq. 3) ends at {100 * stats[best + '-naive']['mean']:.1f}% ± "
                  f"{100 * stats[best + '-naive']['sd']:.1f}, ACR (Eq. 9) at {100 * stats[best + '-acr']['mean']:.1f}% ± "
                  f"{100 * stats[best + '-acr']['sd']:.1f}, BF16 rollout at {100 * bf16['mean']:.1f}% ± "
                  f"{100 * bf16['sd']:.1f}" + (f" (also: {', '.join(found[1:])})" if found[1:] else "") + ".")
    else:
        answer = "**No format of the dial gives it.** The whole sweep is above."
    return "\n".join([answer, "", f"Rule, fixed before the runs: {rule}.", *(f"- {n}" for n in notes)])


def format_verdicts(stats: dict, formats: list[str]) -> str:
    """Per format, every objective judged against BF16 by the headline's rule (holds / fails / in between), and
    the pairs of objectives whose means differ by more than their seed spreads (sd_a + sd_b)."""
    bf16, lines = stats["bf16"], []
    for fmt in formats:
        rows = {o: stats[f"{fmt}-{o}"] for o in ALL_OBJECTIVES if f"{fmt}-{o}" in stats}
        if not rows:
            continue
        if min(len(s["final"]) for s in [bf16, *rows.values()]) < 3:
            lines.append(f"- `{fmt}`: fewer than 3 seeds of some row finished, not judged")
            continue
        verdict = {}
        for o, s in rows.items():
            if s["mean"] >= bf16["mean"] - (bf16["sd"] + s["sd"]):
                verdict.setdefault("holds", []).append(o)
            elif s["mean"] <= bf16["mean"] - 0.10 and s["mean"] + s["sd"] < bf16["mean"] - bf16["sd"]:
                verdict.setdefault("fails", []).append(o)
            else:
                verdict.setdefault("in between", []).append(o)
        apart = [f"{a} {100 * rows[a]['mean']:.1f} vs {b} {100 * rows[b]['mean']:.1f}"
                 for i, a in enumerate(rows) for b in list(rows)[i + 1:]
                 if abs(rows[a]["mean"] - rows[b]["mean"]) > rows[a]["sd"] + rows[b]["sd"]]
        lines.append(f"- `{fmt}`: " + "; ".join(f"{k}: {', '.join(v)}" for k, v in verdict.items()) +
                     (f". Apart beyond the seed spread: {'; '.join(apart)}." if apart else
                      ". No two objectives differ beyond their seed spread."))
    rule = ("holds: mean >= BF16's mean - (BF16's sd + its sd); fails: mean >= 10 points under BF16's and mean + sd "
            "under BF16's mean - sd; otherwise in between")
    return "\n".join([*lines, "", f"Rule, fixed before the runs: {rule}."])


# ----- (c) plots ----------------------------------------------------------------------------------


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


STYLE = {"bf16": ("black", "unquantized rollout (BF16 row), Eq. 1"), "naive": ("tab:red", OBJECTIVES["naive"]),
         "tis": ("tab:blue", OBJECTIVES["tis"]), "acr": ("tab:green", OBJECTIVES["acr"]),
         "icepop": ("tab:purple", FIELD_OBJECTIVES["icepop"]), "seq-tis": ("tab:orange", FIELD_OBJECTIVES["seq-tis"]),
         "geo-tis": ("tab:brown", FIELD_OBJECTIVES["geo-tis"]), "seq-mask": ("tab:olive", FIELD_OBJECTIVES["seq-mask"])}


def _style(row):
    return STYLE["bf16" if row == "bf16" else row.split("-", 1)[1]]


def plot_dose_response(stats: dict, formats: list[str], path: str) -> str:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    bf16 = stats["bf16"]
    ax.axhspan(100 * (bf16["mean"] - bf16["sd"]), 100 * (bf16["mean"] + bf16["sd"]), color="grey", alpha=0.25,
               label=f"BF16 rollout (mean ± sd, KL {bf16['kl_k3_median']:.0e})")
    ax.axhline(100 * bf16["start"], color="grey", ls=":", lw=1, label="warm start")
    for objective in ALL_OBJECTIVES:
        points = sorted((stats[f"{f}-{objective}"]["kl_k3_median"], stats[f"{f}-{objective}"]["mean"],
                         stats[f"{f}-{objective}"]["sd"], f) for f in formats if f"{f}-{objective}" in stats)
        if not points:
            continue
        color, label = STYLE[objective]
        kl, mean, sd, names = zip(*points)
        ax.errorbar(kl, [100 * m for m in mean], yerr=[100 * s for s in sd], color=color, marker="o", capsize=3,
                    label=label)
        if objective == "naive":
            for x, y, name in zip(kl, mean, names):
                ax.annotate(name, (x, 100 * y), textcoords="offset points", xytext=(4, -12), fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("measured KL(behav ‖ prox) per token (k3, median over steps and seeds)")
    ax.set_ylabel("final greedy test accuracy (%)")
    ax.set_title("Dose-response: sampler/learner mismatch vs final accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


CURVES = [("test accuracy (greedy, %)", None), ("KL(behav ‖ prox) per token, k3", "kl_behav_prox_k3"),
          ("max rho = pi_prox / pi_behav", "rho_max_step"), ("share of tokens with rho > C", "rho_over_cap_frac"),
          ("clipped above (solid) / below (dotted)", "clip_frac_upper"), ("gradient norm (before clipping)", "grad_norm")]


def plot_curves(table: dict, rows: list[str], path: str, title: str, panels=CURVES) -> str:
    """Per-step curves like the paper's Fig. 2-3, mean over seeds, one line per row."""
    plt = _plt()
    cols = 3
    fig, axes = plt.subplots((len(panels) + cols - 1) // cols, cols, figsize=(15, 4 * ((len(panels) + 2) // 3)),
                             squeeze=False)
    for ax, (name, key) in zip(axes.flat, panels):
        for row in rows:
            color, label = _style(row)
            if key is None:
                steps, acc = test_accuracy_curve(table[row])
                ax.plot(steps, [100 * a for a in acc], "o-", color=color, label=label)
                continue
            steps, values = series(table[row], key)
            ax.plot(steps, values, color=color, label=label)
            if key == "clip_frac_upper":
                ax.plot(*series(table[row], "clip_frac_lower"), ":", color=color)
        if key in ("kl_behav_prox_k3", "rho_max_step"):
            ax.set_yscale("log")
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def most_mismatched_that_trains(stats: dict, formats: list[str]) -> str:
    """The coarsest trained format where ACR still gains >= 10 points over the warm start (else the finest)."""
    by_kl = sorted(formats, key=lambda f: stats[f"{f}-acr"]["kl_k3_median"] if f"{f}-acr" in stats else 0)
    training = [f for f in by_kl if f"{f}-acr" in stats and stats[f"{f}-acr"]["mean"] >= stats["bf16"]["start"] + 0.10]
    return training[-1] if training else by_kl[0]


# ----- the two commands -------------------------------------------------------------------------


def train_all(work: str, groups: list[list[str]], seeds: list[int], settings: dict, parallel: int = 1) -> dict:
    """Group by group (a format's rows), seed by seed, so a partial sweep answers its first format first;
    parallel > 1: that many runs at a time, each pinned to its own CPU core; 0: start none, read those on disk."""
    flags = [x for kv in settings.items() for x in kv]
    jobs = [(row, seed) for rows in groups for seed in seeds for row in rows]
    if parallel == 0:  # report only: the runs already on disk
        run_dirs = [os.path.join(work, "runs", f"{row}-seed{seed}") for row, seed in jobs]
        finished = [(j, d) for j, d in zip(jobs, run_dirs) if os.path.exists(os.path.join(d, "summary.json"))]
        if not any(row == "bf16" for (row, _), _ in finished):  # every row is read against BF16
            fail(f"--report-only: no finished bf16 run (summary.json) under {work}/runs, and every row is read "
                 f"against it; {len(finished)} of {len(jobs)} runs finished; finish them first (without --report-only)")
        jobs, run_dirs = zip(*finished)
    else:
        run_dirs = run_many(work, [(f"{row}-seed{seed}", flags + row_flags(row) + ["--seed", str(seed)])
                                   for row, seed in jobs], os.path.join(work, "logs"), parallel)
    table = {}
    for (row, _), run_dir in zip(jobs, run_dirs):
        table.setdefault(row, []).append(read_run(run_dir))
    return table


def contrast(args) -> int:
    rows = ["bf16"] + [f"{CONTRAST_FORMAT}-{o}" for o in OBJECTIVES]
    print(f"contrast: BF16 rollout vs {CONTRAST_FORMAT} ({' / '.join(OBJECTIVES)}), seed {args.seeds[0]}, "
          f"{args.settings['--steps']} steps each -> {args.work}", flush=True)
    table = train_all(args.work, [rows], args.seeds[:1], args.settings, args.parallel)
    one_experiment(table, args.settings, f"contrast ({args.work})")
    steps = test_accuracy_curve(table["bf16"])[0]
    curves = {row: dict(zip(*test_accuracy_curve(table[row]))) for row in rows}
    print("\ngreedy test accuracy (%) by step:")
    print("step  " + "".join(f"{row:>18}" for row in rows))
    for s in steps:
        print(f"{s:>4}  " + "".join(f"{100 * curves[row].get(s, float('nan')):>18.1f}" for row in rows))
    for row in rows:
        kl = [m["kl_behav_prox_k3"] for m in table[row][0]["metrics"]]
        rho = max(m["rho_max_step"] for m in table[row][0]["metrics"])
        print(f"  {row:>16}: KL(behav||prox) k3 first/last step {kl[0]:.1e} / {kl[-1]:.1e}, max rho {rho:.1f}")
    png = plot_curves(table, rows, args.out + ".png", f"BF16 rollout vs {CONTRAST_FORMAT} rollout (seed {args.seeds[0]})",
                      panels=CURVES[:3])
    print(f"wrote {png}")
    return 0


def warm_start_dir(recorded: str) -> str | None:
    """The runs' warm start: where they recorded it, else the same cached folder in this checkout."""
    here = os.path.join(REPO, ".cache", os.path.basename(recorded))
    return next((d for d in (recorded, here) if os.path.isdir(d)), None)


def with_weights(model_dir: str | None, weights: str, work: str) -> str | None:
    """model_dir's config and tokenizer with `weights` as its model.safetensors (a folder under work), or None."""
    if not model_dir or not os.path.isfile(weights):
        return None
    folder = os.path.join(work, "bf16_end_model")
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(model_dir, folder, ignore=shutil.ignore_patterns("model.safetensors"))
    shutil.copyfile(weights, os.path.join(folder, "model.safetensors"))
    return folder


def machines(table: dict) -> str:
    """The CPUs (and engine dtypes) the runs recorded in their summary.json, with the rows run on each."""
    seen = {}
    for row, runs in table.items():
        for r in runs:
            name = (f"{r['summary'].get('machine', 'CPU not recorded')}, engine dtype "
                    f"{r['summary'].get('engine_dtype', 'not recorded')}")
            seen.setdefault(name, Counter())[row] += 1
    return "; ".join(f"{name} ({', '.join(f'{row} x{n}' for row, n in rows.items())})" for name, rows in seen.items())


def sweep(args, argv) -> int:
    t0 = time.time()
    paper = [o for o in args.objectives if o in OBJECTIVES]
    field = [o for o in args.objectives if o in FIELD_OBJECTIVES]
    groups = [[f"{f}-{o}" for o in paper] for f in args.formats]  # the paper's rows first, then the field's
    groups += [[f"{f}-{o}" for o in field] for f in args.formats if f in FIELD_FORMATS and field]
    groups[0].insert(0, "bf16")
    print(f"mismatch sweep: {sum(map(len, groups))} rows x {len(args.seeds)} seeds -> {args.work}", flush=True)
    table = train_all(args.work, groups, args.seeds, args.settings, args.parallel)
    base_hash = one_experiment(table, args.settings, f"mismatch sweep ({args.work})")
    stats = {row: run_summary(runs) for row, runs in table.items()}

    from qurl_mini.data import load_problems
    from qurl_mini.infra.hardware import describe_cpu

    _, test = load_problems("synthetic", None, args.static_prompts, 0, 10)
    warm = warm_start_dir(table["bf16"][0]["summary"]["base_model"])
    bf16_final = os.path.join(args.work, "runs", f"bf16-seed{args.seeds[0]}", "final")
    bf16_end = args.out + "_bf16_end.safetensors"  # committed: the static table's second model, checkable
    if os.path.isfile(os.path.join(bf16_final, "model.safetensors")):
        shutil.copyfile(os.path.join(bf16_final, "model.safetensors"), bf16_end)
    static_path = args.out + "_static.json"
    previous = json.load(open(static_path)) if os.path.exists(static_path) else {}
    static, kept = {}, []
    # a model not on this machine keeps the measurement made with it
    for key, model_dir in (("warm_start", warm), ("bf16_end", with_weights(warm, bf16_end, args.work))):
        if model_dir and os.path.isdir(model_dir):
            static[key] = static_mismatch(model_dir, test, prompts=args.static_prompts, samples=4, tokens=24)
        elif key in previous:
            static[key] = previous[key]
            kept.append(key)
    with open(static_path, "w") as f:
        json.dump(static, f, indent=1)

    focus = most_mismatched_that_trains(stats, args.formats)
    pngs = [plot_dose_response(stats, args.formats, args.out + "_dose_response.png"),
            plot_curves(table, [row for row in ["bf16"] + [f"{focus}-{o}" for o in OBJECTIVES] if row in table],
                        args.out + f"_curves.png",  # a partial sweep (--objectives) plots the rows it has
                        f"per-step curves at {focus} (mean over seeds {args.seeds})")]
    settings = " ".join(f"{k} {v}" for k, v in args.settings.items())
    cmd = " ".join(["python experiments/mismatch.py", *(argv if argv is not None else sys.argv[1:])])
    md = [f"# The mismatch dial: where naive quantized PPO breaks\n",
          f"Made by `{cmd}` at commit {commit()} in {(time.time() - t0) / 60:.0f} min (runs already on disk are "
          f"reused; this report and the static tables on {describe_cpu()}). Training rows: `train.py {settings}` + "
          f"the row's `--quant --quant-group --objective`, seeds {args.seeds}; runs in "
          f"`{os.path.relpath(args.work, REPO)}/runs/`, trained on: {machines(table)}. The BF16 row is the "
          f"unquantized engine (`--quant none`, in the engine dtype above: `--engine-dtype auto` picks float32 "
          f"where the CPU has no bf16 arithmetic); the dial's formats are emulated in it. Runs made before "
          f"`--engine-dtype float32` joined the settings recorded `auto`, which their AVX2-only CPU resolved to "
          f"float32 (each run's summary.json has the dtype it ran in).\n",
          "## Is there a format where naive Eq. 3 breaks while ACR holds?\n", headline(stats, args.formats), "",
          "## Per format: which objectives hold, which fail\n",
          "The paper's objectives and the corrections the field uses today (`--objective icepop / seq-tis / geo-tis "
          f"/ seq-mask`, thresholds [1/C, C] with C = {TIS_CAP:g}; run at {', '.join(f'`{f}`' for f in FIELD_FORMATS)}).\n",
          format_verdicts(stats, args.formats), "",
          "## Training: final greedy test accuracy and the measured mismatch\n",
          f"Warm start: {100 * stats['bf16']['start']:.1f}%. KL(behav‖prox) is the k3 estimator over each step's "
          f"sampled tokens; max rho over all steps and seeds; rho > C (C = {TIS_CAP:g}) and clipped shares are "
          "means over steps.\n", training_markdown(table, stats), "",
          "## Static mismatch per format\n",
          f"{args.static_prompts} held-out prompts x 4 samples at T = 1 drawn from the quantized copy (HF, weights "
          "rounded as the engine rounds them; INT8 also rounds activations per token), 24 new tokens, "
          "statistics over the sampled tokens (one sample of responses: another seed or CPU draws other tokens, and "
          "the numbers move by tens of percent: compare formats within one table).\n", "### At the warm start\n", static_markdown(static["warm_start"]), ""]
    if "bf16_end" in static:
        was = (f" (its weights: `{os.path.basename(bf16_end)}`)" if "bf16_end" not in kept else
               " (kept from the measurement made when its weights were on disk)")
        md += [f"### At the end of the BF16 run (seed {args.seeds[0]}, {args.settings['--steps']} steps){was}\n",
               static_markdown(static["bf16_end"]), ""]
    md += [f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in pngs]
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(md) + "\n")
    with open(args.out + ".json", "w") as f:
        json.dump({"settings": args.settings, "seeds": args.seeds, "formats": {f: DIAL[f] for f in args.formats},
                   "training": stats, "static": static, "focus_format": focus}, f, indent=1)
    print(f"wrote {args.out}.md, {args.out}.json, " + ", ".join(pngs))
    return 0


def main(argv=None) -> int:
    from qurl_mini.infra.cli import ArgumentParser  # an unknown flag: one line

    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contrast", action="store_true", help="BF16 vs naive / TIS / ACR at the breaking format, one "
                                                           "seed, curves side by side (make contrast)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--formats", nargs="+", default=TRAIN_FORMATS, choices=list(DIAL), help="formats to train")
    p.add_argument("--objectives", nargs="+", default=list(ALL_OBJECTIVES), choices=list(ALL_OBJECTIVES),
                   help="objectives to train (the field's at FIELD_FORMATS only; a partial sweep: the rest can "
                        "follow later)")
    p.add_argument("--static-prompts", type=int, default=64)
    p.add_argument("--parallel", type=parallel_flag, default=1, help="runs at a time, each pinned to one CPU core "
                                                           "(2 on a 2-core machine: more runs per hour)")
    p.add_argument("--report-only", action="store_true", help="start no run: report the finished runs on disk "
                                                              "(a sweep stopped part-way; the table says how many seeds)")
    p.add_argument("--smoke", action="store_true", help="2-step runs of one format, one seed, tiny eval")
    p.add_argument("--out", default=None, help="writes OUT.md/.json/*.png (sweep) or OUT.png (contrast); "
                                               "default docs/results/mismatch, or runs/contrast with --contrast")
    p.add_argument("--work", default=None, help="where the runs go (default OUT_runs)")
    args = p.parse_args(argv)
    args.settings = dict(SETTINGS)
    if args.smoke:
        args.settings.update(SMOKE)
        args.seeds, args.formats, args.static_prompts = args.seeds[:1], args.formats[:1], 4
        args.objectives = ["seq-mask"]  # BF16 and one row, side by side: the field's group (the paper's is the same code)
    args.out = os.path.abspath(args.out or os.path.join(REPO, *(("runs", "contrast") if args.contrast
                                                                 else ("docs", "results", "mismatch"))))
    args.work = os.path.abspath(args.work or args.out + "_runs")
    if args.report_only:
        args.parallel = 0
    return contrast(args) if args.contrast else sweep(args, argv)


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    sys.exit(main())
