"""A recipe's settings -> the training command the launcher submits.

The recipes (``slurm/drpo_*.sh``) and users set environment variables (docs/launch.md);
``slurm/launch_ray_job.sh`` finds the cluster's shape and keeps the process control (Slurm,
Ray, signals, requeue) and asks this module for the rest: the ``python -m drpo_openrlhf.train``
flags (defaults, method, paths made absolute for Ray's copy of the repository, whole
episodes), the run's directory and the job's environment (Ray's runtime-env JSON).

    python -m drpo_openrlhf.runtime.recipe NODES GPUS_PER_NODE JOB_NAME WORKDIR [FLAG ...]

reads the settings from the environment, resolves relative paths against WORKDIR (where the
launcher runs), appends the FLAGs (the recipe's trailing arguments) to the command and prints
bash assignments for the launcher to ``eval``: ``run_name``, ``ckpt_dir``, ``stop_file``,
``runtime_env``, the array ``train_args`` and ``export`` lines. A setting it refuses is one
``[launch ...] ERROR:`` line on stderr and exit status 1.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from drpo_openrlhf.runtime.train_defaults import PACKAGE, default_value

USAGE = (
    "usage: python -m drpo_openrlhf.runtime.recipe NODES GPUS_PER_NODE JOB_NAME WORKDIR [FLAG ...]"
)

# algo.baseline_rewards.METHODS, written out: importing algo would load torch on every launch (about
# 1 s); tests/test_recipe_command.py holds the two equal
SHAPED_METHODS = ("rloo_lp", "alp", "hapo", "l1_max", "shorter_better", "laser_d")
METHODS = ("drpo", "disco", *SHAPED_METHODS)
# The recipe's settings where unset or empty (docs/launch.md); the recipes set MODEL, LR,
# ZERO_STAGE and the micro-batches. LAMBDA..BETA0 are the paper's (DRPOConfig's defaults,
# written out on the command line); the optimizer's are the entry point's own.
SETTINGS = {
    "METHOD": "drpo",
    "LAMBDA": "0.1",
    "TAU": "10",
    "DELTA": "1e-4",
    "BETA0": "1e3",
    "LENGTH_REWARD": "linear",
    "ROLLOUT_PROMPTS": "128",
    "N_SAMPLES": "8",
    "TRAIN_BATCH": "256",
    "MICRO_TRAIN_BATCH": "1",
    "MICRO_ROLLOUT_BATCH": "4",
    "PROMPT_MAX_LEN": "1024",
    "TEMPERATURE": default_value("--rollout.temperature")[0],
    "WEIGHT_DECAY": default_value("--actor.adam.weight_decay")[0],
    "ZERO_STAGE": "3",
    "VLLM_TP": "1",
    "VLLM_GPU_UTIL": "0.6",
    "PACKING": "1",
    "COLOCATE": "1",
    "ATTN_IMPL": "flash_attention_2",
    "MAX_STEPS": "1000",
    "SAVE_STEPS": "20",
    "EVAL_STEPS": "20",
    "EVAL_N_SAMPLES": "4",
    "CKPT_MAX_NUM": "3",
    "SAVE_HF": "0",
    # OpenRLHF also keeps a full checkpoint of the best evaluation so far (one more ZeRO
    # checkpoint on disk and a save at every new best, inside the step the time-limit grace
    # must fit); off unless BEST_CKPT=1 (docs/launch.md)
    "BEST_CKPT": "0",
    "SEED": "42",
    # relative: the job runs in Ray's copy of the repository
    "REWARD_FUNC": "drpo_openrlhf/rewards/math_reward.py",
    "WANDB_PROJECT": "drpo",
    # --drpo.device: a recipe is a GPU run, and a node whose workers see no CUDA stops it
    # before anything starts, named; auto for a test cluster of GPUs that do not exist
    "DEVICE": "gpu",
}
# runtime.device.DEVICES, written out (it imports torch); tests/test_recipe_command.py holds
# the two equal
DEVICES = ("auto", "gpu", "cpu")
# LONG=16k|32k: a recipe's long-response variant. Ring attention splits every packed
# micro-batch over 2 / 4 GPUs, so each GPU holds about as many tokens of it as in the 8k
# recipe (docs/launch.md, "Long responses"); MAX_NEW_TOKENS and RING_ATTN_SIZE still win.
LONG = {"": ("8192", "1"), "16k": ("16384", "2"), "32k": ("32768", "4")}
POSITIVE = [
    "ROLLOUT_PROMPTS",
    "N_SAMPLES",
    "TRAIN_BATCH",
    "MICRO_TRAIN_BATCH",
    "MICRO_ROLLOUT_BATCH",
    "MAX_NEW_TOKENS",
    "PROMPT_MAX_LEN",
    "RING_ATTN_SIZE",
    "VLLM_TP",
    "MAX_STEPS",
    "SAVE_STEPS",
    "EVAL_STEPS",
    "EVAL_N_SAMPLES",
]
# The off-policy modes (docs/async.md, docs/rollout-correction.md, docs/dynamic-filtering.md):
# unset, each leaves its flags off the command (the released runs). algo.rollout_correction's
# LEVELS, MODES and GATINGS, written out (no torch on a launch; tests/test_recipe_command.py
# holds them equal). What needs DRPO's rules (a band, a filtering range) is the preflight's.
IS_CORRECTION = {
    "IS_CORRECTION_LEVEL": ("--algo.advantage.is_correction_level", ("off", "token", "seq")),
    "IS_CORRECTION_MODE": ("--algo.advantage.is_correction_mode", ("mask", "clip")),
    "IS_CORRECTION_GATING": ("--algo.advantage.is_correction_gating", ("ratio", "binary_kl", "tv")),
}
NUMBER = r"[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?"
# What Ray copies to every node for the job (the sweep's Ray backend sends the same)
EXCLUDES = [".git", ".venv", "outputs", "results", "wandb", "__pycache__", "*.safetensors", "*.pt"]
# Forwarded to the job explicitly (srun already exports the batch environment to every node,
# but the job record then shows the settings): these prefixes plus RAY_ENV_VARS, never
# anything that looks like a secret; secrets reach the processes through the node environment.
FORWARDED = re.compile(r"(NCCL_|GLOO_|HF_|TRANSFORMERS_|VLLM_|WANDB_)")
OWN_SETTINGS = {"VLLM_TP", "VLLM_GPU_UTIL"}  # the launcher's, unknown to vLLM
SECRET = re.compile(r"(^|_)(KEY|TOKEN|SECRET|PASSWORD)(_|$)")


class RecipeError(ValueError):
    """A setting the launcher refuses, before any Ray node starts."""


@dataclass
class Plan:
    """What the launcher submits and where the run lives."""

    run_name: str
    ckpt_dir: str  # created by the launcher
    stop_file: str  # the trainer looks for it after every step (runtime/graceful_stop.py)
    train_args: list[str]
    exports: dict[str, str]  # for the nodes and the job
    runtime_env: str


def read_fields(text: str, separator: str) -> list[str]:
    """``IFS=<separator> read -ra`` of bash: the first line, split at each separator, a
    trailing empty field dropped."""
    parts = text.split("\n", 1)[0].split(separator)
    return parts[:-1] if parts[-1] == "" else parts


def read_words(text: str) -> list[str]:
    """The words of ``text`` split on bash's default IFS (space, tab, newline), quotes kept as
    they are: ``read -ra`` would keep only the first line, dropping the rest without a word."""
    text = text.strip(" \t\n")
    return re.split(r"[ \t\n]+", text) if text else []


def method_flags(env: Mapping[str, str]) -> list[str]:
    """The entry point's flags that choose METHOD (with LAMBDA / SHAPING_PARAMS): the one
    table of methods, for the launcher and the sweep."""
    method = env.get("METHOD") or SETTINGS["METHOD"]
    if method == "disco":  # DRPO without the length reward
        return ["--drpo.lam", "inf"]
    if method == "drpo":
        return ["--drpo.lam", env.get("LAMBDA") or SETTINGS["LAMBDA"]]
    if method not in SHAPED_METHODS:
        raise RecipeError(f"unknown METHOD '{method}' ({' '.join(METHODS)})")
    params = env.get("SHAPING_PARAMS", "")
    return ["--shaping.method", method, *(["--shaping.params", params] if params else [])]


class _Recipe:
    """One translation: the settings, read as bash's ``${NAME:-default}`` reads them."""

    def __init__(self, env: Mapping[str, str], workdir: str) -> None:
        self.env, self.workdir = env, workdir

    def get(self, name: str) -> str:
        return self.env.get(name) or SETTINGS.get(name, "")

    def path(self, path: str) -> str:
        return os.path.realpath(os.path.join(self.workdir, path))

    def exists(self, path: str) -> bool:
        return path != "" and os.path.exists(os.path.join(self.workdir, path))

    def is_file(self, path: str) -> bool:
        return path != "" and os.path.isfile(os.path.join(self.workdir, path))

    def looks_local(self, path: str) -> bool:
        return (
            path.startswith(("/", "."))
            or ".json" in path
            or path.endswith(".parquet")
            or (self.exists(path))
        )

    def positive_reward(self, spec: str) -> str:
        """POSITIVE_REWARD (docs/positive_rewards.md) with each plugin file's path made
        absolute: terms joined by '+', each ``[weight*]name`` with name a built-in or
        ``file.py[:function]``."""
        out = []
        for term in read_fields(spec, "+"):
            weight, star, name = term.partition("*")
            if not star:
                weight, name = "", term
            else:
                weight += "*"
            path = name.split(":", 1)[0]
            if path.endswith(".py"):
                if not self.is_file(path):
                    raise RecipeError(f"POSITIVE_REWARD: plugin file {path} does not exist")
                name = self.path(path) + name[len(path) :]
            out.append(weight + name)
        return "+".join(out)


