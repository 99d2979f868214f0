"""QuRL's losses inside the real verl (qurl_mini/integrations/verl_plugin.py), on CPU, without Ray or GPUs.

verl pins other versions than .venv, so `make test` builds .venv-verl (verl==0.9.1 plus this project,
editable: the `verl.plugins` entry point exists) and, from the main suite, `test_inside_the_verl_env`
reruns this file there. Everything goes through verl's own code: hydra config with docs/verl.md's
overrides, its rollout correction (rho from old and rollout log-probs), its `ppo_loss` call site.
"""
import functools
import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
VERL_PYTHON = ROOT / ".venv-verl" / "bin" / "python"
HAVE_VERL = importlib.util.find_spec("verl") is not None
in_verl_env = pytest.mark.skipif(not HAVE_VERL, reason="needs verl: test_inside_the_verl_env runs it in .venv-verl")

# docs/verl.md's `main_ppo` command, one override per line (data paths are the user's)
OVERRIDES = """
    algorithm.adv_estimator=grpo
    data.train_files=$TRAIN_PARQUET
    data.val_files=$VAL_PARQUET
    data.train_batch_size=512
    actor_rollout_ref.rollout.n=16
    actor_rollout_ref.model.path=$UAQ_CKPT
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.clip_ratio_low=0.2
    actor_rollout_ref.actor.clip_ratio_high=0.28
    actor_rollout_ref.actor.loss_agg_mode=token-mean
    actor_rollout_ref.actor.use_kl_loss=False
    algorithm.use_kl_in_reward=False
    actor_rollout_ref.actor.ppo_mini_batch_size=32
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.quantization=fp8
    actor_rollout_ref.rollout.calculate_log_probs=True
    algorithm.rollout_correction.rollout_is=token
    algorithm.rollout_correction.rollout_is_threshold=1e9
    algorithm.rollout_correction.bypass_mode=False
    actor_rollout_ref.actor.policy_loss.loss_mode=qurl_acr
    actor_rollout_ref.actor.policy_loss._target_=qurl_mini.integrations.verl_plugin.QuRLPolicyLossConfig
    +actor_rollout_ref.actor.policy_loss.tis_cap=2.0
    trainer.n_gpus_per_node=8
    trainer.nnodes=1
    trainer.total_training_steps=200
""".split()
C, EPS_LOW, EPS_HIGH = 2.0, 0.2, 0.28


@pytest.mark.skipif(HAVE_VERL, reason="this is the verl env itself")
def test_inside_the_verl_env():
    if not VERL_PYTHON.exists():
        if os.environ.get("QURL_REQUIRE_VERL"):
            pytest.fail(f"{VERL_PYTHON} is missing: `make verl-env` builds it")
        pytest.skip("no .venv-verl (`make verl-env` builds it; `make test` does)")
    r = subprocess.run([str(VERL_PYTHON), "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"inside .venv-verl:\n{r.stdout[-8000:]}\n{r.stderr[-3000:]}"
    print(r.stdout.strip().splitlines()[-1])


# --- inside .venv-verl ---------------------------------------------------------------------------


@functools.cache
def verl_config(*extra):
    """verl's ppo_trainer config composed by hydra, as `python -m verl.trainer.main_ppo OVERRIDES` would."""
    import verl
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"),
                               version_base=None):
        return compose(config_name="ppo_trainer", overrides=[*OVERRIDES, *extra])


def actor_config(*extra):
    """A fresh ActorConfig, built the way verl's worker builds it (ppo_loss writes into it)."""
    from verl.utils.config import omega_conf_to_dataclass

    return omega_conf_to_dataclass(verl_config(*extra).actor_rollout_ref.actor)


@in_verl_env
def test_a_plain_import_verl_registers_the_losses(tmp_path):
    code = ("import sys, verl; from importlib.metadata import entry_points; "
            "from verl.trainer.ppo.core_algos import get_policy_loss_fn as f; "
            "print([(e.name, e.value) for e in entry_points(group='verl.plugins')]); "
            "print(f('qurl_acr').__module__, f('qurl_acr').__name__, f('qurl_tis').__name__)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env,
                       timeout=300)  # cwd elsewhere: qurl_mini comes from the installed distribution only
    assert r.returncode == 0, r.stderr
    entry_points, names = r.stdout.strip().splitlines()[-2:]
    assert "('qurl', 'qurl_mini.integrations.verl_plugin')" in entry_points
    assert names == "qurl_mini.integrations.verl_plugin qurl_acr_loss qurl_tis_loss"


@in_verl_env
@pytest.mark.filterwarnings("ignore:Disabled critic")  # GRPO: no critic, as intended
def test_the_readme_overrides_make_valid_verl_configs():
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    from qurl_mini.integrations.verl_plugin import QuRLPolicyLossConfig

    cfg = verl_config()
    validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    actor = actor_config()
    assert type(actor.policy_loss) is QuRLPolicyLossConfig and actor.policy_loss.tis_cap == C
    assert actor.policy_loss.loss_mode == "qurl_acr" and (actor.clip_ratio_low, actor.clip_ratio_high) == (0.2, 0.28)
    correction = omega_conf_to_dataclass(cfg.algorithm).rollout_correction
    assert correction["rollout_is"] == "token" and correction["bypass_mode"] is False
    assert correction["rollout_is_threshold"] > math.exp(20)  # above verl's clamp of log rho: untruncated
    assert omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout).quantization == "fp8"
    with pytest.raises(Exception, match=r"policy_loss.tis_cap must be >= 1 .* got 0.5"):
        actor_config("actor_rollout_ref.actor.policy_loss.tis_cap=0.5")


