"""The demo's RL runs: each a ``python -m drpo_openrlhf.train`` command from the base, run
with its log kept and one line per training step, inside a local Ray cluster."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from drpo_openrlhf.demo.config import DemoConfig, RLConfig
from drpo_openrlhf.process_tree import keeping_sigterm, owning_processes, quiet_ray_tip, run_child

# what the runs need on a machine without a model hub; setdefault, so a user's value wins
RUN_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TORCHDYNAMO_DISABLE": "1",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "TOKENIZERS_PARALLELISM": "false",
}


@dataclass(frozen=True)
class Run:
    """One RL run: its ``drpo_openrlhf.train`` flags and how its result is labelled."""

    name: str
    method: str
    param_name: str
    param: str
    role: str
    flags: tuple[str, ...]


def demo_runs(config: DemoConfig) -> list[Run]:
    """DisCO (the no-penalty reference), DRPO and RLOO-LP: same base, same settings. RLOO-LP
    runs OpenRLHF's PPO actor without a reference model, like the others."""
    lam, alpha = str(config.lam), str(config.alpha)
    rloo = ("--shaping.method", "rloo_lp", "--shaping.params", f"alpha={alpha}")
    rloo += ("--algo.kl.init_coef", "0")
    return [
        Run("DisCO", "DRPO", "lambda", "inf", "reference", ("--drpo.lam", "inf")),
        Run(f"DRPO-{lam}", "DRPO", "lambda", lam, "run", ("--drpo.lam", lam)),
        Run(
            f"RLOO-LP-{alpha}",
            "RLOO-LP",
            "alpha",
            alpha,
            "run",
            (*rloo, "--algo.kl.init_coef", "0"),
        ),
    ]


def shared_flags(rl: RLConfig) -> list[str]:
    """The ``drpo_openrlhf.train`` flags every toy run shares: one actor rank and one vLLM
    engine (non-colocated), ZeRO-2, the rollout and optimiser settings (``drpo-sweep toy``
    writes them into its sweep file). The toy policy thinks (``<think> ... </think>``) under a
    plain ChatML template, so the flag says so: ``auto`` would read that template as plain."""
    return [
        *("--data.input_key", "prompt", "--data.label_key", "label", "--data.apply_chat_template"),
        *("--drpo.answer_format", "thinking"),
        *("--actor.num_nodes", "1", "--actor.num_gpus_per_node", "1"),
        *("--vllm.num_engines", "1", "--vllm.enforce_eager"),
        *("--vllm.gpu_memory_utilization", "0.1"),  # on CPU: the share of RAM for KV cache
        *("--rollout.batch_size", str(rl.rollout_batch_size)),
        *("--rollout.n_samples_per_prompt", str(rl.n_samples_per_prompt)),
        *("--rollout.max_new_tokens", str(rl.max_new_tokens)),
        *("--rollout.temperature", str(rl.temperature), "--rollout.top_p", str(rl.top_p)),
        *("--data.max_len", str(rl.max_new_tokens + 64)),
        *("--train.batch_size", str(rl.train_batch_size)),
        *("--train.micro_batch_size", str(rl.micro_batch_size)),
        *("--ds.zero_stage", "2", "--ds.attn_implementation", "sdpa"),
        *("--actor.adam.lr", str(rl.lr)),
        *("--drpo.max_steps", str(rl.rollout_steps)),
    ]


def train_command(rl: RLConfig, run: Run, base: Path, train_file: Path, out: Path) -> list[str]:
    """``python -m drpo_openrlhf.train ...`` for ``run`` from ``base``, with checkpoints and
    the final model in ``out/models/<run>``."""
    return [
        sys.executable,
        "-m",
        "drpo_openrlhf.train",
        *("--actor.model_name_or_path", str(base)),
        *("--data.prompt_dataset", str(train_file)),
        *shared_flags(rl),
        *("--train.seed", str(rl.seed)),
        *("--ckpt.path", str(out / "ckpt" / run.name)),
        *("--ckpt.output_dir", str(out / "models" / run.name)),
        *("--logger.tensorboard_dir", str(out / "tensorboard" / run.name)),
        *run.flags,
    ]


STEP_LINE = re.compile(r"Global step (\d+): ")


def _metric(line: str, key: str) -> str:
    found = re.search(rf"'{re.escape(key)}': ([-+\w.]+)", line)
    return found.group(1) if found else "?"


# how long an interrupted run gets to stop on its own before it is killed (its driver, then
# Ray ending the job's actors: seconds)
CHILD_STOP_S = 60.0


def run_logged(command: list[str], log: Path, label: str, steps: int, progress: bool) -> None:
    """Runs ``command`` with its output in ``log``, printing one line per training step;
    a failure raises with the log's last lines. Interrupted (Ctrl-C, SIGTERM), it stops the
    run with the same signal and waits for it before passing the interruption on."""
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **{k: os.environ.get(k, v) for k, v in RUN_ENV.items()}}

    def echo_step(line: str) -> None:
        found = STEP_LINE.search(line)
        if progress and found:
            reward = _metric(line, "rollout/reward_mean")
            length = _metric(line, "rollout/response_length_mean")
            print(
                f"  {label}: step {found.group(1)}/{steps}  reward {float(reward):.3f}  "
                f"length {float(length):.1f}",
                flush=True,
            )

    with log.open("w") as sink:
        code = run_child(command, sink, echo_step, CHILD_STOP_S, env=env)
    if code != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-25:])
        raise RuntimeError(f"{label} failed (exit {code}); full log: {log}\n{tail}")


@contextmanager
def local_ray_cluster(num_gpus: int) -> Iterator[str]:
    """A local Ray cluster with fake GPUs for the runs to join (``RAY_ADDRESS``): the CPU
    stand-in for the cluster a user submits to. On exit, however it comes, Ray shuts it down
    and every process it started that is still alive is ended, those Ray lost track of
    included (``process_tree``). ``ray.init`` replaces the caller's SIGTERM handler with
    Ray's; a handler of the caller's own is put back."""
    import ray

    quiet_ray_tip()
    with owning_processes(report=_report_leftovers):
        with keeping_sigterm():
            context = ray.init(
                address="local",
                num_cpus=2 * num_gpus,
                num_gpus=num_gpus,
                include_dashboard=False,
                log_to_driver=False,
            )
        try:
            yield context.address_info["address"]
        finally:
            ray.shutdown()


def _report_leftovers(line: str) -> None:
    print(f"local Ray cluster: {line}", file=sys.stderr, flush=True)
