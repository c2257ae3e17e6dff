"""``--drpo.positive_reward`` (issue 24): the built-ins on hand-written responses, SPEC parsing
and composition, every bad plugin refused before launch, the engine-side scoring of a group,
and the loss: the default reproduces the earlier loss (to rounding), another reward enters
the weights exactly as the length reward does."""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from pathlib import Path

import pytest
import torch
from drpo_reference import closed_form_g1

from drpo_openrlhf import train
from drpo_openrlhf.algo import DRPOConfig, ResponseScalars, length_reward, loss_coefficients
from drpo_openrlhf.rewards import positive_reward as pr
from drpo_openrlhf.rewards.positive_engine import POSITIVE_KEY, score_group
from drpo_openrlhf.rewards.preference import (
    count_answers,
    count_reflections,
    fewer_answers,
    fewer_reflections,
    restated_answers,
)
from drpo_openrlhf.runtime import preflight

TRAIN = [
    *("--actor.model_name_or_path", "some/model", "--rollout.max_new_tokens", "100"),
    *("--vllm.num_engines", "1"),
    *("--rollout.n_samples_per_prompt", "8", "--rollout.batch_size", "16"),
    *("--train.batch_size", "64", "--train.micro_batch_size", "4"),
]

# ---------------------------------------------------------------------------------------------
# Built-ins on hand-written responses
# ---------------------------------------------------------------------------------------------
PLAIN = "<think>\n3+4=7\n</think>\n\\boxed{7}"
RECHECKED = "<think>\n3+4=7\nWait, let me check.\n3+4=7\nHmm, yes.\n</think>\n\\boxed{7}"
DOUBLE_CHECKED = "Let me double-check: 3+4=7. Alternatively, 4+3=7. Waiting is not wait-free."
RESTATED = "So the answer is 7.\nThe final answer is \\boxed{7}.\nThus \\boxed{7} and \\boxed{7}"


def test_reflections_are_counted_as_whole_phrases_longest_first():
    assert count_reflections(PLAIN) == 0
    assert count_reflections(RECHECKED) == 3  # "Wait", "let me check", "Hmm"
    # "let me double-check" once (not again as "double-check"), "Alternatively", "wait" in
    # "wait-free"; "Waiting" is not a reflection
    assert count_reflections(DOUBLE_CHECKED) == 3
    assert count_reflections("LET ME\nCHECK") == 1  # case and line breaks inside a phrase
    assert count_reflections(RECHECKED, phrases=["hmm"]) == 1  # the list is overridable
    with pytest.raises(ValueError, match="non-empty strings"):
        count_reflections(PLAIN, phrases=[""])


def test_answer_statements_and_restatements():
    assert count_answers(PLAIN) == 1 and restated_answers(PLAIN) == 0
    # a phrase line without a box, a line whose box is the statement, a line with two boxes
    assert count_answers(RESTATED) == 4 and restated_answers(RESTATED) == 3
    assert count_answers("Answer: 7") == 1 and restated_answers("no answer here") == 0


def test_builtins_prefer_fewer_and_stay_in_unit_range():
    texts = [PLAIN, RECHECKED, RESTATED]
    assert fewer_reflections(texts, [1, 2, 3], ["7"] * 3) == [1.0, 0.25, 1.0]
    assert fewer_answers(texts, [1, 2, 3], ["7"] * 3) == [1.0, 1.0, 0.25]
    assert fewer_reflections([RECHECKED], [1], ["7"], phrases=("wait",)) == [0.5]


