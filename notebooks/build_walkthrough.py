"""Writes notebooks/walkthrough.ipynb from the cells below and runs it, so it is committed with its outputs.

    .venv/bin/python notebooks/build_walkthrough.py            # write + execute (about a minute on 2 cores)
    .venv/bin/python notebooks/build_walkthrough.py --no-run   # write only, without outputs

Edit the cells here, not in the .ipynb. tests/test_notebook.py executes the committed notebook.
"""
import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "walkthrough.ipynb")

CELLS = [
    ("md", r"""
# One RL step of QuRL, with live tensors

This notebook takes one step of qurl-mini's loop by hand, on the embedded model and its synthetic
arithmetic task. The rollout comes from an **INT8 W8A8 vLLM copy** of the policy. The log-probs and the
gradient come from the **full-precision HF actor**. Each heading names the library function that
`Trainer.step` ([`qurl_mini/trainer.py`](../qurl_mini/trainer.py)) calls for that phase. The code cells
call those functions; what they compute beside them (ratios to print, the plots) is for display.

It runs on a CPU in about a minute. The embedded warm start ships with the repository (the same bytes on
every machine); the first run unpacks it into `.cache/`, shared with `make demo` and the tests.

Three policies score every sampled token:

| name | what | in the code |
|---|---|---|
| pi_behav | the quantized rollout engine that sampled the token | `behav_logp` |
| pi_prox | the full-precision actor before the update | `prox_logp` |
| pi_theta | the actor being updated | `logp` |

With R = pi_theta / pi_prox, R_hat = pi_theta / pi_behav and rho = pi_prox / pi_behav. Every symbol of
the paper and its name in the code: [docs/symbols.md](../docs/symbols.md).
"""),
    ("code", r"""
import copy
import logging
import os
import sys
import tempfile
import warnings
from pathlib import Path

REPO = Path.cwd() if (Path.cwd() / "qurl_mini").is_dir() else Path.cwd().parent
sys.path.insert(0, str(REPO))
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine runs in this process (the weight sync needs it)
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # quiet: no engine logs, progress bars or warnings below
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
logging.disable(logging.WARNING)
warnings.filterwarnings("ignore")

import matplotlib.pyplot as plt
import pandas as pd
import torch

import transformers

from qurl_mini.config import Config
from qurl_mini.data import load_problems
from qurl_mini.infra.hardware import describe_cpu
from qurl_mini.base_model import base_model_path

transformers.utils.logging.disable_progress_bar()
print("CPU:", describe_cpu(), "(the numbers below follow its kernels)")
torch.manual_seed(0)
cfg = Config(quant="int8", cache_dir=str(REPO / ".cache"))  # the demo's settings: INT8 rollout, ACR (Eq. 9)
train_problems, test_problems = load_problems(cfg.data, cfg.test_data, cfg.eval_size, cfg.seed, cfg.max_number)
warm_start = base_model_path(cfg, train_problems)  # the SFT'd tiny Qwen2: built on first use, then cached
print("warm start:", os.path.relpath(warm_start, REPO))
print("a training problem:", train_problems[0].question, "->", repr(train_problems[0].answer))
"""),
    ("md", r"""
## 1. Rollout: `RolloutEngine.generate` samples with pi_behav

`RolloutEngine.from_actor` writes the actor as a compressed-tensors W8A8 checkpoint and starts vLLM on it.
The weights are int8 with one scale per output channel; the activations are quantized to int8 per token
at run time. `generate` returns each response's tokens and the engine's log-prob of each sampled token:
log pi_behav. We sample a group of G = 8 responses for each of 4 prompts.
"""),
    ("code", r"""
from qurl_mini.actor import load_actor
from qurl_mini.engine import Platform, RolloutEngine
from qurl_mini.prompts import PromptBuilder

actor, tokenizer = load_actor(warm_start)  # fp32, full precision
prompts = PromptBuilder("auto", tokenizer)
engine, _ = RolloutEngine.from_actor(actor, tokenizer, tempfile.mkdtemp(), quant_fmt="int8",
                                     platform=Platform.detect(), seed=0, max_model_len=128)
print("engine:", engine.engine_format, "W8A8; unquantized parts in", engine.dtype)

G = 8
problems = train_problems[:4]
groups = engine.generate([prompts.ids(p) for p in problems], n=G, temperature=cfg.temperature,
                         max_tokens=cfg.max_new_tokens, stop_token_ids=[tokenizer.eos_token_id])
rollouts = [r for group in groups for r in group]
texts = [tokenizer.decode(r.response_ids, skip_special_tokens=True) for r in rollouts]
print(repr(prompts.text(problems[0])), "target", problems[0].target)
pd.DataFrame({"response": texts[:G], "tokens": [len(r.response_ids) for r in rollouts[:G]],
              "sum of log pi_behav": [round(sum(r.behav_logprobs), 3) for r in rollouts[:G]]})
"""),
    ("md", r"""
## 2. Reward and advantages: `data.reward`, `advantages.grpo_advantages`

The reward is 1 for an exact match of the number after `####`, else 0. GRPO's advantage is the
group-normalized reward, (r - mean) / (std + eps), given to every token of the response. The warm
start's teacher was sloppy and is often one too high, so most groups hold both right and wrong answers.
A group with all right or all wrong answers has zero advantages: DAPO's dynamic sampling drops such a
group (judged on accuracy, `advantages.informative_groups`) and samples another prompt.
"""),
    ("code", r"""
from qurl_mini.advantages import grpo_advantages, informative_groups
from qurl_mini.data import reward

rewards = torch.tensor([reward(t, problems[i // G]) for i, t in enumerate(texts)])
advantages = grpo_advantages(rewards, G)
print("rewards per group:\n", rewards.view(-1, G))
print("advantages per group:\n", advantages.view(-1, G).round(decimals=2))
print("groups DAPO would keep:", informative_groups(rewards, G).tolist())
"""),
    ("md", r"""
## 3. The actor's log-probs: `actor.token_logprobs` gives pi_prox

The sampled rows are packed (prompt + response, right-padded; `batch.pack_sequences`, whose docstring draws
which position's logit scores which token) and the fp32 actor scores every response token at the rollout's
temperature: log pi_prox. GRPO's advantage goes to every response token (`ADVANTAGE_ESTIMATORS`, as
`Trainer.step` calls it). The engine's log-probs are laid out the same way
(`batch.align_per_token`). rho = pi_prox / pi_behav is how much more (or less) likely the
full-precision policy finds a token than the INT8 sampler did. `loss.sampler_mismatch` sums that gap up
over the step's tokens. KL(behav‖prox) is estimated two ways:
- **k1** = mean log(pi_behav / pi_prox): unbiased but noisy, and negative when the two policies are this close;
- **k3** = mean (rho - 1 - log rho): never negative.

The trainer logs both (`kl_behav_prox`, `kl_behav_prox_k3`), and `curves.png` draws both, labelled.
"""),
    ("code", r"""
from qurl_mini.actor import token_logprobs
from qurl_mini.advantages import ADVANTAGE_ESTIMATORS
from qurl_mini.batch import align_per_token, pack_sequences
from qurl_mini.loss import sampler_mismatch

prompt_ids = [r.prompt_ids for r in rollouts]
seq = pack_sequences(prompt_ids, [r.response_ids for r in rollouts], tokenizer.pad_token_id)
mask = seq.response_mask  # 1 where the target token is a response token
behav_logp = align_per_token([r.behav_logprobs for r in rollouts], prompt_ids, seq.input_ids.shape[1])
with torch.no_grad():
    prox_logp = token_logprobs(actor, seq.input_ids, seq.attention_mask, cfg.temperature, only=mask)
rho = torch.exp(prox_logp - behav_logp)
A, _ = ADVANTAGE_ESTIMATORS["group"](rewards, mask, None, cfg)  # per token: the group's advantage on each

row = 0
at = mask[row].bool()
print(pd.DataFrame({"token": [tokenizer.decode([t]) for t in seq.input_ids[row, 1:][at].tolist()],
                    "pi_behav (INT8)": behav_logp[row][at].exp().numpy().round(4),
                    "pi_prox (fp32)": prox_logp[row][at].exp().numpy().round(4),
                    "rho": rho[row][at].numpy().round(4)}).to_string(index=False))
{k: f"{v:.3g}" for k, v in sampler_mismatch(prox_logp, behav_logp, mask, cfg.tis_cap).items()}
"""),
    ("md", r"""
## 4. The objectives on the same tokens: `loss.policy_loss`

Every objective is one weighted PPO surrogate, weight * min(ratio * A, clip(ratio, low, high) * A), and
`loss.POLICY_OBJECTIVES` maps `--objective` to the function that picks the pieces (`loss.py`, one function
per equation). The paper's five (the field's four corrections sit beside them in the same table):

| `--objective` | equation | weight | ratio | upper bound |
|---|---|---|---|---|
| `ppo` | Eq. 1 | 1 | R | 1 + eps |
| `naive` | Eq. 3 | 1 | R_hat | 1 + eps |
| `decoupled` | Eq. 4 | rho | R | 1 + eps |
| `tis` | Eq. 5 (FlashRL) | min(rho, C) | R | 1 + eps |
| `acr` | Eq. 9 (QuRL) | min(rho, C) | R | (1 + eps) / r, with r = 1 / max(1, rho / C) |

Before the first optimizer step pi_theta = pi_prox, so R = 1 and the objectives that clip on R clip nothing;
naive clips on R_hat = pi_theta / pi_behav, which is rho there, so a token whose rho already lies outside
[1 - eps, 1 + eps] is clipped from the start (the range of rho printed above says whether this batch has one;
how far INT8's rho strays depends on the CPU's kernel). The trainer takes
several minibatch steps per rollout batch, and from the second on pi_theta has moved. Here we take four
AdamW steps on the ACR objective (lr 1e-3, ten times the demo's, so that more tokens reach the bounds),
then score the same tokens under each objective. A token is clipped when the min takes the clipped
branch: A > 0 and the ratio above the upper bound, or A < 0 and the ratio below the lower bound. Its
gradient is then zero.
"""),
    ("code", r"""
from qurl_mini.loss import POLICY_OBJECTIVES, policy_loss

EPS, C = 0.2, cfg.tis_cap
settings = dict(clip_low=EPS, clip_high=EPS, tis_cap=C, agg="seq-mean-token-mean")
policy = copy.deepcopy(actor)  # pi_theta
optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3, weight_decay=0.0)
for _ in range(4):
    loss = policy_loss(token_logprobs(policy, seq.input_ids, seq.attention_mask, cfg.temperature, only=mask),
                       prox_logp, behav_logp, A, mask, objective="acr", **settings)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
with torch.no_grad():
    logp = token_logprobs(policy, seq.input_ids, seq.attention_mask, cfg.temperature, only=mask)
R, R_hat = torch.exp(logp - prox_logp), torch.exp(logp - behav_logp)

table = {}
for name in ("ppo", "naive", "decoupled", "tis", "acr"):
    loss = policy_loss(logp, prox_logp, behav_logp, A, mask, objective=name, **settings)
    surrogate = POLICY_OBJECTIVES[name](R, R_hat, rho, EPS, EPS, C)
    above = (surrogate.clipped_above(A) & (mask > 0)).nonzero().tolist()
    below = (surrogate.clipped_below(A) & (mask > 0)).nonzero().tolist()
    table[name] = {"objective value": round(-loss.item(), 5), "clipped above": len(above),
                   "clipped below": len(below), "clipped (row, position), first 3": (above + below)[:3],
                   "same tokens as ppo": above + below == table.get("ppo", {}).get("tokens", above + below),
                   "tokens": above + below}
print(f"{int(mask.sum())} response tokens; R in [{R[mask > 0].min():.3f}, {R[mask > 0].max():.3f}], "
      f"R_hat in [{R_hat[mask > 0].min():.3f}, {R_hat[mask > 0].max():.3f}]")
pd.DataFrame(table).T.drop(columns="tokens")
"""),
    ("md", r"""
`ppo`, `decoupled`, `tis` and `acr` share the ratio R and, while rho stays under C, the same bounds, so
they clip the same tokens. Their values differ by the weight: 1, rho or min(rho, C). `naive` clips on
R_hat = pi_theta / pi_behav = (pi_theta / pi_prox)(pi_prox / pi_behav) = R * rho instead, a ratio that also
carries the sampler's rounding. At INT8, rho stays close to 1
(its range is printed above), so here naive clips the same tokens or nearly so (the last column).

## 5. ACR's widened bound against rho: `loss.objective_acr`

Where the sampler made a token much less likely than the actor does (rho > C), TIS truncates the
weight at C: by Eq. 6-7 that scales the token's term (against Eq. 4) by r = 1 / max(1, rho / C) < 1. Eq. 8 is
where that bites: the truncated term is min(rho, C) R A = rho (r R) A, Eq. 4's term with r R in place of R.
TIS still clips R at 1 + eps, which clips r R at r (1 + eps): where r < 1 the clip range shrinks by r. ACR
(Eq. 9) keeps TIS's weight and clips R at (1 + eps) / r instead, so r R is clipped at 1 + eps again; that
bound grows in proportion to rho / C. So
tokens with A > 0 that TIS would clip keep their gradient. Where rho <= C, r = 1 and ACR is TIS.

By hand, with eps = 0.2 and C = 2: a token with rho = 5 has r = 2 / 5 = 0.4, weight min(5, 2) = 2, and ACR's
upper bound 1.2 / 0.4 = 3.0. If R = 1.5 and A = +1, TIS clips it at 1.2 (no gradient) while ACR passes it with
weight 2: its gradient with respect to log pi_theta is weight * R * A = 2 * 1.5 * 1 = 3. At rho = 1e5, the largest
the paper saw (Fig. 3b), the bound is 1.2 * 1e5 / 2 = 6e4. `loss.py` gives the same numbers:
"""),
    ("code", r"""
import math

from qurl_mini.loss import objective_acr, policy_objective


def on_one_token(objective, rho_value, R_value, A_value):
    # loss.py's weight, upper bound and d(objective)/d(log pi_theta) on one token; pi_prox = e^-1, the rest from it
    prox = torch.tensor([[-1.0]])
    logp = (prox + math.log(R_value)).requires_grad_(True)
    args = dict(objective=objective, clip_low=EPS, clip_high=EPS, tis_cap=C)
    value = policy_objective(logp, prox, prox - math.log(rho_value), torch.tensor([[A_value]]), torch.ones(1, 1), **args)
    surrogate = POLICY_OBJECTIVES[objective](torch.tensor(R_value), None, torch.tensor(rho_value), EPS, EPS, C)
    return {"weight": float(surrogate.weight), "upper bound on R": float(surrogate.high),
            "d objective / d log pi_theta": torch.autograd.grad(value.sum(), logp)[0].item()}


print("rho = 5, R = 1.5, A = +1:")
print(pd.DataFrame({name: on_one_token(name, 5.0, 1.5, +1.0) for name in ("tis", "acr")}).T.to_string())
far = objective_acr(torch.ones(1), None, torch.tensor([1e5]), EPS, EPS, C).high.item()
print(f"rho = 1e5: ACR's upper bound (1 + eps) / r = {far:.4g}")
"""),
    ("md", r"""
A live token: of this batch's response tokens with A > 0 (the sign where ACR's bound matters), the one with the
largest rho. If its rho is not above C (INT8 on this model keeps rho near 1), we construct one from it, as if the
INT8 sampler had given it a fifth of pi_prox (rho = 5). Its A is its own, and R is the four-step policy's of
section 4.
"""),
    ("code", r"""
i, t = divmod((rho * mask * (A > 0)).flatten().argmax().item(), rho.shape[1])
live_rho, constructed = rho[i, t].item(), rho[i, t].item() <= C
if constructed:
    live_rho = 5.0  # pi_behav := pi_prox / 5
R_live, A_live = R[i, t].item(), A[i, t].item()
print(f"token {tokenizer.decode([seq.input_ids[i, t + 1].item()])!r} of row {i}: pi_prox {prox_logp[i, t].exp():.4f}, "
      f"sampled rho {rho[i, t]:.4f}" + (f" -> constructed rho {live_rho}" if constructed else "")
      + f"; A = {A_live:+.3f}, R = {R_live:.4f} after section 4's steps")
print(pd.DataFrame({name: on_one_token(name, live_rho, R_live, A_live) for name in ("tis", "acr")}).T.to_string())
"""),
    ("md", r"""
Below are both upper bounds against rho up to the paper's 1e5, with the worked token, the live one, and the
rho of every response token sampled above.
"""),
    ("code", r"""
grid = torch.logspace(-0.3, 5.0, 400)
ones = torch.ones_like(grid)
fig, ax = plt.subplots(figsize=(7, 3.4))
ax.plot(grid, objective_acr(ones, ones, grid, EPS, EPS, C).high, label="ACR upper bound (1 + eps) / r")
ax.plot(grid, torch.full_like(grid, 1 + EPS), "--", label="TIS / PPO upper bound 1 + eps")
ax.axvline(C, color="grey", lw=0.8)
ax.text(C * 1.1, 2e3, "rho = C")
ax.plot([5, 1e5], [3.0, far], "o", color="tab:red", label="worked: rho = 5 -> 3.0; rho = 1e5 -> 6e4")
ax.plot([live_rho], [objective_acr(ones[:1], ones[:1], torch.tensor([live_rho]), EPS, EPS, C).high.item()], "s",
        color="tab:green", label="the live token" + (" (constructed)" if constructed else ""))
live = rho[mask > 0]
ax.plot(live, torch.full_like(live, 1.0), "|", color="black", ms=14, label=f"rho of the {live.numel()} sampled tokens")
ax.set_xscale("log"), ax.set_yscale("log"), ax.set_xlabel("rho = pi_prox / pi_behav"), ax.set_ylabel("upper clip bound on R")
ax.legend(loc="upper left", fontsize=8)
plt.show()
print(f"rho of the sampled tokens: {live.min():.3f} .. {live.max():.3f}; above C = {C}: {int((live > C).sum())}")
"""),
    ("md", r"""
At INT8 on this model, rho stays far below C, so ACR's bound is never widened and Eq. 9 gives the same
run as Eq. 5. The replay measured this across whole runs ([docs/replay.md](../docs/replay.md)). Coarser
rollout formats push rho past C; [docs/results/mismatch.md](../docs/results/mismatch.md) trains through
those formats.

## 6. UAQ: the same function, more of each update survives quantization: `uaq.apply_uaq`

UAQ (Eq. 11) divides the input columns of q/k/v and gate/up by s and multiplies the RMSNorm in front of
them by s. Only projections right after an RMSNorm can absorb the s on the activations (the paper's
Fig. 5): o_proj and down_proj are not rescaled. The network computes the same function:
"""),
    ("code", r"""
from qurl_mini.uaq import FOLDS, apply_uaq, rescaled_share

scaled = apply_uaq(copy.deepcopy(actor), 1.5)
with torch.no_grad():
    a = actor(input_ids=seq.input_ids, attention_mask=seq.attention_mask).logits
    b = scaled(input_ids=seq.input_ids, attention_mask=seq.attention_mask).logits
print(f"largest logit difference, s = 1 vs s = 1.5: {(a - b).abs().max():.2e} (logits up to {a.abs().max():.1f})")
"""),
    ("md", r"""
What changes is what one optimizer step does to the INT8 codes. Below, one AdamW step on the ACR loss of
this batch at lr 1e-5, for s = 1 and s = 1.5. `metrics.WeightUpdateMonitor` measures what the trainer logs
at every sync: the share of INT8 codes that changed, Eq. 13 (||dW||^2 / ||W||^2) and Eq. 14
(||Q(W) - W||^2 / ||W||^2).

AdamW's step is about lr per weight whatever the gradient's scale: it divides by the gradient's running
RMS. So UAQ's s-times larger gradient does **not** move the weights further. (That is Eq. 12's argument,
and it holds for SGD.) The rescaled weights and their per-channel grid step (amax / 127) shrink by s,
while the step stays the same. The step therefore covers s times more grid steps, and more codes flip.
"""),
    ("code", r"""
import json

from qurl_mini.engine import engine_tensors
from qurl_mini.metrics import WeightUpdateMonitor


def one_adamw_step(s, lr=1e-5):
    # UAQ with scale s, then one AdamW step; the monitor compares the INT8 codes before and after
    model = apply_uaq(copy.deepcopy(actor), s)
    monitor = WeightUpdateMonitor()
    monitor.measure(model, engine_tensors(model, "int8")[1])
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    loss = policy_loss(token_logprobs(model, seq.input_ids, seq.attention_mask, cfg.temperature, only=mask),
                       prox_logp, behav_logp, A, mask, objective="acr", **settings)
    loss.backward()
    optimizer.step()
    return monitor.measure(model, engine_tensors(model, "int8")[1])


steps = {s: one_adamw_step(s) for s in (1.0, 1.5)}
print(pd.DataFrame(steps).T.rename_axis("s").to_string(float_format="{:.3g}".format))
f = rescaled_share(actor)
rescaled = {name.split(".")[-1] for _, projections in FOLDS for name in projections}  # q/k/v, gate/up
projections = {n: p.numel() for n, p in actor.named_parameters() if n.endswith("proj.weight")}
elements = sum(size for n, size in projections.items() if n.split(".")[-2] in rescaled)
total = sum(projections.values())
print(f"\nrescaled projections: {elements / total:.1%} of the quantized weights, {f:.1%} of their squared norm")
print(f"codes changed, s = 1.5 vs s = 1: {steps[1.5]['codes_changed_frac'] / steps[1.0]['codes_changed_frac']:.2f}x")
print(f"Eq. 13, s = 1.5 vs s = 1: {steps[1.5]['weight_update_norm'] / steps[1.0]['weight_update_norm']:.3f}x; "
      f"AdamW predicts 1 / (f / s^2 + 1 - f) = {1 / (f / 1.5 ** 2 + 1 - f):.3f}x")
"""),
    ("md", r"""
Eq. 13 is a ratio of squared norms. Under AdamW its numerator (the update) stays the same, while the
rescaled projections, a share f of ||W||^2, shrink by s^2. So Eq. 13 grows by 1 / (f / s^2 + 1 - f): it
would be s^2 = 2.25 if every projection were rescaled (f = 1), and under SGD the update would grow too.
A code flips with a chance about proportional to
update / grid step. That ratio grows by s on the rescaled share of the weights and not at all on o_proj
and down_proj, so the codes changed grow by share * s + 1 - share. The replay measured both over 8 RL
steps of training ([docs/replay.md](../docs/replay.md)). Here they are against these predictions from
the warm start's shares:
"""),
    ("code", r"""
replay = json.load(open(REPO / "docs" / "results" / "replay.json"))["uaq"]


def mean(row, key):
    values = [m[key] for m in replay[row] if m.get(key) is not None]
    return sum(values) / len(values)


share = elements / total
pd.DataFrame({f"s = {s}": {
    "Eq. 13 growth, measured": mean(f"s={s}", "weight_update_norm") / mean("s=1", "weight_update_norm"),
    "Eq. 13 growth, AdamW: 1 / (f / s^2 + 1 - f)": 1 / (f / s ** 2 + 1 - f),
    "codes changed growth, measured": mean(f"s={s}", "codes_changed_frac") / mean("s=1", "codes_changed_frac"),
    "codes changed growth, AdamW: share * s + 1 - share": share * s + 1 - share,
} for s in (1.5, 2)}).round(2)
"""),
    ("md", r"""
## 7. Quantize and sync: `RolloutEngine.sync_weights`

The last phase of a step quantizes the updated actor again and writes the codes into the live engine in
place. The next rollout then samples from the new policy. Here the engine takes the four-step policy
of section 4, and its log-probs of the sampled tokens move with it:
"""),
    ("code", r"""
from qurl_mini.sync_probe import mean_abs_gap

engine.sync_weights(policy)  # int8 codes + scales of the updated actor, into the live engine

response = mask[row] > 0
before = mean_abs_gap(behav_logp[row][response], logp[row][response])
engine_logp = torch.tensor(engine.prompt_logprobs([seq.input_ids[row][seq.attention_mask[row] > 0].tolist()])[0])
n = len(engine_logp)
after = mean_abs_gap(engine_logp[response[:n]], logp[row][:n][response[:n]])
print(f"mean |log-prob gap| between the engine and the updated actor on row {row}'s response: "
      f"before the sync {before:.4f}, after {after:.4f}")
"""),
    ("md", r"""
That was one step. `Trainer.step` runs these phases in this order for `--steps` steps, with minibatches,
PPO epochs, the KL penalty, logging, checkpoints and the sync probe around them. `make demo` runs 40 of
them in about two minutes on a 2-core CPU (the README gives the machine). The [README](../README.md) maps each phase and equation to
its function, and [docs/](../docs/) covers the rest.
"""),
]


def build(run: bool) -> None:
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata.update({"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
                        "language_info": {"name": "python"}})
    nb.cells = [nbformat.v4.new_markdown_cell(src.strip()) if kind == "md" else nbformat.v4.new_code_cell(src.strip())
                for kind, src in CELLS]
    if run:
        from nbclient import NotebookClient

        t0 = time.time()
        NotebookClient(nb, timeout=900, kernel_name="python3", record_timing=False,  # no timestamps to diff
                       resources={"metadata": {"path": HERE}}).execute()
        print(f"executed in {time.time() - t0:.0f} s", file=sys.stderr)
    nbformat.write(nb, OUT)
    print(OUT)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--no-run", action="store_true", help="write the notebook without executing it")
    build(run=not p.parse_args().no_run)
