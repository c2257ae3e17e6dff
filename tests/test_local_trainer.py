"""The single-process trainer: exact DRPO gradient through the shared core, the baselines'
loss and advantages, and the command line with its checkpoint."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from drpo_openrlhf.algo import DRPOConfig, minibatch_loss, response_scalars
from drpo_openrlhf.algo.advantages import group_advantages
from drpo_openrlhf.algo.shaper import GroupRewardShaper
from drpo_openrlhf.algo.shaping import shape_rewards
from drpo_openrlhf.eval.problems import load_problems
from drpo_openrlhf.eval.runner import encode_prompt
from drpo_openrlhf.local import train as train_cli
from drpo_openrlhf.local.rollout import Rollout, generate_rollout, token_log_probs
from drpo_openrlhf.local.toy_task import ToyProblem, write_jsonl
from drpo_openrlhf.local.trainer import (
    CHECKPOINT_FILE,
    OPTIMIZER_FILE,
    RESUME_DIR,
    TrainConfig,
    baseline_advantages,
    drpo_backward,
    find_resume_state,
    policy_gradient_backward,
    train,
)
from drpo_openrlhf.tiny_model import build_tiny_model

PROMPTS = ["Compute 1+2.", "Compute 4+5+6.", "Compute 7+8."]
N = 4
# mixed, all-correct and all-wrong groups
CORRECT = torch.tensor([1, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0], dtype=torch.bool)
SETTINGS = TrainConfig(max_new_tokens=10, temperature=0.8)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def setup(tiny_dir):
    """A float64 policy, a rollout of 3 prompts x 4 samples and pi_old's log-probs."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float64)
    ids = [encode_prompt(tokenizer, p) for p in PROMPTS]
    rollout = generate_rollout(
        model, tokenizer, ids, n=N, max_new_tokens=10, temperature=0.8, top_p=1.0, seed=3
    )
    with torch.no_grad():
        old = token_log_probs(model, rollout, 0.8)
    return model, rollout, old


def _moved(model, seed: int = 0):
    """A copy of the policy a small step away from pi_old, so that the KL hinge is active."""
    moved = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return moved


def _grads(model) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("kl_estimate", ["minibatch", "microstep"])
@pytest.mark.parametrize(
    "micro_batches", [[list(range(12))], [[0, 1, 2, 3, 4], [5, 6], [7, 8, 9, 10, 11]]]
)
def test_drpo_gradient_is_the_one_piece_gradient(setup, micro_batches, kl_estimate) -> None:
    model, rollout, old = setup
    config = DRPOConfig(lam=0.2, delta=1e-6, kl_estimate=kl_estimate)
    split, whole = _moved(model), _moved(model)

    metrics = drpo_backward(
        split, rollout, old, CORRECT, micro_batches, config, SETTINGS, policy_is_old=False
    )
    microstep = torch.cat([torch.full((len(mb),), j) for j, mb in enumerate(micro_batches)])
    log_probs = token_log_probs(whole, rollout, 0.8)
    r = response_scalars(log_probs, old, rollout.response_mask, CORRECT, rollout.group_ids)
    r = type(r)(**{**r.__dict__, "microstep": microstep})
    loss, _ = minibatch_loss(r, config, SETTINGS.max_new_tokens)
    loss.backward()

    assert metrics["drpo/hinge_active"] > 0
    assert metrics["drpo/loss"] == pytest.approx(loss.item(), rel=1e-10)
    for got, want in zip(_grads(split), _grads(whole), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-12)


def test_drpo_first_step_reuses_old_log_probs(setup) -> None:
    """Before the policy moves, the scores pass may read pi_old's log-probs: same gradient."""
    model, rollout, old = setup
    config = DRPOConfig()
    grads = []
    for is_old in (True, False):
        policy = copy.deepcopy(model)
        drpo_backward(
            policy,
            rollout,
            old,
            CORRECT,
            [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]],
            config,
            SETTINGS,
            policy_is_old=is_old,
        )
        grads.append(_grads(policy))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-14)
    assert any(g.abs().sum() > 0 for g in grads[0])


