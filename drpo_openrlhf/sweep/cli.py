"""``drpo-sweep`` / ``python -m drpo_openrlhf.sweep``: the paper's frontier in one command.

  drpo-sweep run SWEEP.toml --backend {local,slurm,ray} [--dry-run] [--seeds ...] [--throttle N]
  drpo-sweep status SWEEP.toml          each run: done, queued, running, failed or missing
  drpo-sweep report SWEEP.toml          frontier.png, cost.png, report.md, report.json from
                                        finished runs (with each run's training cost)
  drpo-sweep toy DIR [--seeds ...] [--eval-steps N] [--schedules]
                                        the demo's toy task as a sweep (CPU, local)

``run`` checks the whole grid first and submits nothing if anything is wrong; re-running it
skips finished runs and submits the failed and missing ones (docs/sweep.md). ``task`` and
``finish`` are what a Ray job and a Slurm array task run for one run.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from drpo_openrlhf.process_tree import as_interrupted
from drpo_openrlhf.sweep import local, ray_jobs, slurm, state
from drpo_openrlhf.sweep.report import write_report
from drpo_openrlhf.sweep.spec import Run, Sweep, SweepError, read_file
from drpo_openrlhf.sweep.status import format_states, run_states
from drpo_openrlhf.sweep.validate import load_sweep, resolve_paths

BACKENDS = ("local", "slurm", "ray")
RESOLVED = "sweep.json"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="drpo-sweep",
        description="The paper's frontier in one command: train, evaluate and report a grid.",
        epilog="Backends: local (runs one after another here; the CPU toy), slurm (one job "
        "array, one task per run, each the recipe's launcher), ray (ray job submit per run "
        "to an existing cluster). See docs/sweep.md.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="check the grid, then submit what is not done")
    run.add_argument("sweep", type=Path, help="sweep file (TOML)")
    run.add_argument("--backend", choices=BACKENDS, default="local")
    run.add_argument("--dry-run", action="store_true", help="print what would be submitted")
    run.add_argument("--seeds", type=int, nargs="+", help="replace the file's seeds")
    run.add_argument("--throttle", type=int, help="slurm: at most N array tasks at once")
    run.add_argument("--no-report", action="store_true", help="local: skip the final report")
    for name, text in (("status", "each run's state"), ("report", "write the report")):
        sub = commands.add_parser(name, help=text)
        sub.add_argument("sweep", type=Path, help="sweep file, or its output dir's sweep.json")
    toy = commands.add_parser("toy", help="the demo's toy as a sweep file (local, CPU)")
    toy.add_argument("dir", type=Path)
    toy.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    toy.add_argument("--quick", action="store_true", help="the demo's --quick task and model")
    toy.add_argument("--steps", type=int, help="rollout steps per run (default: the demo's)")
    toy.add_argument("--lr", type=float, help="actor learning rate (default: the demo's)")
    toy.add_argument(
        "--eval-steps",
        type=int,
        help="evaluate every N rollout steps during training (OpenRLHF's --eval.steps), so "
        "the report can say when a run reached DisCO's accuracy (default: no evaluations)",
    )
    toy.add_argument(
        "--schedules",
        action="store_true",
        help="add DRPO with lambda from each prompt's pass rate, with and without a prior "
        "(docs/sweep.md, 'Difficulty-adaptive lambda')",
    )
    for name, text in (("task", "train, evaluate, mark (Ray jobs)"), ("finish", "evaluate, mark")):
        sub = commands.add_parser(name, help=f"one run: {text}")
        sub.add_argument("sweep", type=Path, help="the sweep's resolved sweep.json")
        sub.add_argument("--run", required=True)
    return parser


def _resolved(path: Path) -> Path:
    """The resolved copy a submitted sweep keeps (absolute paths, the seeds it ran with), so
    that status and report agree with what was submitted."""
    if path.name == RESOLVED:
        return path
    data = resolve_paths(read_file(path))
    name = data.get("name", "sweep")
    output = Path(data.get("output_dir", f"outputs/sweeps/{name}"))
    return output / RESOLVED if (output / RESOLVED).is_file() else path


def save_resolved(sweep: Sweep, seeds: list[int] | None) -> Path:
    """Writes the resolved sweep; its seeds are those of every submission so far, so that
    a sweep run one seed at a time (``--seeds``) reports all of them."""
    data = resolve_paths(read_file(sweep.source))
    data["output_dir"] = str(sweep.output_dir)
    path = sweep.output_dir / RESOLVED
    earlier = json.loads(path.read_text(encoding="utf-8"))["seeds"] if path.is_file() else []
    data["seeds"] = sorted({*earlier, *(data.get("seeds", []) if seeds is None else seeds)})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return path


def pending(sweep: Sweep) -> list[Run]:
    """Runs to submit: failed and missing ones."""
    states = run_states(sweep)
    skipped = [s for s in states if s.state in ("done", "queued", "running")]
    for s in skipped:
        print(f"skip {s.run.name}: {s.state}")
    return [s.run for s in states if s.state in ("failed", "missing")]


def run_command(args: argparse.Namespace) -> int:
    sweep = load_sweep(args.sweep, args.backend, args.seeds)
    todo = pending(sweep)
    print(f"sweep {sweep.name}: {len(sweep.runs)} runs, {len(todo)} to submit ({args.backend})")
    sweep_file = sweep.output_dir / RESOLVED
    if args.backend == "local":
        if args.dry_run:
            local.dry_run(sweep, todo)
            return 0
        save_resolved(sweep, args.seeds)
        failed = local.run_all(sweep, todo) if todo else []
        if not args.no_report and any(state.done(sweep.run_dir(r)) for r in sweep.runs):
            print(f"report: {write_report(load_sweep(sweep_file, 'none'))}")
        if failed:
            print(f"{len(failed)} run(s) failed: {', '.join(failed)}; re-run to retry them")
        return 1 if failed else 0
    if not todo:
        return 0
    if args.backend == "slurm":
        throttle = args.throttle or sweep.slurm.get("throttle")
        script = slurm.array_script(sweep, todo, throttle, sweep_file)
        sbatch_args = list(sweep.slurm.get("sbatch_args", []))
        if args.dry_run:
            print(f"# sbatch {shlex.join(['--parsable', *sbatch_args])} <this script>")
            print(script, end="")
            return 0
        save_resolved(sweep, args.seeds)
        path = sweep.output_dir / f"array-{time.strftime('%Y%m%d-%H%M%S')}.sh"
        path.write_text(script, encoding="utf-8")
        (sweep.output_dir / "logs").mkdir(exist_ok=True)
        job = slurm.submit(path, sbatch_args)
        for index, run in enumerate(todo):
            log = sweep.output_dir / "logs" / f"{sweep.name}-{job}_{index}.out"
            state.record_attempt(sweep.run_dir(run), "slurm", job=f"{job}_{index}", log=str(log))
        print(f"submitted job array {job} ({len(todo)} tasks): {path}")
        return 0
    stamp = time.strftime("%Y%m%d-%H%M%S")
    commands = []
    for run in todo:
        sid = f"{sweep.name}-{run.name}-{stamp}"
        commands.append((run, sid, ray_jobs.submit_command(sweep, run, sweep_file, sid)))
    if args.dry_run:
        for _, _, command in commands:
            print(shlex.join(command))
        return 0
    save_resolved(sweep, args.seeds)
    for run, sid, command in commands:
        ray_jobs.submit(command)
        state.record_attempt(
            sweep.run_dir(run), "ray", address=sweep.ray["address"], submission_id=sid
        )
        print(f"submitted {sid}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "run":
            return run_command(args)
        if args.command == "toy":
            from drpo_openrlhf.sweep.toy import prepare_toy

            path = prepare_toy(
                args.dir,
                args.seeds,
                args.quick,
                args.steps,
                args.lr,
                args.eval_steps,
                args.schedules,
            )
            print(f"{path}\nrun it with: drpo-sweep run {path} --backend local")
            return 0
        path = _resolved(args.sweep) if args.command in ("status", "report") else args.sweep
        sweep = load_sweep(path, "none")
        if args.command == "status":
            print(format_states(run_states(sweep)))
            return 0
        if args.command == "report":
            print(write_report(sweep))
            return 0
        from drpo_openrlhf.sweep.task import finish, run_task

        run = sweep.run(args.run)
        (run_task if args.command == "task" else finish)(sweep, run)
        return 0
    except SweepError as error:
        print(f"drpo-sweep: error: {error}", file=sys.stderr)
        return 2
    except (RuntimeError, KeyError) as error:
        print(f"drpo-sweep: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM (process_tree.interrupt_on_signals)
        interrupted = as_interrupted(stop)
        print(
            f"drpo-sweep: interrupted by {interrupted.name}; the run in progress and every "
            "process the sweep started are stopped. `drpo-sweep run` again skips the finished "
            "runs and resumes the others",
            file=sys.stderr,
        )
        return interrupted.exit_code