def _switch(r: _Recipe, name: str) -> bool:
    value = r.get(name) or "0"
    if value not in ("0", "1"):
        raise RecipeError(f"{name} must be 0 or 1, got '{value}'")
    return value == "1"


def _numbers(r: _Recipe, name: str, counts: tuple[int, ...], shape: str) -> list[str]:
    words = read_words(r.get(name))
    if len(words) not in counts or not all(re.fullmatch(NUMBER, w) for w in words):
        raise RecipeError(f"{name} must be {shape}, got '{r.get(name)}'")
    return words


def off_policy_flags(r: _Recipe, colocate: bool) -> list[str]:
    """ASYNC, ASYNC_QUEUE, PARTIAL_ROLLOUT, IS_CORRECTION_*, DYNAMIC_FILTERING(_RANGE) as the
    entry point's flags; the combinations refused here are those the settings alone decide."""
    flags = []
    if _switch(r, "ASYNC"):
        # OpenRLHF then colocates only the DeepSpeed models: the engines need GPUs of their
        # own, and the recipe's --vllm.enable_sleep would be refused
        if colocate:
            raise RecipeError(
                "ASYNC=1 needs COLOCATE=0: generation runs beside training, so the vLLM "
                "engines need GPUs of their own and cannot sleep (docs/async.md)"
            )
        flags.append("--train.async_enable")
        if r.get("ASYNC_QUEUE"):
            if not re.fullmatch(r"[1-9][0-9]*", r.get("ASYNC_QUEUE")):
                raise RecipeError(
                    f"ASYNC_QUEUE must be a positive integer, got '{r.get('ASYNC_QUEUE')}'"
                )
            flags += ["--train.async_queue_size", r.get("ASYNC_QUEUE")]
    elif r.get("ASYNC_QUEUE"):
        raise RecipeError("ASYNC_QUEUE needs ASYNC=1: the synchronous trainer has no queue")
    if _switch(r, "PARTIAL_ROLLOUT"):
        if "--train.async_enable" not in flags:
            raise RecipeError(
                "PARTIAL_ROLLOUT=1 needs ASYNC=1: only the asynchronous trainer pauses the "
                "engines (docs/async.md)"
            )
        flags.append("--train.partial_rollout_enable")
    for name, (flag, choices) in IS_CORRECTION.items():
        value = r.get(name)
        if value and value not in choices:
            raise RecipeError(f"{name} must be one of {' '.join(choices)}, got '{value}'")
        if value:
            flags += [flag, value]
    if r.get("IS_CORRECTION_THRESHOLD"):
        band = _numbers(r, "IS_CORRECTION_THRESHOLD", (1, 2), "'HIGH' or 'LOW HIGH' (numbers)")
        flags += ["--algo.advantage.is_correction_threshold", *band]
    tuning = [n for n in (*list(IS_CORRECTION)[1:], "IS_CORRECTION_THRESHOLD") if r.get(n)]
    if tuning and r.get("IS_CORRECTION_LEVEL") in ("", "off"):
        raise RecipeError(
            f"IS_CORRECTION_LEVEL must be token or seq when {', '.join(tuning)} is set: the "
            "correction's mode, gating and threshold do nothing without a level "
            "(docs/rollout-correction.md)"
        )
    if _switch(r, "DYNAMIC_FILTERING"):
        flags.append("--algo.dynamic_filtering_enable")
        if r.get("DYNAMIC_FILTERING_RANGE"):
            band = _numbers(r, "DYNAMIC_FILTERING_RANGE", (2,), "'LO HI' (two numbers)")
            flags += ["--algo.dynamic_filtering_range", *band]
    elif r.get("DYNAMIC_FILTERING_RANGE"):
        raise RecipeError(
            "DYNAMIC_FILTERING_RANGE needs DYNAMIC_FILTERING=1: OpenRLHF ignores a range "
            "without the filter (docs/dynamic-filtering.md)"
        )
    return flags


