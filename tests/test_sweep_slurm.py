"""``drpo-sweep run --backend slurm`` against a real Slurm (tests/slurm_cluster.py: two nodes on
this machine, 8 fake GPUs each): one job array, its throttle, one task per run.

Real here: sbatch of the generated array script, the array and its throttle, each task running
the real recipe (``slurm/drpo_1.5b.sh``) and launcher with the run's variables, the time-limit
warning (USR1 to the task's batch shell) passed on to the launcher, its requeue of the task and
the resume from the run's checkpoint, then ``drpo-sweep finish`` (the real ``drpo-eval`` with
the Hugging Face backend) and the done markers. Stand-in: ``ray`` (tests/fakeslurm/, as in
tests/test_slurm_recipes.py), so no training runs: it records the submitted training command,
and for the runs that "finish" the stand-in writes the tiny test model
(``drpo_openrlhf.models.tiny``) as the run's final model, so that the evaluation has a model.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launch_checks import FAKE_BIN, REPO
from slurm_cluster import SlurmCluster, module_cluster
from time_bounds import Deadline, scaled

from drpo_openrlhf.models.tiny import build_tiny_model

pytestmark = pytest.mark.slow

# What the `ray` stand-in does here: the recorded fake call, and for `ray job submit` of a run
# that ends (not the DRPO run's first attempt, which waits for its time-limit warning) the tiny
# model as its final model.
RAY = f"""#!{sys.executable}
import os, signal, subprocess, sys
argv = sys.argv[1:]
fake = [sys.executable, "-S", "{FAKE_BIN}/ray", *argv]
if argv[:2] != ["job", "submit"]:
    os.execv(sys.executable, fake)
if os.environ["RUN_NAME"].startswith("drpo-"):
    os.environ["FAKE_JOB"] = "train"  # a checkpoint, then trains; resumes when one exists
child = subprocess.Popen(fake)
signal.signal(signal.SIGTERM, lambda signum, frame: child.send_signal(signum))  # teardown
if child.wait() == 0:
    from drpo_openrlhf.models.tiny import build_tiny_model
    build_tiny_model(argv[argv.index("--ckpt.output_dir") + 1])
sys.exit(child.returncode)
"""


@pytest.fixture(scope="module")
def cluster():
    yield from module_cluster()


def write_inputs(tmp_path: Path) -> Path:
    build_tiny_model(tmp_path / "base")
    row = '{"prompt": "Compute 1+2.", "label": "3", "datasource": "toy"}\n'
    (tmp_path / "train.jsonl").write_text(row * 128)  # the launcher trains on whole rollouts
    (tmp_path / "eval.jsonl").write_text(row * 2)
    eval_flags = ["--backend", "hf", "--device", "cpu", "--n", "2", "--max-new-tokens", "8"]
    sweep = tmp_path / "sweep.toml"
    sweep.write_text(
        f"""name = "arr"
output_dir = {json.dumps(str(tmp_path / "out"))}
seeds = [0]
[train]
base_model = {json.dumps(str(tmp_path / "base"))}
data = {json.dumps(str(tmp_path / "train.jsonl"))}
flags = ["--rollout.temperature", "1.0"]
[eval]
data = [{json.dumps(str(tmp_path / "eval.jsonl"))}]
flags = {json.dumps(eval_flags)}
[slurm]
recipe = {json.dumps(str(REPO / "slurm" / "drpo_1.5b.sh"))}
throttle = 2
env = {{ EVAL_DATA = "", MAX_STEPS = "40" }}
[[methods]]
method = "drpo"
grid = {{ lambda = [0.1] }}
[[methods]]
method = "rloo_lp"
grid = {{ alpha = [0.2] }}
"""
    )
    return sweep


def held_back(info: dict) -> bool:
    """A requeued task waiting out Slurm's hold (the credential lifetime, 120 s)."""
    if info["JobState"] != "PENDING" or info["EligibleTime"] in ("Unknown", "None"):
        return False
    eligible = datetime.datetime.fromisoformat(info["EligibleTime"])
    return (eligible - datetime.datetime.now()).total_seconds() > 60


