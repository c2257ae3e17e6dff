"""``scripts/bench_actor_update.py`` on two gloo ranks per method, at a tiny size: what it
reports is what ran. Forwards per optimizer step equal PPO's in the one-pass layout, and are
what the penalty pass and the scores pass imply otherwise; every rank reports; the JSON has
the fields the performance notes quote. No timing is asserted (the machine is shared)."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from time_bounds import scaled

from drpo_openrlhf.testing import openrlhf_share

BENCH = Path(__file__).resolve().parents[1] / "scripts" / "bench_actor_update.py"
RANKS, N, PROMPTS, TRAIN_BATCH = 2, 4, 4, 8
STEPS = PROMPTS * N // TRAIN_BATCH  # optimizer steps per call
TINY = [
    *("--ranks", str(RANKS), "--n", str(N), "--prompts", str(PROMPTS)),
    *("--train-batch", str(TRAIN_BATCH), "--num-layers", "1", "--repeats", "1"),
    *("--prompt-len", "2", "4", "--response-len", "2", "6"),
]


def bench(tmp_path: Path, *flags: str) -> dict:
    out = tmp_path / "bench.json"
    subprocess.run(
        [sys.executable, str(BENCH), *TINY, *flags, "--json", str(out)],
        check=True,
        capture_output=True,
        timeout=scaled(600),  # a hang guard: the module's 6 benches took 86 s in a CI run
    )
    return json.loads(out.read_text())


def rank_calls(result: dict) -> list[dict]:
    """Every rank's report of every timed call."""
    return [r for call in result["calls"] for r in call["ranks"]]


@pytest.mark.slow
def test_one_pass_layout_runs_ppo_forward_count(tmp_path):
    """n divides micro-batch x ranks (2 x 2 = 4): one forward per micro-batch, as PPO."""
    micro = 2
    got = bench(tmp_path, "--micro-batch", str(micro), "--kl-estimate", "microstep")
    results = {r["method"]: r for r in got["results"]}
    assert set(results) == {"drpo", "ppo"}
    assert results["drpo"]["mode"] == "one_pass"
    micro_steps = TRAIN_BATCH // RANKS // micro
    for method, result in results.items():
        assert len(result["ranks"]) == RANKS
        assert sum(r["responses"] for r in result["ranks"]) == PROMPTS * N
        assert all(r["peak_rss_mib"] >= r["rss_before_mib"] > 0 for r in result["ranks"])
        for report in rank_calls(result):
            assert report["optimizer_steps"] == STEPS
            assert report["forwards_grad"] == STEPS * micro_steps
            assert report["forwards_no_grad"] == 0
            assert report["cpu"] > 0
        row = got["summary"][method]
        assert row["forwards/step, grad"] == micro_steps
        assert row["optimizer steps per call"] == STEPS
        for key in ("CPU s per ppo_train", "CPU s, slowest rank", "peak RSS MiB, max rank"):
            assert row[key] > 0
        assert row["CPU s, slowest rank"] <= row["CPU s per ppo_train"]
        # the actor phase: pi_old's scoring (timed apart, its forwards not counted above) and
        # the update; one timed call, so the medians add up
        assert row["CPU s, pi_old scoring"] > 0 and row["wall s, pi_old scoring"] > 0
        phase = row["CPU s, pi_old scoring"] + row["CPU s per ppo_train"]
        assert row["CPU s, actor phase"] == pytest.approx(phase)
        assert row["wall s, actor phase"] >= row["wall s per ppo_train"]
    assert got["summary"]["drpo"]["penalty-pass steps per call"] == 0
    assert "DRPO/PPO CPU s of each turn's pair of calls, actor phase: " in got["report"]


