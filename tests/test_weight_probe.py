"""The weight probe (``sync/weight_probe.py``, ``sync/sync_check.py``): its comparisons
on made-up scores, and where it runs in the trainer, without Ray: a trainer built by hand syncs
through OpenRLHF's own ``broadcast_to_vllm`` and generates through OpenRLHF's own
``generate_samples`` with ``--vllm.enable_sleep``, against stand-in engines and actor group
that record every call. The real pipeline's break-tests: ``tests/test_weight_sync_guard.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from openrlhf.trainer import ppo_trainer
from openrlhf.trainer.ppo_utils import samples_generator
from openrlhf.trainer.ray import vllm_engine
from openrlhf.utils.config import hierarchize
from toy_base import FIXTURES
from transformers import AutoTokenizer

from drpo_openrlhf.runtime import ray_actors
from drpo_openrlhf.runtime.graceful_stop import RolloutCanceller
from drpo_openrlhf.runtime.openrlhf_cli import openrlhf_parser
from drpo_openrlhf.sync import sync_check, weight_version
from drpo_openrlhf.sync.weight_probe import (
    ACTOR_CAP,
    ACTOR_FACTOR,
    ACTOR_FLOOR,
    ENGINE_TOLERANCE,
    PROBE_TOKENS,
    ActorLimits,
    WeightProbeError,
    compare_probe,
    engine_disagreements,
    probe_text,
    probe_token_ids,
)

ACTOR = [-1.0, -2.5, -0.25, -3.0]


def shifted(scores: list[float], at: int, by: float) -> list[float]:
    return [x + by if i == at else x for i, x in enumerate(scores)]


# engines against engines


def test_identical_engines_agree_and_one_token_off_names_that_engine_only():
    assert engine_disagreements([ACTOR, list(ACTOR), list(ACTOR)]) == ([], 0.0)
    problems, spread = engine_disagreements([ACTOR, ACTOR, shifted(ACTOR, 2, 1e-5)])
    assert spread == pytest.approx(1e-5)
    assert len(problems) == 1 and problems[0].startswith("engine 2 scores the probe differently")
    assert "from engines 0, 1" in problems[0] and "(engine 0)" in problems[0]


def test_engines_within_the_tolerance_agree():
    close = shifted(ACTOR, 1, 0.5 * ENGINE_TOLERANCE)
    assert engine_disagreements([ACTOR, close])[0] == []
    far = shifted(ACTOR, 1, 2 * ENGINE_TOLERANCE)
    assert len(engine_disagreements([ACTOR, far])[0]) == 2


def test_the_odd_engine_is_named_wherever_it_is():
    for odd in range(4):
        scores = [shifted(ACTOR, 0, 0.1) if i == odd else ACTOR for i in range(4)]
        problems, _ = engine_disagreements(scores)
        assert [p.split(" scores")[0] for p in problems] == [f"engine {odd}"], problems


def test_without_a_largest_group_every_engine_is_named():
    two = engine_disagreements([ACTOR, shifted(ACTOR, 0, 0.1)])[0]
    assert [p.split(" scores")[0] for p in two] == ["engine 0", "engine 1"]
    assert all("from every other engine" in p for p in two)
    pairs = [ACTOR, ACTOR, shifted(ACTOR, 0, 0.1), shifted(ACTOR, 0, 0.1)]
    assert len(engine_disagreements(pairs)[0]) == 4
    majority = [ACTOR, ACTOR, ACTOR, shifted(ACTOR, 0, 0.1), shifted(ACTOR, 0, -0.15)]
    problems = engine_disagreements(majority)[0]
    assert [p.split(" scores")[0] for p in problems] == ["engine 3", "engine 4"]
    assert problems[1].endswith("up to 0.15 nats per token (engine 0)")  # not engine 3's 0.25


def test_engines_are_held_to_each_other_within_their_kind_only():
    """A mixed job (two device models, started with --drpo.allow_engine_difference device):
    the kinds' kernels differ, so their scores may; within a kind the bits must agree."""
    other_kernels = shifted(ACTOR, 0, 0.02)  # an A100's bf16 kernels beside an H100's
    scores = [ACTOR, ACTOR, other_kernels, list(other_kernels)]
    kinds = ["H100", "H100", "A100", "A100"]
    assert engine_disagreements(scores, kinds=kinds) == ([], 0.0)
    assert len(engine_disagreements(scores)[0]) == 4  # one kind: no largest group
    broken = [ACTOR, ACTOR, other_kernels, shifted(other_kernels, 3, 1e-3)]
    problems, spread = engine_disagreements(broken, kinds=kinds)
    assert spread == pytest.approx(1e-3)
    assert [p.split(" scores")[0] for p in problems] == ["engine 2", "engine 3"]
    assert all("from every other engine" in p for p in problems)
    assert problems[0].endswith("(engine 3)") and problems[1].endswith("(engine 2)")
    odd = [ACTOR, ACTOR, shifted(ACTOR, 1, 0.1), other_kernels]
    problems, _ = engine_disagreements(odd, kinds=["H100", "H100", "H100", "A100"])
    assert problems == [
        "engine 2 scores the probe differently from engines 0, 1: up to 0.1 nats per token "
        "(engine 0)"
    ]


