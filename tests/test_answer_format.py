"""The answer format (``</think>`` or not) decided from a model's chat template, and where it
goes: the entry point's flag, the reward in every vLLM engine, drpo-eval and the sweep.

The templates under ``tests/fixtures/chat_templates`` are short ones written in the
families' shapes (ChatML as SmolLM2-Instruct, Llama 3 Instruct, DeepSeek-R1-Distill with
its template in tokenizer_config.json, QwQ, Qwen3 with ``enable_thinking``; one model with
no template); the toy bases of the pipeline tests are checked too.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_rewards_plugin import MATH_FILE, CharTokenizer, FakeEngine, openrlhf_agent
from test_sweep import FRONTIER, write_sweep

from drpo_openrlhf import train
from drpo_openrlhf.eval.cli import _run_parser
from drpo_openrlhf.eval.cli import main as eval_main
from drpo_openrlhf.rewards.answer_format import (
    AnswerFormat,
    AnswerFormatError,
    answer_format,
    read_chat_template,
)
from drpo_openrlhf.rewards.reward_guard import RewardOptionsEngine, guard_engine_rewards
from drpo_openrlhf.runtime import ray_actors
from drpo_openrlhf.runtime.preflight import reward_takes
from drpo_openrlhf.sweep.commands import eval_argv
from drpo_openrlhf.sweep.spec import SweepError
from drpo_openrlhf.sweep.validate import load_sweep

FIXTURES = Path(__file__).parent / "fixtures"
TEMPLATES = FIXTURES / "chat_templates"
TOY_BASES = FIXTURES / "toy_base"
QWEN3_TEMPLATE = (TEMPLATES / "qwen3" / "chat_template.jinja").read_text()


def model_dir(tmp_path: Path, family: str) -> Path:
    """The toy Qwen2 base (a model the entry point's checks load) with a family's template."""
    target = Path(shutil.copytree(TOY_BASES / "qwen2", tmp_path / family))
    shutil.copy(TEMPLATES / family / "chat_template.jinja", target)
    return target


@pytest.mark.parametrize(
    ("model", "expected", "why"),
    [
        (TEMPLATES / "chatml", "plain", "'<|im_start|>assistant\\n', opens no <think>"),
        (TEMPLATES / "llama3", "plain", "assistant<|end_header_id|>\\n\\n', opens no <think>"),
        (TEMPLATES / "deepseek_r1", "thinking", "tokenizer_config.json's chat_template opens"),
        (TEMPLATES / "qwq", "thinking", "opens <think>: '<|im_start|>assistant\\n<think>\\n'"),
        (TOY_BASES / "qwen2", "plain", "opens no <think>"),
        # DeepSeek-R1-Distill's first release: a bare assistant marker, reasoning dropped
        (TOY_BASES / "llama", "thinking", "drops an earlier answer's reasoning before </think>"),
    ],
)
def test_auto_decides_from_the_template(model: Path, expected: str, why: str) -> None:
    decided = answer_format(str(model))
    assert (decided.name, decided.explicit) == (expected, False)
    assert decided.require_think_end == (expected == "thinking")
    assert why in decided.line(), decided.line()


def test_the_decision_reads_the_prompt_the_tokenizer_renders() -> None:
    """The generation prompt in the line is what the toy base's own tokenizer appends."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOY_BASES / "qwen2")
    chat = [{"role": "user", "content": "q"}]
    with_prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    without = tokenizer.apply_chat_template(chat, add_generation_prompt=False, tokenize=False)
    prompt = with_prompt.removeprefix(without)
    assert prompt == "<|im_start|>assistant\n"
    assert repr(prompt) in answer_format(str(TOY_BASES / "qwen2")).reason


def test_the_flag_overrides_the_template_and_is_not_refused() -> None:
    forced = answer_format(str(TEMPLATES / "chatml"), "thinking")
    assert (forced.name, forced.explicit, forced.require_think_end) == ("thinking", True, True)
    assert forced.line() == "answer format: thinking (--drpo.answer_format thinking)"
    assert answer_format(str(TEMPLATES / "deepseek_r1"), "plain").require_think_end is False
    assert answer_format(str(TEMPLATES / "qwen3"), "plain").name == "plain"
    with pytest.raises(AnswerFormatError, match="must be one of"):
        answer_format(str(TEMPLATES / "chatml"), "maybe")


def test_a_thinking_switch_is_refused_until_the_flag_says_which() -> None:
    with pytest.raises(AnswerFormatError) as error:
        answer_format(str(TEMPLATES / "qwen3"), option="--answer-format")
    message = str(error.value)
    assert "has a thinking switch (enable_thinking)" in message
    assert (
        "'<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' with enable_thinking=False"
        in message
    )
    assert "OpenRLHF renders prompts without it (as with True)" in message
    assert message.endswith("--answer-format thinking or --answer-format plain")


def test_no_template_keeps_the_authors_default_and_says_so() -> None:
    decided = answer_format(str(TEMPLATES / "no_template"))
    assert decided.name == "thinking" and not decided.explicit
    assert decided.line() == (
        f"answer format: thinking ({TEMPLATES / 'no_template'} has no chat template: the "
        "authors' default, answers after </think>; --drpo.answer_format plain for a model "
        "that does not think)"
    )


def test_a_hub_model_that_cannot_be_read_here_keeps_the_default() -> None:
    decided = answer_format("drpo-tests/no-such-model")  # the tests run offline
    assert decided.name == "thinking"
    assert "cannot read the chat template of drpo-tests/no-such-model here" in decided.reason


def write_template(directory: Path, template: str) -> Path:
    directory.mkdir()
    (directory / "chat_template.jinja").write_text(template)
    return directory


def test_template_files_in_transformers_order(tmp_path: Path) -> None:
    both = Path(shutil.copytree(TEMPLATES / "deepseek_r1", tmp_path / "both"))
    shutil.copy(TEMPLATES / "chatml" / "chat_template.jinja", both)
    assert read_chat_template(str(both)).source == "chat_template.jinja"  # the file wins
    assert answer_format(str(both)).name == "plain"

    named = tmp_path / "named"
    named.mkdir()
    r1 = json.loads((TEMPLATES / "deepseek_r1" / "tokenizer_config.json").read_text())
    templates = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": "y"}]
    (named / "tokenizer_config.json").write_text(json.dumps({"chat_template": templates}))
    assert read_chat_template(str(named)).text == "y"
    templates[1] = {"name": "default", "template": r1["chat_template"]}
    (named / "tokenizer_config.json").write_text(json.dumps({"chat_template": templates}))
    assert answer_format(str(named)).name == "thinking"
    (named / "tokenizer_config.json").write_text(json.dumps({"chat_template": templates[:1]}))
    with pytest.raises(AnswerFormatError, match=r"names chat templates \['tool_use'\] but no"):
        answer_format(str(named))


def test_a_generation_prompt_that_closes_an_empty_thinking_block_is_plain(tmp_path) -> None:
    no_think = QWEN3_TEMPLATE.replace(
        "{%- if enable_thinking is defined and enable_thinking is false -%}", "{%- if true -%}"
    )
    decided = answer_format(str(write_template(tmp_path / "no_think", no_think)))
    assert decided.name == "plain"
    assert "closes an empty thinking block: '<|im_start|>assistant\\n<think>\\n\\n</think>" in (
        decided.reason
    )


def test_a_template_that_cannot_render_a_question_is_refused(tmp_path: Path) -> None:
    broken = "{{ raise_exception('System message required') }}"
    with pytest.raises(AnswerFormatError) as error:
        answer_format(str(write_template(tmp_path / "broken", broken)))
    assert "does not render a one-question conversation" in str(error.value)
    assert "System message required" in str(error.value)
    assert str(error.value).endswith("--drpo.answer_format thinking or plain")


# --- the entry point ---------------------------------------------------------------------

LAYOUT = [
    *("--actor.num_nodes", "1", "--actor.num_gpus_per_node", "1", "--vllm.num_engines", "1"),
    *("--rollout.n_samples_per_prompt", "4", "--rollout.batch_size", "4"),
    *("--train.batch_size", "16", "--train.micro_batch_size", "4", "--drpo.gpu_memory_gib", "0"),
    *("--rollout.max_new_tokens", "64", "--data.max_len", "128"),  # the toy base's context
]


def parse_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit):
        train.parse(argv)
    return capsys.readouterr().err


