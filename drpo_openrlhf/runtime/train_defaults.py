"""The OpenRLHF flag values DRPO's entry point applies where the user gives none, and the
reward file they name. One home for the entry point (``drpo_openrlhf.train``) and the recipes'
command (``runtime/recipe.py``): torch-free, so the launcher reads them in milliseconds."""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]


def reward_plugin_path(name: str = "math_reward.py") -> str:
    """A reward file of ours as the vLLM engines on every node will find it (they load it by
    path): relative to the working directory inside a Ray ``working_dir`` copy, whose absolute
    path differs from node to node; absolute otherwise (same install path on every node)."""
    path = PACKAGE / "rewards" / name
    if "working_dir_files" in path.parts and path.is_relative_to(Path.cwd().resolve()):
        return str(path.relative_to(Path.cwd().resolve()))
    return str(path)


MATH_REWARD = reward_plugin_path()

# OpenRLHF flags whose PPO defaults do not fit DRPO; applied unless the user passes them.
DRPO_DEFAULTS: dict[str, list[str]] = {
    # no reference model: DRPO's trust region is around pi_old, not a reference policy
    "--algo.kl.init_coef": ["0"],
    # the estimator only feeds PPO's advantages, which DRPO ignores; gae would need a critic
    "--algo.advantage.estimator": ["group_norm"],
    # 0/1 correctness from math-verify, with a deadline per response
    "--reward.remote_url": [MATH_REWARD],
    # the authors' optimiser: AdamW (0.9, 0.999), weight decay 0.01, constant LR, no warmup
    "--actor.adam.betas": ["0.9", "0.999"],
    "--actor.adam.weight_decay": ["0.01"],
    "--actor.lr_scheduler": ["constant"],
    "--actor.lr_warmup_ratio": ["0"],
    # the authors' rollout temperature (scores use logits / temperature, as in OpenRLHF)
    "--rollout.temperature": ["0.6"],
    # fp32 gradient accumulation, as released; ZeRO-3 honours it, ZeRO-2 does not (docs/gpu.md)
    "--ds.grad_accum_dtype": ["fp32"],
}


def baseline_defaults(method: str) -> dict[str, list[str]]:
    """The paper's estimator for each baseline (RLOO for RLOO-LP, GRPO otherwise) and the
    math reward; everything else stays OpenRLHF's (set clip, KL, ... per the paper's recipes)."""
    estimator = "rloo" if method == "rloo_lp" else "group_norm"
    return {
        "--algo.advantage.estimator": [estimator],
        "--reward.remote_url": [MATH_REWARD],
        "--ds.grad_accum_dtype": ["fp32"],
    }


def default_value(flag: str, method: str | None = None) -> list[str]:
    """What the entry point sets ``flag`` to for ``method`` (None: DRPO) when it is not given."""
    return (baseline_defaults(method) if method else DRPO_DEFAULTS)[flag]
