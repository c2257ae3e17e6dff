"""``drpo-sweep`` without training: the grid and its checks, what each backend's dry run would
submit, the run states a re-run decides on, and the report from result files."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from training_logs import write_run_log

from drpo_openrlhf import train
from drpo_openrlhf.demo.config import DemoConfig, RLConfig
from drpo_openrlhf.demo.training import shared_flags
from drpo_openrlhf.eval.metrics import aes
from drpo_openrlhf.eval.plot import plot_tradeoff
from drpo_openrlhf.eval.training_cost import PHASES
from drpo_openrlhf.models.tiny import build_tiny_model
from drpo_openrlhf.sweep import state
from drpo_openrlhf.sweep.cli import main, pending
from drpo_openrlhf.sweep.commands import train_argv
from drpo_openrlhf.sweep.cost import cost_entry, cost_markdown, cost_rows
from drpo_openrlhf.sweep.cost_figure import plot_cost
from drpo_openrlhf.sweep.report import write_report
from drpo_openrlhf.sweep.spec import SweepError
from drpo_openrlhf.sweep.status import run_states
from drpo_openrlhf.sweep.validate import load_sweep

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "slurm" / "drpo_1.5b.sh"
FLAGS = shared_flags(RLConfig())  # the demo's toy layout: one actor rank, one engine


@pytest.fixture
def inputs(tmp_path: Path) -> Path:
    """A model directory per seed and one training and evaluation file."""
    for seed in (0, 1):
        (tmp_path / f"base{seed}").mkdir()
        (tmp_path / f"base{seed}" / "config.json").write_text("{}")
    row = '{"prompt": "Compute 1+2.", "label": "3", "datasource": "toy"}\n'
    (tmp_path / "train.jsonl").write_text(row)
    (tmp_path / "eval.jsonl").write_text(row)
    return tmp_path


def write_sweep(tmp_path: Path, methods: str, flags: list[str] = FLAGS, **top: str) -> Path:
    settings = {"name": '"t"', "output_dir": json.dumps(str(tmp_path / "out")), "seeds": "[0, 1]"}
    settings |= top
    text = "\n".join(f"{k} = {v}" for k, v in settings.items())
    text += f"""
[train]
base_model = {json.dumps(str(tmp_path / "base{seed}"))}
data = {json.dumps(str(tmp_path / "train.jsonl"))}
flags = {json.dumps(flags)}
[eval]
data = {json.dumps([str(tmp_path / "eval.jsonl")])}
flags = ["--n", "2"]
[slurm]
recipe = {json.dumps(str(RECIPE))}
throttle = 2
env = {{ MAX_STEPS = "100" }}
[ray]
address = "http://head:8265"
{methods}"""
    path = tmp_path / "sweep.toml"
    path.write_text(text)
    return path


FRONTIER = """
[[methods]]
method = "drpo"
grid = { lambda = [0.1, 0.5] }
[[methods]]
method = "disco"
[[methods]]
method = "rloo_lp"
grid = { alpha = [0.2] }
flags = ["--algo.kl.init_coef", "0"]
"""


def runs_of(inputs: Path) -> list[str]:
    return [r.name for r in load_sweep(write_sweep(inputs, FRONTIER), "slurm").runs]


def dry_run(path: Path, backend: str, capsys, *extra: str) -> str:
    assert main(["run", str(path), "--backend", backend, "--dry-run", *extra]) == 0
    return capsys.readouterr().out


def test_grid_expands_methods_parameters_and_seeds(inputs: Path) -> None:
    sweep = load_sweep(write_sweep(inputs, FRONTIER), "slurm")
    assert [r.name for r in sweep.runs] == [
        "base-s0", "base-s1", "drpo-lambda0.1-s0", "drpo-lambda0.1-s1", "drpo-lambda0.5-s0",
        "drpo-lambda0.5-s1", "disco-s0", "disco-s1", "rloo_lp-alpha0.2-s0", "rloo_lp-alpha0.2-s1",
    ]  # fmt: skip
    by_name = {r.name: r for r in sweep.runs}
    assert by_name["base-s1"].base_model == str(inputs / "base1")  # {seed} in the base path
    assert (by_name["disco-s0"].role, by_name["disco-s0"].param) == ("reference", "inf")
    assert by_name["base-s0"].role == "base" and not by_name["base-s0"].trains
    rloo = by_name["rloo_lp-alpha0.2-s1"]
    assert (rloo.display, rloo.param_name, rloo.param, rloo.seed) == ("RLOO-LP", "alpha", "0.2", 1)


def test_a_label_names_a_variant_of_a_method_in_runs_and_report(inputs: Path, capsys) -> None:
    """Two DRPO entries with one grid (a lambda schedule beside the fixed lambda) get apart
    run names, curves and training flags; without the label they would collide."""
    variant = """
