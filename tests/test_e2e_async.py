"""``python -m drpo_openrlhf.train --train.async_enable`` on the CPU toy (real Ray, a vLLM CPU
engine, the DeepSpeed actor): OpenRLHF's asynchronous trainer with DRPO's, to its last step.
``pytest -m e2e`` runs it with the other e2e tests."""

from __future__ import annotations

import math

import pytest
from test_e2e_pipeline import changed_tensors, train

from drpo_openrlhf.demo.training import local_ray_cluster
from drpo_openrlhf.eval.tensorboard_logs import read_scalars

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
STEPS = 3


@pytest.fixture(scope="module")
def ray_address():
    with local_ray_cluster(num_gpus=3) as address:
        yield address


def test_async_drpo_trains_to_its_last_step_with_every_sync_checked(toy, ray_address, tmp_path):
    """Queue of one: rollout 1 comes from the starting weights (lag 0, the honest gap measured
    on it); rollout 2 was generated while update 1 ran (lag 1), rollout 3 while update 2 ran,
    after sync 1 (lag 1). Every sync is checked, the probe of sync 1 runs before rollout 3,
    and the lagged rollouts' gap is logged without stopping the run."""
    done = train(toy, tmp_path, "--train.async_enable", ray_address=ray_address, steps=STEPS)
    out = done.output
    assert done.returncode == 0, out[-3000:]
    for step in range(1, STEPS + 1):
        assert f"drpo_openrlhf: weight sync after rollout step {step} checked: 1 engine" in out
        assert f"weight version {step}" in out
    assert "drpo_openrlhf: step 1: correct" in out and ", policy lag 0" in out
    assert "drpo_openrlhf: step 3: correct" in out and ", policy lag 1" in out
    for when in ("before the first rollout", "after rollout step 1"):
        assert f"drpo_openrlhf: weight probe {when}: |vLLM - actor|" in out, when
    assert "drpo_openrlhf: honest rollout log-prob gap" in out  # rollout 1's weights checked

    logged = read_scalars(tmp_path / "tb")
    steps = list(range(1, STEPS + 1))
    assert sorted(logged["train/drpo/objective"]) == steps
    assert all(math.isfinite(v) for v in logged["train/drpo/objective"].values())
    assert logged["train/drpo/policy_lag_max"] == {1: 0.0, 2: 1.0, 3: 1.0}
    assert sorted(logged["train/drpo/rollout_logprob_gap"]) == [1]  # the fresh rollout only
    assert logged["train/drpo/rollout_logprob_gap"][1] < 0.05
    assert sorted(logged["train/drpo/rollout_logprob_gap_lagged"]) == [2, 3]
    assert (tmp_path / "ckpt" / "_actor" / f"global_step{STEPS}").is_dir()
    assert changed_tensors(tmp_path / "model", toy["base"])


def test_partial_rollout_checks_each_sync_while_the_engines_are_paused(toy, ray_address, tmp_path):
    """Generation takes no lock; each sync pauses the engine, loads, checks and tells it the
    new version while paused, then resumes it. Whether a response spans a sync depends on the
    machine's timing: the run logs it, and its versions stay within the lag they can have."""
    flags = ("--train.async_enable", "--train.partial_rollout_enable")
    done = train(toy, tmp_path, *flags, ray_address=ray_address, steps=2)
    out = done.output
    assert done.returncode == 0, out[-3000:]
    for step in (1, 2):
        assert f"drpo_openrlhf: weight sync after rollout step {step} checked: 1 engine" in out
    logged = read_scalars(tmp_path / "tb")
    assert sorted(logged["train/drpo/objective"]) == [1, 2]
    assert (
        logged["train/drpo/policy_lag_max"][1] == 0.0
        and logged["train/drpo/policy_lag_max"][2] <= 1
    )
    assert all(0 <= v <= 1 for v in logged["train/drpo/mixed_version_fraction"].values())
    print("mixed version fraction per step:", logged["train/drpo/mixed_version_fraction"])
