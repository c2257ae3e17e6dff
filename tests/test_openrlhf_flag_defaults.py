"""Every OpenRLHF flag the project reads, at OpenRLHF's default and at its edge values, through
the entry point's parse and preflight (no Ray): each command line is either refused with a
usage error that names the flag, or yields a run with a memory plan, never a traceback.

The flags are found in the sources, not listed by hand: any quoted ``group.name`` or
``--group.name`` (read, defaulted or refused) or attribute chain ``args.group.name`` in
``drpo_openrlhf/`` that is a destination of OpenRLHF's parser, so that a flag read
tomorrow is covered tomorrow (issue 34, finding 2)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from drpo_openrlhf import train
from drpo_openrlhf.runtime import openrlhf_flags
from drpo_openrlhf.runtime.openrlhf_cli import openrlhf_parser

PACKAGE = Path(train.__file__).parent
ACTIONS = {a.dest: a for a in openrlhf_parser()._actions if a.option_strings}

# A small DRPO run of the 1.5B recipe's model (its shape is known offline: the memory plan runs)
BASE = [
    *("--actor.model_name_or_path", "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"),
    *("--actor.num_nodes", "1", "--actor.num_gpus_per_node", "2", "--vllm.num_engines", "2"),
    *("--rollout.batch_size", "4", "--rollout.n_samples_per_prompt", "4"),
    *("--train.batch_size", "16", "--train.micro_batch_size", "2"),
    *("--rollout.max_new_tokens", "512", "--data.max_len", "1024"),
]


def flags_read_by_the_project() -> list[str]:
    names = set()
    for source in PACKAGE.rglob("*.py"):
        text = source.read_text()
        names |= set(re.findall(r"[\"'](?:--)?([a-z_]+(?:\.[a-z_]+)+)[\"']", text))
        names |= set(re.findall(r"\bargs\.([a-z_]+\.[a-z_]+(?:\.[a-z_]+)?)", text))
    return sorted(n for n in names if n in ACTIONS)


READ = flags_read_by_the_project()


def without(argv: list[str], flag: str) -> list[str]:
    """``argv`` with ``flag`` and its values dropped: the flag at OpenRLHF's default."""
    out, skipping = [], False
    for item in argv:
        if item.startswith("--"):
            skipping = item == flag
        if not skipping:
            out.append(item)
    return out


def edge_values(action: argparse.Action) -> list[list[str]]:
    """Values at the edges of a flag's type: 0 and negatives for numbers, empty strings."""
    if action.nargs == 0:  # a switch: on (off is its default)
        return [[]]
    if action.choices:
        return [
            [str(c)] * (action.nargs if isinstance(action.nargs, int) else 1)
            for c in action.choices
        ]
    count = action.nargs if isinstance(action.nargs, int) else 1
    if action.type is int:
        return [["0"] * count, ["-1"] * count]
    if action.type is float:
        return [["0"] * count, ["-1"] * count, ["nan"] * count]
    return [[""] * count]


def outcome(argv: list[str], capsys) -> str | None:
    """None for a run with a memory plan; the usage error's message otherwise. Anything
    else (a traceback) fails the test."""
    try:
        run, _ = train.parse(argv)
    except SystemExit as stop:
        assert stop.code == 2
        message = capsys.readouterr().err.strip().splitlines()[-1]
        assert message.startswith("python -m drpo_openrlhf.train: error: ")
        return message
    assert run.memory_plan, "the base run has a memory plan; a valid run keeps it"
    return None


def test_the_base_run_is_valid_and_the_scan_finds_the_flags_we_know(capsys):
    assert outcome(BASE, capsys) is None
    known = {"rollout.max_new_tokens", "vllm.num_engines", "data.max_len", "ds.zero_stage"}
    assert known <= set(READ) and len(READ) > 30


