"""Per-step metrics: appended to runs/<name>/metrics.jsonl, plotted to PNG at the end; and the Eq. 13-14
statistics of each weight sync (`WeightUpdateMonitor`)."""
import json
import logging
import math
import os

import torch

from .quant import dequantize

log = logging.getLogger("qurl_mini")


class MetricsLog:
    def __init__(self, path: str, resume_after_step: int | None = None):
        """On resume, rows past the checkpoint's step are dropped so no step appears twice, and so is a
        line cut short by a process killed mid-write (said in a warning)."""
        self.path = path
        if resume_after_step is not None and os.path.exists(path):
            kept = [r for r in read_metrics(path, warn=True) if r["step"] <= resume_after_step]
            with open(path + ".tmp", "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in kept)
            os.replace(path + ".tmp", path)
        elif resume_after_step is None and os.path.exists(path):
            os.remove(path)

    def write(self, row: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(clean) + "\n")
            f.flush()
            os.fsync(f.fileno())


SIGNAL_STEPS = 3  # steps in a row without learning signal before a run says so


class SignalWatch:
    """Says once per run, in one line with the fix, that a run cannot learn: every response scored 0 (or every
    one 1: no group has an advantage) for SIGNAL_STEPS steps in a row, or most of their responses (> 50%) were
    cut off at --max-new-tokens before their answer."""

    def __init__(self, max_new_tokens: int, warned: bool = False):
        self.max_new_tokens, self.warned = max_new_tokens, warned  # warned: carried by a resumed run's checkpoint
        self.recent = []  # (step, accuracy, truncated share) of the last SIGNAL_STEPS steps

    def observe(self, step: int, accuracy: float, truncated_share: float) -> None:
        self.recent = (self.recent + [(step, accuracy, truncated_share)])[-SIGNAL_STEPS:]
        message = self.problem() if len(self.recent) == SIGNAL_STEPS and not self.warned else None
        if message:
            log.warning(message)
            self.warned = True

    def problem(self) -> str | None:
        """One line: what is wrong over the recent steps and the fix; None when the run has signal."""
        steps = f"steps {self.recent[0][0]}-{self.recent[-1][0]}"
        accuracies = {accuracy for _, accuracy, _ in self.recent}
        truncated = sum(share for _, _, share in self.recent) / len(self.recent)
        cut = (f"{truncated:.0%} of the responses hit --max-new-tokens {self.max_new_tokens}, cut off before their "
               f"'####' answer")
        if accuracies == {0.0} and truncated > 0.5:
            return f"{steps}: every response scored 0 and {cut}: nothing to learn from; raise --max-new-tokens"
        if accuracies == {0.0}:
            return (f"{steps}: every response scored 0 (no group has an advantage): nothing to learn from; start "
                    f"easier (an instruct or warm-started model, easier problems) or lower --lr")
        if accuracies == {1.0}:
            return (f"{steps}: every response scored 1 (no group has an advantage): nothing left to learn; use harder "
                    f"problems")
        if truncated > 0.5:
            return f"{steps}: {cut}; raise --max-new-tokens"
        return None


def read_metrics(path: str, warn: bool = False) -> list[dict]:
    """The rows; a line that is not JSON (a write cut short) is left out."""
    rows, torn = read_metrics_lines(path)
    if torn and warn:
        log.warning("%s: dropped line %s, cut short (a write interrupted by the end of the process)",
                    path, ", ".join(map(str, torn)))
    return rows


def read_metrics_lines(path: str) -> tuple[list[dict], list[int]]:
    """(the rows, the numbers of the lines that are not JSON: a write cut short)."""
    rows, torn = [], []
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                torn.append(number)
    return rows, torn


def plot_metrics(path: str, out_png: str, initial_test_accuracy: float | None = None) -> str:
    """Reward, accuracy (sampled and greedy test) and the engine/actor gap over the steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(path)
    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].plot(steps, [r.get("reward_mean") for r in rows], label="reward (mean of samples)")
    axes[0].plot(steps, [r.get("accuracy") for r in rows], label="sampled accuracy")
    evals = [(0, initial_test_accuracy)] if initial_test_accuracy is not None else []
    evals += [(r["step"], r["test_accuracy"]) for r in rows if r.get("test_accuracy") is not None]
    if evals:
        axes[0].plot(*zip(*evals), "o-", label="greedy test accuracy")
    axes[0].set_title("reward and accuracy")
    axes[0].legend()
    axes[1].plot(steps, [r.get("kl_behav_prox_k3") for r in rows], label="k3 estimator (>= 0)")
    axes[1].plot(steps, [r.get("kl_behav_prox") for r in rows], ":", label="k1 estimator (unbiased, can be < 0)")
    axes[1].set_title("KL(behav || prox) per token: engine vs actor")
    axes[1].legend()
    axes[2].plot(steps, [r.get("clip_frac_upper") for r in rows], label="clipped above (A > 0)")
    axes[2].plot(steps, [-r["clip_frac_lower"] if r.get("clip_frac_lower") is not None else None for r in rows],
                 label="clipped below (A < 0), negated")
    axes[2].plot(steps, [r.get("tis_trunc_frac") for r in rows], ":", label="rho > C (ACR widens these)")
    axes[2].axhline(0, color="black", lw=0.5)
    axes[2].set_title("share of response tokens clipped")
    axes[2].legend()
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(os.path.basename(os.path.dirname(os.path.abspath(path))))
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png


class WeightUpdateMonitor:
    """Per sync: Eq. 13 normalized update, Eq. 14 normalized quantization error, and the
    fraction of quantized codes that changed (how much of the update survives quantization)."""

    def __init__(self):
        self.previous_weights = None
        self.previous_codes = None

    @torch.no_grad()
    def measure(self, model, quantized: dict) -> dict:
        """`quantized` is {weight name: (codes, scale)} of the weights just synced."""
        weights = {n: model.get_parameter(n).detach().float().clone() for n in quantized}
        norm2 = sum(w.pow(2).sum().item() for w in weights.values())
        error2 = sum((dequantize(q, s) - weights[n]).pow(2).sum().item() for n, (q, s) in quantized.items())
        stats = {"quant_error_norm": error2 / norm2}  # Eq. 14
        codes = {n: q.view(torch.uint8) for n, (q, _) in quantized.items()}
        if self.previous_weights is not None:
            prev_norm2 = sum(w.pow(2).sum().item() for w in self.previous_weights.values())
            update2 = sum((weights[n] - self.previous_weights[n]).pow(2).sum().item() for n in weights)
            stats["weight_update_norm"] = update2 / prev_norm2  # Eq. 13
            changed = sum((codes[n] != self.previous_codes[n]).sum().item() for n in codes)
            stats["codes_changed_frac"] = changed / sum(c.numel() for c in codes.values())
        self.previous_weights, self.previous_codes = weights, codes
        return stats
