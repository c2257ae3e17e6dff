"""The tests' toy base policies, shipped in ``tests/fixtures/toy_base/<architecture>``: the
demo's quick base (about half its rollouts correct) on a Qwen2 and a Llama policy.

Shipped rather than trained per test session: the SFT took 3-6 minutes of the suite's CPU per
architecture, and its result differs from one CPU to another (float rounding), so the
pipeline tests now start from the same weights on every machine. ``stamp.json`` records the
recipe; ``tests/test_toy_base.py`` fails when the recipe in ``drpo_openrlhf.demo`` no longer
matches it. Rebuild both with ``python tests/toy_base.py``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "toy_base"
ARCHITECTURES = ("qwen2", "llama")


def recipe(architecture: str) -> dict:
    """What the base is trained from (``demo.bases.train_base``): the demo's quick settings."""
    from drpo_openrlhf.demo.bases import recipe
    from drpo_openrlhf.demo.config import DemoConfig

    return recipe(DemoConfig.quick(), architecture)


if __name__ == "__main__":
    from drpo_openrlhf.demo.bases import build
    from drpo_openrlhf.demo.config import DemoConfig

    for name in ARCHITECTURES:
        target = FIXTURES / name
        shutil.rmtree(target, ignore_errors=True)
        print("built", build(DemoConfig.quick(), target, name))
