"""The run-time sync probe: a sync that did not land stops the run on step 1 with one line."""
import json

import pytest
import torch

from qurl_mini.sync_probe import SyncError, SyncProbe

# ----- the decision, on made-up log-probs ------------------------------------------------------

ACTOR_BEFORE = torch.linspace(-3.0, -0.1, 50)
UPDATE = 0.05 * torch.sin(torch.arange(50.0))  # what one step changed in the actor's log-probs
NOISE = 0.01 * torch.cos(7 * torch.arange(50.0))  # the engine's quantization noise


def calibrated_probe():
    probe = SyncProbe(sequence=list(range(51)), every=10)
    probe.calibrate(ACTOR_BEFORE + NOISE, ACTOR_BEFORE)
    return probe


def test_a_sync_that_landed_passes_and_reports_both_gaps():
    probe = calibrated_probe()
    after = ACTOR_BEFORE + UPDATE
    stats = probe.check(1, after + NOISE, after, ACTOR_BEFORE)
    assert stats["sync_probe_gap"] == pytest.approx(NOISE.abs().mean().item(), rel=1e-5)
    assert stats["sync_probe_gap_before"] == pytest.approx((UPDATE + NOISE).abs().mean().item(), rel=1e-5)


def test_stale_weights_are_caught():
    probe = calibrated_probe()
    with pytest.raises(SyncError, match="step 1: the rollout engine did not take the new weights.*old weights"):
        probe.check(1, ACTOR_BEFORE + NOISE, ACTOR_BEFORE + UPDATE, ACTOR_BEFORE)


def test_stale_weights_are_caught_where_quantization_noise_is_as_large_as_an_update():
    """INT8 on an AVX2-only CPU: the start gap (~0.05 nats) is as large as one step's change, so the gaps alone
    cannot tell; an engine whose log-probs did not move while the actor's did still holds the old weights."""
    probe = SyncProbe(sequence=list(range(51)), every=10)
    loud = 5 * NOISE
    probe.calibrate(ACTOR_BEFORE + loud, ACTOR_BEFORE)
    with pytest.raises(SyncError, match="moved 0.00e\\+00, the actor's .*old weights"):
        probe.check(1, ACTOR_BEFORE + loud, ACTOR_BEFORE + UPDATE, ACTOR_BEFORE)
    after = ACTOR_BEFORE + UPDATE  # the same noise, but the sync landed: it passes, and the next check compares
    probe.check(1, after + loud, after, ACTOR_BEFORE)  # with this step's log-probs
    with pytest.raises(SyncError, match="old weights"):
        probe.check(10, after + loud, after + UPDATE, after)


def test_garbage_and_nan_are_caught():
    probe = calibrated_probe()
    after = ACTOR_BEFORE + UPDATE
    with pytest.raises(SyncError, match=r"over \d\.\d+e-02 = 5 x the"):
        probe.check(3, after + 10 * NOISE + 0.2, after, ACTOR_BEFORE)
    with pytest.raises(SyncError, match="not finite"):
        probe.check(3, torch.full_like(after, float("nan")), after, ACTOR_BEFORE)


def test_schedule_and_the_floor_of_an_exact_engine():
    probe = SyncProbe(sequence=[0, 1], every=10)
    assert [s for s in range(1, 31) if probe.due(s)] == [1, 10, 20, 30]
    assert not SyncProbe(sequence=[0, 1], every=0).due(1)
    probe.calibrate(ACTOR_BEFORE, ACTOR_BEFORE)  # an fp32 engine can match exactly: the floor still applies
    assert probe.limit == probe.noise_floor


# ----- real runs: the embedded model, INT8 engine, the sync broken on purpose ------------------------------


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """The embedded model (its cached warm start, as test_e2e's): it earns rewards, so step 1 changes it."""
    import os

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tmp = tmp_path_factory.mktemp("probe")
    return ["--quant", "int8", "--cache-dir", os.path.join(repo, ".cache"), "--out-dir", str(tmp / "runs"),
            "--steps", "2", "--prompts-per-step", "8", "--group-size", "4", "--eval-size", "8", "--save-every", "100"]


# each run is its own process: a second in-process vLLM engine can lose its parallel state when the
# first one is garbage-collected ("pipeline model parallel group is not initialized")
SKIP_THE_WEIGHT_WRITE = "RolloutEngine.load_weights = lambda self, pairs: self.llm.reset_prefix_cache()"
VLLMS_PLAIN_RELOAD = """
import vllm.model_executor.kernels.linear.scaled_mm.cpu as cpu_kernel
cpu_kernel.check_cpu_sgl_kernel = lambda n, k, dtype: False  # oneDNN, the path with the hole, on AMX CPUs too
def plain_reload(self, pairs):  # the hole vllm_cpu_sync fixes (oneDNN's handle reads freed scales)
    self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(pairs)})
    self.llm.reset_prefix_cache()
RolloutEngine.load_weights = plain_reload
"""


def run_main(argv, sync_patch: str = ""):
    """train.py's main(argv) in a fresh process, with the weight sync replaced by `sync_patch`."""
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = (f"import sys\nimport train\nfrom qurl_mini.engine import RolloutEngine\n{sync_patch}\n"
            f"sys.exit(train.main({argv!r}))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stderr.strip().splitlines()


def test_a_working_sync_passes_the_probe_and_logs_it(demo_run):
    """The demo's short run (conftest.py), probed after steps 1, 4 and 8: the engine took every update."""
    with open(demo_run / "metrics.jsonl") as f:
        probed = [r for r in map(json.loads, f) if "sync_probe_gap" in r]
    assert [r["step"] for r in probed] == [1, 4, 8]
    assert all(0 < r["sync_probe_gap"] < r["sync_probe_gap_before"] for r in probed), probed


def test_skipping_the_weight_write_stops_the_run_on_step_1(tiny_run):
    code, err = run_main(tiny_run + ["--run-name", "skipped"], SKIP_THE_WEIGHT_WRITE)
    assert code == 2
    assert err[-1].startswith("error: step 1: the rollout engine did not take the new weights"), err[-3:]
    assert "old weights" in err[-1]


def test_vllms_plain_reload_into_the_cpu_int8_engine_is_caught(tiny_run):
    """The hole vllm_cpu_sync fixes (oneDNN's handle reads freed scales): without the fix, the probe stops it."""
    code, err = run_main(tiny_run + ["--run-name", "plain"], VLLMS_PLAIN_RELOAD)
    print(err[-1])
    assert code == 2
    assert err[-1].startswith("error: step 1: the rollout engine did not take the new weights"), err[-3:]
