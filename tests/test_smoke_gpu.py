"""``scripts/smoke_gpu.py``: the parts that run without a GPU, and proof that its checks fail
when what they check is broken."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from time_bounds import scaled

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
import smoke_gpu  # noqa: E402
import smoke_gradient  # noqa: E402

from drpo_openrlhf import train  # noqa: E402
from drpo_openrlhf.models.tiny import build_tiny_model  # noqa: E402
from drpo_openrlhf.update.layout import Layout  # noqa: E402


@pytest.fixture(scope="module")
def model_and_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("smoke")
    data = root / "train.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=?", "label": "2"}) + "\n")
    return build_tiny_model(root / "model"), data


def value_of(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


@pytest.mark.parametrize("gpus", range(9))  # docs/gpu.md: one node with 1-8 GPUs
@pytest.mark.parametrize("mode", list(smoke_gpu.MODES))
def test_each_mode_is_a_valid_run_of_that_update_mode(mode, gpus, model_and_data, tmp_path):
    base, data = model_and_data
    setup = smoke_gpu.Setup(work=tmp_path, gpus=gpus)
    command = smoke_gpu.pipeline_command(setup, mode, base, data, tmp_path / "out")
    config = train.parse(command[3:])[0].drpo  # what python -m drpo_openrlhf.train accepts
    ranks = int(value_of(command, "--actor.num_gpus_per_node"))
    layout = Layout(
        ranks,
        smoke_gpu.N,
        int(value_of(command, "--rollout.batch_size")),
        int(value_of(command, "--train.batch_size")),
        int(value_of(command, "--train.micro_batch_size")),
    )
    assert layout.groups_fit_micro_steps == (mode != "scores")
    assert config.kl_estimate == ("microstep" if mode == "one-pass" else "minibatch")
    gpu_path = {"flash_attention_2", "--ds.packing_samples", "--train.colocate_all"}
    assert gpu_path <= set(command) if gpus else not gpu_path & set(command)
    assert value_of(command, "--ds.zero_stage") == ("3" if gpus else "2")


PATH_SETUPS = [(gpus, 1) for gpus in range(9)] + [(gpus, 2) for gpus in (1, 8)]


@pytest.mark.parametrize(("gpus", "nodes"), PATH_SETUPS)
@pytest.mark.parametrize("name", list(smoke_gpu.PATHS))
def test_each_recipe_path_is_a_valid_run_of_that_path_or_skipped(
    name, gpus, nodes, model_and_data, tmp_path
):
    """Where a node (and cluster) has what a path needs, its command is a run the entry
    point accepts, along that path and on whole groups; elsewhere the check is a SKIP that
    names what is missing, and runs nothing."""
    base, data = model_and_data
    setup = smoke_gpu.Setup(work=tmp_path, gpus=gpus, nodes=nodes)
    path = smoke_gpu.PATHS[name]
    missing = smoke_gpu.missing_for(path, setup)
    if missing:
        outcome = smoke_gpu.CHECKS[name](setup)  # no toy policy here: it must not start
        assert outcome.skipped and outcome.passed and outcome.detail == missing
        assert path.what in missing
        return
    command = smoke_gpu.pipeline_command(setup, "penalty", base, data, tmp_path / "out", path)
    train.parse(command[3:])  # what python -m drpo_openrlhf.train accepts
    args = train.build_parser().parse_args(command[3:])
    ranks, engines = args.__dict__["actor.num_gpus_per_node"], args.__dict__["vllm.num_engines"]
    nodes_used, tp = args.__dict__["actor.num_nodes"], args.__dict__["vllm.tensor_parallel_size"]
    ring = args.__dict__["ds.ring_attn_size"] or 1
    layout = Layout(
        ranks * nodes_used // ring,
        smoke_gpu.N,
        args.__dict__["rollout.batch_size"],
        args.__dict__["train.batch_size"],
        args.__dict__["train.micro_batch_size"],
    )
    assert layout.groups_fit_micro_steps
    colocated = args.__dict__["train.colocate_all"]
    assert colocated == (bool(gpus) and name != "nccl")
    if colocated:  # the engines share the actor's GPUs
        assert engines * tp == ranks * nodes_used
    expected = {
        "zero2": lambda: args.__dict__["ds.zero_stage"] == 2,
        "nccl": lambda: (ranks, engines, args.__dict__["vllm.enable_sleep"]) == (1, 1, False),
        "tp2": lambda: (ranks, engines, tp) == (2, 1, 2),
        "ring": lambda: ring == 2 and ranks == 2 and args.__dict__["ds.packing_samples"],
        "eval-loop": lambda: args.__dict__["eval.dataset"] == str(data),
        "two-nodes": lambda: (nodes_used, engines) == (2, 2 * gpus),
    }
    assert expected[name](), command


def test_a_skipped_check_prints_skip_and_does_not_fail_the_smoke(tmp_path, capsys):
    code = smoke_gpu.main(["--work", str(tmp_path), "--checks", "tp2", "two-nodes"])
    out = capsys.readouterr().out
    assert code == 0 and "0 PASS, 0 FAIL, 2 SKIP" in out
    assert "SKIP tp2: GPU only: one vLLM engine of tensor parallel 2" in out


def resumed_run(out: Path, before: dict[str, torch.Tensor], step3_gap: float = 0.01) -> str:
    """What a resumed run leaves: the first run's logs and step 3's, a final model moved
    from ``before``; its log lines as OpenRLHF and DeepSpeed print them."""
    from torch.utils.tensorboard import SummaryWriter

    finished_run(out, {k: v + 0.01 for k, v in before.items()})
    with SummaryWriter(out / "tb") as writer:
        writer.add_scalar("train/drpo/objective", 0.3, 3)
        writer.add_scalar("train/drpo/rollout_logprob_gap", step3_gap, 3)
    return "Loading the checkpoint ... {'global_step': 2, ...}\n... Global step 3: {...}\n"


def test_the_resume_check_passes_a_resumed_run_and_fails_one_that_started_over(tmp_path):
    before = {"w": torch.zeros(4)}
    log = resumed_run(tmp_path / "run", before)
    outcome = smoke_gpu.resumed_outcome(tmp_path / "run", log, before)
    assert outcome.passed, outcome.detail
    started_over = "Global step 1: {...}\n" + log
    outcome = smoke_gpu.resumed_outcome(tmp_path / "run", started_over, before)
    assert not outcome.passed and "did not continue from the step-2 checkpoint" in outcome.detail
    moved = {"w": torch.zeros(4) + 0.01}  # the final model is the step-2 one
    outcome = smoke_gpu.resumed_outcome(tmp_path / "run", log, moved)
    assert not outcome.passed and "did not change the model" in outcome.detail
    resumed_run(tmp_path / "stale", before, step3_gap=0.2)
    outcome = smoke_gpu.resumed_outcome(tmp_path / "stale", log, before)
    assert not outcome.passed and "gap at step 3 0.2" in outcome.detail


def test_the_eval_loop_check_wants_evaluations_at_both_steps(tmp_path):
    from safetensors.torch import save_file
    from torch.utils.tensorboard import SummaryWriter

    (tmp_path / "base").mkdir()
    save_file({"w": torch.zeros(4)}, tmp_path / "base" / "model.safetensors")
    finished_run(tmp_path / "run", {"w": torch.ones(4)})
    outcome = smoke_gpu.evaluated_in_loop(tmp_path / "run", tmp_path / "base")
    assert not outcome.passed and "want eval/* at steps 1 and 2" in outcome.detail
    with SummaryWriter(tmp_path / "run" / "tb") as writer:
        for step in (1, 2):
            writer.add_scalar("eval/train_pass1", 0.5, step)
    assert smoke_gpu.evaluated_in_loop(tmp_path / "run", tmp_path / "base").passed


# seconds per phase at steps 1 and 2, as OpenRLHF logs them (step_total: their sum)
TIMING = {
    "generation": (30.0, 12.0),
    "make_experience": (5.0, 3.0),
    "ppo_train": (14.0, 4.5),
    "broadcast": (1.0, 0.5),
}


def finished_run(out: Path, final: dict[str, torch.Tensor], probed: bool = True) -> None:
    """What a healthy 2-step run leaves (logs, checkpoint), with ``final`` as its model;
    ``probed=False``: a run whose weight probe never ran."""
    from safetensors.torch import save_file
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(out / "tb") as writer:
        for step in (1, 2):
            tags = ("valid_prompt_fraction", "objective", "kl", "rollout_logprob_gap")
            for tag in (*tags, "probe_logprob_gap") if probed else tags:
                writer.add_scalar(f"train/drpo/{tag}", 0.01, step)
            for phase, seconds in TIMING.items():
                writer.add_scalar(f"train/timing/{phase}", seconds[step - 1], step)
            total = sum(seconds[step - 1] for seconds in TIMING.values())
            writer.add_scalar("train/timing/step_total", total, step)
    (out / "ckpt" / "_actor" / "global_step2").mkdir(parents=True)
    (out / "model").mkdir()
    save_file(final, out / "model" / "model.safetensors")


def test_a_run_that_saved_its_base_in_bf16_did_not_train(tmp_path):
    """The runs load the fp32 SFT policy in bf16 (OpenRLHF's --ds.param_dtype) and save bf16:
    a run whose updates changed nothing saves the base rounded to bf16, and must FAIL."""
    from safetensors.torch import save_file

    base = {"w": torch.randn(64, 64, generator=torch.Generator().manual_seed(0))}
    (tmp_path / "base").mkdir()
    save_file(base, tmp_path / "base" / "model.safetensors")
    finished_run(tmp_path / "untrained", {"w": base["w"].to(torch.bfloat16)})
    untrained = smoke_gpu.trained_outcome(tmp_path / "untrained", tmp_path / "base")
    assert not untrained.passed and "the final model equals the base" in untrained.detail
    finished_run(tmp_path / "trained", {"w": (base["w"] + 0.01).to(torch.bfloat16)})
    assert smoke_gpu.trained_outcome(tmp_path / "trained", tmp_path / "base").passed


def test_a_run_whose_weight_probe_never_ran_fails(tmp_path):
    from safetensors.torch import save_file

    (tmp_path / "base").mkdir()
    save_file({"w": torch.zeros(4)}, tmp_path / "base" / "model.safetensors")
    finished_run(tmp_path / "run", {"w": torch.ones(4)}, probed=False)
    outcome = smoke_gpu.trained_outcome(tmp_path / "run", tmp_path / "base")
    assert not outcome.passed and "weight probe {} (want it logged" in outcome.detail


def test_a_run_reports_its_step_times_and_each_phase_share(tmp_path):
    """Read back from the run's own tensorboard log: each step's time, then the last step's
    share per phase (20 s: 12 generating and grading, 3 log-probs, 4.5 updating, 0.5 sync)."""
    from safetensors.torch import save_file

    base = {"w": torch.zeros(4)}
    (tmp_path / "base").mkdir()
    save_file(base, tmp_path / "base" / "model.safetensors")
    finished_run(tmp_path / "run", {"w": torch.ones(4)})
    outcome = smoke_gpu.trained_outcome(tmp_path / "run", tmp_path / "base")
    assert outcome.passed
    assert outcome.timing == (
        "step 1 50.0 s, step 2 20.0 s; step 2: generation (with grading) 60%, log-probs 15%, "
        "actor update 22%, weight sync 2%"
    )


def test_a_run_without_timing_says_so_and_missing_phases_are_named():
    assert "no step timing logged" in smoke_gpu.step_timing({"train/drpo/kl": {1: 0.0}})
    logged = {"train/timing/step_total": {1: 8.0}, "train/timing/generation": {1: 2.0}}
    timing = smoke_gpu.step_timing(logged)
    assert timing.startswith("step 1 8.0 s; step 1: generation (with grading) 25%")
    assert "actor update not logged" in timing


def test_the_timing_is_printed_after_the_check(tmp_path, monkeypatch, capsys):
    outcome = smoke_gpu.Outcome(True, "trained", "step 1 2.0 s; step 1: generation 50%")
    monkeypatch.setitem(smoke_gpu.CHECKS, "env", lambda setup: outcome)
    assert smoke_gpu.main(["--work", str(tmp_path), "--checks", "env"]) == 0
    out = capsys.readouterr().out
    assert "PASS env: trained\nTIME env: step 1 2.0 s; step 1: generation 50%\n" in out


@pytest.mark.parametrize("gpus", [0, 1])
def test_eval_check_runs_drpo_eval_on_two_models_with_vllm(gpus, tmp_path):
    from drpo_openrlhf.eval.cli import _run_parser

    setup = smoke_gpu.Setup(work=tmp_path, gpus=gpus)
    models = [tmp_path / "base", tmp_path / "base-copy"]
    command = smoke_gpu.eval_command(setup, models, tmp_path / "d.jsonl", tmp_path)
    assert command[1:4] == ["-m", "drpo_openrlhf.eval", "run"]
    args = _run_parser().parse_args(command[4:])
    assert args.backend == "vllm" and args.name == list(smoke_gpu.EVAL_MODELS)
    assert args.model == [str(m) for m in models]
    assert args.gpu_memory_utilization > 0.5 if gpus else args.gpu_memory_utilization <= 0.1
    assert args.enforce_eager == (not gpus)  # CUDA graphs on a GPU, as users run it


def test_eval_check_fails_without_both_results_or_with_no_right_answer(tmp_path):
    def write(name: str, score: float) -> None:
        (tmp_path / f"{name}.json").write_text(json.dumps({"average": {"pass@1": score}}))

    write("first", 0.4)
    assert "no result for the second" in smoke_gpu.evaluated_outcome(tmp_path).detail
    write("second", 0.0)
    outcome = smoke_gpu.evaluated_outcome(tmp_path)
    assert not outcome.passed and "all wrong" in outcome.detail
    write("second", 0.5)
    assert smoke_gpu.evaluated_outcome(tmp_path).passed


def test_gradient_check_passes_on_this_device_and_its_control_is_caught(tmp_path):
    from drpo_openrlhf.demo.toy_model import build_toy_model

    model = build_toy_model(tmp_path / "toy", hidden_size=64, seed=0)
    result = smoke_gradient.check_gradient(model, "cpu", torch.float32, "sdpa", packing=False)
    assert result.passed
    assert result.error < result.tolerance / 10 and result.corrupted_error > 100 * result.tolerance


def test_gradient_check_fails_on_a_wrong_gradient(tmp_path, monkeypatch):
    """Break what the check guards: the device's gradient off by 1% of its norm."""
    honest = smoke_gradient.drpo_gradient
    calls = []

    def off_on_the_device(actor, data, old, group, device):
        gradient = honest(actor, data, old, group, device)
        calls.append(1)
        if len(calls) == 2:  # the device's honest gradient (1: fp64 reference, 3: corrupted)
            gradient = gradient.clone()
            gradient[0] += 0.01 * gradient.norm()
        return gradient

    monkeypatch.setattr(smoke_gradient, "drpo_gradient", off_on_the_device)
    outcome = smoke_gpu.check_gradient(smoke_gpu.Setup(work=tmp_path, gpus=0))
    assert not outcome.passed and "gradient is wrong" in outcome.detail


def test_env_check_on_a_gpu_runs_the_kernels_of_flash_attn_and_vllm(tmp_path, monkeypatch):
    """Here (no CUDA build of flash-attn, the stand-in imports) the env check of a GPU node
    must FAIL at flash-attn's compiled kernels: it runs them, as the install's check does."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H100")
    outcome = smoke_gpu.check_env(smoke_gpu.Setup(work=tmp_path, gpus=1))
    assert not outcome.passed
    assert "flash_attn's CUDA kernels: ModuleNotFoundError" in outcome.detail
    assert "flash_attn_2_cuda" in outcome.detail


def test_a_failed_check_prints_fail_and_exits_non_zero(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(
        smoke_gpu.CHECKS, "env", lambda setup: smoke_gpu.Outcome(False, "broken on purpose")
    )
    monkeypatch.setitem(smoke_gpu.CHECKS, "gradient", lambda setup: smoke_gpu.Outcome(True, "ok"))
    code = smoke_gpu.main(["--work", str(tmp_path), "--checks", "env", "gradient"])
    out = capsys.readouterr().out
    assert code == 1
    assert "FAIL env: broken on purpose" in out and "PASS gradient: ok" in out
    assert "1 PASS, 1 FAIL" in out


def test_a_crashing_check_is_a_fail(tmp_path, monkeypatch, capsys):
    def crash(setup):
        raise RuntimeError("no device")

    monkeypatch.setitem(smoke_gpu.CHECKS, "env", crash)
    assert smoke_gpu.main(["--work", str(tmp_path), "--checks", "env"]) == 1
    assert "FAIL env: RuntimeError: no device" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.e2e
def test_cpu_smoke_trains_and_its_check_catches_a_run_that_did_not(tmp_path, toy):
    """The script as a user runs it (the CPU path): env, gradient and one real pipeline run.
    Then the run's own check is pointed at a run that trained nothing (its final model as the
    base) and must fail. Its work folder already holds the toy policy (the shipped base the
    script's ``toy_policy`` would train: ``demo.bases.train_base``, tests/test_toy_base.py)."""
    shutil.copytree(toy["base"], tmp_path / "toy" / "base")
    shutil.copy(toy["train"], tmp_path / "toy" / "train.jsonl")
    out = tmp_path / "outcomes.json"
    done = subprocess.run(
        [
            *(sys.executable, str(SCRIPTS / "smoke_gpu.py"), "--work", str(tmp_path)),
            *("--checks", "env", "gradient", "penalty", "--json", str(out)),
        ],
        capture_output=True,
        text=True,
        # a hang guard: one real pipeline run (35-45 s alone on the AVX-512 machine, 2-3.5x
        # that beside two busy loops, 1.8x on the AVX2 class) and the checks around it
        # (the module's 40 tests: 49-58 s in CI runs); 1500 s is over 5x the worst of those
        timeout=scaled(1500),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    outcomes = json.loads(out.read_text())
    assert all(o["passed"] for o in outcomes.values()) and set(outcomes) == {
        "env",
        "gradient",
        "penalty",
    }
    assert "PASS penalty" in done.stdout and "3 PASS, 0 FAIL" in done.stdout
    timing = re.search(
        r"^TIME penalty: step 1 [\d.]+ s, step 2 [\d.]+ s; step 2: (.*)$", done.stdout, re.M
    )
    assert timing and "not logged" not in timing.group(1), done.stdout[-3000:]
    run = tmp_path / "run-penalty"
    untrained = smoke_gpu.trained_outcome(run, run / "model")
    assert not untrained.passed and "the final model equals the base" in untrained.detail