def user_plugin(tmp_path: Path, signature: str) -> str:
    file = tmp_path / "user_reward.py"
    file.write_text(f"def reward_func({signature}):\n    return {{'rewards': [1.0]}}\n")
    return str(file)


def test_the_entry_point_decides_before_launch(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.delenv("DRPO_REWARD_REQUIRE_THINK_END", raising=False)
    chatml = ["--actor.model_name_or_path", str(model_dir(tmp_path, "chatml")), *LAYOUT]
    run, argv = train.parse(chatml)
    assert (run.answer_format.name, run.answer_format.explicit) == ("plain", False)
    assert run.answer_format_line == run.answer_format.line()
    assert not any(a.startswith("--drpo.answer_format") for a in argv)  # ours, not OpenRLHF's
    run, _ = train.parse([*chatml, "--shaping.method", "rloo_lp", "--shaping.params", "alpha=1"])
    assert run.answer_format.name == "plain"  # the baselines grade with the same reward

    qwen3 = ["--actor.model_name_or_path", str(model_dir(tmp_path, "qwen3")), *LAYOUT]
    assert "has a thinking switch (enable_thinking)" in parse_error(qwen3, capsys)
    run, _ = train.parse([*qwen3, "--drpo.answer_format", "plain"])
    assert run.answer_format_line == "answer format: plain (--drpo.answer_format plain)"

    # the plugins' environment fallback, set on the driver, must agree with the decision
    monkeypatch.setenv("DRPO_REWARD_REQUIRE_THINK_END", "1")
    error = parse_error(chatml, capsys)
    assert "DRPO_REWARD_REQUIRE_THINK_END=1 is set, but the entry point decided the answer " in (
        error
    )
    train.parse([*chatml, "--drpo.answer_format", "thinking"])  # the flag decides
    monkeypatch.setenv("DRPO_REWARD_REQUIRE_THINK_END", "0")
    train.parse(chatml)


def test_a_user_plugin_without_the_keyword(tmp_path: Path, capsys, monkeypatch) -> None:
    """``auto`` leaves such a plugin to its own rules and says so; a flag it cannot receive
    is refused."""
    monkeypatch.delenv("DRPO_REWARD_REQUIRE_THINK_END", raising=False)
    plugin = user_plugin(tmp_path, "queries, prompts, labels")
    argv = ["--actor.model_name_or_path", str(model_dir(tmp_path, "chatml")), *LAYOUT]
    argv += ["--reward.remote_url", plugin]
    run, _ = train.parse(argv)
    assert run.answer_format_line.endswith(
        f"; not passed on: the reward {plugin} takes no require_think_end and grades by its "
        "own rules"
    )
    error = parse_error([*argv, "--drpo.answer_format", "plain"], capsys)
    assert f"--drpo.answer_format plain: the reward {plugin} takes no require_think_end" in error


def test_reward_takes_reads_the_signature(tmp_path: Path) -> None:
    assert reward_takes(str(MATH_FILE), "require_think_end")  # **kwargs
    assert reward_takes(
        user_plugin(tmp_path, "q, p, l, require_think_end=True"), "require_think_end"
    )
    assert reward_takes(user_plugin(tmp_path, "q, p, l, *, require_think_end"), "require_think_end")
    assert not reward_takes(user_plugin(tmp_path, "q, p, l, timeout_s=1"), "require_think_end")
    assert not reward_takes("http://reward-server:5000/get_reward", "require_think_end")


# --- the engines ------------------------------------------------------------------------


class RecordingExecutor:
    """An engine's executor whose reward function records what it was called with."""

    def __init__(self, reward_func=None) -> None:
        self.calls: list[dict] = []
        self.reward_func = reward_func or self.record

    def record(self, queries, prompts, labels, **kwargs):
        self.calls.append(kwargs)
        return {"rewards": [1.0] * len(queries), "scores": [1.0] * len(queries)}


class EngineActor(RewardOptionsEngine):
    def __init__(self, executor) -> None:
        self.executor = executor
        guard_engine_rewards(executor)  # as the engine actor's constructor does


def test_the_engine_binds_the_options_its_reward_takes() -> None:
    executor = RecordingExecutor()
    engine = EngineActor(executor)
    executor.reward_func(["q"], ["p"], ["l"])
    assert executor.calls == [{}]  # before the trainer binds anything: OpenRLHF's call
    assert asyncio.run(engine.bind_reward_options({"require_think_end": False})) == [
        "require_think_end"
    ]
    executor.reward_func(["q"], ["p"], ["l"])
    assert asyncio.run(engine.bind_reward_options({"require_think_end": True})) == [
        "require_think_end"
    ]
    executor.reward_func(["q"], ["p"], ["l"])  # bound anew, not wrapped twice
    assert executor.calls == [{}, {"require_think_end": False}, {"require_think_end": True}]


def test_a_user_plugin_without_the_keyword_keeps_working() -> None:
    seen = []

    def reward_func(queries, prompts, labels):
        seen.append(queries)
        return {"rewards": [0.5], "scores": [0.5]}

    executor = RecordingExecutor(reward_func)
    engine = EngineActor(executor)
    assert asyncio.run(engine.bind_reward_options({"require_think_end": False})) == []
    assert executor.reward_func(["q"], ["p"], ["l"]) == {"rewards": [0.5], "scores": [0.5]}
    assert seen == [["q"]]
    assert guard_engine_rewards(SimpleNamespace(reward_func=None), {"x": 1}) == []  # a server


class EngineHandle:
    """A Ray handle stand-in: ``engine.bind_reward_options.remote(options)``."""

    def __init__(self, engine: RewardOptionsEngine) -> None:
        self.bind_reward_options = SimpleNamespace(
            remote=lambda options: asyncio.run(engine.bind_reward_options(options))
        )


def trainer_args(decided: AnswerFormat) -> SimpleNamespace:
    return SimpleNamespace(drpo_run=SimpleNamespace(answer_format=decided))


def test_the_trainer_binds_the_decision_in_every_engine(monkeypatch, capsys) -> None:
    monkeypatch.setattr(ray_actors.ray, "get", list)
    executors = [RecordingExecutor(), RecordingExecutor()]
    engines = [EngineHandle(EngineActor(e)) for e in executors]
    ray_actors.bind_answer_format(engines, trainer_args(AnswerFormat("plain", "chat template")))
    assert capsys.readouterr().out == (
        "drpo_openrlhf: require_think_end=False bound to the reward in 2 of 2 vLLM engine(s)\n"
    )
    for executor in executors:
        executor.reward_func(["q"], ["p"], ["l"])
        assert executor.calls == [{"require_think_end": False}]

    def reward_func(queries, prompts, labels):
        return {"rewards": [1.0], "scores": [1.0]}

    user = [EngineHandle(EngineActor(RecordingExecutor(reward_func)))]
    ray_actors.bind_answer_format(user, trainer_args(AnswerFormat("plain", "chat template")))
    assert "bound to the reward in 0 of 1 vLLM engine(s)" in capsys.readouterr().out
    explicit = AnswerFormat("plain", "--drpo.answer_format plain", explicit=True)
    with pytest.raises(RuntimeError, match=r"1 of 1 vLLM engine.*takes no require_think_end"):
        ray_actors.bind_answer_format(user, trainer_args(explicit))


def test_openrlhf_s_executor_grades_a_plain_answer_once_bound(monkeypatch) -> None:
    """The math reward in OpenRLHF's own executor: an answer without ``</think>`` scores 1
    once ``require_think_end=False`` is bound, whatever the engine's environment says."""
    monkeypatch.setenv("DRPO_REWARD_REQUIRE_THINK_END", "1")
    executor = openrlhf_agent.SingleTurnAgentExecutor(remote_rm_url=str(MATH_FILE))
    params = SimpleNamespace(max_tokens=None, logprobs=None)

    def score() -> float:
        engine = FakeEngine("1 + 1 = 2, so the answer is \\boxed{2}.")
        out = asyncio.run(
            executor.execute("What is 1+1? ", "2", params, 1000, CharTokenizer(), engine)
        )
        return float(out["scores"])

    guard_engine_rewards(executor)
    assert score() == 0.0  # the environment's default: no </think>, no answer
    guard_engine_rewards(executor, {"require_think_end": False})
    assert score() == 1.0


# --- drpo-eval and the sweep ------------------------------------------------------------


def test_drpo_eval_flags() -> None:
    parse = _run_parser().parse_args
    required = ["--model", "m", "--data", "d.jsonl"]
    assert parse(required).answer_format == "auto"
    assert parse([*required, "--no-require-think-end"]).answer_format == "plain"  # the old flag
    assert parse([*required, "--answer-format", "thinking"]).answer_format == "thinking"


def test_drpo_eval_refuses_a_switch_before_generating(tmp_path: Path) -> None:
    data = FIXTURES / "eval" / "problems.jsonl"
    argv = ["--model", str(TEMPLATES / "qwen3"), "--data", str(data), "--output-dir", str(tmp_path)]
    with pytest.raises(SystemExit, match="--answer-format thinking or --answer-format plain"):
        eval_main(argv)


def sweep_formats(tmp_path: Path, flags: list[str]) -> set[str]:
    """The ``--answer-format`` of every evaluation of the FRONTIER sweep with ``flags``."""
    sweep = load_sweep(write_sweep(tmp_path, FRONTIER, flags), "slurm")
    argvs = [eval_argv(sweep, run) for run in sweep.runs]
    return {argv[argv.index("--answer-format") + 1] for argv in argvs}


def test_the_sweep_evaluates_in_the_format_its_runs_train_with(tmp_path: Path) -> None:
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+2?", "label": "3"}\n')
    (tmp_path / "eval.jsonl").write_text('{"prompt": "1+2?", "label": "3", "datasource": "t"}\n')
    chatml = model_dir(tmp_path, "chatml")
    for seed in (0, 1):
        shutil.copytree(chatml, tmp_path / f"base{seed}")
    flags = ["--data.input_key", "prompt", "--data.label_key", "label"]
    assert sweep_formats(tmp_path, flags) == {"plain"}  # the bases' evaluations included
    assert sweep_formats(tmp_path, [*flags, "--drpo.answer_format", "thinking"]) == {"thinking"}

    for seed in (0, 1):
        (tmp_path / f"base{seed}" / "chat_template.jinja").write_text(QWEN3_TEMPLATE)
    with pytest.raises(SweepError) as error:
        load_sweep(write_sweep(tmp_path, FRONTIER, flags), "slurm")
    (problem,) = [p for p in error.value.problems if "base-s0" in p]
    assert problem.startswith("answer format of base-s0, ")
    assert "has a thinking switch (enable_thinking)" in problem