def sanitize(name: str) -> str:
    """A run name from a job name: bytes other than letters, digits and ``._-`` become ``-``
    (as ``tr -c``), trailing ``-`` dropped."""
    keep = re.compile(rb"[A-Za-z0-9._-]")
    out = bytes(b if keep.fullmatch(bytes([b])) else ord("-") for b in name.encode())
    return out.decode().rstrip("-")


def last_value(flag: str, argv: list[str]) -> str:
    """The value of the last ``FLAG VALUE`` / ``FLAG=VALUE`` (argparse's choice when a
    trailing flag overrides the recipe's)."""
    value, take = "", False
    for arg in argv:
        if take:
            value, take = arg, False
        elif arg == flag:
            take = True
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def bash_quote(text: str) -> str:
    """``${text@Q}`` of bash for a string with control characters: ``$'...'``."""
    names = {"\a": "a", "\b": "b", "\t": "t", "\n": "n", "\v": "v", "\f": "f", "\r": "r"}
    names |= {"\x1b": "E", "\\": "\\", "'": "'"}
    chars = (
        "\\" + names[c] if c in names else f"\\{ord(c):03o}" if _control(c) else c for c in text
    )
    return "$'" + "".join(chars) + "'"


def _control(char: str) -> bool:
    return ord(char) < 0x20 or 0x7F <= ord(char) <= 0x9F