[[methods]]
method = "drpo"
grid = { lambda = [0.1] }
[[methods]]
method = "drpo"
label = "drpo_pass_rate"
grid = { lambda = [0.1] }
flags = ["--drpo.lambda_by_pass_rate", "--drpo.pass_rate_prior", "4"]
"""
    sweep = load_sweep(write_sweep(inputs, variant, seeds="[0]"), "local")
    names = [r.name for r in sweep.runs]
    assert names == ["base-s0", "drpo-lambda0.1-s0", "drpo_pass_rate-lambda0.1-s0"]
    fixed, schedule = sweep.runs[1:]
    assert (fixed.display, schedule.display) == ("DRPO", "drpo_pass_rate")
    assert schedule.method == "drpo" and schedule.flags[0] == "--drpo.lambda_by_pass_rate"
    out = dry_run(write_sweep(inputs, variant, seeds="[0]"), "local", capsys)
    configs = {}
    for line in out.splitlines():
        command = shlex.split(line) if not line.startswith(("#", "sweep")) else []
        if command[2:3] == ["drpo_openrlhf.train"]:
            options, argv = train.parse(command[3:])
            config = options.drpo
            configs[Path(argv[argv.index("--ckpt.output_dir") + 1]).parent.name] = config
    assert not configs["drpo-lambda0.1-s0"].lambda_by_pass_rate
    assert configs["drpo_pass_rate-lambda0.1-s0"].lambda_by_pass_rate
    assert configs["drpo_pass_rate-lambda0.1-s0"].pass_rate_prior == 4.0
    assert "--method drpo_pass_rate" in out  # drpo-eval's curve name
    unlabelled = variant.replace('label = "drpo_pass_rate"\n', "")
    with pytest.raises(SweepError, match=r"run drpo-lambda0\.1-s0 appears 2 times"):
        load_sweep(write_sweep(inputs, unlabelled, seeds="[0]"), "local")
    for bad, message in (('"rloo_lp"', "is a method's name"), ('"a b"', "letters, digits")):
        with pytest.raises(SweepError, match=message):
            load_sweep(write_sweep(inputs, variant.replace('"drpo_pass_rate"', bad)), "local")


def test_grid_errors_are_listed_together_and_nothing_is_submitted(tmp_path: Path, capsys) -> None:
    (tmp_path / "train.jsonl").write_text('{"prompt": "p"}\n')  # no label
    path = tmp_path / "bad.toml"
    path.write_text(
        f"""name = "bad"
