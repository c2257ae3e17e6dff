"""``python -m drpo_openrlhf.train --train.async_enable`` on the CPU toy (real Ray, a vLLM CPU
engine, the DeepSpeed actor): OpenRLHF's asynchronous trainer with DRPO's, to its last step,
then resumed from its checkpoint under partial rollout. ``pytest -m e2e`` runs it with the
other e2e tests."""

from __future__ import annotations

import math

import pytest
from test_e2e_pipeline import changed_tensors, train

from drpo_openrlhf.eval.tensorboard_logs import read_scalars

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
SYNC = "drpo_openrlhf: weight sync {when} checked: 1 engine(s) hold the"


def test_async_drpo_trains_every_sync_checked_then_resumes_under_partial_rollout(
    toy, ray_address, tmp_path
):
    """Queue of one. The first run: rollout 1 comes from the starting weights (lag 0, the
    honest gap measured on it), rollout 2 was generated while update 1 ran (lag 1: its gap
    logged, not held to the limit). The resumed run, under partial rollout (no lock for
    generation: each sync pauses the engine, loads, checks and tells it the version while
    paused): its first sync is checked and probed before its first rollout (lag 0, held to
    the saved honest gap), its second rollout lags again. Whether a response spans a sync
    depends on the machine's timing: logged, within the lag it can have."""
    first = train(toy, tmp_path, "--train.async_enable", ray_address=ray_address, steps=2)
    out = first.output
    assert first.returncode == 0, out[-3000:]
    for step in (1, 2):
        assert SYNC.format(when=f"after rollout step {step}") in out, step
        assert f"hold the 26 tensors sent, weight version {step}" in out
    assert "drpo_openrlhf: step 1: correct" in out and ", policy lag 0 |" in out
    assert "drpo_openrlhf: step 2: correct" in out and ", policy lag 1 |" in out
    assert "drpo_openrlhf: weight probe before the first rollout: |vLLM - actor|" in out
    assert "drpo_openrlhf: honest rollout log-prob gap" in out  # rollout 1's weights checked

    partial = ("--train.async_enable", "--train.partial_rollout_enable", "--ckpt.load_enable")
    resumed = train(toy, tmp_path, *partial, ray_address=ray_address, steps=4)
    out = resumed.output
    assert resumed.returncode == 0, out[-3000:]
    assert "Global step 3:" in out and "Global step 1:" not in out
    when = "at the start of the resumed run"
    assert SYNC.format(when=when) in out and "weight version 2" in out
    assert f"drpo_openrlhf: weight probe {when}: |vLLM - actor|" in out
    assert "drpo_openrlhf: rollout log-prob gap after resuming: engine 0" in out
    for step in (3, 4):
        assert SYNC.format(when=f"after rollout step {step}") in out, step

    logged = read_scalars(tmp_path / "tb")
    assert sorted(logged["train/drpo/objective"]) == [1, 2, 3, 4]
    assert all(math.isfinite(v) for v in logged["train/drpo/objective"].values())
    lag = logged["train/drpo/policy_lag_max"]
    assert lag[1] == 0 and lag[2] == 1 and lag[3] == 0 and lag[4] <= 1, lag
    assert all(0 <= v <= 1 for v in logged["train/drpo/mixed_version_fraction"].values())
    # the fresh rollouts (rollout 4 too if the machine was slow to send it, as that of 3)
    assert sorted(logged["train/drpo/rollout_logprob_gap"]) in ([1, 3], [1, 3, 4])
    assert max(logged["train/drpo/rollout_logprob_gap"].values()) < 0.05
    assert sorted(logged["train/drpo/rollout_logprob_gap_lagged"]) in ([2], [2, 4])
    assert (tmp_path / "ckpt" / "_actor" / "global_step4").is_dir()
    assert changed_tensors(tmp_path / "model", toy["base"])
    print("mixed version fraction per step:", logged["train/drpo/mixed_version_fraction"])
