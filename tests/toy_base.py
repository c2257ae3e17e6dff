"""The tests' toy base policies, shipped in ``tests/fixtures/toy_base/<architecture>``: the
demo's quick base (about half its rollouts correct) on a Qwen2 and a Llama policy.

Shipped rather than trained per test session: the SFT took 3-6 minutes of the suite's CPU per
architecture, and its result differs from one CPU to another (float rounding), so the
pipeline tests now start from the same weights on every machine. ``stamp.json`` records the
recipe; ``tests/test_toy_base.py`` fails when the recipe in ``drpo_openrlhf.demo`` no longer
matches it. Rebuild both with ``python tests/toy_base.py``.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "toy_base"
ARCHITECTURES = ("qwen2", "llama")


def recipe(architecture: str) -> dict:
    """What the base is trained from (``demo.run.train_base``): the demo's quick settings."""
    from drpo_openrlhf.demo.run import DemoConfig

    config = DemoConfig.quick()
    return {
        "architecture": architecture,
        "hidden_size": config.hidden_size,
        "num_layers": config.num_layers,
        "seed": config.seed,
        "num_train_problems": config.num_train_problems,
        "task": dataclasses.asdict(config.task),
        "sft": dataclasses.asdict(config.sft),
    }


def build(output: Path, architecture: str) -> Path:
    """Trains the base into ``output`` (an HF model directory) with its ``stamp.json``."""
    from drpo_openrlhf.demo.run import DemoConfig, make_problems, train_base

    config = DemoConfig.quick()
    train_problems, _ = make_problems(config)
    init = output.with_name(output.name + ".init")
    train_base(config, init, output, train_problems, architecture=architecture)
    shutil.rmtree(init)
    (output / "stamp.json").write_text(json.dumps(recipe(architecture), indent=1) + "\n")
    return output


if __name__ == "__main__":
    for name in ARCHITECTURES:
        target = FIXTURES / name
        shutil.rmtree(target, ignore_errors=True)
        print("built", build(target, name))
