"""What the launch-script tests share: the recipes' expected training commands, the option
strings they are checked against, and the call log the `ray` stand-in writes
(tests/test_launch_scripts.py under a fake Slurm, tests/test_slurm_recipes.py under a real one).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path

from drpo_openrlhf.train import build_parser, parse

REPO = Path(__file__).resolve().parents[1]
FAKE_BIN = REPO / "tests" / "fakeslurm"
LAUNCHER = REPO / "slurm" / "launch_ray_job.sh"
RECIPES = {
    "1.5b": dict(
        model="deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", lr=2e-6, zero=3, micro=4, rollout_micro=8
    ),
    "7b": dict(
        model="deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", lr=1e-6, zero=3, micro=2, rollout_micro=4
    ),
    "8b": dict(
        model="deepseek-ai/DeepSeek-R1-Distill-Llama-8B", lr=5e-7, zero=3, micro=2, rollout_micro=4
    ),
}
EVAL_SETS = ("aime2024", "aime2025", "amc", "math500")
DEEPSCALER_PROMPTS = 40315  # 314 whole rollouts of 128 prompts, and 123 left over


def recipe(size: str) -> Path:
    return REPO / "slurm" / f"drpo_{size}.sh"


def write_data(d: Path) -> Path:
    """A DeepScaleR-sized training file (one short row per prompt) and four eval sets."""
    row = '{"prompt": "p", "label": "1", "datasource": "x"}\n'
    (d / "deepscaler.jsonl").write_text(row * DEEPSCALER_PROMPTS)
    for name in EVAL_SETS:
        (d / f"{name}.jsonl").write_text(row)
    return d


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


@dataclass
class Run:
    """One launch: its exit code, its output and the stand-ins' call log."""

    returncode: int
    output: str
    calls: list[dict]

    @classmethod
    def read(cls, returncode: int, output: str, log: Path) -> Run:
        return cls(returncode, output, [json.loads(line) for line in log.read_text().splitlines()])

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
        assert command[1:3] == ["-m", "drpo_openrlhf.train"]
        return command[3:]

    @property
    def runtime_env(self) -> dict:
        argv = self.submit
        return json.loads(argv[argv.index("--runtime-env-json") + 1])

    def args(self) -> dict:
        """The training command as drpo_openrlhf.train parses it (flag name -> value)."""
        return vars(build_parser().parse_args(self.train_args))

    def stopped_nodes(self) -> set[str]:
        """Nodes whose blocking `ray start` ended on SIGTERM (not killed)."""
        return {c["node"] for c in self.of("ray", "<stopped>")}


def assert_flags_known(run: Run) -> None:
    """Every flag is one OpenRLHF's parser defines or one the DRPO entry point adds, and the
    entry point accepts the whole command (types, choices, PPO-only flags, group layout)."""
    known = openrlhf_option_strings() | entry_point_option_strings()
    assert [a for a in run.train_args if a.startswith("--") and a not in known] == []
    parse(run.train_args)  # exits with a usage error on anything it refuses


def expected_recipe_args(size: str, data_dir: Path, run_dir: Path, nodes: int) -> dict:
    """The paper's settings a recipe must submit (docs/launch.md), with 8 GPUs per node."""
    spec = RECIPES[size]
    return {
        "actor.model_name_or_path": spec["model"],
        "actor.adam.lr": spec["lr"],
        "actor.adam.weight_decay": 0.01,
        "actor.adam.betas": [0.9, 0.999],
        "actor.lr_scheduler": "constant",
        "actor.lr_warmup_ratio": 0.0,
        "actor.max_norm": 1.0,
        "actor.num_nodes": nodes,
        "actor.num_gpus_per_node": 8,
        "actor.gradient_checkpointing_enable": True,
        "vllm.num_engines": 8 * nodes,
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
        "rollout.micro_batch_size": spec["rollout_micro"],
        "vllm.gpu_memory_utilization": 0.6,
        "rollout.max_new_tokens": 8192,
        "data.max_len": 1024 + 8192,
        "rollout.temperature": 0.6,
        "rollout.top_p": 1.0,
        "algo.kl.init_coef": 0.0,
        "data.prompt_dataset": str(data_dir / "deepscaler.jsonl"),
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
        "eval.dataset": ",".join(str(data_dir / f"{n}.jsonl") for n in EVAL_SETS),
        "eval.temperature": 0.6,
        "train.num_episodes": 4,  # 314 steps per episode: 4 episodes cover 1000 steps
        "logger.wandb.key": None,
    }
