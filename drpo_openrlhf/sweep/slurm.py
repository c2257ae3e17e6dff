"""The ``slurm`` backend: one job array, one task per run. Each task runs the existing recipe
(``slurm/drpo_*.sh`` -> ``slurm/launch_ray_job.sh``) with the run's variables, so Ray, the
time-limit requeue and the resume from ``$OUTPUT_ROOT/$RUN_NAME/ckpt`` work as for a single
``sbatch``, then evaluates the final model on the same allocation and writes the done marker."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

from drpo_openrlhf.sweep.commands import recipe_env
from drpo_openrlhf.sweep.spec import Run, Sweep, seeded_flags

REPO = Path(__file__).resolve().parents[2]
# Set by the sweep itself, so the recipe's own values are dropped
OWN_DIRECTIVES = ("--job-name", "--output", "--array", "-J", "-o")
ACTIVE = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED"}


def recipe_directives(recipe: Path) -> list[str]:
    """The recipe's ``#SBATCH`` lines (nodes, GPUs, --requeue, --signal, ...): sbatch reads
    them only from the script it is given, so the array script repeats them."""
    directives = []
    for line in recipe.read_text().splitlines()[1:]:
        if not line.startswith("#"):
            break
        if line.startswith("#SBATCH"):
            option = line.split(None, 1)[1]
            if not option.startswith(OWN_DIRECTIVES):
                directives.append(line)
    return directives


def _exports(env: dict[str, str]) -> str:
    return " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())


def array_script(sweep: Sweep, runs: list[Run], throttle: int | None, sweep_file: Path) -> str:
    """The job-array script: task ``i`` runs ``runs[i]``."""
    recipe = Path(sweep.slurm["recipe"])
    array = f"0-{len(runs) - 1}" + (f"%{throttle}" if throttle else "")
    logs = sweep.output_dir / "logs"
    lines = [
        "#!/usr/bin/env bash",
        f"#SBATCH --job-name={sweep.name}",
        f"#SBATCH --array={array}",
        f"#SBATCH --output={logs}/%x-%A_%a.out",
        *recipe_directives(recipe),
        f"# drpo-sweep {sweep.name}: {len(runs)} run(s), one per array task. A task runs",
        f"# {recipe.name} (Ray, training, requeue and resume as for one sbatch), then",
        "# evaluates the final model (drpo-eval) and writes the run's done marker.",
        "set -euo pipefail",
        f"export DRPO_ROOT={shlex.quote(str(REPO))}",
        f"export OUTPUT_ROOT={shlex.quote(str(sweep.output_dir))}",
    ]
    if sweep.slurm.get("env"):
        lines.append(f"export {_exports(sweep.slurm['env'])}")
    lines.append("train=1")
    lines.append('case "${SLURM_ARRAY_TASK_ID:?not an array task}" in')
    for index, run in enumerate(runs):
        if run.trains:
            seeded = (
                *seeded_flags(sweep.train_flags, run.seed),
                *seeded_flags(run.flags, run.seed),
            )
            flags = " ".join(shlex.quote(f) for f in seeded)
            lines.append(f"{index}) export {_exports(recipe_env(sweep, run))}; flags=({flags}) ;;")
        else:
            lines.append(f"{index}) export RUN_NAME={shlex.quote(run.name)}; train=0 ;;")
    lines += [
        '*) echo "no run for array task $SLURM_ARRAY_TASK_ID" >&2; exit 1 ;;',
        "esac",
        "if ((train)); then",
        "  # The time-limit warning (--signal=B:USR1) reaches this shell only: pass it on to the",
        "  # launcher, which tears Ray down and requeues this task; scancel signals every process.",
        f'  bash {shlex.quote(str(recipe))} "${{flags[@]}}" &',
        "  launcher=$!",
        "  trap 'kill -USR1 \"$launcher\" 2>/dev/null || true' USR1",
        "  # wait returns early (>128) when the trap runs; the launcher's own status comes last",
        '  while kill -0 "$launcher" 2>/dev/null; do rc=0; wait "$launcher" || rc=$?; done',
        '  ((rc == 0)) || exit "$rc"',
        "fi",
        'cd "$DRPO_ROOT"',
        f'exec "${{PYTHON:-python}}" -m drpo_openrlhf.sweep finish {shlex.quote(str(sweep_file))} '
        '--run "$RUN_NAME"',
    ]
    return "\n".join(lines) + "\n"


def submit(script: Path, sbatch_args: list[str]) -> str:
    """``sbatch`` the array; returns its job id."""
    result = subprocess.run(
        ["sbatch", "--parsable", *sbatch_args, str(script)], capture_output=True, text=True
    )
    if result.returncode != 0:
        raise RuntimeError(f"sbatch failed: {result.stderr.strip() or result.stdout.strip()}")
    return result.stdout.strip().split(";")[0]


def queue_states(job_ids: set[str]) -> dict[str, str]:
    """``{"<array id>_<task>": state}`` of the given arrays' tasks still known to Slurm."""
    if not job_ids:
        return {}
    try:
        result = subprocess.run(
            ["squeue", "-h", "-r", "-o", "%i %T", "-j", ",".join(sorted(job_ids))],
            capture_output=True,
            text=True,
        )
    except FileNotFoundError:
        raise RuntimeError("runs were submitted to Slurm, but there is no squeue here") from None
    pairs = (line.split() for line in result.stdout.splitlines())
    return {p[0]: p[1] for p in pairs if len(p) == 2 and re.fullmatch(r"\d+_\d+", p[0])}
