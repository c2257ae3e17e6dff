"""Dynamic filtering under DRPO (``runtime/dynamic_filter.py``): the rule is the objective's
(``algo/learnable.py``), a range that says otherwise is refused before launch, the rollout is
refilled from new prompts as OpenRLHF refills it, and a run whose prompts give nothing to keep
stops. The generator runs OpenRLHF's own ``generate_samples`` and ``_generate_vllm`` over
stand-in engines (Ray's ``wait``/``get`` answered from a table), so the same rollouts also go
through OpenRLHF's own filter, which the guard shows dropping groups DRPO learns from."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest
import torch
from openrlhf.trainer.ppo_utils import samples_generator
from openrlhf.trainer.ppo_utils.experience import Experience
from test_signal_watch import MIXED, rollout, trainer
from test_train_cli import BASE

from drpo_openrlhf import train
from drpo_openrlhf.algo import DRPOConfig
from drpo_openrlhf.algo.objective import drpo_loss
from drpo_openrlhf.rewards.reward_guard import RewardError
from drpo_openrlhf.runtime import dynamic_filter, ray_actors
from drpo_openrlhf.runtime.dynamic_filter import FilterReport, drpo_keeps, range_keeps
from drpo_openrlhf.update.signal_watch import NoLearningSignalError

N = 4
BATCH = 4
OPTIONS = list(itertools.product([False, True], repeat=2))  # keep_all_wrong, all_correct


def learnable(k: int, n: int, config: DRPOConfig) -> bool:
    """By hand, from docs/algorithm.md: the groups DRPO's objective gives a term."""
    if 0 < k < n:
        return True
    if k == 0:
        return config.keep_all_wrong
    return config.all_correct_length_signal and math.isfinite(config.lam)


# ---------------------------------------------------------------- the rule and the range


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("lam", [0.1, math.inf])
@pytest.mark.parametrize(("keep_all_wrong", "all_correct"), OPTIONS)
def test_the_rule_is_the_objectives(n, lam, keep_all_wrong, all_correct):
    config = DRPOConfig(
        lam=lam, keep_all_wrong=keep_all_wrong, all_correct_length_signal=all_correct
    )
    assert drpo_keeps(config, n) == [learnable(k, n, config) for k in range(n + 1)]


def test_openrlhfs_default_range_keeps_the_mixed_groups_of_0_1_scores():
    assert range_keeps((0, 1), 4) == [False, True, True, True, False]
    assert range_keeps((-1, 2), 4) == [True] * 5
    assert range_keeps((0.3, 1), 4) == [False, False, True, True, False]


def parse(*flags: str, capsys=None) -> str | None:
    """``train.parse`` of BASE (8 samples per prompt) plus ``flags``: None if accepted, else
    the usage error's text."""
    try:
        train.parse([*BASE, *flags])
    except SystemExit as refused:
        assert refused.code == 2
        return capsys.readouterr().err if capsys else "refused"
    return None


ON = (dynamic_filter.ENABLE,)
KEEP_WRONG = ("--drpo.keep_all_wrong",)
ALL_CORRECT = ("--drpo.all_correct_length_signal",)


