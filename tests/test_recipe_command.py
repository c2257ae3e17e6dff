"""The recipes' command (drpo_openrlhf/runtime/recipe.py) against the commands the bash
launcher built before it: tests/fixtures/launcher_commands.json, recorded by
tests/record_launcher_commands.py (recipe x method x LONG x COLOCATE, quoting hazards, single
settings, refused settings). Every case's training argv, runtime-env JSON, episode log line and
error must come back byte for byte; a few also through the launcher itself."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from record_launcher_commands import FIXTURE, REPO, launch, launch_env, placeholders, scratch

from drpo_openrlhf.algo import DRPOConfig
from drpo_openrlhf.algo.baseline_rewards import METHODS as SHAPING_METHODS
from drpo_openrlhf.runtime import recipe
from drpo_openrlhf.runtime.device import DEVICES
from drpo_openrlhf.runtime.train_defaults import DRPO_DEFAULTS, baseline_defaults

CASES = json.loads(FIXTURE.read_text())
# refused by the launcher's own (bash) checks, before the translation runs
BASH_ERRORS = {"error-bad-grace"}


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("recipe")
    scratch(path)
    return path


def recipe_exports(size: str) -> dict[str, str]:
    """The ``export NAME=${NAME:-value}`` defaults of slurm/drpo_<size>.sh."""
    text = (REPO / "slurm" / f"drpo_{size}.sh").read_text()
    return dict(re.findall(r"^export (\w+)=\$\{\1:-(.*)\}$", text, re.MULTILINE))


def recorded(case: dict) -> dict:
    """What a case's launch gave, as tests/record_launcher_commands.py keeps it."""
    keys = ("exit", "errors", "log", "train_args", "runtime_env", "shape")
    return {k: case[k] for k in keys if k in case}


def translate(case: dict, tmp: Path) -> dict:
    """A case through ``recipe.plan`` with the environment the launcher would give it, in the
    recording's terms."""
    _, _, env = launch_env(REPO, tmp, case)
    for name, value in recipe_exports(case["size"]).items():
        env[name] = env.get(name) or value
    if case["local"]:
        nodes, job = 1, env.get("RECIPE_NAME") or "drpo"
        visible = env.get("CUDA_VISIBLE_DEVICES")
        gpus = len(visible.split(",")) if visible else int(env["FAKE_GPUS"])
    else:
        nodes, gpus = 2, int(env["SLURM_GPUS_ON_NODE"])
        job = env.get("SLURM_JOB_NAME") or env.get("RECIPE_NAME") or "drpo"
    got: dict = {"exit": 0, "errors": [], "log": []}
    try:
        plan = recipe.plan(
            env, nodes, gpus, job, str(tmp / "cwd"), case["args"], str(REPO), got["log"].append
        )
    except recipe.RecipeError as error:
        got |= {"exit": 1, "errors": [f"ERROR: {error}"]}
    else:
        got |= {"train_args": plan.train_args, "runtime_env": plan.runtime_env}
        got["shape"] = {"mode": "local" if case["local"] else "slurm", "nodes": str(nodes)}
        got["shape"]["gpus_per_node"] = str(gpus)
    return placeholders(got, tmp, REPO)


@pytest.mark.parametrize(
    "case", [c for c in CASES if c["id"] not in BASH_ERRORS], ids=lambda c: c["id"]
)
def test_translation_reproduces_the_recorded_command(case: dict, tmp: Path) -> None:
    assert translate(case, tmp) == recorded(case)


def test_the_recording_covers_every_method_recipe_and_layout() -> None:
    cross = {
        (c["size"], c["env"].get("METHOD"), c["env"].get("LONG", ""), c["env"].get("COLOCATE"))
        for c in CASES
    }
    for size in ("1.5b", "7b", "8b"):
        for method in recipe.METHODS:
            for long in ("", "16k"):
                assert {(size, method, long, "1"), (size, method, long, "0")} <= cross
    assert sum(c["exit"] != 0 for c in CASES) >= 15
    assert "error-bad-grace" in {c["id"] for c in CASES if c["exit"]}