# ---------------------------------------------------------------------------------------------
# SPEC: parsing, composition, loading
# ---------------------------------------------------------------------------------------------
def test_spec_terms_weights_and_files():
    assert pr.parse("length") == [pr.Term(1.0, "length")]
    assert pr.parse("length + 0.5*fewer_reflections+-2e-1*a/b.py:style") == [
        pr.Term(1.0, "length"),
        pr.Term(0.5, "fewer_reflections"),
        pr.Term(-0.2, "a/b.py", "style"),
    ]
    assert pr.parse("x.py") == [pr.Term(1.0, "x.py", "positive_reward")]
    assert (
        pr.with_paths("0.5*x.py+length", lambda p: "/abs/" + p)
        == "0.5*/abs/x.py:positive_reward+length"
    )
    assert pr.is_default(" length ") and not pr.is_default("1*length")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("shortest", "unknown positive reward 'shortest'; built-ins: length, fewer_reflections"),
        ("abc*length", "weight 'abc' is not a number"),
        ("inf*length", "weight 'inf' is not a number"),
        ("length+", "empty term in a sum"),
        ("f.py:not-a-name", "'not-a-name' is not a function name"),
        ("  ", "empty"),
    ],
)
def test_bad_specs_are_named(spec, message):
    with pytest.raises(pr.PositiveRewardError, match=message.replace("*", r"\*")):
        pr.parse(spec)


def test_a_weighted_sum_adds_its_terms():
    texts = [PLAIN, RECHECKED, RESTATED]
    lengths = [10, 50, 30]
    reward = pr.load("length+0.5*fewer_reflections+2*fewer_answers", max_len=100)
    expected = [
        (1 - n / 100) + 0.5 * r + 2 * a
        for n, r, a in zip(
            lengths, fewer_reflections(texts, lengths, []), fewer_answers(texts, lengths, []),
            strict=True,
        )
    ]  # fmt: skip
    assert reward(texts, lengths, ["7"] * 3) == pytest.approx(expected, abs=1e-12)
    # the length term is r_l with the run's shape and C
    cosine = pr.load("length", max_len=100, length_shape="cosine")
    counts = torch.tensor(lengths, dtype=torch.float64)
    assert cosine(texts, lengths, ["7"] * 3) == length_reward(counts, 100, "cosine").tolist()


def test_a_plugin_may_take_the_prompt(tmp_path):
    plugin = tmp_path / "p.py"
    plugin.write_text(
        "def by_prompt(texts, lengths, labels, prompt):\n    return [len(prompt)] * len(texts)\n"
        "def rest(texts, lengths, labels, **kw):\n    return [len(kw)] * len(texts)\n"
    )
    assert pr.load(f"{plugin}:by_prompt", 10)(["a", "b"], [1, 2], ["x", "x"], "four") == [4, 4]
    assert pr.load(f"{plugin}:rest", 10)(["a"], [1], ["x"], "p") == [1.0]


# Every bad plugin of the issue, refused by the real entry point's parsing before launch.
SIG = "def positive_reward(texts, lengths, labels):\n    "
BAD_PLUGINS = {
    "no_function": ("def other(texts, lengths, labels):\n    return []\n",
                    "defines no function 'positive_reward'"),
    "not_callable": ("positive_reward = 3\n", "'positive_reward' is not a function"),
    "signature": ("def positive_reward(texts):\n    return [0.0] * len(texts)\n",
                  "cannot be called as positive_reward(texts, lengths, labels)"),
    "raises": (SIG + "raise KeyError('style')\n",
               "raised KeyError: 'style' (on the probe: 3 hand-written correct"),
    "count": (SIG + "return [1.0]\n", "returned 1 values for 3 responses"),
    "nan": (SIG + "return [0.0, float('nan'), 1.0]\n", "returned non-finite values: [nan]"),
    "inf": ("import torch\n" + SIG + "return torch.tensor([0.0, 1.0, float('inf')])\n",
            "returned non-finite values: [inf]"),
    "scalar": (SIG + "return 1.0\n", "returned a float, not one number per response"),
    "strings": (SIG + "return ['a', 'b', 'c']\n", "returned non-numbers (str)"),
    "import": ("import not_a_module_anywhere\n", "importing it raised ModuleNotFoundError"),
    "syntax": ("def positive_reward(texts:\n", "importing it raised SyntaxError"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_PLUGINS))
def test_a_bad_plugin_is_refused_before_launch_naming_file_and_problem(case, tmp_path, capsys):
    source, problem = BAD_PLUGINS[case]
    plugin = tmp_path / f"{case}.py"
    plugin.write_text(source)
    with pytest.raises(SystemExit) as stop:
        train.parse([*TRAIN, "--drpo.positive_reward", f"0.5*{plugin}+length"])
    assert stop.value.code == 2
    error = capsys.readouterr().err
    assert f"--drpo.positive_reward 0.5*{plugin}+length: {plugin}" in error
    assert problem in " ".join(error.split()), error