def given(lo: str, hi: str) -> tuple[str, ...]:
    return (dynamic_filter.RANGE, lo, hi)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        # a range OpenRLHF would ignore
        (given("0", "1"), "does nothing without --algo.dynamic_filtering_enable"),
        # DRPO's default rule: mixed groups only
        (
            (*ON, *given("0.3", "1")),
            "0.3 1 would drop groups DRPO's update learns from (1 of 8 correct, 2 of 8 "
            "correct) in groups of 8: under DRPO the filter keeps the groups the objective "
            "learns from (mixed); drop --algo.dynamic_filtering_range, or give a range that "
            "keeps exactly those (--algo.dynamic_filtering_range 0 1)",
        ),
        (
            (*ON, *given("-1", "2")),
            "would keep groups it cannot learn from (all wrong, all correct)",
        ),
        (
            (*ON, *given("0", "0.85")),
            "would drop groups DRPO's update learns from (7 of 8 correct)",
        ),
        # under keep_all_wrong, OpenRLHF's default range drops the all-wrong groups
        (
            (*ON, *KEEP_WRONG, *given("0", "1")),
            "0 1 would drop groups DRPO's update learns from (all wrong) in groups of 8: under "
            "DRPO the filter keeps the groups the objective learns from (mixed, all wrong "
            "(--drpo.keep_all_wrong)); drop --algo.dynamic_filtering_range, or give a range "
            "that keeps exactly those (--algo.dynamic_filtering_range -1 1)",
        ),
        # both at once: drops the all-wrong, keeps the all-correct
        (
            (*ON, *KEEP_WRONG, *given("0", "2")),
            "would drop groups DRPO's update learns from (all wrong) and keep groups it "
            "cannot learn from (all correct)",
        ),
        (
            (*ON, *ALL_CORRECT, *given("0", "1")),
            "would drop groups DRPO's update learns from (all correct) in groups of 8: under "
            "DRPO the filter keeps the groups the objective learns from (mixed, all correct "
            "(--drpo.all_correct_length_signal)); drop --algo.dynamic_filtering_range, or "
            "give a range that keeps exactly those (--algo.dynamic_filtering_range 0 2)",
        ),
        # DisCO gives all-correct groups no length signal: keeping them trains nothing
        (
            (*ON, *ALL_CORRECT, "--drpo.lam", "inf", *given("0", "2")),
            "would keep groups it cannot learn from (all correct)",
        ),
    ],
)
def test_a_range_other_than_drpos_rule_is_refused_naming_both(flags, message, capsys):
    error = parse(*flags, capsys=capsys)
    assert error is not None and message in error, error


@pytest.mark.parametrize(
    "flags",
    [
        ON,  # the default range: DRPO's rule applies under every option
        (*ON, *KEEP_WRONG),
        (*ON, *ALL_CORRECT, *KEEP_WRONG),
        (*ON, *given("0", "1")),
        (*ON, *given("0.1", "0.9")),  # the same groups of 8: 1/8 > 0.1 and 7/8 < 0.9
        (*ON, *KEEP_WRONG, *given("-1", "1")),
        (*ON, *ALL_CORRECT, *given("0", "2")),
        (*ON, *ALL_CORRECT, *KEEP_WRONG, *given("-0.5", "1.5")),
        (*ON, *ALL_CORRECT, "--drpo.lam", "inf", *given("0", "1")),
        # a baseline's range means OpenRLHF's (its PPO loss learns from shaped rewards)
        (*ON, "--shaping.method", "rloo_lp", "--shaping.params", "alpha=0.2", *given("0", "2")),
    ],
)
def test_drpos_rule_and_ranges_equal_to_it_are_accepted(flags):
    assert parse(*flags) is None


def test_a_baselines_range_without_the_filter_is_refused_too(capsys):
    flags = ("--shaping.method", "rloo_lp", "--shaping.params", "alpha=0.2", *given("0", "2"))
    assert "does nothing without" in parse(*flags, capsys=capsys)


# ---------------------------------------------------------------- the generator


def response(prompt: str, correct: bool) -> Experience:
    """One response as ``_process_response_into_experience`` makes it, with the math reward's
    0/1 reason columns."""
    score = torch.tensor([float(correct)])
    info = {
        "math/ok": score.clone(),
        "math/wrong": 1 - score,
        "reward": score.clone(),
    }
    return Experience(
        scores=score,
        rewards=score.clone(),
        truncated=torch.tensor([False]),
        response_length=torch.tensor([10]),
        prompts=[prompt],
        labels=["l"],
        info=info,
    )


class Engines:
    """Stand-in vLLM engines and Ray: prompt ``"p<i>:<k>"`` gets ``N`` responses, its first
    ``k`` correct; ``scores`` overrides a prompt's scores. Records each prompt dispatched."""

    def __init__(self, scores: dict[str, list[float]] | None = None):
        self.results: dict[int, list[Experience]] = {}
        self.dispatched: list[str] = []
        self.scores = scores or {}

    def dispatch(self, generator, prompts, labels, images=None, **kwargs):
        refs = []
        for prompt in prompts:
            k = int(prompt.split(":")[1])
            group = [response(prompt, i < k) for i in range(N)]
            for e, s in zip(group, self.scores.get(prompt, []), strict=False):
                e.scores = None if s is None else torch.tensor([s])
            ref = len(self.results)
            self.results[ref] = group
            self.dispatched.append(prompt)
            refs.append(ref)
        return refs

    def wait(self, refs, num_returns=1, timeout=None):
        return refs[:num_returns], refs[num_returns:]

    def get(self, ref):
        return self.results[ref]