def test_sweep_submits_one_job_array_whose_tasks_requeue_and_resume(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    sweep = write_inputs(tmp_path)
    out, state_dir, calls = tmp_path / "out", tmp_path / "state", tmp_path / "calls.jsonl"
    state_dir.mkdir()
    calls.touch()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ray").write_text(RAY)
    (bin_dir / "ray").chmod(0o755)
    env = cluster.env(
        PATH=os.pathsep.join(
            [str(bin_dir), str(Path(sys.executable).parent), cluster.env()["PATH"]]
        ),
        PYTHON=sys.executable,
        FAKE_LOG=str(calls),
        FAKE_STATE=str(state_dir),
        NET_IFACE="lo",
        PREFLIGHT="0",
        RAY_POLL_INTERVAL="0.1",
        RAY_WAIT_TIMEOUT="60",
    )

    # Hang guards, stretched by the time scale: the whole test took about 30 s in CI runs,
    # 69-112 s on a 2-core AMX machine at load 2-5 (a sweep command 4-6 s, the task's start
    # 10 s, the array's end after the requeue 35 s)
    def drpo_sweep(*argv: str) -> str:
        result = subprocess.run(
            [sys.executable, "-m", "drpo_openrlhf.sweep", *argv],
            env=env, cwd=REPO, capture_output=True, text=True, timeout=scaled(300),
        )  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout

    submitted = drpo_sweep("run", str(sweep), "--backend", "slurm")
    array = submitted.split("submitted job array ")[1].split()[0]
    assert "3 to submit" in submitted
    info = cluster.job(f"{array}_0")
    assert info["ArrayTaskThrottle"] == "2" and info["JobName"] == "arr"

    # The DRPO run (task 1) is training: the time-limit warning, as --signal=B:USR1 sends it
    deadline = Deadline(120, "the DRPO task's start")
    while not (state_dir / "job-running").exists():
        deadline.check(cluster.logs())
        time.sleep(0.2)
    cluster.run("scancel", "--batch", "--signal=USR1", f"{array}_1")
    cluster.wait_job(
        f"{array}_1", lambda i: i["Restarts"] == "1" and held_back(i), timeout=scaled(120)
    )
    time.sleep(1.05 - time.time() % 1)  # slurmd refuses a credential of the revoking second
    cluster.run("scontrol", "update", f"JobId={array}_1", "StartTime=now")

    deadline = Deadline(300, "the array's end")
    while cluster.run("squeue", "-h", "-r", "-j", array, check=False).stdout.strip():
        deadline.check(cluster.logs())
        time.sleep(0.5)
    logs = {p.name: p.read_text() for p in (out / "logs").glob("*.out")}
    assert sorted(logs) == [f"arr-{array}_{i}.out" for i in range(3)]
    status = drpo_sweep("status", str(sweep))
    assert status.splitlines()[-1] == "3 done", status + "\n".join(logs.values())

    drpo_log = logs[f"arr-{array}_1.out"]
    assert "received SIGUSR1" in drpo_log and "requeueing job" in drpo_log
    recorded = [json.loads(line) for line in calls.read_text().splitlines()]
    # the launcher's stop request made the stand-in save step 21 before the requeue
    assert [c["argv"] for c in recorded if c["argv"][0] == "<job resumed>"] == [
        ["<job resumed>", "global_step21"]
    ]
    submits = [c["argv"] for c in recorded if c["argv"][:2] == ["job", "submit"]]
    by_run = {}
    for argv in submits:  # the recipe's training command, one per attempt
        train = argv[argv.index("--") + 1 :]
        by_run.setdefault(Path(train[train.index("--ckpt.output_dir") + 1]).parent.name, []).append(
            train
        )
    assert sorted((k, len(v)) for k, v in by_run.items()) == [
        ("drpo-lambda0.1-s0", 2),  # first attempt, then the requeued one
        ("rloo_lp-alpha0.2-s0", 1),
    ]
    drpo, rloo = by_run["drpo-lambda0.1-s0"][-1], by_run["rloo_lp-alpha0.2-s0"][0]
    assert drpo[drpo.index("--drpo.lam") + 1] == "0.1" and drpo[-2:] == [
        "--rollout.temperature",
        "1.0",
    ]
    assert rloo[rloo.index("--shaping.params") + 1] == "alpha=0.2"
    for train in (drpo, rloo):
        assert train[train.index("--train.seed") + 1] == "0"
        assert train[train.index("--drpo.max_steps") + 1] == "40"  # [slurm] env
        assert train[train.index("--actor.model_name_or_path") + 1] == str(tmp_path / "base")

    for run in ("base", "drpo-lambda0.1-s0", "rloo_lp-alpha0.2-s0"):
        marker = json.loads((out / run / "sweep-done.json").read_text())
        result = json.loads(Path(marker["result"]).read_text())
        assert (result["name"], result["settings"]["n"]) == (run, 2)
    assert "0 to submit" in drpo_sweep("run", str(sweep), "--backend", "slurm")
    assert len(list(out.glob("array-*.sh"))) == 1  # nothing submitted again
