"""Toy run: does a positive reward other than length move what it targets?

The demo's toy (``make demo``'s task, seeded SFT base, ``python -m drpo_openrlhf.train`` and
``drpo-eval``'s evaluation), run by ``scripts/toy_ablation.py`` with its settings narrowed to
the comparison of docs/positive_rewards.md: the base, DisCO (no ranking of correct
responses), DRPO ranking them by length, and DRPO ranking them by ``fewer_reflections``.
The toy's traces re-check their sums with "Wait, let me check." (two reflection phrases),
so ``rechecks`` in the report is the quantity ``fewer_reflections`` targets; ``skipped``
(answers without the steps) is a length cut that ``fewer_reflections`` does not reward.

    python scripts/toy_positive_reward.py --out outputs/positive-reward --seeds 0
    python scripts/toy_positive_reward.py --out outputs/positive-reward --report
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import toy_ablation  # a script beside this one, not a package

REFLECTIONS = ("--drpo.lam", "0.1", "--drpo.positive_reward", "fewer_reflections")
COMPARED = ("base", "disco", "drpo-0.1")


def main() -> None:
    settings = {name: toy_ablation.SETTINGS[name] for name in COMPARED}
    settings["reflections-0.1"] = (REFLECTIONS, {})
    toy_ablation.SETTINGS = settings  # its main, run_one and report read this table
    toy_ablation.main()


if __name__ == "__main__":
    main()