def prompts(*ks: int) -> list[tuple]:
    """The dataloader's items (OpenRLHF's batch of one prompt) with ``k`` correct each."""
    return [(None, [f"p{i}:{k}"], ["l"], [None]) for i, k in enumerate(ks)]


@pytest.fixture
def engines(monkeypatch):
    stand_in = Engines()
    monkeypatch.setattr(samples_generator, "ray", stand_in)
    monkeypatch.setattr(
        samples_generator.SamplesGenerator,
        "_dispatch_prompts_to_vllm",
        lambda self, texts, labels, images=None, **kw: stand_in.dispatch(
            self, texts, labels, images, **kw
        ),
    )
    monkeypatch.setattr(
        samples_generator.SamplesGenerator,
        "_process_response_into_experience",
        lambda self, r, **kw: r,
    )
    return stand_in


DEFAULT = DRPOConfig()


def generator(data, tmp_path, config=DEFAULT, method=None, limit=3, score_range=(0, 1)):
    """``StoppableSamplesGenerator`` as the trainer holds it, without Ray or vLLM."""
    g = ray_actors.StoppableSamplesGenerator.__new__(ray_actors.StoppableSamplesGenerator)
    g.args = SimpleNamespace(
        ckpt=SimpleNamespace(path=str(tmp_path)),
        vllm=SimpleNamespace(enable_sleep=False),
        rollout=SimpleNamespace(
            batch_size=BATCH, n_samples_per_prompt=N, vllm_generate_batch_size=BATCH
        ),
        algo=SimpleNamespace(dynamic_filtering_enable=True, dynamic_filtering_range=score_range),
        drpo=config,
        drpo_run=SimpleNamespace(method=method, max_steps_without_signal=limit),
    )
    g.prompts_dataloader = data
    g.vllm_engines = []
    g.canceller = SimpleNamespace(track=lambda refs: None, finished=lambda: None, requested=False)
    return g


def kept_prompts(samples: list[Experience]) -> list[str]:
    """The prompts of a rollout's groups, in order; each must hold ``N`` responses."""
    names = [e.prompts[0] for e in samples]
    groups = [names[i : i + N] for i in range(0, len(names), N)]
    assert all(len(set(g)) == 1 and len(g) == N for g in groups), names
    return [g[0] for g in groups]


def assert_learnable_only(samples, dispatched: list[str], config: DRPOConfig) -> None:
    """Every group kept is one DRPO's update learns from, every group dropped is not."""
    kept = set(kept_prompts(samples))
    for prompt in dispatched:
        k = int(prompt.split(":")[1])
        assert (prompt in kept) == learnable(k, N, config), (prompt, sorted(kept))


MIXED_DATA = (0, 4, 2, 0, 1, 4, 3, 0, 2, 4, 1, 3, 0, 2)


def test_drpo_keeps_a_full_rollout_of_learnable_groups_refilled_in_order(engines, tmp_path):
    g = generator(prompts(*MIXED_DATA), tmp_path)
    samples, pass_rate, consumed, exhausted = g.generate_samples()
    assert kept_prompts(samples) == ["p2:2", "p4:1", "p6:3", "p8:2"]
    assert engines.dispatched == [f"p{i}:{k}" for i, k in enumerate(MIXED_DATA[:9])]
    assert consumed == 9 and not exhausted
    assert_learnable_only(samples, engines.dispatched, DRPOConfig())
    assert pass_rate == pytest.approx(100 * 4 / 9)  # OpenRLHF's would be N times that
    report = g.filter_report
    assert (report.prompts_generated, report.prompts_kept, report.samples_generated) == (9, 4, 36)
    assert (report.all_wrong, report.all_correct, report.other) == (3, 2, 0)
    assert report.line() == (
        "filter kept 4 of 9 prompts (dropped 56%: 3 all wrong, 2 all correct), 36 samples in "
        f"{report.rounds} rounds"
    )
    # the next rollout goes on from the next prompt
    samples, _, consumed, _ = g.generate_samples()
    assert kept_prompts(samples) == ["p10:1", "p11:3", "p13:2"] and consumed == 5


