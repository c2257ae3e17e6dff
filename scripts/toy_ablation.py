"""Why does DisCO trail RLOO on the demo's toy? Each setting over several seeds (docs/demo.md).

Every run is ``make demo``'s: the same seeded data, SFT base, ``python -m drpo_openrlhf.train``
command and ``drpo-eval`` evaluation (``drpo_openrlhf/demo/``); a setting changes only
the flags it names. Results are written per (setting, seed) as they finish, so a rerun skips
what is done; ``--report`` prints the table (mean and min..max over seeds).

    python scripts/toy_ablation.py --out outputs/ablation --seeds 0 1 2 [--settings ...]
    python scripts/toy_ablation.py --out outputs/ablation --report
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path

from drpo_openrlhf.demo.config import DemoConfig, with_seed
from drpo_openrlhf.demo.results import evaluate, misled_share
from drpo_openrlhf.demo.training import Run, local_ray_cluster, run_logged, train_command
from drpo_openrlhf.sweep.toy import build_seed

DISCO = ("--drpo.lam", "inf")
RLOO = ("--shaping.method", "rloo_lp", "--algo.kl.init_coef", "0")

# The learning rate every setting ran at unless it names its own: the demo's earlier one
# (the ablation is what moved the demo to 5e-5), kept so that the table's rows stay comparable.
ABLATION_LR = 2e-4

# name -> (train flags, RLConfig overrides). "base" evaluates the SFT policy untrained.
SETTINGS: dict[str, tuple[tuple[str, ...], dict]] = {
    "base": ((), {}),
    "disco": (DISCO, {}),
    "rloo-alpha0": ((*RLOO, "--shaping.params", "alpha=0"), {}),
    "disco-delta1e-2": ((*DISCO, "--drpo.delta", "1e-2"), {}),
    "disco-beta0-1e4": ((*DISCO, "--drpo.beta0", "1e4"), {}),
    "disco-lr5e-5": (DISCO, {"lr": 5e-5}),
    "disco-tau1": ((*DISCO, "--drpo.tau", "1"), {}),
    "drpo-0.1": (("--drpo.lam", "0.1"), {}),
    "rloo-lp-0.2": ((*RLOO, "--shaping.params", "alpha=0.2"), {}),
    "disco-64steps": (DISCO, {"rollout_steps": 64}),
    "rloo-alpha0-lr5e-5": ((*RLOO, "--shaping.params", "alpha=0"), {"lr": 5e-5}),
}

# Settings whose run is also evaluated at an earlier rollout step, from a model it saves there:
# the same run up to that step, so the comparison is paired (a second, shorter run would not
# be: a seed does not fix vLLM's CPU sampling).
MIDPOINTS = {"disco-64steps": 32}


def base_policy(config: DemoConfig, root: Path) -> tuple[Path, Path, Path]:
    """The seed's SFT base, training and evaluation files (the sweep's toy seed folder)."""
    build_seed(config, root)
    return root / "base", root / "train.jsonl", root / "eval.jsonl"


def means(tensorboard_dir: Path, tags: list[str]) -> dict[str, float | None]:
    from drpo_openrlhf.eval.tensorboard_logs import read_scalars

    logged = read_scalars(tensorboard_dir)
    return {
        tag.rsplit("/", 1)[-1]: (statistics.fmean(logged[tag].values()) if tag in logged else None)
        for tag in tags
    }


def evaluated(config: DemoConfig, model: Path, name: str, eval_file: Path, results: Path) -> dict:
    """pass@1, length, skipped steps and re-checks of ``model``, averaged over the datasets."""
    from drpo_openrlhf.eval.runner import RunLabel

    label = RunLabel(name, name, name, "setting", "base" if name == "base" else "run")
    docs, shapes = evaluate(config, [(model, label)], eval_file, results, False)
    average = docs[0]["average"]
    return {
        "pass@1": average["pass@1"],
        "length": average["mean_length"],
        "skipped": statistics.fmean(s["skipped"] for s in shapes[name].values()),
        "rechecks": statistics.fmean(s["rechecks"] for s in shapes[name].values()),
    }


def run_one(name: str, seed: int, out: Path) -> dict:
    flags, overrides = SETTINGS[name]
    midpoint = MIDPOINTS.get(name)
    if midpoint:
        flags = (*flags, "--ckpt.save_steps", str(midpoint), "--ckpt.save_hf", "--ckpt.disable_ds")
    config = with_seed(DemoConfig(), seed)
    config = replace(config, rl=replace(config.rl, **{"lr": ABLATION_LR, **overrides}))
    base, train_file, eval_file = base_policy(config, out / f"seed{seed}")
    where = out / f"seed{seed}" / name
    clock = time.perf_counter()
    model, extra = base, {}
    if name != "base":
        run = Run(name, name, "setting", name, "run", flags)
        log = where / "train.log"
        run_logged(train_command(config.rl, run, base, train_file, where), log, name, 0, False)
        model = where / "models" / name
        tags = [
            "train/drpo/hinge_active",
            "train/drpo/kl",
            "train/drpo/valid_prompt_fraction",
            "train/rollout/reward_mean",
        ]
        extra = means(where / "tensorboard" / name, tags)
        extra["correct_pushed_down"] = misled_share(where / "tensorboard" / name)
    result = {
        "setting": name,
        "seed": seed,
        **evaluated(config, model, name, eval_file, where / "results"),
    }
    if midpoint:
        early = where / "ckpt" / name / f"global_step{midpoint}_hf"
        result["midpoint"] = {
            "step": midpoint,
            **evaluated(config, early, f"{name}@{midpoint}", eval_file, where / "results"),
        }
    return {**result, "seconds": time.perf_counter() - clock, **extra}


def report(out: Path) -> str:
    rows = [json.loads(p.read_text()) for p in sorted(out.glob("seed*/*/result.json"))]
    columns = ["pass@1", "length", "skipped", "rechecks", "hinge_active", "kl"]
    lines = [
        "| setting | seeds | " + " | ".join(columns) + " |",
        "|---" * (len(columns) + 2) + "|",
    ]
    rows += [  # the whole run's training means (hinge, KL) do not describe its midpoint
        {"seed": r["seed"], **r["midpoint"], "setting": f"{r['setting']}@{r['midpoint']['step']}"}
        for r in rows
        if "midpoint" in r
    ]
    for name in [*SETTINGS, *(f"{n}@{step}" for n, step in MIDPOINTS.items())]:
        mine = [r for r in rows if r["setting"] == name]
        if not mine:
            continue
        cells = []
        for column in columns:
            values = [r[column] for r in mine if r.get(column) is not None]
            if not values:
                cells.append("-")
                continue
            scale = 100 if column in ("pass@1", "skipped", "hinge_active") else 1
            low, mean, high = (
                scale * v for v in (min(values), statistics.fmean(values), max(values))
            )
            digits = ".2e" if column == "kl" else ".1f"
            cells.append(f"{mean:{digits}} ({low:{digits}}..{high:{digits}})")
        seeds = ",".join(str(r["seed"]) for r in sorted(mine, key=lambda r: r["seed"]))
        lines.append(f"| {name} | {seeds} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    p.add_argument("--report", action="store_true", help="print the table of what is done")
    args = p.parse_args()
    out = args.out.resolve()
    if args.report:
        print(report(out))
        return
    with local_ray_cluster(num_gpus=2) as address:
        os.environ["RAY_ADDRESS"] = address
        for name in args.settings:  # every seed of a setting before the next setting
            for seed in args.seeds:
                done = out / f"seed{seed}" / name / "result.json"
                if done.exists():
                    continue
                result = run_one(name, seed, out)
                done.write_text(json.dumps(result, indent=1))
                print(json.dumps(result), flush=True)
    print(report(out))


if __name__ == "__main__":
    main()