def test_a_missing_plugin_file_or_an_unknown_name_is_refused(tmp_path, capsys):
    for spec, message in [
        (str(tmp_path / "nowhere.py"), f"{tmp_path / 'nowhere.py'}: no such file"),
        ("fewest_words", "unknown positive reward 'fewest_words'"),
    ]:
        with pytest.raises(SystemExit):
            train.parse([*TRAIN, "--drpo.positive_reward", spec])
        assert message in capsys.readouterr().err


def test_a_good_plugin_reaches_the_config_with_an_absolute_path(tmp_path, monkeypatch):
    (tmp_path / "style.py").write_text(
        "def short(texts, lengths, labels):\n    return [-n for n in lengths]\n"
    )
    monkeypatch.chdir(tmp_path)
    options, argv = train.parse([*TRAIN, "--drpo.positive_reward", "style.py:short+length"])
    config = options.drpo
    assert config.positive_reward == f"{tmp_path / 'style.py'}:short+length"
    assert not config.length_positive_reward
    assert "--drpo.positive_reward" not in argv  # ours, not OpenRLHF's
    # inside a Ray working_dir copy a relative path names the same file on every node
    copy = tmp_path / "working_dir_files" / "job"
    copy.mkdir(parents=True)
    (copy / "style.py").write_text((tmp_path / "style.py").read_text())
    monkeypatch.chdir(copy)
    assert preflight.check_positive_reward("style.py:short", 100, "linear") == "style.py:short"


def test_the_default_is_not_probed_and_baselines_refuse_another(capsys):
    config = train.parse(TRAIN)[0].drpo
    assert config.positive_reward == "length" and config.length_positive_reward
    with pytest.raises(SystemExit):
        train.parse(
            [
                *TRAIN,
                "--shaping.method",
                "rloo_lp",
                "--shaping.params",
                "alpha=0.2",
                "--drpo.positive_reward",
                "fewer_answers",
            ]
        )
    assert "the baselines (--shaping.method) shape rewards by length" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# In the engine: one group's correct responses, bounded in time, failures named