def test_openrlhfs_own_filter_consumes_and_keeps_the_same_under_drpos_default(engines, tmp_path):
    """Under DRPO's default rule OpenRLHF's range (0, 1) is the same rule: its streaming
    refill consumes the same prompts and keeps the same groups as the rounds do."""
    ours = generator(prompts(*MIXED_DATA), tmp_path)
    samples, _, consumed, _ = ours.generate_samples()
    theirs = generator(prompts(*MIXED_DATA), tmp_path)
    it = iter(theirs.prompts_dataloader)
    upstream = samples_generator.SamplesGenerator._generate_vllm(theirs, it, BATCH, True)
    assert sorted(kept_prompts(upstream[0])) == sorted(kept_prompts(samples))
    assert upstream[1] == consumed


@pytest.mark.parametrize(
    "config",
    [
        DRPOConfig(keep_all_wrong=True),
        DRPOConfig(all_correct_length_signal=True),
        DRPOConfig(keep_all_wrong=True, all_correct_length_signal=True),
    ],
)
def test_openrlhfs_filter_drops_groups_drpo_learns_from_and_ours_keeps_them(
    engines, tmp_path, config
):
    """The guard: the same rollouts through OpenRLHF's own filter (its default range, as a
    DAPO-style command line gives it) drop groups the objective learns from under these
    options, so the check below fails on it; under DRPO's rule it holds."""
    g = generator(prompts(*MIXED_DATA), tmp_path, config)
    samples, *_ = g.generate_samples()
    assert_learnable_only(samples, engines.dispatched, config)
    upstream = generator(prompts(*MIXED_DATA), tmp_path, config)
    engines.dispatched.clear()
    it = iter(upstream.prompts_dataloader)
    theirs = samples_generator.SamplesGenerator._generate_vllm(upstream, it, BATCH, True)[0]
    with pytest.raises(AssertionError):
        assert_learnable_only(theirs, engines.dispatched, config)


def test_disco_drops_all_correct_groups_even_with_the_length_signal(engines, tmp_path):
    config = DRPOConfig(lam=math.inf, all_correct_length_signal=True)
    g = generator(prompts(*MIXED_DATA), tmp_path, config)
    samples, *_ = g.generate_samples()
    assert "p1:4" not in kept_prompts(samples)
    assert_learnable_only(samples, engines.dispatched, config)


def test_a_baseline_keeps_openrlhfs_meaning_of_the_range(engines, tmp_path):
    """A baseline's filter is OpenRLHF's: here (0.3, 2) keeps all-correct groups and those
    with at least 2 of 4 right, as OpenRLHF's own filter does."""
    ours = generator(prompts(*MIXED_DATA), tmp_path, method="rloo_lp", score_range=(0.3, 2))
    samples, *_ = ours.generate_samples()
    assert kept_prompts(samples) == ["p1:4", "p2:2", "p5:4", "p6:3"]
    theirs = generator(prompts(*MIXED_DATA), tmp_path, method="rloo_lp", score_range=(0.3, 2))
    it = iter(theirs.prompts_dataloader)
    upstream = samples_generator.SamplesGenerator._generate_vllm(theirs, it, BATCH, True)
    assert sorted(kept_prompts(upstream[0])) == sorted(kept_prompts(samples))
    assert ours.filter_report.other == 1  # p4:1, mixed but outside the range


def test_evaluation_and_the_flag_off_are_not_filtered(engines, tmp_path):
    g = generator(prompts(0, 4, 0, 4, 2), tmp_path)
    g.args.algo.dynamic_filtering_enable = False
    samples, pass_rate, _, _ = g.generate_samples()
    assert kept_prompts(samples) == ["p0:0", "p1:4", "p2:0", "p3:4"] and pass_rate is None
    assert g.filter_report is None
    assert len(g._generate_vllm(iter(prompts(0, 4)), 2, False)[0]) == 2 * N  # eval's call


def test_a_run_that_never_fills_a_rollout_stops_after_k_rollouts_worth(engines, tmp_path):
    """Every group all wrong: the run stops after 3 rollouts' worth of prompts (12), not after
    the 1000 prompts of its data (OpenRLHF's filter goes through them all, every episode)."""
    g = generator(prompts(*[0] * 1000), tmp_path, limit=3)
    with pytest.raises(NoLearningSignalError) as stopped:
        g.generate_samples()
    assert len(engines.dispatched) == 12
    assert str(stopped.value) == (
        "dynamic filtering kept no prompt group in 12 prompts in a row (48 samples; 3 "
        "rollouts' worth of 4 prompts, --drpo.max_steps_without_signal 3; 0 turns this stop "
        "off): in the last round 4 of 4 groups all wrong (math: wrong 100%): wrong: the "
        "prompts are too hard for this model: easier prompts, a stronger model or more "
        "samples per prompt (--rollout.n_samples_per_prompt)"
    )