@pytest.mark.parametrize(
    "name",
    [
        "trailing-args-hazards",
        "runtime-env-hazards",
        "local-node",
        "error-bad-method",
        "error-bad-grace",
        "partial-rollout",
        "error-partial-without-async",
    ],
)
def test_the_launcher_submits_the_recorded_command(name: str, tmp: Path) -> None:
    """The launcher's glue: the plan ``eval``ed, exported and submitted unchanged."""
    case = next(c for c in CASES if c["id"] == name)
    assert placeholders(launch(REPO, tmp, case), tmp, REPO) == recorded(case)


def test_defaults_have_one_home() -> None:
    """The recipes' DRPO parameters are DRPOConfig's, their optimizer and estimators the entry
    point's, their shaped methods the shaper's."""
    config = DRPOConfig()
    for name, value in {
        "LAMBDA": config.lam,
        "TAU": config.tau,
        "DELTA": config.delta,
        "BETA0": config.beta0,
    }.items():
        assert float(recipe.SETTINGS[name]) == value, name
    assert recipe.SETTINGS["LENGTH_REWARD"] == config.length_reward
    assert recipe.SETTINGS["TEMPERATURE"] == DRPO_DEFAULTS["--rollout.temperature"][0]
    assert recipe.SHAPED_METHODS == SHAPING_METHODS
    assert recipe.DEVICES == DEVICES
    assert baseline_defaults("rloo_lp")["--algo.advantage.estimator"] == ["rloo"]


def test_method_flags() -> None:
    assert recipe.method_flags({}) == ["--drpo.lam", "0.1"]
    assert recipe.method_flags({"METHOD": "disco", "LAMBDA": "3"}) == ["--drpo.lam", "inf"]
    assert recipe.method_flags({"METHOD": "hapo"}) == ["--shaping.method", "hapo"]
    with pytest.raises(recipe.RecipeError, match=r"unknown METHOD 'grpo' \(drpo disco rloo_lp"):
        recipe.method_flags({"METHOD": "grpo"})


