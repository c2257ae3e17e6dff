"""Records the training commands the launcher submits, for tests/test_recipe_command.py.

Runs each case's recipe (slurm/drpo_*.sh, or scripts/train_local_node.sh) under the fake Slurm
and Ray of tests/fakeslurm and keeps what reached ``ray job submit``: the training argv and
the runtime-env JSON, or the launcher's error. Paths under the scratch directory read
``@TMP@`` and the launched checkout ``@REPO@``, so the recording is the same on any machine.

    .venv/bin/python tests/record_launcher_commands.py [--rev REV] [--out FILE]

``--rev`` records the launcher, recipes and package of a git revision (``git archive`` into
a scratch directory) instead of the working tree: the recording of the commands the bash
translation built came from the revision before ``drpo_openrlhf/runtime/recipe.py``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from time_bounds import scaled

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
FIXTURE = TESTS / "fixtures" / "launcher_commands.json"
SIZES = ("1.5b", "7b", "8b")
METHODS = ("drpo", "disco", "rloo_lp", "alp", "hapo", "l1_max", "shorter_better", "laser_d")
# What the fake cluster of a Slurm case is: 2 nodes of 8 GPUs, job name drpo-job.
SLURM_ENV = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NAME": "drpo-job",
    "SLURM_JOB_NODELIST": "gpu[1-2]",
    "SLURM_NNODES": "2",
    "SLURMD_NODENAME": "gpu1",
    "SLURM_GPUS_ON_NODE": "8",
    "SLURM_CPUS_ON_NODE": "64",
}
HAZARD = (
    """--rollout.top_p  0.95\t--x "a b" 'c d' $HOME \\$y a\\b {"k": "v w", "n": [1, 2]} --last"""
)
HAZARD_ARGS = [
    "--json",
    '{"a": [1, 2], "b": "x y", "c": "q\\"uote"}',
    "--dollar",
    "$PATH `id` $(id)",
    "--quote",
    'it\'s "so"',
    "--backslash",
    "a\\b\\\\c",
    "--empty",
    "",
    "--unicode",
    "λ=0.1 ✓",
]


def cases() -> list[dict]:
    """Every recipe x method x LONG x COLOCATE, then single settings, quoting and errors."""
    out: list[dict] = []

    def case(name: str, size: str = "1.5b", env=None, args=(), local: bool = False) -> None:
        out.append(dict(id=name, size=size, env=dict(env or {}), args=list(args), local=local))

    for size, method, long, colocate in itertools.product(SIZES, METHODS, ("", "16k"), "10"):
        env = {"METHOD": method, "COLOCATE": colocate, **({"LONG": long} if long else {})}
        case(f"{size}-{method}-long{long or 'none'}-colocate{colocate}", size, env)
    for size in SIZES:
        case(f"{size}-drpo-long32k", size, {"LONG": "32k"})
    # quoting hazards: EXTRA_ARGS is split on blanks (no quote removal), trailing flags are kept
    case("extra-args-hazards", env={"EXTRA_ARGS": HAZARD})
    # the bash launcher kept only the first line (--a 1); the recording was edited to keep
    # both, the one intended change of the translation (runtime/recipe.py: read_words)
    case("extra-args-newline", env={"EXTRA_ARGS": "--a 1\n--b 2"})
    case("extra-args-blank-edges", env={"EXTRA_ARGS": " \t --a\t 1  "})
    case("trailing-args-hazards", env={"EXTRA_ARGS": "--rollout.top_p 0.9"}, args=HAZARD_ARGS)
    case("help", args=["--help"])
    # single settings
    case("run-name-hazards", env={"RUN_NAME": "my run \"x\" $y 'z'", "WANDB": "1"})
    case("recipe-name-sanitized", env={"RECIPE_NAME": "x y/λ", "SLURM_JOB_NAME": ""})
    case(
        "wandb",
        "7b",
        {"WANDB_API_KEY": "secret", "WANDB_ENTITY": "lab", "WANDB_GROUP": "g 1"},
    )
    case(
        "wandb-run-id-given",
        env={"WANDB": "1", "WANDB_RUN_ID": "keep", "WANDB_RESUME": "must", "WANDB_PROJECT": "p"},
    )
    case(
        "runtime-env-hazards",
        "7b",
        {
            "NET_IFACE": "ib0",
            "NCCL_IB_HCA": "mlx5",
            "HF_TOKEN": "hf-secret",
            "HF_HOME": 'C:\\hf "home" $x',
            "VLLM_USE_V1": "1",
            "TRANSFORMERS_CACHE": "/c",
            "GLOO_SOCKET_IFNAME": "eth0",
            "RAY_ENV_VARS": "MY_VAR,OTHER_VAR,MY_API_KEY,UNSET_VAR,EMPTY_VAR,VLLM_TP",
            "MY_VAR": 'a\\b"c',
            "OTHER_VAR": "λ",
            "MY_API_KEY": "k",
            "EMPTY_VAR": "",
            "VLLM_TP": "2",
            "VLLM_GPU_UTIL": "0.5",
        },
    )
    case("ray-env-vars-spaces", env={"RAY_ENV_VARS": "A_VAR, B_VAR", "A_VAR": "1", "B_VAR": "2"})
    case("positive-reward", env={"POSITIVE_REWARD": "length+0.5*style.py:style+2*./style.py"})
    case("positive-reward-disco", env={"METHOD": "disco", "POSITIVE_REWARD": "fewer_answers"})
    case("positive-reward-shaped", env={"METHOD": "hapo", "POSITIVE_REWARD": "length"})
    case(
        "own-data",
        env={
            "TRAIN_DATA": "train.jsonl",
            "EVAL_DATA": "",
            "MAX_STEPS": "10",
            "MODEL": "my-model",
            "OUTPUT_ROOT": "rel/out",
        },
    )
    case("eval-mixed", env={"EVAL_DATA": "org/hub-set,./eval.jsonl,,eval.jsonl,"})
    case("hub-train-data", env={"TRAIN_DATA": "org/some-set", "NUM_EPISODES": "3"})
    case("ckpt-dir", env={"CKPT_DIR": "ckpts/../ckpt", "SAVE_HF": "1", "PACKING": "0"})
    case("best-ckpt", env={"BEST_CKPT": "1"})
    case("best-ckpt-no-eval", env={"BEST_CKPT": "1", "EVAL_DATA": ""})
    case(
        "drpo-params",
        "7b",
        {
            "LAMBDA": "0.3",
            "TAU": "5",
            "DELTA": "1e-3",
            "BETA0": "100",
            "LENGTH_REWARD": "cosine",
            "DRPO_MAX_LEN": "4096",
            "ESTIMATOR": "rloo",
        },
    )
    case("shaping-params", "8b", {"METHOD": "hapo", "SHAPING_PARAMS": "w=1.0,c=-0.7"})
    case("rloo-estimator", "8b", {"METHOD": "rloo_lp", "ESTIMATOR": "group_norm"})
    case(
        "sizes",
        env={
            "ROLLOUT_PROMPTS": "64",
            "N_SAMPLES": "16",
            "TRAIN_BATCH": "512",
            "MAX_NEW_TOKENS": "4096",
            "PROMPT_MAX_LEN": "512",
            "TEMPERATURE": "1.0",
            "WEIGHT_DECAY": "0",
            "ATTN_IMPL": "sdpa",
            "SAVE_STEPS": "5",
            "EVAL_STEPS": "7",
            "EVAL_N_SAMPLES": "2",
            "CKPT_MAX_NUM": "1",
            "SEED": "3",
            "REWARD_FUNC": "my_reward.py",
            "RING_ATTN_SIZE": "2",
            "MAX_STEPS": "2000",
        },
    )
    case("actor-gpus", env={"COLOCATE": "0", "ACTOR_GPUS_PER_NODE": "6", "VLLM_TP": "2"})
    # the off-policy modes, one launch per variable (asynchronous needs its own engine GPUs);
    # newer than the bash translation, so recorded from the launcher that introduced them
    split = {"COLOCATE": "0"}
    case("async", env=split | {"ASYNC": "1"})
    case("async-queue", env=split | {"ASYNC": "1", "ASYNC_QUEUE": "2"})
    case("partial-rollout", env=split | {"ASYNC": "1", "PARTIAL_ROLLOUT": "1"})
    case("is-correction-level", env={"IS_CORRECTION_LEVEL": "token"})
    case("is-correction-mode", env={"IS_CORRECTION_LEVEL": "seq", "IS_CORRECTION_MODE": "clip"})
    case(
        "is-correction-gating",
        env={
            "IS_CORRECTION_LEVEL": "token",
            "IS_CORRECTION_GATING": "tv",
            "IS_CORRECTION_THRESHOLD": "0.1",
        },
    )
    case(
        "is-correction-threshold",
        env={"IS_CORRECTION_LEVEL": "seq", "IS_CORRECTION_THRESHOLD": " 0.8\t1.25 "},
    )
    case("dynamic-filtering", "7b", {"DYNAMIC_FILTERING": "1"})
    case(
        "dynamic-filtering-range", env={"DYNAMIC_FILTERING": "1", "DYNAMIC_FILTERING_RANGE": "0 1"}
    )
    case("local-node", "7b", {"FAKE_GPUS": "4"}, ["--train.seed", "3"], local=True)
    case("local-node-visible", env={"FAKE_GPUS": "8", "CUDA_VISIBLE_DEVICES": "2,3"}, local=True)
    # errors: the launcher stops before Ray
    for name, env in {
        "bad-method": {"METHOD": "grpo"},
        "bad-long": {"LONG": "64k"},
        "bad-colocate": {"COLOCATE": "2"},
        "bad-actor-gpus": {"COLOCATE": "0", "ACTOR_GPUS_PER_NODE": "8"},
        "bad-vllm-tp": {"VLLM_TP": "3"},
        "bad-n-samples": {"N_SAMPLES": "0"},
        "bad-steps": {"MAX_STEPS": "1.5"},
        "bad-best": {"BEST_CKPT": "yes"},
        "bad-grace": {"STOP_GRACE_S": "4m"},
        "bad-episodes": {"TRAIN_DATA": "org/x", "NUM_EPISODES": "0"},
        "no-episodes": {"TRAIN_DATA": "org/some-hub-dataset"},
        "missing-train": {"TRAIN_DATA": "/nope/train.jsonl"},
        "missing-eval": {"EVAL_DATA": "/nonexistent/aime.jsonl"},
        "too-few-prompts": {"TRAIN_DATA": "small.jsonl"},
        "ring-without-packing": {"RING_ATTN_SIZE": "2", "PACKING": "0"},
        "missing-plugin": {"POSITIVE_REWARD": "fewer_answers+nowhere.py"},
        "control-char": {"RAY_ENV_VARS": "MY_VAR", "MY_VAR": "a\tb"},
        "bad-async": {"COLOCATE": "0", "ASYNC": "yes"},
        "async-colocated": {"ASYNC": "1"},
        "queue-without-async": {"ASYNC_QUEUE": "2"},
        "bad-async-queue": {"COLOCATE": "0", "ASYNC": "1", "ASYNC_QUEUE": "0"},
        "partial-without-async": {"PARTIAL_ROLLOUT": "1"},
        "bad-is-correction-level": {"IS_CORRECTION_LEVEL": "sequence"},
        "bad-is-correction-threshold": {
            "IS_CORRECTION_LEVEL": "seq",
            "IS_CORRECTION_THRESHOLD": "1 2 3",
        },
        "is-correction-without-level": {"IS_CORRECTION_MODE": "clip"},
        "bad-partial-rollout": {"COLOCATE": "0", "ASYNC": "1", "PARTIAL_ROLLOUT": "true"},
        "bad-is-correction-mode": {"IS_CORRECTION_LEVEL": "seq", "IS_CORRECTION_MODE": "trunc"},
        "bad-is-correction-gating": {"IS_CORRECTION_LEVEL": "token", "IS_CORRECTION_GATING": "kl"},
        "bad-dynamic-filtering": {"DYNAMIC_FILTERING": "on"},
        "bad-dynamic-filtering-range": {"DYNAMIC_FILTERING": "1", "DYNAMIC_FILTERING_RANGE": "0"},
        "range-without-filtering": {"DYNAMIC_FILTERING_RANGE": "0 1"},
    }.items():
        case(f"error-{name}", env=env)
    return out


def scratch(tmp: Path) -> None:
    """The files the cases read: a DeepScaleR-sized training file and the eval sets under
    data/, and beside the launch directory a small dataset, a plugin and a model."""
    sys.path.insert(0, str(TESTS))
    from launch_checks import write_data

    (tmp / "data").mkdir()
    write_data(tmp / "data")
    cwd = tmp / "cwd"
    cwd.mkdir()
    (cwd / "train.jsonl").write_text('{"prompt": "p", "label": "1"}\n' * 300)
    (cwd / "small.jsonl").write_text('{"prompt": "p", "label": "1"}\n' * 100)
    (cwd / "eval.jsonl").write_text('{"prompt": "p", "label": "1"}\n')
    (cwd / "style.py").write_text("def style(texts, lengths, labels):\n    return [0.0]\n")
    (cwd / "my-model").mkdir()


def launch_env(tree: Path, tmp: Path, case: dict) -> tuple[Path, list[str], dict[str, str]]:
    """The script, arguments and environment a case launches with (as tests/test_launch_scripts.py
    launches the recipes)."""
    path = [str(TESTS / "fakeslurm"), str(Path(sys.executable).parent), "/usr/bin:/bin"]
    env = {
        "PATH": os.pathsep.join(path),
        "HOME": str(tmp),
        "LANG": "C.UTF-8",
        "FAKE_LOG": str(tmp / "calls.jsonl"),
        "FAKE_STATE": str(tmp / "state"),
        "DATA_DIR": str(tmp / "data"),
        "OUTPUT_ROOT": str(tmp / "out"),
        "RAY_POLL_INTERVAL": "0.05",
        "PREFLIGHT": "0",
        "RAY_WAIT_TIMEOUT": "20",
        "TEARDOWN_TIMEOUT": "10",
    }
    if case["local"]:
        script, args = tree / "scripts" / "train_local_node.sh", [case["size"], *case["args"]]
    else:
        script, args = tree / "slurm" / f"drpo_{case['size']}.sh", case["args"]
        env |= SLURM_ENV | {"SLURM_SUBMIT_DIR": str(tree)}
    return script, args, env | case["env"]


def launch(tree: Path, tmp: Path, case: dict) -> dict:
    """One case through the launcher of ``tree``: its exit, and what it submitted or its
    error."""
    state, log = tmp / "state", tmp / "calls.jsonl"
    state.mkdir(exist_ok=True)
    log.write_text("")
    script, args, env = launch_env(tree, tmp, case)
    result = subprocess.run(
        ["bash", str(script), *args],
        env=env,
        cwd=tmp / "cwd",
        capture_output=True,
        text=True,
        timeout=scaled(120),  # a hang guard: the slowest case 1.2 s (2 cores at load 4-7)
    )
    output = result.stdout + result.stderr
    record: dict = {"exit": result.returncode}
    shape = re.search(r"mode=(\S+) nodes=(\d+) gpus/node=(\d+) ", output)
    if shape:
        record["shape"] = dict(zip(("mode", "nodes", "gpus_per_node"), shape.groups(), strict=True))
    submits = [json.loads(line) for line in log.read_text().splitlines()]
    submits = [
        c["argv"] for c in submits if c["prog"] == "ray" and c["argv"][:2] == ["job", "submit"]
    ]
    if submits:
        (argv,) = submits
        command = argv[argv.index("--") + 1 :]
        record["train_args"] = command[3:]
        record["runtime_env"] = argv[argv.index("--runtime-env-json") + 1]
    record["errors"] = [
        line.split("] ", 1)[1] for line in output.splitlines() if "] ERROR: " in line
    ]
    record["log"] = [
        line.split("] ", 1)[1] for line in output.splitlines() if " prompts: the first " in line
    ]
    return record


def placeholders(value, tmp: Path, tree: Path):
    if isinstance(value, str):
        for path, name in ((tree.resolve(), "@REPO@"), (tmp.resolve(), "@TMP@"), (tmp, "@TMP@")):
            value = value.replace(str(path), name)
        return value
    if isinstance(value, list):
        return [placeholders(v, tmp, tree) for v in value]
    if isinstance(value, dict):
        return {k: placeholders(v, tmp, tree) for k, v in value.items()}
    return value


def record_all(tree: Path) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="drpo-launch-") as name:
        tmp = Path(name)
        scratch(tmp)
        recorded = []
        for case in cases():
            result = launch(tree, tmp, case)
            recorded.append(case | placeholders(result, tmp, tree))
            print(f"{case['id']}: exit {result['exit']}", file=sys.stderr)
        return recorded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", help="record this git revision instead of the working tree")
    parser.add_argument("--out", type=Path, default=FIXTURE)
    args = parser.parse_args()
    if args.rev is None:
        recorded = record_all(REPO)
    else:
        with tempfile.TemporaryDirectory(prefix="drpo-rev-") as tree:
            archive = subprocess.run(
                ["git", "-C", str(REPO), "archive", args.rev], check=True, capture_output=True
            )
            subprocess.run(["tar", "-x", "-C", tree], input=archive.stdout, check=True)
            recorded = record_all(Path(tree))
    args.out.write_text(json.dumps(recorded, indent=1, ensure_ascii=False) + "\n")
    print(f"{len(recorded)} cases -> {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