output_dir = {json.dumps(str(tmp_path / "out"))}
seeds = [0, 0]
[train]
base_model = "./no-such-model"
data = {json.dumps(str(tmp_path / "train.jsonl"))}
[eval]
data = ["missing-eval.jsonl"]
[[methods]]
method = "grpo"
[[methods]]
method = "drpo"
grid = {{ lambda = [0.1, -1, "inf"] }}
[[methods]]
method = "disco"
[[methods]]
method = "rloo_lp"
grid = {{ alpha = [0.2, 1.5] }}
[[methods]]
method = "alp"
[[methods]]
method = "hapo"
grid = {{ w = [0.1] }}
params = {{ cutoff = -0.7 }}
"""
    )
    assert main(["run", str(path), "--backend", "slurm"]) == 2
    error = capsys.readouterr().err
    problems = [line[4:] for line in error.splitlines() if line.startswith("  - ")]
    assert (
        problems
        == [
            "seeds repeat: [0, 0]",
            "[[methods]] #1: unknown method 'grpo' (known: drpo, disco, rloo_lp, alp, hapo, "
            "l1_max, shorter_better, laser_d)",
            "[[methods]] #2 (drpo): drpo: lambda must be > 0 or inf, got -1",
            "[[methods]] #4 (rloo_lp): rloo_lp: alpha must be a number in [0, 1], got 1.5",
            "[[methods]] #5 (alp): alp needs beta (a finite number >= 0)",
            "[[methods]] #6 (hapo): hapo takes hyper-parameters ['c', 'h', 'w'], not ['cutoff']",
            "run disco-s0 appears 2 times in the grid",  # lambda = inf is DisCO
            "base model: --actor.model_name_or_path ./no-such-model: no such directory",
            "evaluation data: missing-eval.jsonl: no such file (drpo-eval reads local JSONL)",
            "training data: --data.prompt_dataset " + str(tmp_path / "train.jsonl") + ": 1 bad "
            "row(s): row 1: no 'label' (drpo-data validates and converts datasets: docs/data.md)",
            "[slurm] recipe: no such file None (e.g. slurm/drpo_1.5b.sh)",
        ]
    )
    assert f"{len(problems)} problem(s), nothing submitted" in error
    assert not (tmp_path / "out").exists()


def test_training_flags_are_checked_by_the_entry_point(inputs: Path) -> None:
    path = write_sweep(inputs, FRONTIER)
    path.write_text(path.read_text().replace('"16", "--rollout.n', '"15", "--rollout.n'))
    with pytest.raises(SweepError) as error:
        load_sweep(path, "local")
    (problem,) = error.value.problems  # one line for all runs that share the fault
    runs = "drpo-lambda0.1-s0, drpo-lambda0.1-s1, drpo-lambda0.5-s0, drpo-lambda0.5-s1, disco-s0"
    assert problem.startswith(f"training command of {runs}, disco-s1: ")
    assert "--rollout.batch_size" in problem  # 15 prompts cannot fill optimizer steps of 64


def test_local_dry_run_prints_each_command(inputs: Path, capsys) -> None:
    out = dry_run(write_sweep(inputs, FRONTIER), "local", capsys)
    commands = [
        shlex.split(line) for line in out.splitlines() if not line.startswith(("#", "sweep"))
    ]
    assert len(commands) == 2 + 2 * 8  # base evaluations, then training + evaluation per run
    parsed = {}
    for command in commands:
        assert command[:2] == [sys.executable, "-m"]
        if command[2] == "drpo_openrlhf.train":
            run, argv = train.parse(command[3:])
            config = run.drpo
            flags = {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a.startswith("--")}
            parsed[Path(flags["--ckpt.output_dir"]).parent.name] = (config, run, flags)
    assert sorted(parsed) == sorted(r for r in runs_of(inputs) if not r.startswith("base"))
    disco_config, _, disco = parsed["disco-s1"]
    assert disco_config.lam == float("inf") and disco["--train.seed"] == "1"
    assert disco["--actor.model_name_or_path"] == str(inputs / "base1")
    assert parsed["drpo-lambda0.5-s0"][0].lam == 0.5
    _, rloo, flags = parsed["rloo_lp-alpha0.2-s0"]
    assert (rloo.method, rloo.params) == ("rloo_lp", {"alpha": 0.2})
    assert flags["--algo.kl.init_coef"] == "0"
    assert flags["--ckpt.path"] == str(inputs / "out" / "rloo_lp-alpha0.2-s0" / "ckpt")
    assert all("--ckpt.load_enable" in c for c in commands if c[2] == "drpo_openrlhf.train")
    evals = [c for c in commands if c[2] == "drpo_openrlhf.eval"]
    drpo_eval = next(c for c in evals if "drpo-lambda0.1-s1" in c)
    assert drpo_eval[drpo_eval.index("--model") + 1] == str(
        inputs / "out" / "drpo-lambda0.1-s1" / "model"
    )
    for flag, value in (("--method", "DRPO"), ("--param", "0.1"), ("--seed", "1"), ("--n", "2")):
        assert drpo_eval[drpo_eval.index(flag) + 1] == value
    assert not (inputs / "out").exists()  # a dry run writes nothing


def test_slurm_dry_run_prints_one_job_array(inputs: Path, capsys, tmp_path: Path) -> None:
    out = dry_run(write_sweep(inputs, FRONTIER), "slurm", capsys, "--throttle", "3")
    script = out[out.index("#!/usr/bin/env bash") :]
    lines = script.splitlines()
    assert "#SBATCH --array=0-9%3" in lines  # ten runs, --throttle over the file's 2
    assert "#SBATCH --job-name=t" in lines
    assert f"#SBATCH --output={inputs / 'out' / 'logs'}/%x-%A_%a.out" in lines
    # the recipe's own directives, so each task is what `sbatch slurm/drpo_1.5b.sh` would be
    for directive in ("--requeue", "--signal=B:USR1@300", "--gpus-per-node=8", "--exclusive"):
        assert f"#SBATCH {directive}" in lines
    assert not any(line.startswith("#SBATCH --output=%x-%j") for line in lines)
    assert "export MAX_STEPS=100" in lines
    tasks = {line.split(")", 1)[0]: line for line in lines if line[:1].isdigit()}
    assert tasks["0"] == "0) export RUN_NAME=base-s0; train=0 ;;"
    assert tasks["3"] == (
        f"3) export RUN_NAME=drpo-lambda0.1-s1 MODEL={inputs / 'base1'} "
        f"TRAIN_DATA={inputs / 'train.jsonl'} SEED=1 METHOD=drpo LAMBDA=0.1; "
        f"flags=({shlex.join(FLAGS)}) ;;"
    )
    assert "METHOD=disco;" in tasks["6"] and "SEED=0" in tasks["6"]
    assert "METHOD=rloo_lp SHAPING_PARAMS=alpha=0.2;" in tasks["8"]
    assert tasks["8"].endswith("--algo.kl.init_coef 0) ;;")
    assert f'  bash {RECIPE} "${{flags[@]}}" &' in lines
    finish = f'-m drpo_openrlhf.sweep finish {inputs / "out" / "sweep.json"} --run "$RUN_NAME"'
    assert lines[-1].endswith(finish)
    (tmp_path / "array.sh").write_text(script)
    subprocess.run(["bash", "-n", str(tmp_path / "array.sh")], check=True)
    shellcheck = Path(sys.executable).parent / "shellcheck"
    if shellcheck.exists():
        subprocess.run([str(shellcheck), str(tmp_path / "array.sh")], check=True)


def test_ray_dry_run_prints_one_submission_per_run(inputs: Path, capsys) -> None:
    out = dry_run(write_sweep(inputs, FRONTIER), "ray", capsys, "--seeds", "1")
    commands = [shlex.split(line) for line in out.splitlines() if line.startswith("ray ")]
    assert len(commands) == 5  # base, two lambdas, DisCO and RLOO-LP for the one seed
    first = commands[1]
    assert first[:5] == ["ray", "job", "submit", "--address", "http://head:8265"]
    assert first[first.index("--submission-id") + 1].startswith("t-drpo-lambda0.1-s1-")
    assert json.loads(first[first.index("--runtime-env-json") + 1])["working_dir"] == str(REPO)
    task = first[first.index("--") + 1 :]
    assert task == ["python", "-m", "drpo_openrlhf.sweep", "task",
                    str(inputs / "out" / "sweep.json"), "--run", "drpo-lambda0.1-s1"]  # fmt: skip


def test_states_decide_what_a_rerun_submits(inputs: Path) -> None:
    sweep = load_sweep(write_sweep(inputs, FRONTIER, seeds="[0]"), "local")
    names = [r.name for r in sweep.runs]
    dirs = {r.name: sweep.run_dir(r) for r in sweep.runs}
    state.record_attempt(dirs["base-s0"], "local", pid=os.getpid())  # this process: alive
    state.update_attempt(dirs["base-s0"], stage="evaluate")
    state.record_attempt(dirs["drpo-lambda0.1-s0"], "local", pid=os.getpid())
    state.update_attempt(dirs["drpo-lambda0.1-s0"], error="train exited with 1")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    state.record_attempt(dirs["drpo-lambda0.5-s0"], "local", pid=int(dead.stdout))
    state.record_attempt(dirs["disco-s0"], "local", pid=os.getpid())
    state.mark_done(dirs["disco-s0"], {"result": "r.json", "pushed_down": 0.0})
    states = {s.run.name: (s.state, s.detail) for s in run_states(sweep)}
    assert states == {
        "base-s0": ("running", f"pid {os.getpid()}, evaluate"),
        "drpo-lambda0.1-s0": ("failed", "train exited with 1"),
        "drpo-lambda0.5-s0": ("failed", "interrupted"),  # its process is gone
        "disco-s0": ("done", "r.json"),
        "rloo_lp-alpha0.2-s0": ("missing", ""),
    }
    assert [r.name for r in pending(sweep)] == [n for n in names if n in
                                                ("drpo-lambda0.1-s0", "drpo-lambda0.5-s0",
                                                 "rloo_lp-alpha0.2-s0")]  # fmt: skip
    state.record_attempt(dirs["disco-s0"], "local", pid=os.getpid())  # a new attempt
    assert state.done(dirs["disco-s0"]) is None  # drops the old marker


def result(name: str, method: str | None, param: str | None, role: str,
           points: dict[str, tuple[float, float]]) -> dict:  # fmt: skip
    """A drpo-eval result document: dataset -> (pass@1, mean length)."""
    metrics = {d: {"num_problems": 1, "num_samples": 1, "pass@1": a, "mean_length": n}
               for d, (a, n) in points.items()}  # fmt: skip
    average = {"pass@1": sum(a for a, _ in points.values()) / len(points),
               "mean_length": sum(n for _, n in points.values()) / len(points)}  # fmt: skip
    return {"name": name, "method": method, "param": param, "role": role,
            "param_name": "lambda" if method == "DRPO" else "alpha",
            "datasets": metrics, "average": average}  # fmt: skip


def test_report_frontier_aes_and_pushed_down(inputs: Path) -> None:
    sweep = load_sweep(write_sweep(inputs, FRONTIER), "slurm")
    numbers = {  # run -> ((pass@1, length) on toy, pushed down)
        "base-s0": ((0.40, 100.0), None), "base-s1": ((0.50, 110.0), None),
        "drpo-lambda0.1-s0": ((0.45, 50.0), 0.0), "drpo-lambda0.1-s1": ((0.55, 70.0), 0.0),
        "disco-s0": ((0.44, 80.0), 0.0), "disco-s1": ((0.50, 90.0), 0.0),
        "rloo_lp-alpha0.2-s0": ((0.40, 60.0), 0.05),
    }  # fmt: skip
    for run in sweep.runs:
        if run.name not in numbers:
            continue
        point, pushed = numbers[run.name]
        doc = result(run.name, run.display, run.param, run.role, {"toy": point})
        path = sweep.run_dir(run) / "eval" / f"{run.name}.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(doc))
        state.mark_done(sweep.run_dir(run), {"result": str(path), "pushed_down": pushed})
    write_report(sweep)
    report = json.loads((sweep.output_dir / "report.json").read_text())
    assert report["unfinished"] == ["drpo-lambda0.5-s0", "drpo-lambda0.5-s1", "rloo_lp-alpha0.2-s1"]
    frontier = {(r["method"], r["param"]): r for r in report["frontier"]}
    drpo = frontier[("DRPO", "0.1")]
    assert drpo["seeds"] == [0, 1]
    assert drpo["panels"]["toy"]["pass@1"] == pytest.approx({"mean": 0.5, "min": 0.45, "max": 0.55})
    assert drpo["panels"]["toy"]["mean_length"] == pytest.approx({"mean": 60, "min": 50, "max": 70})
    aes_rows = {(r["method"], r["param"]): r for r in report["aes"]}
    expected = [aes(0.45, 50, 0.44, 80), aes(0.55, 70, 0.50, 90)]  # each seed vs its DisCO
    assert aes_rows[("DRPO", "0.1")]["average"] == pytest.approx(
        {"mean": sum(expected) / 2, "min": min(expected), "max": max(expected)}
    )
    assert aes_rows[("RLOO-LP", "0.2")]["seeds"] == [0]
    pushed = {r["name"]: r["pushed_down"] for r in report["runs"]}
    assert pushed["rloo_lp-alpha0.2-s0"] == 0.05 and pushed["base-s0"] is None
    markdown = (sweep.output_dir / "report.md").read_text()
    assert "| DRPO lambda=0.1 | 0,1 | 50.0 (45.0..55.0) | 60.0 (50.0..70.0) |" in markdown
    assert "| rloo_lp-alpha0.2-s0 | 0 | 40.0 | 60.0 | 5.0% |" in markdown
    assert "| DRPO lambda=inf (DisCO) | 0,1 | 47.0 (44.0..50.0) | 85.0 (80.0..90.0) |" in markdown
    assert (sweep.output_dir / "frontier.png").read_bytes()[:4] == b"\x89PNG"
    assert "No run logged step timing yet." in markdown  # no run left a tensorboard log
    assert not (sweep.output_dir / "cost.png").exists()


def test_a_variant_is_compared_with_its_method_s_curve_at_the_same_length(inputs: Path) -> None:
    """Per seed, the fixed-lambda runs and DisCO interpolated at the variant's average length
    (a quarter of the way from lambda 0.1 to 0.5 on seed 0; on seed 1, whose lambda 0.1 did
    not finish, exactly at lambda 0.5), per panel; outside the curve: a note, no number."""
    variant = """