@pytest.mark.slow
def test_penalty_pass_adds_a_forward_per_micro_batch_on_the_steps_that_ran_it(tmp_path):
    """Mini-batch KL, whole-group micro-steps: a second forward per micro-batch exactly on
    the steps whose KL exceeded delta (at lr 1e-4 step 2 of this tiny rollout does)."""
    micro = 2
    got = bench(tmp_path, "--micro-batch", str(micro), "--methods", "drpo", "--lr", "1e-4")
    (result,) = got["results"]
    assert result["mode"] == "penalty_pass"
    micro_steps = TRAIN_BATCH // RANKS // micro
    for report in rank_calls(result):
        penalty_steps = round(report["penalty_pass"] * STEPS)
        assert penalty_steps == STEPS - 1  # every step but the rollout's first (KL 0)
        assert report["forwards_grad"] == (STEPS + penalty_steps) * micro_steps
        assert report["forwards_no_grad"] == 0
    assert got["summary"]["drpo"]["penalty-pass steps per call"] == STEPS - 1


@pytest.mark.slow
def test_scores_pass_layout_adds_a_no_grad_forward_per_micro_batch(tmp_path):
    """Micro-steps of 1 x 2 responses cut groups of 4: a no-grad scores pass on every step
    but the rollout's first (its scores are pi_old's, known), then the gradient pass."""
    micro = 1
    got = bench(tmp_path, "--micro-batch", str(micro), "--methods", "drpo")
    (result,) = got["results"]
    assert result["mode"] == "scores_pass"
    micro_steps = TRAIN_BATCH // RANKS // micro
    for report in rank_calls(result):
        assert report["forwards_grad"] == STEPS * micro_steps
        assert report["forwards_no_grad"] == (STEPS - 1) * micro_steps
    row = got["summary"]["drpo"]
    assert row["forwards/step, no grad"] == (STEPS - 1) * micro_steps / STEPS


@pytest.mark.parametrize(("count", "world", "batch"), [(16, 2, 1), (32, 8, 1), (16, 2, 3)])
def test_ppo_share_is_openrlhfs_chunk(count, world, batch):
    """``openrlhf_share`` against OpenRLHF's own ``async_run_method_batch`` (the driver's
    dealing of experience batches to the actor ranks), with Ray's object store bypassed."""
    from openrlhf.trainer.ray import launcher

    chunks = []

    remote = lambda _method, data, *_: chunks.append(data["experience"])  # noqa: E731
    handle = SimpleNamespace(execute_batch=SimpleNamespace(remote=remote))  # a Ray actor
    group = launcher.RayActorGroup.__new__(launcher.RayActorGroup)
    group._actor_handlers = [handle] * world
    group.duplicate_actors = 1
    batches = [list(range(i, min(i + batch, count))) for i in range(0, count, batch)]
    with mock.patch.object(launcher.ray, "put", lambda data: data):
        group.async_run_method_batch("append", experience=batches)
    for rank, chunk in enumerate(chunks):
        expected = [i for b in chunk for i in b]
        assert openrlhf_share(count, world, rank, batch).tolist() == expected
    assert torch.cat([openrlhf_share(count, world, r, batch) for r in range(world)]).tolist() == [
        *range(count)
    ]


def test_ppo_drop_logits_releases_only_the_outputs_logits():
    """The memory ablation's wrapper frees the logits the output held (nothing else keeps
    them: autograd saved what the backward needs) and leaves the log-probs' gradient as it
    was; an output without ``return_output`` passes through."""
    import importlib.util
    import weakref

    from transformers.modeling_outputs import CausalLMOutput

    spec = importlib.util.spec_from_file_location("bench_actor_update", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    layer = torch.nn.Linear(3, 5)
    x = torch.randn(4, 3)
    held = []

    def forward(return_output: bool = True):
        logits = layer(x).float()
        held.append(weakref.ref(logits))
        log_probs = logits.log_softmax(-1)[:, 0]
        return (log_probs, CausalLMOutput(logits=logits)) if return_output else log_probs

    log_probs, output = module.drop_logits(forward)()
    assert output.logits is None and output["logits"] is None
    assert held[-1]() is None
    (grad,) = torch.autograd.grad(log_probs.sum(), layer.weight)
    reference, kept = forward()
    (expected,) = torch.autograd.grad(reference.sum(), layer.weight)
    torch.testing.assert_close(grad, expected, rtol=0, atol=0)
    assert held[-1]() is kept.logits  # without the wrapper the output keeps them alive
    bare = module.drop_logits(forward)(return_output=False)
    assert isinstance(bare, torch.Tensor)
