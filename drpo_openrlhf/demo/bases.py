"""The demo's base policies, shipped for seeds 0-2 in ``drpo_openrlhf/demo/bases/seed<N>``.

The SFT that makes a base is seeded, but its float rounding differs from one CPU to another:
seed 0's base scored 43.5, 63.3 and 46.5 pass@1 on three machines, more than any method
moved it. Shipping the bases makes the demo and the toy sweep start from the same weights
everywhere; the SFT stays the way to rebuild them (``python -m drpo_openrlhf.demo.bases``)
and serves any other seed or setting. ``stamp.json`` records what a base was trained from;
a base is used only while that still equals the current recipe.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
from pathlib import Path

from drpo_openrlhf.demo.config import DemoConfig, make_problems, with_seed
from drpo_openrlhf.demo.toy_task import ToyProblem

SHIPPED = Path(__file__).resolve().parent / "bases"
SHIPPED_SEEDS = (0, 1, 2)


def train_base(
    config: DemoConfig,
    init_dir: Path,
    base_dir: Path,
    train_problems: list[ToyProblem],
    *,
    architecture: str = "qwen2",
    progress: bool = False,
) -> Path:
    """The demo's base policy: the toy model at ``config``'s size and seed (``init_dir``),
    fine-tuned on traces of ``train_problems`` into ``base_dir``."""
    from drpo_openrlhf.demo.sft import train_sft
    from drpo_openrlhf.demo.toy_model import build_toy_model
    from drpo_openrlhf.demo.toy_task import sample_traces

    init = build_toy_model(
        init_dir,
        hidden_size=config.hidden_size,
        num_layers=config.num_layers,
        seed=config.seed,
        architecture=architecture,
    )
    traces = sample_traces(random.Random(config.seed + 1), config.task, train_problems)
    return train_sft(init, base_dir, traces, config.sft, progress=progress)


def recipe(config: DemoConfig, architecture: str = "qwen2") -> dict:
    """Everything ``train_base`` reads: model size, seed, task, problems and SFT settings."""
    return {
        "architecture": architecture,
        "hidden_size": config.hidden_size,
        "num_layers": config.num_layers,
        "seed": config.seed,
        "num_train_problems": config.num_train_problems,
        "task": dataclasses.asdict(config.task),
        "sft": dataclasses.asdict(config.sft),
    }


def stamped(model_dir: Path, config: DemoConfig, architecture: str = "qwen2") -> bool:
    """Whether ``model_dir`` holds a base trained from ``config``'s current recipe."""
    stamp = model_dir / "stamp.json"
    return stamp.is_file() and json.loads(stamp.read_text()) == recipe(config, architecture)


def build(
    config: DemoConfig, output: Path, architecture: str = "qwen2", *, progress: bool = False
) -> Path:
    """Trains the base into ``output`` (an HF model directory) and stamps it."""
    train_problems, _ = make_problems(config)
    init = output.with_name(output.name + ".init")
    train_base(config, init, output, train_problems, architecture=architecture, progress=progress)
    shutil.rmtree(init)
    (output / "stamp.json").write_text(json.dumps(recipe(config, architecture), indent=1) + "\n")
    return output


def provide_base(
    config: DemoConfig, output: Path, *, retrain: bool = False, progress: bool = False
) -> str:
    """Puts the base for ``config`` in ``output``: a copy of the shipped one when it was
    trained from this recipe (unless ``retrain``), else a fresh SFT. Returns which."""
    shutil.rmtree(output, ignore_errors=True)
    shipped = SHIPPED / f"seed{config.seed}"
    if not retrain and stamped(shipped, config):
        shutil.copytree(shipped, output)
        return "shipped"
    build(config, output, progress=progress)
    return "trained"


if __name__ == "__main__":
    for seed in SHIPPED_SEEDS:
        target = SHIPPED / f"seed{seed}"
        shutil.rmtree(target, ignore_errors=True)
        print("built", build(with_seed(DemoConfig(), seed), target), flush=True)
