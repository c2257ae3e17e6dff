"""``drpo-sweep run --backend local`` end to end on CPU: two real runs of the demo's toy (DRPO
lambda 0.1 and DisCO, a few rollout steps each, through ``python -m drpo_openrlhf.train`` with
Ray, a vLLM CPU engine and the DeepSpeed actor), the base evaluation, ``drpo-eval`` on every
final model, the done markers and the report. The DRPO run's training process is killed
mid-run: the sweep goes on with DisCO, reports DRPO as failed, and the re-run trains only DRPO.
The DisCO run is also the suite's end-to-end check of ``--drpo.lam inf``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from test_e2e_pipeline import assert_drpo_logged, changed_tensors
from time_bounds import Deadline, scaled

from drpo_openrlhf.demo.config import DemoConfig
from drpo_openrlhf.demo.training import shared_flags
from drpo_openrlhf.sweep.toy import eval_flags

# Three trainings and four evaluations (the toy's base is shipped): about 5 minutes on the 2-core
# machine by itself, several times that while other suites share it
# Hang guards only: the whole test took 150-284 s alone on a 2-core AVX-512 machine, 352 s
# beside two busy loops, so about 630 s with the AVX2 class's 1.8x. The wait for DRPO's first
# step (900 s), each sweep's (1500 s) and the test's own limit (2400 s; conftest stretches
# it) are past that, each stretched by the time scale.
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(2400)]
FIRST_STEP_S, SWEEP_S, STATUS_S = 900, 1500, 120

STEPS = 5


def sweep_file(toy: dict[str, Path], tmp_path: Path) -> Path:
    config = DemoConfig.quick()
    config = replace(config, eval_samples=2, rl=replace(config.rl, rollout_steps=STEPS))
    flags = [*shared_flags(config.rl), "--algo.kl.init_coef", "0"]
    path = tmp_path / "sweep.toml"
    path.write_text(
        f"""name = "e2e"
output_dir = {json.dumps(str(tmp_path / "out"))}
seeds = [0]
[train]
base_model = {json.dumps(str(toy["base"]))}
data = {json.dumps(str(toy["train"]))}
flags = {json.dumps(flags)}
[eval]
data = {json.dumps([str(toy["eval"])])}
flags = {json.dumps(eval_flags(config))}
[[methods]]
method = "drpo"
grid = {{ lambda = [0.1] }}
[[methods]]
method = "disco"
"""
    )
    return path


def sweep(*argv: str, **popen) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own Ray cluster
    command = [sys.executable, "-m", "drpo_openrlhf.sweep", *argv]
    popen = {"stderr": subprocess.STDOUT, **popen}
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True, **popen)


def children(parent: int, marker: str) -> list[int]:
    """Child processes of ``parent`` whose command line holds ``marker``."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
        except (OSError, ValueError):
            continue
        if ppid == parent and marker in cmdline:
            found.append(int(proc.name))
    return found


def test_local_sweep_kill_and_resume(toy, tmp_path: Path) -> None:
    path = sweep_file(toy, tmp_path)
    out = tmp_path / "out"
    drpo_log = out / "drpo-lambda0.1-s0" / "train.log"

    first = sweep("run", str(path), "--backend", "local")
    deadline = Deadline(FIRST_STEP_S, "DRPO's first step in the sweep")
    while "Global step 1:" not in (drpo_log.read_text() if drpo_log.exists() else ""):
        assert first.poll() is None, first.stdout.read()
        deadline.check()
        time.sleep(0.2)
    (trainer,) = children(first.pid, "drpo_openrlhf.train")
    os.kill(trainer, signal.SIGKILL)
    output, _ = first.communicate(timeout=scaled(SWEEP_S))
    assert first.returncode == 1, output
    assert "drpo-lambda0.1-s0 FAILED" in output and "1 run(s) failed" in output

    status = sweep("status", str(path), stderr=subprocess.DEVNULL)  # no library warnings
    listing = status.communicate(timeout=scaled(STATUS_S))[0]
    states = dict(line.split()[:2] for line in listing.splitlines()[:3])
    assert states == {"base": "done", "drpo-lambda0.1-s0": "failed", "disco-s0": "done"}, listing
    disco_marker = out / "disco-s0" / "sweep-done.json"
    finished_at = json.loads(disco_marker.read_text())["finished"]

    second = sweep("run", str(path), "--backend", "local")
    output, _ = second.communicate(timeout=scaled(SWEEP_S))
    assert second.returncode == 0, output
    assert "skip base: done" in output and "skip disco-s0: done" in output
    assert "1 to submit" in output and "[1/1] drpo-lambda0.1-s0" in output
    assert json.loads(disco_marker.read_text())["finished"] == finished_at  # not run again
    # DisCO (--drpo.lam inf) trained as every DRPO run must, and changed the model
    assert_drpo_logged(out / "disco-s0" / "tensorboard", steps=STEPS)
    assert changed_tensors(out / "disco-s0" / "model", toy["base"])

    report = json.loads((out / "report.json").read_text())
    assert (report["finished"], report["total"], report["unfinished"]) == (3, 3, [])
    runs = {r["name"]: r for r in report["runs"]}
    assert runs["drpo-lambda0.1-s0"]["pushed_down"] == 0.0  # DRPO never pushes a correct one down
    assert runs["disco-s0"]["pushed_down"] == 0.0
    assert runs["base"]["pushed_down"] is None
    for name in ("drpo-lambda0.1-s0", "disco-s0"):  # training cost, read from the real logs
        cost = runs[name]["training_cost"]["cost"]
        assert (cost["steps"], cost["missing_steps"]) == (STEPS, []) and cost["tokens"] > 0, cost
        assert all(seconds > 0 for seconds in cost["phases_s"].values()), cost
    assert runs["base"]["training_cost"] is None
    assert (out / "cost.png").read_bytes()[:4] == b"\x89PNG"
    (aes,) = report["aes"]  # DRPO against DisCO of the same seed
    assert (aes["method"], aes["param"], aes["seeds"]) == ("DRPO", "0.1", [0])
    assert report["panels"] == ["average", "add2"]  # the toy fixture's 16 eval problems
    assert (out / "frontier.png").read_bytes()[:4] == b"\x89PNG"
    assert "| DRPO lambda=0.1 | 0 |" in (out / "report.md").read_text()
    for run in ("base", "drpo-lambda0.1-s0", "disco-s0"):
        result = json.loads((out / run / "eval" / f"{run}.json").read_text())
        assert result["settings"]["n"] == 2 and result["name"] == run