@pytest.mark.parametrize("name", READ)
def test_a_flag_at_its_default_and_edges_is_a_usage_error_or_a_run(name, capsys):
    flag = f"--{name}"
    at_default = outcome(without(BASE, flag), capsys)
    assert at_default is None or "--" in at_default, at_default
    for values in edge_values(ACTIONS[name]):
        message = outcome([*without(BASE, flag), flag, *values], capsys)
        # an edge value is refused by name; a switch or a choice may move another limit
        named = flag if values and values[0] in ("0", "-1", "nan", "") else "--"
        assert message is None or named in message, (values, message)


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--vllm.num_engines", "0"),
        ("--rollout.max_new_tokens", "0"),
        ("--rollout.max_new_tokens", "1024"),  # = --data.max_len: no room for the prompt
        ("--data.max_len", "0"),
        ("--train.micro_batch_size", "0"),
        ("--actor.num_gpus_per_node", "0"),
        ("--train.batch_size", "0"),
        ("--ds.zero_stage", "4"),
        ("--vllm.gpu_memory_utilization", "0"),
        ("--vllm.gpu_memory_utilization", "1.5"),
        ("--ds.grad_accum_dtype", "float8"),
        ("--algo.kl.init_coef", "nan"),  # NaN rewards: the first rollout is refused
        ("--reward.remote_url", ""),
        ("--drpo.logprob_chunk_tokens", "-1"),
        ("--drpo.max_logprob_gap", "0"),
        ("--rollout.temperature", "0"),
        ("--rollout.top_p", "0"),
        ("--actor.adam.betas", "1 0.999"),
        ("--actor.adam.weight_decay", "-0.01"),
    ],
)
def test_values_a_run_would_die_of_are_refused_naming_the_flag(flag, value, capsys):
    """Each ended the run after launch before: in the engines at start-up or the first
    rollout, in the layout check (ZeroDivisionError), in DeepSpeed's or torch's optimizer as
    the actor starts, or at the first step's checks (NaN rewards, a zero log-prob gap)."""
    message = outcome([*without(BASE, flag), flag, *value.split(" ")], capsys)
    assert message is not None and flag in message, message


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--train.colocate_all", "--vllm.num_engines", "1"], "--train.colocate_all"),
        (["--rollout.vllm_generate_batch_size", "8"], "requires --train.async_enable"),
        (["--train.partial_rollout_enable"], "requires --train.async_enable"),
    ],
)
def test_openrlhfs_own_checks_run_before_anything_starts(flags, message, capsys):
    """OpenRLHF asserts these in its ``__main__`` or ``train()``, after the entry point has
    started Ray on a CPU run; now they are usage errors (the first is ours, the others are
    OpenRLHF's own assertions run at parse time: ``openrlhf_cli.check_openrlhf_validation``)."""
    argv = [*without(BASE, "--vllm.num_engines"), "--vllm.num_engines", "2"]
    got = outcome([*without(argv, flags[0]), *flags], capsys)
    assert got is not None and message in got, got


@pytest.mark.parametrize("flag", ["--actor.model_name_or_path", "--vllm.num_engines"])
def test_required_flags_left_at_openrlhfs_default_are_refused_naming_them(flag, capsys):
    message = outcome(without(BASE, flag), capsys)
    assert message is not None and flag in message, message


def test_without_a_generation_budget_c_is_the_longest_response_openrlhf_allows(capsys):
    """OpenRLHF's default ``--rollout.max_new_tokens`` (None): each response may fill
    ``--data.max_len`` minus its prompt, so C = ``--data.max_len``; the plugin probe gets it
    too (it raised a TypeError before)."""
    argv = without(BASE, "--rollout.max_new_tokens")
    options, openrlhf_argv = train.parse(argv)
    config = options.drpo
    assert config.max_len == 1024 and "--rollout.max_new_tokens" not in openrlhf_argv
    config = train.parse([*argv, "--drpo.positive_reward", "length+fewer_answers"])[0].drpo
    assert config.max_len == 1024
    assert train.parse([*argv, "--drpo.max_len", "300"])[0].drpo.max_len == 300
    assert train.parse(BASE)[0].drpo.max_len == 512  # --rollout.max_new_tokens
    args = train.build_parser().parse_args(argv)
    assert openrlhf_flags.length_reward_c(args) == 1024