[[methods]]
method = "drpo"
grid = { lambda = [0.1, 0.5, "inf"] }
[[methods]]
method = "drpo"
label = "drpo_pass_rate"
grid = { lambda = [0.1, 0.05] }
flags = ["--drpo.lambda_by_pass_rate"]
"""
    sweep = load_sweep(write_sweep(inputs, variant), "slurm")
    numbers = {  # run -> (pass@1, length) on the easy and the hard set; average length
        "drpo-lambda0.1-s0": ((0.9, 20.0), (0.3, 60.0)),  # 40
        "drpo-lambda0.5-s0": ((0.9, 40.0), (0.4, 80.0)),  # 60
        "disco-s0": ((0.9, 50.0), (0.45, 90.0)),  # 70
        "drpo_pass_rate-lambda0.1-s0": ((0.9, 20.0), (0.4, 70.0)),  # 45
        "drpo_pass_rate-lambda0.05-s0": ((0.8, 20.0), (0.2, 40.0)),  # 30: shorter than all
        "drpo-lambda0.5-s1": ((0.9, 40.0), (0.4, 80.0)),  # 60
        "disco-s1": ((0.9, 50.0), (0.5, 90.0)),  # 70
        "drpo_pass_rate-lambda0.1-s1": ((0.8, 30.0), (0.5, 90.0)),  # 60
    }
    for run in sweep.runs:
        if run.name in numbers:
            easy, hard = numbers[run.name]
            doc = result(run.name, run.display, run.param, run.role, {"easy": easy, "hard": hard})
            path = sweep.run_dir(run) / "eval" / f"{run.name}.json"
            path.parent.mkdir(parents=True)
            path.write_text(json.dumps(doc))
            state.mark_done(sweep.run_dir(run), {"result": str(path), "pushed_down": 0.0})
    write_report(sweep)
    report = json.loads((sweep.output_dir / "report.json").read_text())
    (row,) = report["matched"]
    assert (row["method"], row["param"], row["seeds"]) == ("drpo_pass_rate", "0.1", [0, 1])
    panels = row["panels"]
    # seed 0: at 45 tokens the curve is 3/4 lambda 0.1 + 1/4 lambda 0.5; seed 1: lambda 0.5
    approx = pytest.approx
    assert panels["hard"]["pass@1"] == approx({"mean": 0.0875, "min": 0.075, "max": 0.1})
    assert panels["hard"]["mean_length"] == approx({"mean": 7.5, "min": 5.0, "max": 10.0})
    assert panels["easy"]["pass@1"] == approx({"mean": -0.05, "min": -0.1, "max": 0.0})
    assert panels["easy"]["mean_length"] == approx({"mean": -7.5, "min": -10.0, "max": -5.0})
    assert panels["average"]["mean_length"] == approx({"mean": 0.0, "min": 0.0, "max": 0.0})
    assert report["matched_notes"] == [
        "drpo_pass_rate-lambda0.05-s0: average length 30.0 is outside its seed's DRPO curve "
        "(3 runs): not compared"
    ]
    markdown = (sweep.output_dir / "report.md").read_text()
    line = "| drpo_pass_rate lambda=0.1 | 0,1 | +1.9 (+0.0..+3.8) | +0.0 (+0.0..+0.0) | -5.0 "
    assert line in markdown


def finish_fake_run(sweep, run, pass1: float, logged: tuple | None = None) -> None:
    """A finished run: its drpo-eval result, done marker and (``logged``: steps and
    in-training evaluations) the tensorboard log its training wrote."""
    doc = result(run.name, run.display, run.param, run.role, {"toy": (pass1, 40.0)})
    path = sweep.run_dir(run) / "eval" / f"{run.name}.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(doc))
    state.mark_done(sweep.run_dir(run), {"result": str(path), "pushed_down": 0.0})
    if logged is not None:
        write_run_log(sweep.run_dir(run) / "tensorboard", *logged)


def steps(generation: float, length: float) -> dict[int, tuple]:
    """4 steps of 16 responses: generation seconds, 0.5 log-probs, 1 update, 0.5 sync."""
    return {step: (generation, 0.5, 1.0, 0.5, length, 16.0) for step in (1, 2, 3, 4)}


def test_report_training_cost_per_setting_and_to_disco_s_accuracy(inputs: Path) -> None:
    """Each run's tokens and time from its own log, the phase shares, and the tokens and time
    until its in-training evaluation first reached the last one of its seed's DisCO run
    (0.6 on seed 0, 0.5 on seed 1), as mean (min..max) over seeds; the figure is written."""
    path = write_sweep(inputs, FRONTIER)
    sweep = load_sweep(path, "slurm")
    runs = {run.name: run for run in sweep.runs}
    logs = {
        "disco-s0": (steps(2.0, 48.0), {2: {"toy": 0.5}, 4: {"toy": 0.6}}),
        "disco-s1": (steps(2.0, 48.0), {2: {"toy": 0.5}, 4: {"toy": 0.5}}),
        "drpo-lambda0.1-s0": (steps(2.0, 32.0), {2: {"toy": 0.625}, 4: {"toy": 0.5}}),
        "drpo-lambda0.1-s1": (steps(3.0, 24.0), {2: {"toy": 0.25}, 4: {"toy": 0.5}}),
        "rloo_lp-alpha0.2-s0": (steps(2.0, 40.0), {}),  # no in-training evaluation
    }
    for name, logged in logs.items():
        finish_fake_run(sweep, runs[name], 0.5, logged)
    finish_fake_run(sweep, runs["drpo-lambda0.5-s0"], 0.5)  # left no log
    finish_fake_run(sweep, runs["base-s0"], 0.4)
    assert main(["report", str(path)]) == 0  # drpo-sweep report
    report = json.loads((sweep.output_dir / "report.json").read_text())
    rows = {(r["method"], r["param"]): r for r in report["cost"]}
    drpo = rows[("DRPO", "0.1")]
    assert drpo["seeds"] == [0, 1]
    assert drpo["tokens"] == {"mean": 1792.0, "min": 1536.0, "max": 2048.0}  # 16 x 4 x 32|24
    assert drpo["seconds"] == {"mean": 18.0, "min": 16.0, "max": 20.0}
    assert drpo["phase_share"]["generation"] == pytest.approx(
        {"mean": 0.55, "min": 0.5, "max": 0.6}
    )
    assert drpo["phase_share"]["broadcast"] == pytest.approx(
        {"mean": 0.1125, "min": 0.1, "max": 0.125}
    )
    assert (drpo["compared"], drpo["reached"]) == (2, 2)
    assert drpo["tokens_to_disco"] == {"mean": 1280.0, "min": 1024.0, "max": 1536.0}  # steps 2, 4
    assert drpo["seconds_to_disco"] == {"mean": 14.0, "min": 8.0, "max": 20.0}
    disco = rows[("DRPO", "inf")]  # DisCO reaches its own last accuracy, maybe before its end
    assert disco["tokens_to_disco"] == {"mean": 2304.0, "min": 1536.0, "max": 3072.0}
    rloo = rows[("RLOO-LP", "0.2")]
    assert (rloo["compared"], rloo["reached"], rloo["tokens_to_disco"]) == (0, 0, None)
    assert ("DRPO", "0.5") not in rows
    by_run = {r["name"]: r["training_cost"] for r in report["runs"]}
    assert by_run["drpo-lambda0.1-s1"]["reached"] == {
        "step": 4, "pass@1": 0.5, "tokens": 1536.0, "seconds": 20.0
    }  # fmt: skip
    assert by_run["drpo-lambda0.1-s1"]["target"] == 0.5
    assert by_run["drpo-lambda0.5-s0"]["cost"] is None and by_run["base-s0"] is None
    markdown = (sweep.output_dir / "report.md").read_text()
    assert (
        "| DRPO lambda=0.1 | 0,1 | 1.79k (1.54k..2.05k) | 18 (16..20) | 55% (50%..60%) | "
        "11% (10%..12%) | 22% (20%..25%) | 11% (10%..12%) | 2/2 | 1.28k (1.02k..1.54k) | "
        "14 (8..20) |"
    ) in markdown
    assert "| RLOO-LP alpha=0.2 | 0 | 2.56k | 16 | 50% | 12% | 25% | 12% | - | - | - |" in markdown
    assert "| drpo-lambda0.1-s1 | 4 | 1.54k | 20.0 | 50.0 | 4 |" in markdown
    assert (
        "| rloo_lp-alpha0.2-s0 | 4 | 2.56k | 16.0 | 60.0 | no in-training evaluations |" in markdown
    )
    assert "| drpo-lambda0.5-s0 | no step timing logged |" in markdown
    assert (sweep.output_dir / "cost.png").read_bytes()[:4] == b"\x89PNG"


def test_figure_draws_seeds_of_a_setting_as_one_point_with_error_bars() -> None:
    docs = [result(f"d{i}", "DRPO", "0.1", "run", {"toy": p})
            for i, p in enumerate([(0.4, 50.0), (0.6, 70.0)])]  # fmt: skip
    docs.append(result("disco", "DRPO", "inf", "reference", {"toy": (0.5, 90.0)}))
    figure = plot_tradeoff(docs)
    toy = figure.axes[1]
    curve = toy.get_lines()[0]
    assert list(curve.get_xdata()) == [60.0, 90.0] and list(curve.get_ydata()) == [0.5, 0.5]
    (bars,) = toy.containers  # one setting with two seeds
    xerr, yerr = (segment for collection in bars.lines[2] for segment in collection.get_segments())
    assert xerr.tolist() == [[50.0, 0.5], [70.0, 0.5]] and yerr.tolist() == [
        [60.0, 0.4],
        [60.0, 0.6],
    ]


def test_a_run_whose_seed_has_no_disco_evaluation_says_so(inputs: Path) -> None:
    run = next(r for r in load_sweep(write_sweep(inputs, FRONTIER), "slurm").runs if r.trains)
    point = {"step": 2, "pass@1": 0.5, "tokens": 64.0, "seconds": 2.0}
    cost = {"steps": 2, "missing_steps": [], "tokens": 64.0, "seconds": 2.0,
            "phases_s": dict.fromkeys(PHASES, 0.5), "evaluations": [point]}  # fmt: skip
    entry = cost_entry(run, cost, None)
    assert (entry["compared"], entry["reached"]) == (False, None)
    lines = cost_markdown(cost_rows([run], {run.name: entry}), [entry], str)
    reason = "no DisCO evaluation of its seed to compare with"
    assert f"| {run.name} | 2 | 64 | 2.0 | - | {reason} |" in lines


def cost_point(method: str, param: str, role: str, pass1: float, tokens: float,
               evaluations: list[tuple[int, float, float]]) -> dict:  # fmt: skip
    """One trained run as the cost figure gets it; evaluations as (step, tokens, pass@1)."""
    curve = [{"step": s, "tokens": t, "pass@1": a, "seconds": 1.0} for s, t, a in evaluations]
    cost = {"tokens": tokens, "evaluations": curve}
    return {"method": method, "param": param, "role": role, "label": f"lambda={param}",
            "pass@1": pass1, "cost": cost}  # fmt: skip


def test_cost_figure_draws_seeds_at_their_mean_with_error_bars() -> None:
    """Left: final pass@1 against total training tokens, a setting's seeds as one point with
    min..max bars; right: in-training pass@1 against the tokens spent until each evaluation,
    at the steps every seed of the setting evaluated (seed 1's step 6 alone is left out)."""
    runs = [
        cost_point("DRPO", "0.1", "run", 0.4, 1000.0, [(2, 400.0, 0.3), (4, 1000.0, 0.4)]),
        cost_point(
            "DRPO", "0.1", "run", 0.6, 2000.0, [(2, 600.0, 0.5), (4, 1400.0, 0.6), (6, 2000.0, 0.7)]
        ),
        cost_point("DRPO", "inf", "reference", 0.5, 3000.0, [(4, 3000.0, 0.5)]),
    ]
    final, along = plot_cost(runs).axes
    curve = final.get_lines()[0]
    assert list(curve.get_xdata()) == [1500.0, 3000.0] and list(curve.get_ydata()) == [0.5, 0.5]
    (bars,) = final.containers  # one setting with two seeds
    xerr, yerr = (segment for collection in bars.lines[2] for segment in collection.get_segments())
    assert xerr.tolist() == [[1000.0, 0.5], [2000.0, 0.5]]
    assert yerr.tolist() == [[1500.0, 0.4], [1500.0, 0.6]]
    drpo, disco = (line for line in along.get_lines() if line.get_label().startswith("DRPO"))
    assert list(drpo.get_xdata()) == [500.0, 1200.0] and list(drpo.get_ydata()) == [0.4, 0.5]
    assert drpo.get_linestyle() != disco.get_linestyle() and disco.get_marker() == "s"


def test_toy_writes_the_demo_s_inputs_and_a_runnable_sweep(tmp_path: Path, capsys) -> None:
    """Bases already there are kept, so this test skips the minutes of SFT (test_toy_base tests
    the SFT)."""
    for seed in (0, 1):
        build_tiny_model(tmp_path / "toy" / f"seed{seed}" / "base")
    argv = ["toy", str(tmp_path / "toy"), "--seeds", "0", "1", "--quick", "--steps", "4"]
    assert main([*argv, "--lr", "5e-5", "--eval-steps", "2"]) == 0
    path = tmp_path / "toy" / "sweep.toml"
    assert str(path) in capsys.readouterr().out
    rows = (tmp_path / "toy" / "seed1" / "eval.jsonl").read_text().splitlines()
    assert len(rows) == 2 * DemoConfig.quick().eval_problems_per_dataset  # add2, add3
    sweep = load_sweep(path, "local")  # every training command parses
    trained = [r for r in sweep.runs if r.trains]
    assert len(trained) == 2 * (4 + 1 + 3 + 1)  # lambdas, DisCO, RLOO-LP alphas, ALP; 2 seeds
    assert [r.name for r in sweep.runs if not r.trains] == ["base-s0", "base-s1"]
    assert trained[-1].train_data == str(tmp_path / "toy" / "seed1" / "train.jsonl")
    assert sweep.train_flags[sweep.train_flags.index("--drpo.max_steps") + 1] == "4"
    assert sweep.train_flags[sweep.train_flags.index("--actor.adam.lr") + 1] == "5e-05"
    assert sweep.eval_flags[:2] == ("--backend", "hf")  # the demo evaluates with HF on CPU
    along = train_argv(sweep, trained[-1])  # evaluated along the run, on its seed's problems
    assert along[along.index("--eval.dataset") + 1] == str(
        tmp_path / "toy" / "seed1" / "eval.jsonl"
    )
    assert along[along.index("--eval.steps") + 1] == "2"
    assert along[along.index("--ckpt.best_metric_key") + 1] == "none"  # no extra saves
    assert main([*argv, "--schedules"]) == 0  # issue 38's sweep: two DRPO variants more
    sweep = load_sweep(path, "local")
    variants = {r.label: r for r in sweep.runs if r.label}
    assert len([r for r in sweep.runs if r.label]) == 2 * 2 * 3  # 2 schedules x 3 lambdas
    assert "--drpo.pass_rate_prior" not in variants["drpo_pass_rate"].flags
    assert variants["drpo_pass_rate_a4"].flags[-2:] == ("--drpo.pass_rate_prior", "4")


def test_seed_in_train_flags_is_each_run_s_seed(inputs: Path, capsys) -> None:
    """``{seed}`` in ``[train] flags`` (a per-seed in-training evaluation set) becomes the
    run's seed in every backend's command."""
    for seed in (0, 1):
        (inputs / f"eval{seed}.jsonl").write_text((inputs / "eval.jsonl").read_text())
    flags = [*FLAGS, "--eval.dataset", str(inputs / "eval{seed}.jsonl"), "--eval.steps", "2"]
    path = write_sweep(inputs, FRONTIER, flags)
    sweep = load_sweep(path, "local")  # each seed's command parses and its file is checked
    run = next(r for r in sweep.runs if r.name == "disco-s1")
    argv = train_argv(sweep, run)
    assert argv[argv.index("--eval.dataset") + 1] == str(inputs / "eval1.jsonl")
    script = dry_run(path, "slurm", capsys)
    task = next(line for line in script.splitlines() if "RUN_NAME=disco-s1" in line)
    assert str(inputs / "eval1.jsonl") in task and "{seed}" not in script


def test_a_sweep_run_one_seed_at_a_time_reports_every_seed(inputs: Path) -> None:
    """``--seeds 0`` then ``--seeds 1`` (e.g. two submissions side by side): the resolved
    sweep that status and report read holds both seeds, not only the last one's."""
    from drpo_openrlhf.sweep.cli import RESOLVED, save_resolved

    path = write_sweep(inputs, FRONTIER, seeds="[0, 1]")
    for seed in (0, 1):
        save_resolved(load_sweep(path, "local", [seed]), [seed])
    resolved = load_sweep(inputs / "out" / RESOLVED, "none")
    assert sorted({r.seed for r in resolved.runs}) == [0, 1]


def test_a_variant_sweeps_an_off_policy_mode(inputs: Path, capsys) -> None:
    """Asynchronous training with the rollout correction, and dynamic filtering, as labelled
    variants of DRPO (docs/sweep.md): their flags reach each run's command and the entry
    point's parser; a combination it refuses is a problem of the sweep, before submitting."""
    variants = """
[[methods]]
method = "drpo"
grid = { lambda = [0.1] }
[[methods]]
method = "drpo"
label = "drpo_async"
grid = { lambda = [0.1] }
flags = ["--train.async_enable", "--algo.advantage.is_correction_level", "seq"]
[[methods]]
method = "drpo"
label = "drpo_filtered"
grid = { lambda = [0.1] }
flags = ["--algo.dynamic_filtering_enable"]
"""
    out = dry_run(write_sweep(inputs, variants, seeds="[0]"), "local", capsys)
    argvs = {}
    for line in out.splitlines():
        command = shlex.split(line) if not line.startswith(("#", "sweep")) else []
        if command[2:3] == ["drpo_openrlhf.train"]:
            _, argv = train.parse(command[3:])
            argvs[Path(argv[argv.index("--ckpt.output_dir") + 1]).parent.name] = argv
    modes = ("--train.async_enable", "--algo.dynamic_filtering_enable")
    plain, run_async, filtered = (
        argvs[f"{name}-lambda0.1-s0"] for name in ("drpo", "drpo_async", "drpo_filtered")
    )
    assert not set(modes) & set(plain)
    assert modes[0] in run_async and modes[1] not in run_async
    level = run_async.index("--algo.advantage.is_correction_level")
    assert run_async[level + 1] == "seq"
    assert modes[1] in filtered and modes[0] not in filtered
    refused = variants.replace('"--train.async_enable"', '"--train.partial_rollout_enable"')
    with pytest.raises(SweepError, match="partial_rollout_enable"):
        load_sweep(write_sweep(inputs, refused, seeds="[0]"), "local")