def test_policy_gradient_is_reinforce_on_policy_and_split_invariant(setup) -> None:
    model, rollout, old = setup
    advantages = torch.linspace(-1.0, 1.5, 12, dtype=torch.float64)
    grads = []
    for micro_batches in ([list(range(12))], [[0, 1, 2], [3, 4, 5, 6, 7], [8, 9, 10, 11]]):
        policy = copy.deepcopy(model)
        policy_gradient_backward(policy, rollout, old, advantages, micro_batches, SETTINGS)
        grads.append(_grads(policy))
    # on-policy (ratio 1, nothing clipped) the loss is -(1/N) sum_i A_i mean_t log pi
    reference = copy.deepcopy(model)
    mask = rollout.response_mask.double()
    lp = token_log_probs(reference, rollout, 0.8)
    (-(advantages * (lp * mask).sum(-1) / mask.sum(-1)).mean()).backward()
    for split, whole, want in zip(*grads, _grads(reference), strict=True):
        torch.testing.assert_close(split, whole, rtol=1e-9, atol=1e-13)
        torch.testing.assert_close(whole, want, rtol=1e-9, atol=1e-13)


def test_policy_gradient_clips_off_policy_ratios(setup) -> None:
    model, rollout, old = setup
    moved = _moved(model, seed=1)
    advantages = torch.ones(12, dtype=torch.float64)
    metrics = policy_gradient_backward(
        moved,
        rollout,
        old,
        advantages,
        [list(range(12))],
        TrainConfig(eps_clip=0.01, temperature=0.8),
    )
    assert 0 < metrics["clip_fraction"] <= 1


def _fake_rollout(lengths: list[int], group_size: int) -> Rollout:
    width = max(lengths)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    b = len(lengths)
    return Rollout(
        sequences=torch.zeros(b, width + 1, dtype=torch.long),
        attention_mask=torch.cat([torch.ones(b, 1, dtype=torch.long), mask], 1),
        response_mask=mask,
        group_ids=torch.arange(b // group_size).repeat_interleave(group_size),
        truncated=torch.zeros(b, dtype=torch.bool),
        texts=("",) * b,
        prompt_width=1,
    )


@pytest.mark.parametrize(
    ("method", "params", "estimator"),
    [
        ("rloo_lp", {"alpha": 0.4}, "rloo"),
        ("alp", {"beta": 1e-3}, "grpo"),
    ],
)
def test_baseline_advantages_are_the_core_functions_per_group(method, params, estimator) -> None:
    lengths = [15, 12, 19, 22, 28, 20, 36, 64]
    correct = torch.tensor([1, 1, 0, 1, 0, 0, 1, 1], dtype=torch.bool)
    shaper = GroupRewardShaper(method, 4, **params)
    advantages, rewards = baseline_advantages(
        shaper, ["p", "q"], _fake_rollout(lengths, 4), correct, estimator
    )
    for g in range(2):
        part = slice(4 * g, 4 * g + 4)
        want = shape_rewards(method, lengths[part], correct[part].tolist(), **params)
        assert rewards[part] == pytest.approx(want)
        assert advantages[part].tolist() == pytest.approx(group_advantages(want, estimator))


def test_command_line_trains_and_writes_an_evaluable_checkpoint(tiny_dir, tmp_path) -> None:
    data = write_jsonl([ToyProblem((1, 2)), ToyProblem((3, 4, 5))], tmp_path / "d.jsonl")
    common = [
        "--model",
        str(tiny_dir),
        "--data",
        str(data),
        "--rollout-steps",
        "2",
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "4",
        "--train-batch-size",
        "4",
        "--micro-batch-size",
        "2",
        "--max-new-tokens",
        "6",
        "--no-progress",
    ]
    drpo_args = ["--output", str(tmp_path / "drpo"), "--drpo.lam", "0.5", "--device", "cpu"]
    train_cli.main([*common, *drpo_args])
    train_cli.main(
        [
            *common,
            "--output",
            str(tmp_path / "rloo"),
            "--shaping.method",
            "rloo_lp",
            "--shaping.params",
            "alpha=0.2",
        ]
    )

    drpo = json.loads((tmp_path / "drpo" / CHECKPOINT_FILE).read_text())
    assert (drpo["method"], drpo["step"], drpo["drpo"]["lam"]) == ("drpo", 2, 0.5)
    assert drpo["train"]["micro_batch_size"] == 2 and drpo["shaping"] is None
    rloo = json.loads((tmp_path / "rloo" / CHECKPOINT_FILE).read_text())
    assert (rloo["method"], rloo["drpo"]) == ("rloo_lp", None)
    assert rloo["train"]["shaping_params"] == {"alpha": 0.2}
    assert rloo["shaping"]["method"] == "rloo_lp"
    for run in ("drpo", "rloo"):
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in lines] == [1, 2]

    from drpo_openrlhf.eval import cli as eval_cli

    eval_cli.main(
        [
            "--model",
            str(tmp_path / "drpo"),
            "--data",
            str(data),
            "--output-dir",
            str(tmp_path / "results"),
            "--backend",
            "hf",
            "--device",
            "cpu",
            "--n",
            "2",
            "--max-new-tokens",
            "4",
            "--no-progress",
        ]
    )
    result = json.loads((tmp_path / "results" / "drpo.json").read_text())
    assert set(result["datasets"]) == {"add2", "add3"}
    assert result["average"]["num_samples"] == 4