def runtime_env(env: Mapping[str, str], repo: str) -> str:
    """Ray's runtime-env JSON: the repository as the job's working directory, and the
    forwarded variables that are set, by name."""
    names = {n for n in env if FORWARDED.match(n) and n not in OWN_SETTINGS}
    names |= {"TOKENIZERS_PARALLELISM", "PYTHONUNBUFFERED"}
    names |= set(read_words(env.get("RAY_ENV_VARS", "").replace(",", " ")))
    env_vars = {n: env[n] for n in sorted(names) if not SECRET.search(n) and n in env}
    for text in (*(t for pair in env_vars.items() for t in pair), repo):
        if any(_control(c) for c in text):
            raise RecipeError(
                f"cannot pass a value with control characters to Ray: {bash_quote(text)}"
            )
    runtime = {"working_dir": repo, "excludes": EXCLUDES, "env_vars": env_vars}
    return json.dumps(runtime, ensure_ascii=False)


def _checked_settings(r: _Recipe) -> dict[str, str]:
    """The settings with LONG's token budget and ring size filled in, each checked before any
    flag is built so that a bad one names itself."""
    if not r.get("MODEL"):
        raise RecipeError("MODEL (HF id or local path of the policy) is required")
    if not r.get("LR"):
        raise RecipeError("LR is required")
    long = r.get("LONG")
    if long not in LONG:
        raise RecipeError(f"LONG must be 16k or 32k, got '{long}'")
    s = {name: r.get(name) for name in SETTINGS}
    s["MAX_NEW_TOKENS"] = r.get("MAX_NEW_TOKENS") or LONG[long][0]
    s["RING_ATTN_SIZE"] = r.get("RING_ATTN_SIZE") or LONG[long][1]
    for name in POSITIVE:
        if not re.fullmatch(r"[1-9][0-9]*", s[name]):
            raise RecipeError(f"{name} must be a positive integer, got '{s[name]}'")
    if s["BEST_CKPT"] not in ("0", "1"):
        raise RecipeError(f"BEST_CKPT must be 0 or 1, got '{s['BEST_CKPT']}'")
    if s["DEVICE"] not in DEVICES:
        raise RecipeError(f"DEVICE must be one of {' '.join(DEVICES)}, got '{s['DEVICE']}'")
    return s


