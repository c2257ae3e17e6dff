"""``drpo-sweep toy DIR``: the demo's toy task as a sweep, for the ``local`` backend on CPU.
Per seed it writes what ``make demo`` builds (training and evaluation problems, the SFT base
policy), then a sweep file whose shared flags and evaluation protocol are the demo's
(``demo/training.py``, ``demo/config.py``), with the toy frontier's grid as its methods."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

from drpo_openrlhf.demo.bases import provide_base
from drpo_openrlhf.demo.config import DemoConfig, make_problems, with_seed
from drpo_openrlhf.demo.training import shared_flags

# lambda in {0.05, 0.1, 0.2, 0.5, inf}, RLOO-LP alpha in {0.1, 0.2, 0.4}, and ALP with its
# penalty scaled to the toy's lengths: beta * 40 tokens = 0.2, RLOO-LP alpha 0.2's largest cut
METHODS = (
    ("drpo", {"lambda": [0.05, 0.1, 0.2, 0.5]}),
    ("disco", {}),
    ("rloo_lp", {"alpha": [0.1, 0.2, 0.4]}),
    ("alp", {"beta": [0.005]}),
)
# lambda per prompt from its pass rate (the group's own, and shrunk by 4
# pseudo-samples towards 1/2), at the fixed grid's lambdas below 0.5: dividing by the pass
# rate raises lambda 1.3-8x, so 0.5 would sit between the fixed 0.5 and DisCO
SCHEDULES = (
    ("drpo_pass_rate", ["--drpo.lambda_by_pass_rate"]),
    ("drpo_pass_rate_a4", ["--drpo.lambda_by_pass_rate", "--drpo.pass_rate_prior", "4"]),
)
SCHEDULE_LAMBDAS = [0.05, 0.1, 0.2]


def build_seed(config: DemoConfig, root: Path) -> None:
    """The seed's problems, and its base in ``root`` (the shipped one where it fits, as in
    the demo) unless one is there already: a base trained here is not trained again when
    the sweep file is written again."""
    from drpo_openrlhf.demo.toy_task import write_jsonl

    train_problems, eval_problems = make_problems(config)
    write_jsonl(train_problems, root / "train.jsonl")
    write_jsonl(eval_problems, root / "eval.jsonl")
    if (root / "base" / "config.json").is_file():
        return
    provide_base(config, root / "base")


def eval_flags(config: DemoConfig) -> list[str]:
    """The demo's evaluation protocol as drpo-eval flags (HF generate on CPU)."""
    rl = config.rl
    return [
        *("--backend", "hf", "--device", "cpu", "--batch-size", "64"),
        *("--n", str(config.eval_samples), "--k", str(config.eval_samples)),
        *("--temperature", str(rl.temperature), "--top-p", str(rl.top_p)),
        *("--max-new-tokens", str(rl.max_new_tokens)),
    ]


def along_flags(root: Path, config: DemoConfig, eval_steps: int) -> list[str]:
    """OpenRLHF's in-training evaluation of the seed's evaluation problems every
    ``eval_steps`` rollout steps, with the final evaluation's samples and temperature: the
    evaluations along the run that the cost report compares with DisCO's. Without
    ``--ckpt.best_metric_key none`` OpenRLHF would also save a checkpoint at every new best."""
    return [
        *("--eval.dataset", str(root / "seed{seed}" / "eval.jsonl")),
        *("--eval.steps", str(eval_steps), "--eval.temperature", str(config.rl.temperature)),
        *("--eval.n_samples_per_prompt", str(config.eval_samples)),
        *("--ckpt.best_metric_key", "none"),
    ]


def sweep_toml(
    name: str,
    root: Path,
    seeds: list[int],
    config: DemoConfig,
    eval_steps: int | None = None,
    schedules: bool = False,
) -> str:
    """The sweep file (TOML; JSON strings and arrays are valid TOML values)."""
    flags = [*shared_flags(config.rl), "--algo.kl.init_coef", "0"]
    if eval_steps is not None:
        flags += along_flags(root, config, eval_steps)
    lines = [
        f"name = {json.dumps(name)}",
        f"output_dir = {json.dumps(str(root / 'runs'))}",
        f"seeds = {json.dumps(seeds)}",
        "",
        "[train]",
        f"base_model = {json.dumps(str(root / 'seed{seed}' / 'base'))}",
        f"data = {json.dumps(str(root / 'seed{seed}' / 'train.jsonl'))}",
        f"flags = {json.dumps(flags)}",
        "",
        "[eval]",
        f"data = {json.dumps([str(root / 'seed{seed}' / 'eval.jsonl')])}",
        f"flags = {json.dumps(eval_flags(config))}",
        "",
        "[local]",
        "num_gpus = 2",
    ]
    for method, grid in METHODS:
        lines += ["", "[[methods]]", f"method = {json.dumps(method)}"]
        if grid:
            table = ", ".join(f"{k} = {json.dumps(v)}" for k, v in grid.items())
            lines.append(f"grid = {{ {table} }}")
    for label, flags in SCHEDULES if schedules else ():
        lines += ["", "[[methods]]", 'method = "drpo"', f"label = {json.dumps(label)}"]
        lines += [f"grid = {{ lambda = {json.dumps(SCHEDULE_LAMBDAS)} }}"]
        lines += [f"flags = {json.dumps(flags)}"]
    return "\n".join(lines) + "\n"


def prepare_toy(
    root: Path,
    seeds: list[int],
    quick: bool,
    steps: int | None,
    lr: float | None = None,
    eval_steps: int | None = None,
    schedules: bool = False,
) -> Path:
    """Builds every seed's inputs under ``root`` and writes ``root/sweep.toml``."""
    root = root.resolve()
    config = DemoConfig.quick() if quick else DemoConfig()
    if steps is not None:
        config = replace(config, rl=replace(config.rl, rollout_steps=steps))
    if lr is not None:
        config = replace(config, rl=replace(config.rl, lr=lr))
    for seed in seeds:
        build_seed(with_seed(config, seed), root / f"seed{seed}")
    path = root / "sweep.toml"
    path.write_text(
        sweep_toml(
            re.sub(r"[^A-Za-z0-9._-]+", "-", f"toy-{root.name}"),
            root,
            seeds,
            config,
            eval_steps,
            schedules,
        ),
        encoding="utf-8",
    )
    return path
