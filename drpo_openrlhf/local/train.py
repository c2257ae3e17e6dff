"""``python -m drpo_openrlhf.local.train``: DRPO (or a baseline) in one process, CPU or one GPU.

For small models, and for debugging a reward or a dataset before spending cluster hours: the
same algorithm core, reward, grouping, metrics and checkpoint format as the OpenRLHF path,
with Hugging Face ``generate`` for rollouts. Takes an HF model directory, a JSONL dataset of
``{"prompt", "label", "datasource"}`` rows (``drpo-data``'s format) and the ``--drpo.*`` /
``--shaping.*`` flags of ``python -m drpo_openrlhf.train``.
"""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

from drpo_openrlhf.algo.shaper import GroupRewardShaper
from drpo_openrlhf.local.trainer import DRPO, TrainConfig


def build_parser() -> argparse.ArgumentParser:
    from drpo_openrlhf.train import add_drpo_arguments, add_shaping_arguments

    p = argparse.ArgumentParser(prog="python -m drpo_openrlhf.local.train", description=__doc__)
    p.add_argument("--model", required=True, help="HF model directory to start from")
    p.add_argument("--data", nargs="+", required=True, help="JSONL: prompt, label, datasource")
    p.add_argument("--output", type=Path, required=True, help="checkpoint directory")
    p.add_argument("--grader", default=None, help="module:function (default: math reward)")
    p.add_argument("--no-require-think-end", action="store_true")
    p.add_argument("--device", default="cpu", help="cpu, or one GPU such as cuda")
    p.add_argument(
        "--save-steps", type=int, default=0, help="save the resume state every N rollouts"
    )
    p.add_argument("--resume", action="store_true", help="continue from OUTPUT/resume if any")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    p.add_argument("--no-progress", action="store_true")
    defaults = TrainConfig()
    g = p.add_argument_group("rollouts and optimisation")
    for f in fields(TrainConfig):
        if f.name in ("method", "shaping_params"):
            continue
        g.add_argument(
            f"--{f.name.replace('_', '-')}",
            type=type(getattr(defaults, f.name)),
            default=getattr(defaults, f.name),
            help="default %(default)s",
        )
    add_drpo_arguments(p)
    add_shaping_arguments(p)
    return p


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    from drpo_openrlhf.train import drpo_config

    method = getattr(args, "shaping.method") or DRPO
    config = TrainConfig(
        method=method,
        shaping_params=getattr(args, "shaping.params"),
        **{
            f.name: getattr(args, f.name)
            for f in fields(TrainConfig)
            if f.name not in ("method", "shaping_params")
        },
    )
    try:  # refuse bad batch arithmetic or DRPO settings before loading anything
        config.layout()
        drpo = drpo_config(args) if method == DRPO else None
        if drpo is None:
            GroupRewardShaper(method, config.n_samples_per_prompt, **config.shaping_params)
    except ValueError as error:  # LayoutError and bad baseline parameters included
        parser.error(str(error))

    import torch

    from drpo_openrlhf.eval.problems import load_problems
    from drpo_openrlhf.eval.runner import DEFAULT_GRADER, load_grader
    from drpo_openrlhf.local.trainer import train

    if args.threads:
        torch.set_num_threads(args.threads)
    problems = [p for ps in load_problems(args.data).values() for p in ps]
    grader_kwargs = {"require_think_end": False} if args.no_require_think_end else {}
    grader = load_grader(args.grader or DEFAULT_GRADER, **grader_kwargs)
    path = train(
        args.model,
        problems,
        args.output,
        config,
        drpo,
        grader=grader,
        device=args.device,
        save_steps=args.save_steps,
        resume=args.resume,
        progress=not args.no_progress,
    )
    print(path)


if __name__ == "__main__":
    main()