# engines against the actor


def test_the_first_probe_sets_each_engines_limit():
    limits = ActorLimits()
    problems, notes = limits.check([0.001, 0.002])
    assert problems == [] and len(notes) == 2
    assert limits.limit(0) == pytest.approx(max(ACTOR_FACTOR * 0.001, ACTOR_FLOOR))
    assert limits.limit(1) == pytest.approx(ACTOR_FACTOR * 0.002)
    assert limits.check([0.9 * limits.limit(0), 0.9 * limits.limit(1)]) == ([], [])
    problems, _ = limits.check([0.001, 1.1 * ACTOR_FACTOR * 0.002])
    assert len(problems) == 1 and problems[0].startswith("engine 1 is ")
    assert "first gap 0.002" in problems[0]


def test_an_exact_first_probe_leaves_the_floor_as_limit():
    limits = ActorLimits()
    limits.check([0.0])
    assert limits.limit(0) == ACTOR_FLOOR
    assert limits.check([0.9 * ACTOR_FLOOR])[0] == []
    assert len(limits.check([1.1 * ACTOR_FLOOR])[0]) == 1


def test_the_cap_bounds_the_limit_and_the_first_probe():
    limits = ActorLimits()
    assert limits.check([0.5 * ACTOR_CAP])[0] == []  # honest but large: capped, not 4x
    assert limits.limit(0) == ACTOR_CAP
    assert len(limits.check([1.01 * ACTOR_CAP])[0]) == 1
    first = ActorLimits()
    problems, notes = first.check([1.5 * ACTOR_CAP])
    assert len(problems) == 1 and "the cap, first probe" in problems[0] and notes == []
    assert first.baselines == {}  # a first probe over the cap is no baseline


# both, and the flag


def test_compare_probe_guards_what_the_flag_says():
    engines = [ACTOR, shifted(ACTOR, 0, 0.1)]
    for guard, stops in (("all", 2 + 1), ("engines", 2), ("actor", 1), ("log", 0)):
        limits = ActorLimits({0: 0.0, 1: 0.0})
        result = compare_probe(ACTOR, engines, limits, guard)
        assert len(result.problems) == stops, (guard, result.problems)
        assert len(result.notes) == 3 - stops, (guard, result.notes)
    with pytest.raises(ValueError, match="not one of"):
        compare_probe(ACTOR, engines, ActorLimits(), "none")


def test_compare_probe_metrics_per_engine():
    engines = [ACTOR, shifted(ACTOR, 1, 0.004)]
    result = compare_probe(ACTOR, engines, ActorLimits(), "all")
    assert result.metrics() == pytest.approx(
        {
            "drpo/probe_logprob_gap": 0.001,
            "drpo/probe_logprob_gap/engine_0": 0.0,
            "drpo/probe_logprob_gap/engine_1": 0.001,
            "drpo/probe_engine_spread": 0.004,
        }
    )


# the text


def test_the_probe_text_is_fixed_and_as_long_as_asked():
    tokenizer = AutoTokenizer.from_pretrained(FIXTURES / "qwen2")
    ids = probe_token_ids(tokenizer, PROBE_TOKENS)
    assert len(ids) == PROBE_TOKENS and ids == probe_token_ids(tokenizer, PROBE_TOKENS)
    assert probe_token_ids(tokenizer, 100) == ids[:100]
    assert probe_text(3).startswith("Step 0: 11 + 29 = 40, and 11 * 29 = 319. Wait")
    assert len(set(ids)) >= 30  # the digits, the words and the signs, not one token repeated


# where it runs in the trainer


class Remote:
    def __init__(self, call) -> None:
        self.remote = call


class Engine:
    """A vLLM engine actor's calls, recorded; ``offset`` moves its probe scores."""

    def __init__(self, index: int, calls: list[str], offset: float = 0.0) -> None:
        self.wake_up = Remote(lambda tags=None: calls.append(f"wake_up {tags or 'all'}"))
        self.sleep = Remote(lambda level=1: calls.append("sleep"))
        self.begin_weight_sync = Remote(lambda: None)
        self.weight_sync_report = Remote(lambda: [])
        self.set_weight_version = Remote(lambda version: version)

        def probe(ids):
            calls.append(f"probe engine {index}")
            return [-1.0 - offset] * (len(ids) - 1)

        self.probe_logprobs = Remote(probe)