# ---------------------------------------------------------------------------------------------
class Tokenizer:
    """Decodes token ids to letters (0 -> 'a', ...); id 99 is a special token."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join("" if (i == 99 and skip_special_tokens) else chr(97 + i % 26) for i in ids)


def output(response: list[int], score) -> dict:
    prompt = [5, 5]
    return {
        "observation_tokens": prompt + response,
        "action_ranges": [(2, 2 + len(response))],
        "scores": score,
        "extra_logs": {},
    }


def test_the_engine_scores_only_the_correct_responses_of_a_group():
    seen = []

    def plugin(texts, lengths, labels, prompt=None):
        seen.append((texts, lengths, labels, prompt))
        return [float(len(t)) for t in texts]

    reward = pr.PositiveReward("test", ((2.0, "test", plugin, True),))
    outputs = [
        output([0, 1, 99], torch.tensor([1.0])),
        output([2], torch.tensor([0.0])),
        output([3, 4, 5, 6], 1.0),
        output([7], None),
    ]
    scores = asyncio.run(score_group(outputs, "p", "7", Tokenizer(), reward, 5.0))
    assert seen == [(["ab", "defg"], [3, 4], ["7", "7"], "p")]  # EOS counted, not decoded
    assert scores == [4.0, 0.0, 8.0, 0.0]
    # no correct response: the plugin is not called
    assert asyncio.run(score_group(outputs[1:2], "p", "7", Tokenizer(), reward, 5.0)) == [0.0]
    assert len(seen) == 1


def test_an_engine_side_failure_or_hang_raises_naming_the_plugin():
    def raises(texts, lengths, labels):
        raise ZeroDivisionError("bad group")

    def hangs(texts, lengths, labels):
        time.sleep(3)
        return [0.0] * len(texts)

    group = [output([0], 1.0), output([1], 1.0)]
    for func, timeout, message in [
        (raises, 5.0, "--drpo.positive_reward s: f raised ZeroDivisionError: bad group"),
        (hangs, 0.2, "did not return within 0.2 s (DRPO_REWARD_CALL_TIMEOUT_S)"),
        (lambda texts, n, labels: [1.0], 5.0, "returned 1 values for 2 responses"),
    ]:
        reward = pr.PositiveReward("s", ((1.0, "f", func, False),))
        with pytest.raises(pr.PositiveRewardError, match=re.escape(message)):
            asyncio.run(score_group(group, "p", "7", Tokenizer(), reward, timeout))


def test_engine_mixin_writes_every_response_s_score_into_extra_logs():
    from drpo_openrlhf.rewards.positive_engine import PositiveRewardEngine

    class Engine:
        async def generate_responses(self, prompt, label, *args):
            return [output([0], 1.0), output([1, 2], 0.0)]

    class Scored(PositiveRewardEngine, Engine):
        pass

    engine = Scored()
    asyncio.run(engine.configure_positive_reward("fewer_answers", 10, "linear"))
    outputs = asyncio.run(engine.generate_responses("p", "7", None, 10, Tokenizer(), 2))
    assert [o["extra_logs"][POSITIVE_KEY] for o in outputs] == [1.0, 0.0]
    # the length reward configures nothing: the engine's outputs are OpenRLHF's
    unconfigured = asyncio.run(Scored().generate_responses("p", "7", None, 10, Tokenizer(), 2))
    assert all(POSITIVE_KEY not in o["extra_logs"] for o in unconfigured)


def test_the_actor_refuses_a_rollout_without_the_scores():
    from types import SimpleNamespace

    from drpo_openrlhf.update.actor_trainer import DRPOActorTrainer

    trainer = SimpleNamespace(drpo=DRPOConfig(positive_reward="fewer_answers"))
    batch = SimpleNamespace(info={POSITIVE_KEY: [torch.tensor([0.5]), torch.tensor(2.0)]})
    got = DRPOActorTrainer._preference(trainer, batch, torch.device("cpu"))
    assert got.tolist() == [0.5, 2.0] and got.dtype == torch.float64
    with pytest.raises(ValueError, match="reached the actor without its scores"):
        DRPOActorTrainer._preference(trainer, SimpleNamespace(info={}), torch.device("cpu"))
    trainer.drpo = DRPOConfig()
    assert DRPOActorTrainer._preference(trainer, batch, torch.device("cpu")) is None


# ---------------------------------------------------------------------------------------------
# The loss
# ---------------------------------------------------------------------------------------------
def scalars(preference: torch.Tensor | None = None) -> ResponseScalars:
    g = torch.Generator().manual_seed(7)
    b = 24
    score = -torch.rand(b, generator=g, dtype=torch.float64) * 3
    kl = torch.rand(b, generator=g, dtype=torch.float64) * 1e-2
    tokens = torch.randint(1, 60, (b,), generator=g).double()
    correct = torch.rand(b, generator=g) < 0.6
    group = torch.arange(b) // 4
    return ResponseScalars(score, kl, tokens, correct, group, torch.arange(b) // 8, preference)


# The settings whose dL/ds, dL/dkl_sum and metrics the code before issue 24 (commit 9921efe)
# computed on ``scalars()``, stored in fixtures/loss_before_issue24.json (repr, so exact).
BEFORE = json.loads((Path(__file__).parent / "fixtures" / "loss_before_issue24.json").read_text())
SETTINGS = {
    "default": DRPOConfig(max_len=64),
    "concave": DRPOConfig(length_reward="concave", lam=0.05, max_len=50),
    "cosine": DRPOConfig(
        length_reward="cosine", kl_estimate="microstep", all_correct_length_signal=True, max_len=64
    ),
    "pass_rate": DRPOConfig(
        lambda_by_pass_rate=True, keep_all_wrong=True, penalty_form="paper", max_len=64
    ),
}
# Another CPU (other exp/log kernels, another summation order) moves these float64 values by
# rounding only: a loop-based restatement of G1 (drpo_reference.closed_form_g1) differs from
# them by at most 1.4e-16 (1e-15 relative); any change of formula moves them far more.
TOLERANCE = {"rel": 1e-12, "abs": 1e-13}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_the_default_length_reward_reproduces_the_earlier_loss(name):
    config, before = SETTINGS[name], BEFORE[name]
    assert config.positive_reward == "length"
    score_coef, kl_coef, metrics = loss_coefficients(scalars(), config)
    assert score_coef.tolist() == pytest.approx(before["score_coef"], **TOLERANCE)
    assert kl_coef.tolist() == pytest.approx(before["kl_coef"], **TOLERANCE)
    got = {k: metrics[k].item() for k in before["metrics"]}
    assert got == pytest.approx(before["metrics"], **TOLERANCE)
    # a carried preference is ignored under the length reward
    again = loss_coefficients(scalars(torch.randn(24)), config)[0]
    assert torch.equal(again, score_coef)


def test_the_stored_earlier_loss_is_algorithm_1_s_g1():
    """The fixture's default dL/ds is Algorithm 1's G1 restated by hand (r_l = 1 - |o|/64)."""
    r = scalars()
    lengths = (1 - r.num_tokens / 64).tolist()
    g1 = closed_form_g1(r.score.tolist(), r.correct.tolist(), r.group_id.tolist(), lengths, 0.1, 10)
    assert BEFORE["default"]["score_coef"] == pytest.approx(g1, **TOLERANCE)


def test_another_positive_reward_enters_the_weights_as_the_length_reward_does():
    r = scalars(torch.randn(24, generator=torch.Generator().manual_seed(1), dtype=torch.float64))
    config = DRPOConfig(positive_reward="fewer_reflections", beta0=0.0)
    score_coef, _, metrics = loss_coefficients(r, config)
    expected = closed_form_g1(
        r.score.tolist(), r.correct.tolist(), r.group_id.tolist(), r.preference.tolist(), 0.1, 10.0
    )
    assert score_coef.tolist() == pytest.approx(expected, abs=1e-12)
    assert metrics["positive_reward_correct"] == pytest.approx(r.preference[r.correct].mean())
    # the same scalars ranked by length give other coefficients: the preference was used
    assert not torch.allclose(
        score_coef, loss_coefficients(r, DRPOConfig(beta0=0.0, max_len=64))[0]
    )
    # equal preferences are DisCO's equal weights
    flat = loss_coefficients(scalars(torch.zeros(24)), config)[0]
    disco = loss_coefficients(scalars(), DRPOConfig(lam=math.inf, beta0=0.0, max_len=64))[0]
    assert torch.allclose(flat, disco, rtol=0, atol=1e-15)


def test_a_missing_preference_is_an_error_not_a_length_reward():
    with pytest.raises(ValueError, match="carry no score of it"):
        loss_coefficients(scalars(), DRPOConfig(positive_reward="x.py"))


def test_concat_keeps_the_preference_or_refuses_a_mix():
    a, b = scalars(torch.zeros(24)), scalars(torch.ones(24))
    assert torch.equal(
        ResponseScalars.concat([a, b]).preference, torch.cat([a.preference, b.preference])
    )
    assert ResponseScalars.concat([scalars(), scalars()]).preference is None
    with pytest.raises(ValueError, match="some parts have no preference"):
        ResponseScalars.concat([a, scalars()])


def test_the_doc_s_example_plugin_loads_and_passes_the_probe(tmp_path):
    doc = Path(__file__).parents[1] / "docs" / "positive_rewards.md"
    source = doc.read_text().split("```python\n", 1)[1].split("```", 1)[0]
    assert source.count("\ndef ") + source.startswith("def ") == 1  # one function, one file
    plugin = tmp_path / "my_reward.py"
    plugin.write_text(source)
    reward = pr.probe(str(plugin), 8192)
    assert len(reward(list(pr.PROBE_TEXTS), [10, 20, 30], ["4"] * 3, pr.PROBE_PROMPT)) == 3


# ---------------------------------------------------------------------------------------------
# Evaluation: the counts a positive reward targets, per response, beside length
# ---------------------------------------------------------------------------------------------
def test_drpo_eval_reports_reflections_and_restated_answers(tmp_path):
    from types import SimpleNamespace

    from drpo_openrlhf.eval.generation import Sample, SamplingSettings
    from drpo_openrlhf.eval.metrics import average_metrics, dataset_metrics
    from drpo_openrlhf.eval.problems import Problem
    from drpo_openrlhf.eval.results import csv_rows
    from drpo_openrlhf.eval.runner import Evaluator

    def grader(texts, labels):
        return [SimpleNamespace(correct="\\boxed{7}" in t, reason="r") for t in texts]

    evaluator = Evaluator(
        sampling=SamplingSettings(n=3, max_new_tokens=64),
        grader=grader,
        backend_factory=None,
        cache_dir=tmp_path,
        backend_key={},
        ks=[1],
        progress=False,
    )
    texts = [PLAIN, RECHECKED, "Wait. Answer: 8\n\\boxed{8}"]
    graded = evaluator.grade("d", [Problem("3+4?", "7")], [[Sample(t, 9, False) for t in texts]])
    assert [(s.reflections, s.restated_answers) for s in graded[0]] == [(0, 0), (3, 0), (1, 1)]
    metrics = dataset_metrics(graded, [1])
    assert metrics["mean_reflections"] == pytest.approx(4 / 3)
    assert metrics["mean_reflections_correct"] == pytest.approx(1.5)
    assert metrics["mean_restated_answers"] == pytest.approx(1 / 3)
    assert metrics["mean_restated_answers_correct"] == 0
    average = average_metrics({"d": metrics})
    assert average["mean_reflections"] == metrics["mean_reflections"]
    doc = {"name": "n", "datasets": {"d": metrics}, "average": average}
    assert csv_rows(doc)[0]["mean_restated_answers"] == pytest.approx(1 / 3)


# ---------------------------------------------------------------------------------------------
# The sweep passes the flag through, and probes it before submitting anything
# ---------------------------------------------------------------------------------------------
def test_a_sweep_method_s_flags_carry_the_positive_reward(tmp_path):
    from test_sweep import write_sweep

    from drpo_openrlhf.sweep.commands import train_argv
    from drpo_openrlhf.sweep.slurm import array_script
    from drpo_openrlhf.sweep.spec import SweepError
    from drpo_openrlhf.sweep.validate import load_sweep

    (tmp_path / "base0").mkdir()
    (tmp_path / "base0" / "config.json").write_text("{}")
    row = '{"prompt": "Compute 1+2.", "label": "3", "datasource": "toy"}\n'
    (tmp_path / "train.jsonl").write_text(row)
    (tmp_path / "eval.jsonl").write_text(row)
    plugin = tmp_path / "style.py"
    plugin.write_text("def positive_reward(texts, lengths, labels):\n    return [1.0]\n")
    methods = f"""
[[methods]]
method = "drpo"
grid = {{ lambda = [0.1] }}
flags = ["--drpo.positive_reward", "length+0.5*{plugin}"]
"""
    path = write_sweep(tmp_path, methods, seeds="[0]")
    with pytest.raises(SweepError) as error:  # returns 1 value for 3: refused for every run
        load_sweep(path, "local")
    assert "returned 1 values for 3 responses" in str(error.value)
    plugin.write_text(
        "def positive_reward(texts, lengths, labels):\n    return [1.0] * len(texts)\n"
    )
    sweep = load_sweep(path, "local")
    (run,) = [r for r in sweep.runs if r.trains]
    argv = train_argv(sweep, run)
    assert argv[argv.index("--drpo.positive_reward") + 1] == f"length+0.5*{plugin}"
    on_slurm = load_sweep(path, "slurm")
    script = array_script(on_slurm, [r for r in on_slurm.runs if r.trains], None, path)
    assert f"length+0.5*{plugin}" in script  # the recipe's extra flags


def test_help_lists_the_flag(capsys):
    with pytest.raises(SystemExit) as done:
        train.main(["--help"])
    assert done.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--drpo.positive_reward SPEC" in out
    assert "'length+0.5*fewer_reflections'" in out