@in_verl_env
def test_verl_reads_a_uaq_checkpoint(tmp_path):
    import quantize
    from transformers import AutoModelForCausalLM
    from verl.workers.config import HFModelConfig

    from qurl_mini.embedded import build_tiny_model

    src = build_tiny_model(str(tmp_path / "in"), layers=1, hidden=64, heads=2, kv_heads=1)
    out = str(tmp_path / "uaq")
    assert quantize.main(["--model", src, "--fmt", "none", "--uaq-scale", "1.5", "--out", out]) == 0
    assert HFModelConfig(path=out).hf_config.uaq_scale == 1.5  # what verl's workers build from model.path
    ids = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = (AutoModelForCausalLM.from_pretrained(d)(ids).logits for d in (src, out))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_verl_doc_has_these_overrides():
    doc = (ROOT / "docs" / "verl.md").read_text()
    assert [o for o in OVERRIDES if o not in re.findall(r"\S+", doc)] == []


# Four rows of five response tokens; row 2 was emptied (its response_mask zeroed, as verl's rejection
# sampling does); prompts of different lengths, left-padded, as verl's batches are.
PROMPT_LENS, RESPONSE_LENS, P, T = [2, 3, 1, 2], [5, 3, 4, 2], 3, 5


def tokens(seed=0):
    """(log pi_theta leaf, log pi_prox, log pi_behav, A, mask); rho = pi_prox/pi_behav goes well above C."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[float(t < n) for t in range(T)] for n in RESPONSE_LENS])
    mask[2] = 0
    prox = -0.1 - 2 * torch.rand(4, T, generator=g)
    behav = prox - 1.5 * torch.randn(4, T, generator=g)
    logp = prox + 0.25 * torch.randn(4, T, generator=g)
    A = torch.tensor([1.0, -0.7, 0.4, -1.3])[:, None].expand(4, T).clone()
    # hand-made tokens: (0, 0) rho = 4 > C with A > 0 and R = 2.0, between 1 + eps and (1 + eps) / r = 2.56
    behav[0, 0], logp[0, 0] = prox[0, 0] - math.log(4.0), prox[0, 0] + math.log(2.0)
    # (1, 1) A < 0 with R = 4, above vanilla's dual-clip constant clip_ratio_c = 3
    logp[1, 1] = prox[1, 1] + math.log(4.0)
    return logp.requires_grad_(), prox, behav, A, mask


def verl_rollout_is_weights(prox, behav, mask, *overrides):
    """rho as verl's trainer computes it from old_log_probs and the vLLM rollout_log_probs, with its
    `algorithm.rollout_correction` config (docs/verl.md's: untruncated)."""
    from verl import DataProto
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch

    batch = DataProto.from_dict(tensors={"old_log_probs": prox, "rollout_log_probs": behav, "response_mask": mask})
    batch, _ = compute_rollout_correction_and_add_to_batch(batch, verl_config(*overrides).algorithm.rollout_correction)
    return batch.batch["rollout_is_weights"]


def verl_ppo_loss(config, logp, prox, A, mask, weights, rows, *, batch_num_tokens, global_batch_size):
    """verl.workers.utils.losses.ppo_loss on the micro-batch `rows`: a TensorDict as verl's FSDP engine
    hands it over, with log-probs as the model's flat (no-padding) output."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss

    attention = torch.zeros(len(rows), P + T, dtype=torch.long)
    pieces = []
    for i, row in enumerate(rows):
        p, n = PROMPT_LENS[row], RESPONSE_LENS[row]
        attention[i, P - p:P + n] = 1
        # model output at position j scores token j + 1: response token t sits at p - 1 + t
        pieces += [torch.zeros(p - 1), logp[row, :n], torch.zeros(1)]
    data = TensorDict({"prompts": torch.ones(len(rows), P, dtype=torch.long),
                       "responses": torch.ones(len(rows), T, dtype=torch.long), "attention_mask": attention,
                       "response_mask": mask[rows], "old_log_probs": prox[rows], "advantages": A[rows],
                       "rollout_is_weights": weights[rows]}, batch_size=[len(rows)])
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=batch_num_tokens, global_batch_size=global_batch_size)
    loss, metrics = ppo_loss(config, {"log_probs": torch.cat(pieces)}, data)
    return loss, {k: m.aggregate() for k, m in metrics.items()}


def qurl_mini_loss(objective, logp, prox, behav, A, mask, agg="token-mean"):
    from qurl_mini.loss import policy_loss, policy_stats

    objective = dict(objective=objective, clip_low=EPS_LOW, clip_high=EPS_HIGH, tis_cap=C)
    loss, stats = policy_loss(logp, prox, behav, A, mask, agg=agg, **objective), policy_stats(logp, prox, behav, A,
                                                                                             mask, **objective)
    grad, = torch.autograd.grad(loss, logp)
    return loss.item(), grad, stats


@in_verl_env
def test_acr_through_verl_equals_qurl_mini_over_two_micro_batches():
    logp, prox, behav, A, mask = tokens()
    weights = verl_rollout_is_weights(prox, behav, mask)
    assert (weights[mask > 0] > C).sum() >= 3 and weights[2].abs().sum() == 0  # truncation matters; empty row
    config = actor_config()  # loss_mode=qurl_acr, tis_cap 2, eps 0.2 / 0.28, token-mean: docs/verl.md's
    total = 0.0
    for rows in ([0, 1], [2, 3]):  # one mini-batch as two micro-batches, normalized by its token count
        loss, _ = verl_ppo_loss(config, logp, prox, A, mask, weights, rows, batch_num_tokens=int(mask.sum()),
                                global_batch_size=4)
        total = total + loss
    grad, = torch.autograd.grad(total, logp)
    want_loss, want_grad, _ = qurl_mini_loss("acr", logp, prox, behav, A, mask)
    assert total.item() == pytest.approx(want_loss, rel=1e-6, abs=1e-7)
    torch.testing.assert_close(grad, want_grad, rtol=1e-6, atol=1e-7)
    # token (0, 0) by hand: rho = 4 > C, r = 1/2, R = 2 < (1 + 0.28) / r: ACR keeps -C * R * A / N
    assert grad[0, 0].item() == pytest.approx(-C * 2.0 * 1.0 / mask.sum().item(), rel=1e-5)
    assert grad[2].abs().sum() == 0


@in_verl_env
def test_acr_metrics_and_sequence_mean_through_verl():
    logp, prox, behav, A, mask = tokens(seed=1)
    weights = verl_rollout_is_weights(prox, behav, mask)
    config = actor_config("actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean")
    loss, metrics = verl_ppo_loss(config, logp, prox, A, mask, weights, [0, 1, 2, 3], batch_num_tokens=None,
                                  global_batch_size=3)  # the non-empty rows, as qurl_mini averages
    grad, = torch.autograd.grad(loss, logp)
    want_loss, want_grad, stats = qurl_mini_loss("acr", logp, prox, behav, A, mask, agg="seq-mean-token-mean")
    assert loss.item() == pytest.approx(want_loss, rel=1e-6)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-7)
    assert stats["tis_trunc_frac"] > 0 and stats["clip_rescued_frac"] > 0 and stats["rho_max"] > C
    for name, value in stats.items():
        assert metrics[f"actor/{name}"] == pytest.approx(value, rel=1e-5, abs=1e-7), name
    # verl's own global_batch_size counts the emptied row too (ppo_mini_batch_size * n): the mean is over 4
    counted, _ = verl_ppo_loss(actor_config("actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"), logp,
                               prox, A, mask, weights, [0, 1, 2, 3], batch_num_tokens=None, global_batch_size=4)
    assert counted.item() == pytest.approx(want_loss * 3 / 4, rel=1e-6)


@in_verl_env
def test_qurl_tis_equals_verl_vanilla_with_token_tis_at_the_same_cap():
    logp, prox, behav, A, mask = tokens(seed=2)
    untruncated = verl_rollout_is_weights(prox, behav, mask)
    truncated = verl_rollout_is_weights(prox, behav, mask, f"algorithm.rollout_correction.rollout_is_threshold={C}")
    assert torch.equal(truncated, untruncated.clamp(max=C))

    def loss_and_grad(weights, *overrides):
        loss, _ = verl_ppo_loss(actor_config(*overrides), logp, prox, A, mask, weights, [0, 1, 2, 3],
                                batch_num_tokens=int(mask.sum()), global_batch_size=4)
        return (loss.item(), *torch.autograd.grad(loss, logp))

    tis = loss_and_grad(untruncated, "actor_rollout_ref.actor.policy_loss.loss_mode=qurl_tis")
    # vanilla with dual-clip off (Eq. 5 has none): clip_ratio_c only applies to A < 0 with ratio > c
    vanilla = loss_and_grad(truncated, "actor_rollout_ref.actor.policy_loss.loss_mode=vanilla",
                            "actor_rollout_ref.actor.clip_ratio_c=1e9")
    assert tis[0] == pytest.approx(vanilla[0], rel=1e-6)
    torch.testing.assert_close(tis[1], vanilla[1], rtol=1e-6, atol=1e-7)
    want_loss, want_grad, _ = qurl_mini_loss("tis", logp, prox, behav, A, mask)
    assert tis[0] == pytest.approx(want_loss, rel=1e-6)
    # with verl's default clip_ratio_c = 3, token (1, 1) (A < 0, R = 4) is dual-clipped: no gradient there
    dual_clip = loss_and_grad(truncated, "actor_rollout_ref.actor.policy_loss.loss_mode=vanilla")
    assert dual_clip[1][1, 1] == 0 and tis[1][1, 1] != 0
    acr = loss_and_grad(untruncated)  # and ACR differs from TIS exactly where rho > C widened the bound
    differs = (acr[1] != tis[1])
    assert differs.any() and (untruncated[differs] > C).all()


@in_verl_env
def test_acr_without_rollout_is_weights_is_a_one_line_error():
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    logp, prox, behav, A, mask = tokens()
    with pytest.raises(ValueError, match=r"^loss_mode=qurl_acr needs verl's rollout_is_weights .*rollout_is=token"):
        get_policy_loss_fn("qurl_acr")(old_log_prob=prox, log_prob=logp, advantages=A, response_mask=mask.bool(),
                                       loss_agg_mode="token-mean", config=actor_config(), rollout_is_weights=None)
