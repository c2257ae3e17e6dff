"""The first run on a GPU node: every check prints PASS or FAIL, any FAIL exits non-zero.

Checks (``--checks`` picks some; docs/gpu.md says what each means and what to do on FAIL):
  env        torch sees CUDA, flash-attn's and vLLM's CUDA kernels run (the install's
             checks), versions (GPU only)
  gradient   DRPO's gradient on the device (bf16, flash-attention 2, packed samples) equals the
             fp64 reference within its measured tolerance, and a corrupted loss does not: the
             negative control (scripts/smoke_gradient.py)
  sync       a vLLM engine with the GPU worker extension takes one weight update over CUDA
             IPC and one over NCCL (with a second GPU), and the weight check finds it holds
             exactly what was sent (scripts/smoke_weight_sync.py; GPU only)
  eval       drpo-eval's vLLM backend on the toy policy, two models in one process as
             drpo-eval runs them: the second engine starts only if the first one's GPU
             memory came back; both must answer some prompts right
  scores / penalty / one-pass
             ``python -m drpo_openrlhf.train`` on a toy task with mixed rewards (a policy that
             answers about half its prompts right), one run per update mode of the DRPO actor;
             on a GPU: ZeRO-3, bf16, flash-attention 2 with packing, the hybrid engine
             (colocated, vLLM and DeepSpeed sleep). Each must exit 0 having trained on
             prompts with both right and wrong answers, with finite objective and KL, vLLM
             sampling the actor's weights, a checkpoint and a final model. Then a ``TIME``
             line: each step's seconds and the last step's share per phase, from the
             run's tensorboard (OpenRLHF's train/timing/*).
  zero2 / nccl / tp2 / ring / eval-loop / two-nodes / resume
             the penalty run along a path of the recipes that the three runs above do not
             take (ZeRO-2 under sleep, the non-colocated NCCL sync, tensor-parallel engines,
             ring attention, evaluation in the loop, two nodes, a resume under sleep); SKIP
             where this node or cluster lacks what the path needs (GPUs, nodes)
Without a GPU the same checks run on the CPU path (vLLM CPU, gloo, sdpa, ZeRO-2), which is
how CI runs the script; ``env`` then only reports, and the GPU-only paths are skipped.

    python scripts/smoke_gpu.py [--work DIR] [--checks gradient scores ...]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_install
import smoke_gradient
import smoke_weight_sync

N = 4  # responses per prompt in the pipeline runs
RUN_TIMEOUT_S = 1200


@dataclass(frozen=True)
class Outcome:
    passed: bool
    detail: str
    timing: str = ""  # a pipeline run's step times and phase shares
    skipped: bool = False  # this node or cluster lacks what the check needs (passed too)


def skip(reason: str) -> Outcome:
    return Outcome(True, reason, skipped=True)


@dataclass(frozen=True)
class Setup:
    work: Path
    gpus: int  # on this node; 0: the CPU path
    nodes: int = 1  # of the Ray cluster the runs use (``--address``), each with ``gpus``

    @property
    def device(self) -> str:
        return "cuda" if self.gpus else "cpu"


# ----------------------------------------------------------------------------------- checks
def check_env(setup: Setup) -> Outcome:
    parts = [f"torch {torch.__version__}"]
    if not setup.gpus:
        return Outcome(True, "no CUDA device: CPU path (" + ", ".join(parts) + ")")
    parts.append(f"CUDA {torch.version.cuda}, {setup.gpus} x {torch.cuda.get_device_name(0)}")
    # the install's kernel checks: flash-attn's and vLLM's CUDA kernels load and compute right
    for name, probe in (
        ("flash_attn", gpu_install._flash_attn_kernels),
        ("vllm", gpu_install._vllm_cuda),
    ):
        try:
            parts.append(probe())
        except Exception as error:  # any failure to load or run a kernel is the report
            reason = f"{type(error).__name__}: {error}"
            return Outcome(False, f"{name}'s CUDA kernels: {reason} (scripts/install_gpu.sh)")
    return Outcome(True, ", ".join(parts))


def check_gradient(setup: Setup) -> Outcome:
    from drpo_openrlhf.demo.toy_model import build_toy_model

    model = build_toy_model(setup.work / "toy-init", hidden_size=64, seed=0)
    if setup.gpus:
        dtype, attn, packing = torch.bfloat16, "flash_attention_2", True
    else:
        dtype, attn, packing = torch.float32, "sdpa", False
    r = smoke_gradient.check_gradient(model, setup.device, dtype, attn, packing)
    detail = (
        f"{dtype} {attn}{' packed' if packing else ''}: error {r.error:.3g} "
        f"(tolerance {r.tolerance:g}), corrupted loss {r.corrupted_error:.3g}"
    )
    if r.error > r.tolerance:
        detail += ": the device's gradient is wrong"
    elif r.corrupted_error <= r.tolerance:
        detail += ": the negative control passed, so this check cannot see a wrong gradient"
    return Outcome(r.passed, detail)


# Per update mode of the DRPO actor: (--drpo.kl_estimate, responses per micro-batch, actor
# ranks: None = one per GPU). Micro-batches of n responses on every rank hold whole groups
# (penalty pass when the mini-batch KL exceeds delta, or one pass with micro-step KL); n / 2
# responses on a single rank cannot (scores pass first).
MODES = {
    "penalty": ("minibatch", N, None),
    "one-pass": ("microstep", N, None),
    "scores": ("minibatch", N // 2, 1),
}


def toy_policy(setup: Setup) -> tuple[Path, Path]:
    """The demo's quick SFT policy (about half its answers right) and its prompts; built once."""
    from drpo_openrlhf.demo.bases import train_base
    from drpo_openrlhf.demo.config import DemoConfig, make_problems
    from drpo_openrlhf.demo.toy_task import write_jsonl

    root = setup.work / "toy"
    data = root / "train.jsonl"
    if not (root / "base" / "config.json").exists():
        config = DemoConfig.quick()
        problems, _ = make_problems(config)
        train_base(config, root / "init", root / "base", problems)
        write_jsonl(problems, data)
    return root / "base", data