def test_module_prints_assignments_bash_reads(tmp: Path) -> None:
    """``python -m drpo_openrlhf.runtime.recipe``: bash ``eval``s its output back into the
    same argv; without its arguments it prints its usage."""
    env = {"PATH": "/usr/bin:/bin", "MODEL": "m", "LR": "1e-6", "DATA_DIR": str(tmp / "data")}
    env |= {"OUTPUT_ROOT": str(tmp / "out"), "EXTRA_ARGS": "--x $HOME"}
    args = ["2", "8", "job", str(tmp / "cwd"), "--json", '{"a": "b c"}', "it's"]
    module = [sys.executable, "-m", recipe.__name__]
    out = subprocess.run([*module, *args], env=env, capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "40315 prompts: the first 40192 make 314 steps/episode" in out.stderr
    script = out.stdout + 'printf "%s\\0" "$run_name" "$stop_file" "${train_args[@]}"'
    printed = subprocess.run(["bash", "-c", script], capture_output=True, check=True).stdout
    plan = recipe.plan(env, 2, 8, "job", str(tmp / "cwd"), args[4:], str(REPO), lambda _: None)
    assert printed.decode().split("\0")[:-1] == [plan.run_name, plan.stop_file, *plan.train_args]
    assert plan.train_args[-5:] == ["--x", "$HOME", "--json", '{"a": "b c"}', "it's"]
    usage = subprocess.run(module, capture_output=True, text=True, cwd=REPO)
    assert (usage.returncode, usage.stderr) == (2, recipe.USAGE + "\n")


OFF_POLICY = {
    "async": ["--train.async_enable"],
    "async-queue": ["--train.async_enable", "--train.async_queue_size", "2"],
    "partial-rollout": ["--train.async_enable", "--train.partial_rollout_enable"],
    "is-correction-level": ["--algo.advantage.is_correction_level", "token"],
    "is-correction-mode": [
        *("--algo.advantage.is_correction_level", "seq"),
        *("--algo.advantage.is_correction_mode", "clip"),
    ],
    "is-correction-gating": [
        *("--algo.advantage.is_correction_level", "token"),
        *("--algo.advantage.is_correction_gating", "tv"),
        *("--algo.advantage.is_correction_threshold", "0.1"),
    ],
    "is-correction-threshold": [
        *("--algo.advantage.is_correction_level", "seq"),
        *("--algo.advantage.is_correction_threshold", "0.8", "1.25"),
    ],
    "dynamic-filtering": ["--algo.dynamic_filtering_enable"],
    "dynamic-filtering-range": [
        *("--algo.dynamic_filtering_enable", "--algo.dynamic_filtering_range", "0", "1"),
    ],
}
OFF_POLICY_FLAGS = {f for flags in OFF_POLICY.values() for f in flags if f.startswith("--")}


@pytest.mark.parametrize("name", OFF_POLICY)
def test_an_off_policy_setting_adds_its_flags_and_the_entry_point_takes_them(
    name: str, tmp: Path
) -> None:
    """Each ASYNC / PARTIAL_ROLLOUT / IS_CORRECTION_* / DYNAMIC_FILTERING launch is its
    setting's flags, in order, and nothing else of them; the entry point's parser and checks
    accept the command."""
    from drpo_openrlhf.train import parse

    case = next(c for c in CASES if c["id"] == name)
    args = case["train_args"]
    start = args.index(OFF_POLICY[name][0])
    assert args[start : start + len(OFF_POLICY[name])] == OFF_POLICY[name]
    assert {a for a in args if a in OFF_POLICY_FLAGS} == {
        f for f in OFF_POLICY[name] if f.startswith("--")
    }
    parse([a.replace("@TMP@", str(tmp)).replace("@REPO@", str(REPO)) for a in args])


def test_the_released_recipes_run_synchronously_on_policy() -> None:
    """Unset, the off-policy settings add none of their flags."""
    released = [c for c in CASES if c["exit"] == 0 and not set(c["env"]) & OFF_POLICY_SETTINGS]
    assert len(released) > 100
    for case in released:
        assert not set(case["train_args"]) & OFF_POLICY_FLAGS, case["id"]


OFF_POLICY_SETTINGS = {
    "ASYNC",
    "ASYNC_QUEUE",
    "PARTIAL_ROLLOUT",
    *recipe.IS_CORRECTION,
    "IS_CORRECTION_THRESHOLD",
    "DYNAMIC_FILTERING",
    "DYNAMIC_FILTERING_RANGE",
}


def test_the_correction_choices_are_the_algorithm_s() -> None:
    from drpo_openrlhf.algo.rollout_correction import GATINGS, LEVELS, MODES

    choices = [choices for _, choices in recipe.IS_CORRECTION.values()]
    assert choices == [LEVELS, MODES, GATINGS]


def test_every_off_policy_setting_has_a_recorded_launch_and_refusal() -> None:
    for setting in OFF_POLICY_SETTINGS:
        used = [c for c in CASES if setting in c["env"]]
        assert any(c["exit"] == 0 for c in used), setting
        assert any(c["exit"] == 1 and setting in c["errors"][0] for c in used), setting


def test_every_off_policy_setting_is_in_the_table_of_variables() -> None:
    text = (REPO / "docs" / "launch.md").read_text()
    table = text[text.index("## Environment variables") : text.index("## What the launcher")]
    rows = [line.split(" | ")[0] for line in table.splitlines() if line.startswith("| `")]
    for setting in OFF_POLICY_SETTINGS:
        assert any(f"`{setting}`" in row for row in rows), setting