def test_command_line_refuses_layouts_that_split_groups(tiny_dir, tmp_path) -> None:
    data = write_jsonl([ToyProblem((1, 2))], tmp_path / "d.jsonl")
    with pytest.raises(SystemExit):
        train_cli.main(
            [
                "--model",
                str(tiny_dir),
                "--data",
                str(data),
                "--output",
                str(tmp_path / "x"),
                "--n-samples-per-prompt",
                "4",
                "--rollout-batch-size",
                "2",
                "--train-batch-size",
                "6",
            ]
        )


class _Interrupt(Exception):
    pass


def _parity_grader(texts, labels):
    """Correct when the response text has even length: mixed groups from a random model."""
    return [SimpleNamespace(correct=len(t) % 2 == 0) for t in texts]


def _stop_after(step: int):
    def log(record: dict) -> None:
        if record["step"] == step:
            raise _Interrupt

    return log


def test_an_interrupted_run_resumes_exactly(tiny_dir, tmp_path) -> None:
    """Stopped after rollout 3 with a save every 2, resumed: the same weights, optimizer
    state and metrics as an uninterrupted run."""
    problems = [ToyProblem((1, 2)), ToyProblem((3, 4, 5)), ToyProblem((2, 2))]
    config = TrainConfig(
        rollout_steps=4,
        rollout_batch_size=2,
        n_samples_per_prompt=4,
        train_batch_size=4,
        micro_batch_size=2,
        max_new_tokens=6,
        lr=1e-2,
    )
    data = write_jsonl(problems, tmp_path / "d.jsonl")
    prompts = [p for ps in load_problems([data]).values() for p in ps]
    options = dict(grader=_parity_grader, progress=False)
    whole = train(tiny_dir, prompts, tmp_path / "whole", config, **options)
    with pytest.raises(_Interrupt):
        train(
            tiny_dir, prompts, tmp_path / "cut", config, save_steps=2, log=_stop_after(3), **options
        )
    assert json.loads((tmp_path / "cut" / RESUME_DIR / CHECKPOINT_FILE).read_text())["step"] == 2
    cut = train(tiny_dir, prompts, tmp_path / "cut", config, resume=True, **options)

    init, a, b = (AutoModelForCausalLM.from_pretrained(d) for d in (tiny_dir, whole, cut))
    moved = max((x - y).abs().max() for x, y in zip(a.parameters(), init.parameters(), strict=True))
    assert moved > 1e-3
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), name
    assert torch.load(whole / RESUME_DIR / OPTIMIZER_FILE)["state"].keys()
    metrics = [
        [{k: v for k, v in json.loads(line).items() if k != "seconds"} for line in lines]
        for lines in (
            (whole / "metrics.jsonl").read_text().splitlines(),
            (cut / "metrics.jsonl").read_text().splitlines(),
        )
    ]
    assert metrics[0] == metrics[1] and len(metrics[0]) == 4
    state = json.loads((cut / CHECKPOINT_FILE).read_text())
    assert state["step"] == 4 and state["init_model"] == str(tiny_dir)

    with pytest.raises(ValueError, match=r"changed settings: train\.lr"):
        train(tiny_dir, prompts, cut, replace(config, lr=0.5), resume=True, **options)


def test_an_interrupted_swap_resumes_from_the_previous_state(tmp_path) -> None:
    assert find_resume_state(tmp_path) is None
    (tmp_path / "resume.old").mkdir()
    (tmp_path / "resume.old" / OPTIMIZER_FILE).write_bytes(b"")
    (tmp_path / "resume.tmp").mkdir()  # half written: ignored
    assert find_resume_state(tmp_path) == tmp_path / "resume.old"
