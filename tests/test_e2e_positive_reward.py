"""``--drpo.positive_reward path/to/file.py`` through ``python -m drpo_openrlhf.train`` on the
CPU toy (real Ray, a vLLM CPU engine, the DeepSpeed actor), in one run: the plugin runs in the
engine on each group's correct responses and its scores reach the actor's loss (steps 1-2),
then it fails (step 3) and the run stops naming it, without training on that rollout.
``pytest -m e2e`` runs it with the other e2e tests."""

from __future__ import annotations

import json
import math

import pytest
from test_e2e_pipeline import assert_drpo_logged, train

from drpo_openrlhf.rewards.grading import grade_responses
from drpo_openrlhf.rewards.positive_reward import PROBE_PROMPT

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
STOP = "drpo_openrlhf: the run stopped: "  # the entry point's last word (Ray's logs may follow)

# Scores of 6 or 7, far from any length reward in [0, 1]: the loss must have used them. Once
# step 2 is saved (so from step 3's generation on) the plugin raises instead.
PLUGIN = """
import json
import os

def positive_reward(texts, lengths, labels, prompt=None):
    if os.path.isdir({fail_after!r}):
        raise RuntimeError("no score for this group")
    with open({log!r}, "a") as log:
        log.write(json.dumps(dict(texts=texts, lengths=lengths, labels=labels, prompt=prompt)))
        log.write("\\n")
    return [7.0 - min(text.count("Wait"), 1) for text in texts]
"""


def test_a_plugin_file_ranks_the_correct_responses_then_its_failure_stops_the_run(
    toy, ray_address, tmp_path
):
    calls = tmp_path / "calls.jsonl"
    plugin = tmp_path / "style.py"
    step2 = tmp_path / "ckpt" / "_actor" / "global_step2"
    plugin.write_text(PLUGIN.format(log=str(calls), fail_after=str(step2)))
    done = train(
        toy, tmp_path, "--drpo.positive_reward", str(plugin), ray_address=ray_address, steps=3
    )
    assert done.returncode == 1, done.output[-3000:]
    stop = [line for line in done.output.splitlines() if line.startswith(STOP)]
    assert stop, done.output[-3000:]
    assert "the positive reward (--drpo.positive_reward) failed" in stop[-1], stop
    assert f"{plugin}:positive_reward raised RuntimeError: no score for this group" in stop[-1]
    logged = assert_drpo_logged(tmp_path / "tb", steps=2)  # step 3's rollout was never trained on

    groups = [json.loads(line) for line in calls.read_text().splitlines()]
    probe, run = groups[0], groups[1:]
    assert probe["prompt"] == PROBE_PROMPT  # the entry point probed it before launching
    assert run, "the engine never called the plugin"
    labels = {json.loads(r)["label"] for r in toy["train"].read_text().splitlines()}
    for group in run:
        assert 1 <= len(group["texts"]) <= 4  # the correct responses of one prompt (n = 4)
        assert len(set(group["labels"])) == 1 and group["labels"][0] in labels
        assert "Compute" in group["prompt"]
        # correct by the run's own grader (a sampled "\\boxed{3\n}" is a correct 3)
        assert all(r.correct for r in grade_responses(group["texts"], group["labels"]))
        assert all(n > 0 for n in group["lengths"])
    # what the loss ranked the correct responses by: the plugin's 6s and 7s
    ranked = logged["train/drpo/positive_reward_correct"].values()
    assert all(6.0 <= v <= 7.0 for v in ranked if not math.isnan(v)), ranked