def pipeline_command(
    setup: Setup, mode: str, base: Path, data: Path, out: Path, path: RecipePath | None = None
) -> list[str]:
    """The run of ``mode``, or of the penalty mode along a recipe ``path``."""
    kl_estimate, micro, ranks = MODES[mode]
    ranks = (path.ranks if path else None) or ranks or max(setup.gpus, 1)
    nodes = path.nodes if path else 1
    # at least 4 groups per step, a whole number per rank: a multiple of n x ranks
    train_batch = N * ranks * nodes * -(-4 // (ranks * nodes))
    command = [
        sys.executable,
        "-m",
        "drpo_openrlhf.train",
        *("--actor.model_name_or_path", str(base), "--data.prompt_dataset", str(data)),
        *("--data.input_key", "prompt", "--data.label_key", "label", "--data.apply_chat_template"),
        *("--actor.num_nodes", str(nodes), "--actor.num_gpus_per_node", str(ranks)),
        *("--vllm.num_engines", str(ranks * nodes), "--vllm.tensor_parallel_size", "1"),
        *("--rollout.batch_size", str(2 * train_batch // N)),
        *("--rollout.n_samples_per_prompt", str(N), "--rollout.max_new_tokens", "96"),
        *("--data.max_len", "192", "--train.batch_size", str(train_batch)),
        *("--train.micro_batch_size", str(micro), "--rollout.micro_batch_size", str(micro)),
        *("--actor.adam.lr", "1e-3", "--drpo.lam", "0.1", "--drpo.kl_estimate", kl_estimate),
        # the toy policy writes <think> under a ChatML template: grade it as it writes
        *("--drpo.answer_format", "thinking"),
        *("--drpo.max_steps", "2", "--ckpt.save_steps", "2", "--ckpt.path", str(out / "ckpt")),
        *("--ckpt.output_dir", str(out / "model"), "--logger.tensorboard_dir", str(out / "tb")),
    ]
    if setup.gpus:
        command += [
            *("--ds.zero_stage", "3", "--ds.param_dtype", "bf16", "--ds.packing_samples"),
            *(
                "--ds.attn_implementation",
                "flash_attention_2",
                "--vllm.gpu_memory_utilization",
                "0.3",
            ),
            *("--train.colocate_all", "--vllm.enable_sleep", "--ds.enable_sleep"),
        ]
    else:
        command += [
            *("--ds.zero_stage", "2", "--ds.attn_implementation", "sdpa"),
            *("--vllm.enforce_eager", "--vllm.gpu_memory_utilization", "0.1"),
        ]
    if path:  # a later value of a flag wins (argparse)
        command = [a for a in command if a not in path.drop] + list(path.flags(data))
    return command


@dataclass(frozen=True)
class RecipePath:
    """A path of the recipes (docs/launch.md) that the update modes' runs do not take: the
    penalty run with ``flags`` added (a later value wins) and ``drop`` removed, on ``ranks``
    actor GPUs per node (None: every GPU) of ``nodes`` nodes. It needs ``gpus`` GPUs on this
    node (``gpu_only``: the CPU path cannot take it at all); with fewer it is skipped."""

    what: str
    flags: Callable[[Path], tuple[str, ...]] = lambda data: ()
    drop: tuple[str, ...] = ()
    ranks: int | None = None
    nodes: int = 1
    gpus: int = 1
    gpu_only: bool = True


COLOCATION = ("--train.colocate_all", "--vllm.enable_sleep", "--ds.enable_sleep")
PATHS = {
    "zero2": RecipePath(
        "ZeRO-2 under the hybrid engine (sleep, CUDA IPC sync): ZERO_STAGE=2",
        flags=lambda data: ("--ds.zero_stage", "2"),
    ),
    "nccl": RecipePath(
        "the actor on one GPU and its vLLM engine on another, synced over NCCL through Ray "
        "(COLOCATE=0)",
        drop=COLOCATION,
        ranks=1,
        gpus=2,
    ),
    "tp2": RecipePath(
        "one vLLM engine of tensor parallel 2 beside two actor ranks (VLLM_TP=2)",
        flags=lambda data: ("--vllm.num_engines", "1", "--vllm.tensor_parallel_size", "2"),
        ranks=2,
        gpus=2,
    ),
    "ring": RecipePath(
        "ring attention over two GPUs with flash-attn's kernels (LONG=16k)",
        flags=lambda data: ("--ds.ring_attn_size", "2"),
        ranks=2,
        gpus=2,
    ),
    "eval-loop": RecipePath(
        "OpenRLHF's evaluation inside the training loop, where a pending weight probe fires",
        flags=lambda data: (
            *("--eval.dataset", str(data), "--eval.steps", "1"),
            *("--eval.n_samples_per_prompt", "2", "--eval.temperature", "0.6"),
        ),
        gpus=0,
        gpu_only=False,
    ),
    "two-nodes": RecipePath(
        "every GPU of two nodes: actor ranks and engines across nodes (--address of a "
        "two-node Ray cluster)",
        nodes=2,
    ),
}


def missing_for(path: RecipePath, setup: Setup) -> str | None:
    """Why this node or cluster cannot take ``path``, or None."""
    if path.gpu_only and not setup.gpus:
        return f"GPU only: {path.what}"
    if setup.gpus < path.gpus:
        return f"needs {path.gpus} GPUs on this node, it has {setup.gpus}: {path.what}"
    if setup.nodes < path.nodes:
        nodes = f"a Ray cluster of {path.nodes} GPU nodes, this one has {setup.nodes}"
        return f"needs {nodes}: {path.what}"
    return None


def same_weights(trained: dict[str, torch.Tensor], base: dict[str, torch.Tensor]) -> bool:
    """Whether a run's final weights are its base's as the run loaded them: the base (the
    fp32 SFT policy) rounded to the dtype the run trained and saved in (bf16), so that an
    update that changed nothing is not mistaken for one by the rounding alone."""
    return all(torch.equal(trained[k], base[k].to(trained[k].dtype)) for k in base)


def step_timing(logged: dict[str, dict[int, float]]) -> str:
    """Each step's seconds and the last step's share per phase (the first step also pays
    for warm-up: CUDA graphs, kernel compilation, allocator growth). The phases and what
    they hold: ``drpo_openrlhf.eval.training_cost``, which the sweep report reads too."""
    from drpo_openrlhf.eval.training_cost import PHASES, STEP_TOTAL, TIMING, step_seconds

    totals = step_seconds(logged)
    if not totals:
        return f"no step timing logged ({STEP_TOTAL} missing)"
    last = max(totals)
    steps = ", ".join(f"step {step} {seconds:.1f} s" for step, seconds in sorted(totals.items()))
    shares = []
    for phase, label in PHASES.items():
        seconds = logged.get(TIMING + phase, {}).get(last)
        share = "not logged" if seconds is None else f"{seconds / totals[last]:.0%}"
        shares.append(f"{label} {share}")
    return f"{steps}; step {last}: {', '.join(shares)}"


def trained_outcome(out: Path, base: Path) -> Outcome:
    """What a run must show: real updates from mixed groups, finite numbers, vLLM sampling the
    actor's weights, the step-2 checkpoint and a final model that moved."""
    from safetensors.torch import load_file

    from drpo_openrlhf.eval.tensorboard_logs import read_scalars

    logged = read_scalars(out / "tb")
    problems = []
    valid = logged.get("train/drpo/valid_prompt_fraction", {})
    if not valid or max(valid.values()) <= 0:
        problems.append("no prompt had both right and wrong answers (nothing to learn from)")
    for tag in ("train/drpo/objective", "train/drpo/kl"):
        values = logged.get(tag, {})
        if sorted(values) != [1, 2] or not all(math.isfinite(v) for v in values.values()):
            problems.append(f"{tag} is {values} (want finite values at steps 1 and 2)")
    gaps = logged.get("train/drpo/rollout_logprob_gap", {})
    if not gaps or max(gaps.values()) >= 0.05:
        problems.append(f"rollout log-prob gap {gaps} (vLLM is not sampling the actor's weights)")
    probe = logged.get("train/drpo/probe_logprob_gap", {})
    if sorted(probe) != [1, 2]:  # the GPU run sleeps: the probe runs as the engines wake
        problems.append(f"weight probe {probe} (want it logged at steps 1 and 2)")
    if not (out / "ckpt" / "_actor" / "global_step2").is_dir():
        problems.append("no checkpoint at step 2")
    final = out / "model" / "model.safetensors"
    if not final.exists():
        problems.append("no final model")
    elif same_weights(load_file(final), load_file(base / "model.safetensors")):
        problems.append("the final model equals the base")
    timing = step_timing(logged)
    if problems:
        return Outcome(False, "; ".join(problems), timing)
    fraction = max(valid.values())
    detail = f"2 steps, up to {fraction:.0%} of prompts mixed, gap {max(gaps.values()):.3g}"
    return Outcome(True, detail, timing)


def log_path(out: Path) -> Path:
    """Where ``logged_run`` writes the output of a run into ``out``."""
    return out.with_name(out.name + ".log")


def logged_run(command: list[str], out: Path, judge: Callable[[], Outcome]) -> Outcome:
    """Run ``command`` with its output in ``out``.log; a non-zero exit fails with the log's
    tail, else ``judge`` says what the run left."""
    log = log_path(out)
    clock = time.monotonic()
    with log.open("w") as sink:
        done = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S)
    seconds = time.monotonic() - clock
    if done.returncode != 0:
        tail = log.read_text().splitlines()[-5:]
        return Outcome(False, f"exit {done.returncode} after {seconds:.0f} s ({log}): {tail}")
    outcome = judge()
    return Outcome(outcome.passed, f"{outcome.detail} ({seconds:.0f} s, log {log})", outcome.timing)


def pipeline_check(mode: str) -> Callable[[Setup], Outcome]:
    def check(setup: Setup) -> Outcome:
        base, data = toy_policy(setup)
        out = setup.work / f"run-{mode}"
        command = pipeline_command(setup, mode, base, data, out)
        return logged_run(command, out, lambda: trained_outcome(out, base))

    return check


def evaluated_in_loop(out: Path, base: Path) -> Outcome:
    """A trained run that also evaluated at both steps (``--eval.steps 1``)."""
    from drpo_openrlhf.eval.tensorboard_logs import read_scalars

    trained = trained_outcome(out, base)
    evaluated = {t: sorted(s) for t, s in read_scalars(out / "tb").items() if t.startswith("eval/")}
    if trained.passed and (not evaluated or any(s != [1, 2] for s in evaluated.values())):
        return Outcome(False, f"evaluation logged {evaluated} (want eval/* at steps 1 and 2)")
    return trained


def path_check(name: str) -> Callable[[Setup], Outcome]:
    path = PATHS[name]

    def check(setup: Setup) -> Outcome:
        missing = missing_for(path, setup)
        if missing:
            return skip(missing)
        base, data = toy_policy(setup)
        out = setup.work / f"run-{name}"
        command = pipeline_command(setup, "penalty", base, data, out, path)
        judge = evaluated_in_loop if name == "eval-loop" else trained_outcome
        return logged_run(command, out, lambda: judge(out, base))

    return check


RESUME_FLAGS = ("--ckpt.load_enable", "--drpo.max_steps", "3", "--ckpt.save_steps", "3")


def resumed_outcome(out: Path, log: str, before: dict[str, torch.Tensor]) -> Outcome:
    """The second run resumed the first's step-2 checkpoint (weights, optimizer, client
    state), trained step 3 only, with vLLM sampling the actor's weights, and moved the model."""
    from safetensors.torch import load_file

    from drpo_openrlhf.eval.tensorboard_logs import read_scalars

    logged = read_scalars(out / "tb")
    problems = []
    if "'global_step': 2" not in log or "Global step 1:" in log or "Global step 3:" not in log:
        problems.append("it did not continue from the step-2 checkpoint at step 3")
    objective = logged.get("train/drpo/objective", {}).get(3)
    if objective is None or not math.isfinite(objective):
        problems.append(f"train/drpo/objective at step 3 is {objective}")
    gap = logged.get("train/drpo/rollout_logprob_gap", {}).get(3)
    if gap is None or gap >= 0.05:
        problems.append(f"rollout log-prob gap at step 3 {gap} (vLLM is not sampling the actor)")
    final = out / "model" / "model.safetensors"
    if not final.exists():
        problems.append("no final model")
    elif same_weights(load_file(final), before):
        problems.append("the resumed step did not change the model")
    if problems:
        return Outcome(False, "; ".join(problems))
    return Outcome(True, f"resumed at step 3 from global_step2, gap {gap:.3g}")


def check_resume(setup: Setup) -> Outcome:
    """The penalty run, then the same command resumed from its checkpoint to step 3: on a GPU
    under sleep, where the start-up weight map is read from sleeping engines."""
    from safetensors.torch import load_file

    base, data = toy_policy(setup)
    out = setup.work / "run-resume"
    command = pipeline_command(setup, "penalty", base, data, out)
    first = logged_run(command, out, lambda: trained_outcome(out, base))
    if not first.passed:
        return Outcome(False, f"the first run: {first.detail}", first.timing)
    before = load_file(out / "model" / "model.safetensors")
    resumed = out.with_name(out.name + "-resumed")  # the same run directory, its own log
    judge = lambda: resumed_outcome(out, log_path(resumed).read_text(), before)  # noqa: E731
    return logged_run([*command, *RESUME_FLAGS], resumed, judge)


EVAL_MODELS = ("first", "second")


def eval_command(setup: Setup, models: list[Path], data: Path, out: Path) -> list[str]:
    """``drpo-eval`` with its vLLM backend on two copies of the toy policy (two directories,
    so that neither answers from the other's generation cache), in one process as drpo-eval
    evaluates its models in turn. Each engine asks for 60% of the GPU, so the second one
    starts only if closing the first gave its memory back."""
    share = "0.6" if setup.gpus else "0.1"  # without a GPU: vLLM CPU's share of RAM
    eager = [] if setup.gpus else ["--enforce-eager"]  # as the CPU pipeline runs vLLM
    pairs = zip(models, EVAL_MODELS, strict=True)
    models = [x for model, name in pairs for x in ("--model", str(model), "--name", name)]
    return [
        *(sys.executable, "-m", "drpo_openrlhf.eval", "run", "--backend", "vllm", *models),
        *("--data", str(data), "--limit", "16", "--n", str(N), "--temperature", "0.6"),
        *("--top-p", "1.0", "--max-new-tokens", "96", "--gpu-memory-utilization", share),
        *eager,
        *("--output-dir", str(out), "--no-progress"),
    ]


def evaluated_outcome(out: Path) -> Outcome:
    """Both models evaluated, each answering some of the toy prompts right (the policy
    answers about half of them): a backend that generates garbage scores 0."""
    scores = {}
    for name in EVAL_MODELS:
        result = out / f"{name}.json"
        if not result.exists():
            return Outcome(False, f"no result for the {name} model")
        scores[name] = json.loads(result.read_text())["average"]["pass@1"]
    wrong = {name: s for name, s in scores.items() if not s > 0}
    if wrong:
        return Outcome(False, f"pass@1 {wrong}: the vLLM backend's responses are all wrong")
    return Outcome(True, "pass@1 " + ", ".join(f"{n} {s:.2f}" for n, s in scores.items()))


def check_eval(setup: Setup) -> Outcome:
    base, data = toy_policy(setup)
    copy = base.with_name("base-copy")
    if not copy.exists():
        shutil.copytree(base, copy)
    out = setup.work / "eval"
    command = eval_command(setup, [base, copy], data, out)
    return logged_run(command, out, lambda: evaluated_outcome(out))


def synced_outcome(log: str, returncode: int) -> Outcome:
    """What ``smoke_weight_sync.py`` found: per check (``start``, ``cuda-ipc``, ``nccl``) its
    problems, from its ``SYNC_RESULT`` line; a run without that line crashed."""
    lines = [line for line in log.splitlines() if line.startswith(smoke_weight_sync.RESULT)]
    if not lines:
        return Outcome(False, f"exit {returncode}, no result: {log.splitlines()[-5:]}")
    result = json.loads(lines[-1][len(smoke_weight_sync.RESULT) :])
    skipped = result.pop("skipped", [])
    failed = {name: problems for name, problems in result.items() if problems}
    if failed or returncode != 0:
        listed = "; ".join(f"{name}: {', '.join(p[:3])}" for name, p in failed.items())
        return Outcome(False, f"exit {returncode}: {listed or 'no problem listed'}")
    detail = f"engine held exactly what was sent: {', '.join(result)}"
    return Outcome(True, detail + "".join(f"; skipped {s}" for s in skipped))


def check_sync(setup: Setup) -> Outcome:
    if not setup.gpus:
        return Outcome(True, "no CUDA device: the CPU path syncs over gloo (the pipeline checks)")
    base, _ = toy_policy(setup)
    log = setup.work / "sync.log"
    script = Path(__file__).resolve().with_name("smoke_weight_sync.py")
    command = [sys.executable, str(script), "--model", str(base), "--gpus", str(setup.gpus)]
    with log.open("w") as sink:
        done = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S)
    outcome = synced_outcome(log.read_text(), done.returncode)
    return Outcome(outcome.passed, f"{outcome.detail} (log {log})")


CHECKS: dict[str, Callable[[Setup], Outcome]] = {
    "env": check_env,
    "gradient": check_gradient,
    "eval": check_eval,
    "sync": check_sync,
    **{mode: pipeline_check(mode) for mode in MODES},
    **{name: path_check(name) for name in PATHS},
    "resume": check_resume,
}
PIPELINE = {*MODES, *PATHS, "resume"}


# ----------------------------------------------------------------------------------- runner
def local_ray_cluster(gpus: int) -> str:
    """A Ray cluster on this node for the runs (their ``RAY_ADDRESS``); without a GPU, two
    GPU slots that the runs' device probe recognises as CPU ones (docs/gpu.md)."""
    import ray

    slots = gpus or 2
    context = ray.init(
        address="local",
        num_gpus=slots,
        num_cpus=max(2 * slots, os.cpu_count() or 1),
        include_dashboard=False,
        log_to_driver=False,
    )
    return context.address_info["address"]


def gpu_nodes(address: str) -> int:
    """The alive nodes with GPUs of the Ray cluster at ``address``."""
    import ray

    ray.init(address=address, log_to_driver=False)
    try:
        return sum(1 for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU", 0) > 0)
    finally:
        ray.shutdown()


def run_checks(names: list[str], setup: Setup, address: str | None = None) -> dict[str, Outcome]:
    results = {}
    runs = [n for n in names if n in PIPELINE and not (n in PATHS and missing_for(PATHS[n], setup))]
    if runs:  # a cluster only for runs that are not skipped
        os.environ["RAY_ADDRESS"] = address or local_ray_cluster(setup.gpus)
    try:
        for name in names:
            try:
                outcome = CHECKS[name](setup)
            except Exception as error:  # a crashed check is a FAIL with its reason
                outcome = Outcome(False, f"{type(error).__name__}: {error}")
            results[name] = outcome
            verdict = "SKIP" if outcome.skipped else "PASS" if outcome.passed else "FAIL"
            print(f"{verdict} {name}: {outcome.detail}", flush=True)
            if outcome.timing:
                print(f"TIME {name}: {outcome.timing}", flush=True)
    finally:
        if "RAY_ADDRESS" in os.environ:
            import ray

            ray.shutdown()  # a local cluster stops; a given one stays up
            del os.environ["RAY_ADDRESS"]
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--work", type=Path, help="working directory (default: a new temporary one)")
    p.add_argument("--checks", nargs="+", choices=list(CHECKS), default=list(CHECKS))
    p.add_argument("--json", type=Path, help="also write the outcomes here")
    p.add_argument(
        "--address",
        help="run the pipeline checks on this Ray cluster (e.g. two nodes started with `ray "
        "start`, each with this node's GPU count) instead of a local one; two-nodes needs it",
    )
    args = p.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="drpo-smoke-"))
    work.mkdir(parents=True, exist_ok=True)
    nodes = gpu_nodes(args.address) if args.address else 1
    setup = Setup(work=work, gpus=torch.cuda.device_count(), nodes=nodes)
    results = run_checks(args.checks, setup, args.address)
    failed = [name for name, outcome in results.items() if not outcome.passed]
    skipped = sum(outcome.skipped for outcome in results.values())
    if args.json:
        args.json.write_text(json.dumps({k: vars(v) for k, v in results.items()}, indent=1))
    passed = len(results) - len(failed) - skipped
    summary = f"{passed} PASS, {len(failed)} FAIL, {skipped} SKIP"
    print(f"smoke ({setup.device}, {work}): {summary}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