def _placement(
    r: _Recipe, s: Mapping[str, str], nodes: int, gpus_per_node: int
) -> tuple[int, int, list[str]]:
    """Actor GPUs per node, vLLM GPUs in all and the placement flags: how COLOCATE shares the
    cluster's GPUs between training and generation."""
    # Colocated (the recipes): every GPU holds one DeepSpeed rank and, time-shared, a slice of
    # a vLLM engine. COLOCATE=0: ACTOR_GPUS_PER_NODE GPUs of each node train, the others
    # generate (also the layout of the CPU pipeline, whose vLLM cannot sleep). The batch
    # arithmetic is checked by the entry point itself (the launcher's preflight).
    if s["COLOCATE"] == "1":
        actor_gpus, vllm_gpus = gpus_per_node, nodes * gpus_per_node
        placement = ["--train.colocate_all", "--vllm.enable_sleep", "--ds.enable_sleep"]
    elif s["COLOCATE"] == "0":
        given = r.get("ACTOR_GPUS_PER_NODE") or str(gpus_per_node // 2)
        if not (re.fullmatch(r"-?[0-9]+", given) and 1 <= int(given) < gpus_per_node):
            raise RecipeError(
                f"COLOCATE=0 needs 1 <= ACTOR_GPUS_PER_NODE < GPUS_PER_NODE={gpus_per_node}, "
                f"got '{given}'"
            )
        actor_gpus = int(given)
        vllm_gpus, placement = nodes * (gpus_per_node - actor_gpus), []
    else:
        raise RecipeError(f"COLOCATE must be 1 or 0, got '{s['COLOCATE']}'")
    vllm_tp = int(s["VLLM_TP"])
    if vllm_gpus % vllm_tp:
        raise RecipeError(
            f"{vllm_gpus} GPUs cannot be split into vLLM engines of VLLM_TP={vllm_tp}"
        )
    return actor_gpus, vllm_gpus, placement


def _method_args(r: _Recipe, env: Mapping[str, str], s: Mapping[str, str]) -> tuple[list[str], str]:
    """METHOD's flags (estimator, loss settings) and the tag it gives the run's name, so that
    each method's runs keep their own checkpoints."""
    # DRPO (default), DisCO (DRPO without the length reward), or a shaped-reward baseline
    # trained with OpenRLHF's PPO loss and group advantages
    method = s["METHOD"]
    selected = method_flags(env)
    estimator = (
        r.get("ESTIMATOR")
        or default_value(
            "--algo.advantage.estimator", None if method in ("drpo", "disco") else method
        )[0]
    )
    method_args = ["--algo.advantage.estimator", estimator, *selected]
    if method in ("drpo", "disco"):
        run_tag = "disco" if method == "disco" else f"drpo_lam{s['LAMBDA']}"
        method_args += ["--drpo.tau", s["TAU"], "--drpo.delta", s["DELTA"]]
        method_args += ["--drpo.beta0", s["BETA0"], "--drpo.length_reward", s["LENGTH_REWARD"]]
        if r.get("DRPO_MAX_LEN"):
            method_args += ["--drpo.max_len", r.get("DRPO_MAX_LEN")]
        if r.get("POSITIVE_REWARD"):
            method_args += ["--drpo.positive_reward", r.positive_reward(r.get("POSITIVE_REWARD"))]
    else:
        params = r.get("SHAPING_PARAMS")
        run_tag = method + (f"_{params}" if params else "")
    return method_args, run_tag


def _data_paths(r: _Recipe, env: Mapping[str, str], repo: str) -> tuple[str, str]:
    """TRAIN_DATA and EVAL_DATA with local files checked and made absolute: the job runs in
    Ray's copy of the repository, so user paths must be absolute (and on storage every node
    sees)."""
    data_dir = r.get("DATA_DIR") or os.path.join(repo, "data")
    train_data = r.get("TRAIN_DATA") or f"{data_dir}/deepscaler.jsonl"
    if r.looks_local(train_data):
        if not r.is_file(train_data):
            raise RecipeError(
                f"TRAIN_DATA={train_data} does not exist (python -m drpo_openrlhf.data)"
            )
        train_data = r.path(train_data)
    evals = ("aime2024", "aime2025", "amc", "math500")
    eval_data = env.get("EVAL_DATA", ",".join(f"{data_dir}/{name}.jsonl" for name in evals))
    eval_files = []
    for item in read_fields(eval_data, ",") if eval_data else []:
        if r.looks_local(item):
            if not r.is_file(item):
                raise RecipeError(
                    f"eval set {item} does not exist (set EVAL_DATA, or EVAL_DATA= to disable)"
                )
            item = r.path(item)
        eval_files.append(item)
    return train_data, ",".join(eval_files)


def _episodes(
    r: _Recipe, s: Mapping[str, str], train_data: str, log: Callable[[str], None]
) -> tuple[str, list[str]]:
    """NUM_EPISODES and the ``--data.max_samples`` flags: whole episodes of whole rollouts
    covering MAX_STEPS, so that no short rollout leaves prompts out."""
    # OpenRLHF ends an episode (a pass over the prompts) with whatever prompts are left; DRPO
    # trains only the whole-group optimizer steps of such a short rollout (and logs what it
    # left out): train on the first whole rollouts' worth of prompts so nothing is left out.
    # Cover MAX_STEPS with whole episodes; --drpo.max_steps stops the run exactly there.
    data_args = []
    episodes, rollout, max_steps = r.get("NUM_EPISODES"), int(s["ROLLOUT_PROMPTS"]), s["MAX_STEPS"]
    if r.is_file(train_data) and train_data.endswith(".jsonl"):
        with open(os.path.join(r.workdir, train_data), "rb") as f:
            prompts = sum(1 for line in f if line.rstrip(b"\n"))
        per_episode = prompts // rollout
        if not per_episode:
            raise RecipeError(
                f"TRAIN_DATA={train_data} has {prompts} prompts, fewer than "
                f"ROLLOUT_PROMPTS={rollout}"
            )
        data_args = ["--data.max_samples", str(per_episode * rollout)]
        episodes = episodes or str(math.ceil(int(max_steps) / per_episode))
    if not episodes:
        raise RecipeError(f"cannot count the prompts of TRAIN_DATA={train_data}; set NUM_EPISODES")
    if not re.fullmatch(r"[1-9][0-9]*", episodes):
        raise RecipeError(f"NUM_EPISODES must be a positive integer, got '{episodes}'")
    if data_args:
        log(
            f"{prompts} prompts: the first {per_episode * rollout} make {per_episode} "
            f"steps/episode; {episodes} episode(s) = {int(episodes) * per_episode} steps "
            f"(MAX_STEPS={max_steps})"
        )
    return episodes, data_args


def _optimizer_args(lr: str, s: Mapping[str, str]) -> list[str]:
    """The optimizer's flags: LR and WEIGHT_DECAY, the rest the entry point's defaults written
    out, so the job record shows them."""
    return [
        *("--actor.adam.lr", lr, "--actor.adam.betas", *default_value("--actor.adam.betas")),
        *("--actor.adam.weight_decay", s["WEIGHT_DECAY"]),
        *("--actor.lr_scheduler", *default_value("--actor.lr_scheduler")),
        *("--actor.lr_warmup_ratio", *default_value("--actor.lr_warmup_ratio")),
        *("--actor.max_norm", "1.0", "--algo.kl.init_coef", *default_value("--algo.kl.init_coef")),
    ]


def _optional_args(s: Mapping[str, str], eval_data: str) -> list[str]:
    """Packing, ring attention, the HF save and the evaluation: flags only the settings that
    ask for them add."""
    args = []
    if s["PACKING"] == "1":
        args.append("--ds.packing_samples")
    if int(s["RING_ATTN_SIZE"]) > 1:
        # OpenRLHF would turn packing on by itself; say so instead of running another layout
        if s["PACKING"] != "1":
            raise RecipeError(
                f"RING_ATTN_SIZE={s['RING_ATTN_SIZE']} needs PACKING=1: ring attention splits "
                "packed sequences"
            )
        args += ["--ds.ring_attn_size", s["RING_ATTN_SIZE"]]
    if s["SAVE_HF"] == "1":
        args.append("--ckpt.save_hf")
    if eval_data:
        args += ["--eval.dataset", eval_data, "--eval.steps", s["EVAL_STEPS"]]
        args += ["--eval.temperature", s["TEMPERATURE"]]
        args += ["--eval.n_samples_per_prompt", s["EVAL_N_SAMPLES"]]
        if s["BEST_CKPT"] != "1":
            args += ["--ckpt.best_metric_key", "none"]
    return args


def _logging(
    r: _Recipe, env: Mapping[str, str], s: Mapping[str, str], run_name: str
) -> tuple[list[str], dict[str, str]]:
    """The wandb flags and the job's exports (network interface, wandb's run): what the nodes'
    environment must carry rather than the command line."""
    args = []
    exports = {"TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    if r.get("NET_IFACE"):
        for name in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
            exports[name] = r.get(name) or r.get("NET_IFACE")
    # wandb logs when a key is in the environment (or WANDB=1 with a ~/.netrc login). OpenRLHF
    # turns it on for any non-empty --logger.wandb.key and wandb then reads WANDB_API_KEY
    # itself, so the secret never appears on a command line, in the Ray job record, or in
    # wandb's config.
    if r.get("WANDB_API_KEY") or env.get("WANDB", "0") == "1":
        args += ["--logger.wandb.key", "from-environment"]
        args += ["--logger.wandb.project", s["WANDB_PROJECT"]]
        args += ["--logger.wandb.run_name", run_name]
        if r.get("WANDB_ENTITY"):
            args += ["--logger.wandb.org", r.get("WANDB_ENTITY")]
        if r.get("WANDB_GROUP"):
            args += ["--logger.wandb.group", r.get("WANDB_GROUP")]
        # a requeued job continues the same wandb run
        exports["WANDB_RUN_ID"] = r.get("WANDB_RUN_ID") or run_name
        exports["WANDB_RESUME"] = r.get("WANDB_RESUME") or "allow"
    return args, exports


def plan(
    env: Mapping[str, str],
    nodes: int,
    gpus_per_node: int,
    job_name: str,
    workdir: str,
    extra: list[str],
    repo: str,
    log: Callable[[str], None],
) -> Plan:
    """The launch of a recipe: ``env`` its settings, ``nodes`` x ``gpus_per_node`` the
    cluster the launcher found, ``extra`` the recipe's trailing flags; ``log`` says how the
    training data makes episodes."""
    r = _Recipe(env, workdir)
    s = _checked_settings(r)
    model, lr, long = r.get("MODEL"), r.get("LR"), r.get("LONG")
    actor_gpus, vllm_gpus, placement = _placement(r, s, nodes, gpus_per_node)
    vllm_tp = int(s["VLLM_TP"])
    method_args, run_tag = _method_args(r, env, s)
    if r.exists(model):
        model = r.path(model)
    train_data, eval_data = _data_paths(r, env, repo)

    # a long variant is its own run: it must not resume the 8k run's checkpoints
    run_name = r.get("RUN_NAME") or sanitize(f"{job_name}_{run_tag}" + (f"_{long}" if long else ""))
    output_root = r.path(r.get("OUTPUT_ROOT") or os.path.join(repo, "outputs"))
    run_dir = f"{output_root}/{run_name}"
    ckpt_dir = r.path(r.get("CKPT_DIR") or f"{run_dir}/ckpt")
    # With --ckpt.load_enable the entry point picks the newest *complete* checkpoint
    # (runtime/checkpoints.py) and logs "drpo_openrlhf: resuming from ...".
    episodes, data_args = _episodes(r, s, train_data, log)

    tokens = s["MAX_NEW_TOKENS"]
    train_args = [
        *("--actor.model_name_or_path", model),
        *("--actor.num_nodes", str(nodes), "--actor.num_gpus_per_node", str(actor_gpus)),
        *("--vllm.num_engines", str(vllm_gpus // vllm_tp), "--vllm.tensor_parallel_size"),
        *(s["VLLM_TP"], "--vllm.gpu_memory_utilization", s["VLLM_GPU_UTIL"], *placement),
        *("--ds.zero_stage", s["ZERO_STAGE"], "--ds.param_dtype", "bf16"),
        *("--ds.attn_implementation", s["ATTN_IMPL"], "--actor.gradient_checkpointing_enable"),
        *("--data.prompt_dataset", train_data, *data_args),
        *("--data.input_key", "prompt", "--data.label_key", "label"),
        *("--data.apply_chat_template", "--data.max_len"),
        str(int(s["PROMPT_MAX_LEN"]) + int(tokens)),
        *("--rollout.max_new_tokens", tokens),
        *("--rollout.batch_size", s["ROLLOUT_PROMPTS"]),
        *("--rollout.n_samples_per_prompt", s["N_SAMPLES"]),
        *("--rollout.micro_batch_size", s["MICRO_ROLLOUT_BATCH"]),
        *("--rollout.temperature", s["TEMPERATURE"], "--rollout.top_p", "1.0"),
        *("--train.batch_size", s["TRAIN_BATCH"]),
        *("--train.micro_batch_size", s["MICRO_TRAIN_BATCH"]),
        *("--train.num_episodes", episodes, "--train.seed", s["SEED"]),
        *("--drpo.max_steps", s["MAX_STEPS"], "--drpo.device", s["DEVICE"]),
        *_optimizer_args(lr, s),
        *("--reward.remote_url", s["REWARD_FUNC"]),
        *("--ckpt.path", ckpt_dir, "--ckpt.load_enable", "--ckpt.save_steps", s["SAVE_STEPS"]),
        *("--ckpt.max_num", s["CKPT_MAX_NUM"], "--ckpt.output_dir", f"{run_dir}/model"),
        *("--logger.logging_steps", "1", "--logger.tensorboard_dir", f"{run_dir}/tensorboard"),
    ]
    train_args += _optional_args(s, eval_data)
    train_args += off_policy_flags(r, s["COLOCATE"] == "1")
    logging_args, exports = _logging(r, env, s, run_name)
    train_args += [*logging_args, *method_args, *read_words(r.get("EXTRA_ARGS")), *extra]

    return Plan(
        run_name=run_name,
        ckpt_dir=ckpt_dir,
        stop_file=last_value("--ckpt.path", train_args) + "/DRPO_STOP_REQUESTED",
        train_args=train_args,
        exports=exports,
        runtime_env=runtime_env({**env, **exports}, repo),
    )


def _log(message: str) -> None:
    print(f"[launch {time.strftime('%Y-%m-%d %H:%M:%S')}] {message}", file=sys.stderr)


def bash_assignments(p: Plan) -> str:
    """The plan as the lines the launcher ``eval``s."""
    q = shlex.quote
    lines = [f"{name}={q(getattr(p, name))}" for name in ("run_name", "ckpt_dir", "stop_file")]
    lines.append(f"runtime_env={q(p.runtime_env)}")
    lines.append(f"train_args=({' '.join(q(a) for a in p.train_args)})")
    lines += [f"export {name}={q(value)}" for name, value in p.exports.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) < 4 or not all(re.fullmatch(r"[0-9]+", n) for n in argv[:2]):
        print(USAGE, file=sys.stderr)
        return 2
    nodes, gpus, job_name, workdir, *extra = argv
    repo = str(PACKAGE.parent)
    try:
        p = plan(os.environ, int(nodes), int(gpus), job_name, workdir, extra, repo, _log)
    except RecipeError as error:
        _log(f"ERROR: {error}")
        return 1
    sys.stdout.write(bash_assignments(p))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