class ActorGroup:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def async_run_method(self, method_name: str, **kwargs):
        if method_name == "probe_logprobs":
            self.calls.append("actor probe")
            return [[-1.0] * (len(kwargs["token_ids"]) - 1)]
        self.calls.append(method_name)
        return [{}]


@pytest.fixture
def run(tmp_path, monkeypatch):
    """A trainer and its samples generator as the run builds them, under ``--vllm.enable_sleep``,
    over two stand-in engines; OpenRLHF's sync and generation code is the real one down to the
    requests, which are recorded as ``generate``."""
    calls: list[str] = []
    identity = SimpleNamespace(get=lambda refs: refs)
    for module in (sync_check, weight_version, ppo_trainer, vllm_engine, samples_generator):
        monkeypatch.setattr(module, "ray", identity)
    monkeypatch.setattr(sync_check, "check_sync", lambda *a, **k: calls.append("check"))

    def dispatch(self, prompts, labels, **kwargs):
        calls.append("generate")
        return []

    monkeypatch.setattr(samples_generator.SamplesGenerator, "_dispatch_prompts_to_vllm", dispatch)
    argv = ["--vllm.enable_sleep", "--ckpt.path", str(tmp_path), "--data.max_len", "64"]
    args = hierarchize(openrlhf_parser().parse_args(argv))
    args.drpo_run = SimpleNamespace(verify_weight_sync=True, weight_probe="all")
    tokenizer = AutoTokenizer.from_pretrained(FIXTURES / "qwen2")
    engines = [Engine(0, calls), Engine(1, calls)]

    g = ray_actors.StoppableSamplesGenerator.__new__(ray_actors.StoppableSamplesGenerator)
    g.args, g.vllm_engines, g.tokenizer = args, engines, tokenizer
    g.prompts_dataloader = [(None, ["p"] * 4, ["l"] * 4, [None] * 4)]
    g.canceller = RolloutCanceller(str(tmp_path), cancel=print)

    t = ray_actors._GroupAwarePPOTrainer.__new__(ray_actors._GroupAwarePPOTrainer)
    t.args, t.tokenizer, t.vllm_engines, t.samples_generator = args, tokenizer, engines, g
    t.actor_model_group = ActorGroup(calls)
    return SimpleNamespace(trainer=t, generator=g, calls=calls, engines=engines)


WAKE, SLEEP = ["wake_up all"] * 2, ["sleep"] * 2  # each call on both engines
SLEEPING_SYNC = [*["wake_up ['weights']"] * 2, "broadcast_to_vllm", "sent_weight_digests", "check"]
PROBED_ROLLOUT = [*WAKE, "probe engine 0", "probe engine 1", "generate", *SLEEP]


def test_under_sleep_the_engines_wake_then_probe_then_generate(run, capsys):
    """Before the first rollout (the check's probe) and after a sync: the actor scores the
    probe at the check, the engines once OpenRLHF woke them, before the rollout's first
    request; the next rollout without a sync probes nothing."""
    run.trainer._probe("before the first rollout")
    run.generator.generate_samples()
    assert run.calls == ["actor probe", *PROBED_ROLLOUT]
    run.calls.clear()
    run.trainer._sync_when = "after rollout step 1"
    run.trainer.broadcast_to_vllm()
    assert run.calls == [*SLEEPING_SYNC, "actor probe"]  # the engines' KV cache still asleep
    run.generator.generate_samples()
    assert run.calls == [*SLEEPING_SYNC, "actor probe", *PROBED_ROLLOUT]
    run.calls.clear()
    run.generator.generate_samples()
    assert run.calls == [*WAKE, "generate", *SLEEP]
    out = capsys.readouterr().out
    assert "weight probe before the first rollout: |vLLM - actor| log-prob over 62 fixed" in out
    assert "weight probe after rollout step 1: |vLLM - actor|" in out
    assert run.trainer._probe_metrics["drpo/probe_logprob_gap/engine_1"] == 0.0


def test_an_engine_that_scores_otherwise_stops_the_rollout_before_its_first_request(run):
    run.engines[1].probe_logprobs = Engine(1, run.calls, offset=1e-3).probe_logprobs
    run.trainer._probe("after rollout step 4")
    with pytest.raises(WeightProbeError, match="weight probe after rollout step 4 failed") as e:
        run.generator.generate_samples()
    assert "engine 0 scores the probe differently" in str(e.value)  # two engines: both named
    assert "engine 1 scores the probe differently" in str(e.value)
    assert run.calls == ["actor probe", *WAKE, "probe engine 0", "probe engine 1"]