def test_a_kept_group_resets_the_count(engines, tmp_path):
    g = generator(prompts(*[0] * 11, 2, *[0] * 30), tmp_path, limit=3)
    with pytest.raises(NoLearningSignalError, match="in 12 prompts in a row"):
        g.generate_samples()
    assert len(engines.dispatched) == 24  # 12 before the kept group and 12 after


def test_all_correct_groups_point_at_the_length_signal(engines, tmp_path):
    g = generator(prompts(*[4] * 20), tmp_path, limit=1)
    with pytest.raises(NoLearningSignalError, match=r"--drpo\.all_correct_length_signal"):
        g.generate_samples()


def test_without_the_stop_the_data_runs_out_and_says_so(engines, tmp_path, capsys):
    g = generator(prompts(*[0] * 40, 2), tmp_path, limit=0)
    samples, pass_rate, consumed, exhausted = g.generate_samples()
    assert kept_prompts(samples) == ["p40:2"] and consumed == 41 and exhausted
    assert pass_rate == pytest.approx(100 / 41)
    assert (
        "drpo_openrlhf: dynamic filtering: the prompt data ran out with 1 of 4 groups for this "
        "rollout (filter kept 1 of 41 prompts (dropped 98%: 40 all wrong)"
    ) in capsys.readouterr().out


def test_drpo_refuses_scores_that_are_not_correctness(engines, tmp_path):
    engines.scores = {"p0:2": [0.5, 1.0, 0.0, 0.0]}
    with pytest.raises(ValueError, match="DRPO needs 0/1 correctness"):
        generator(prompts(2, 2), tmp_path).generate_samples()
    engines.scores = {"p0:2": [None, 1.0, 0.0, 0.0]}
    with pytest.raises(RewardError, match="no finite reward or score for 1 of"):
        generator(prompts(2, 2), tmp_path).generate_samples()


# ---------------------------------------------------------------- the step and the update


def test_the_step_line_says_what_filling_the_rollout_took(capsys):
    t = trainer(limit=3)
    report = FilterReport()
    groups = [[response("a", c) for c in flags] for flags in ([1, 0, 0, 0], [0] * 4, [1] * 4)]
    report.count(groups, [True, False, False])
    t.samples_generator = SimpleNamespace(filter_report=report)
    t._rollout_step = 2
    stats = t._watch_signal(rollout(MIXED))
    line = capsys.readouterr().out
    assert line.startswith(
        "drpo_openrlhf: step 2: correct 25%, learnable groups 1/2, filter kept 1 of 3 prompts "
        "(dropped 67%: 1 all wrong, 1 all correct), 12 samples in 1 round | math: "
    )
    assert stats["rollout/filtered_prompt_fraction"] == pytest.approx(2 / 3)
    assert stats["rollout/filter_prompts_generated"] == 3.0
    assert stats["rollout/filter_samples_generated"] == 12.0


def test_the_objective_is_a_mean_over_the_groups_in_the_batch():
    """The denominator: filtered groups are not in the mini-batch, so the loss is the mean
    over the groups kept; unfiltered, the unlearnable ones count in it with a term of 0."""
    torch.manual_seed(0)
    # groups of two: mixed, mixed, all wrong, all correct, mixed, mixed
    correct = torch.tensor([1, 0, 1, 0, 0, 0, 1, 1, 0, 1, 1, 0], dtype=torch.bool)
    group_ids = torch.arange(6).repeat_interleave(2)
    scores = -torch.rand(12, dtype=torch.float64)
    rewards = torch.rand(12, dtype=torch.float64)
    whole = drpo_loss(scores, correct, group_ids, rewards)
    mixed = torch.isin(group_ids, torch.tensor([0, 1, 4, 5]))
    kept = drpo_loss(scores[mixed], correct[mixed], group_ids[mixed], rewards[mixed])
    assert kept.item() == pytest.approx(whole.item() * 6 / 4, rel=1e-12)
    assert kept.item() != pytest.approx(whole.item(), rel=1e-3)  # the scale does change
