"""Run OpenRLHF's own PPO entry point with DRPO's Ray actors in place of PPO's.

Imported only when a run starts: it pulls in OpenRLHF's GPU-side modules (vLLM).
"""

from __future__ import annotations

import inspect
import logging
import os
import runpy
import sys

from drpo_openrlhf import process_tree, upstream
from drpo_openrlhf.runtime import cpu_dtype, cpu_support
from drpo_openrlhf.runtime.device import ClusterDevices, resolve_mode
from drpo_openrlhf.runtime.openrlhf_cli import TRAIN_MODULE, openrlhf_parser
from drpo_openrlhf.runtime.options import RunOptions

logger = logging.getLogger(__name__)

# OpenRLHF's own ray.init environment (cli/train_ppo_ray.py: train), which our ray.init replaces
RAY_ENV_VARS = {
    "TOKENIZERS_PARALLELISM": "true",
    "NCCL_DEBUG": "WARN",
    "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1",
}


def with_rollout_logprobs(create_vllm_engines):
    """``create_vllm_engines`` whose engines report the log-probs of the sampled tokens after
    temperature (OpenRLHF asks for them only for its importance-sampling correction); the
    driver compares them with the actor's (``drpo/rollout_logprob_gap``)."""
    signature = inspect.signature(create_vllm_engines)

    def create(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        if bound.arguments.get("logprobs_mode") is None:
            bound.arguments["logprobs_mode"] = "processed_logprobs"
        return create_vllm_engines(*bound.args, **bound.kwargs)

    return create


def hide_ppo_correction(args) -> None:
    """Turn OpenRLHF's importance-sampling correction off in a DRPO run's nested ``args``: DRPO
    reads the flags into ``DRPOConfig.rollout_correction`` and replaces the PPO loss, whose
    constructor would refuse DRPO's sequence-level clip (the truncated sequence weight). The
    flag's other effects, the engines' log-probs of the sampled tokens after temperature,
    every run asks for (``with_rollout_logprobs``, ``ray_actors``)."""
    args.algo.advantage.is_correction_level = "off"


# every worker of a CPU run calls it first: the CPU patches, and the exit without teardown
CPU_WORKER_SETUP_HOOK = "drpo_openrlhf.runtime.cpu_support.enable"


def init_cpu_ray(args: dict, address: str | None) -> None:
    """Ray for a run without a GPU (``args``: OpenRLHF's flat flags): every worker process
    installs ``cpu_support`` first. Joins the cluster at ``address``; with none, a local one
    is started whose fake GPUs and CPUs cover OpenRLHF's placement groups (one
    ``{"GPU": 1, "CPU": 1}`` bundle per actor rank and per vLLM engine)."""
    import ray

    env = {**RAY_ENV_VARS, cpu_dtype.ENV: os.environ[cpu_dtype.ENV]}
    runtime_env = {
        "env_vars": {k: os.environ.get(k, v) for k, v in env.items()},
        "worker_process_setup_hook": CPU_WORKER_SETUP_HOOK,
    }
    if address:
        ray.init(address=address, runtime_env=runtime_env)
        return
    slots = args["actor.num_nodes"] * args["actor.num_gpus_per_node"]
    slots += (args["vllm.num_engines"] or 0) * args["vllm.tensor_parallel_size"]
    ray.init(
        address="local",
        runtime_env=runtime_env,
        num_gpus=slots,
        num_cpus=max(slots + 1, os.cpu_count() or 1),
        include_dashboard=False,
    )


def allow_job_env_overlap() -> None:
    """Let ``ray.init`` set environment variables that the submitted job's runtime env also
    sets.

    Under ``ray job submit --runtime-env-json '{"env_vars": {...}}'`` (the Slurm launcher
    forwards TOKENIZERS_PARALLELISM, users add NCCL_DEBUG) Ray refuses a driver runtime env
    that names any of the same keys, and OpenRLHF's ``ray.init`` always names three
    (``RAY_ENV_VARS``): every such job would die before training. Both ``ray.init`` calls
    read their values from this process's environment, which already holds the job's
    env_vars, so letting the driver's entries win changes no value.
    """
    os.environ.setdefault("RAY_OVERRIDE_JOB_RUNTIME_ENV", "1")


def shutdown_ray() -> None:
    """Ray's own shutdown: a local cluster stops, a joined one ends this job's actors."""
    import ray

    ray.shutdown()


def _report_leftovers(line: str) -> None:
    print(f"drpo_openrlhf: local Ray cluster: {line}", file=sys.stderr, flush=True)


def _resolve_device(openrlhf_argv: list[str], device: str) -> tuple[ClusterDevices, dict | None]:
    """The run's cluster and, for a CPU run, OpenRLHF's flat flags (its layout checked for the
    CPU path); a contradiction is a usage error, exit 2 as argparse's."""
    try:
        mode, cluster = resolve_mode(device)
        if mode != "cpu":
            return cluster, None
        args = vars(openrlhf_parser().parse_args(openrlhf_argv))
        ranks = args["actor.num_nodes"] * args["actor.num_gpus_per_node"]
        cpu_support.check_layout(
            args["ds.zero_stage"],
            ranks,
            args["ds.ring_attn_size"],
            args["vllm.tensor_parallel_size"],
        )
        return cluster, args
    except ValueError as error:  # DeviceError included
        print(f"python -m drpo_openrlhf.train: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def _start_cpu_ray(
    openrlhf_argv: list[str], args: dict, requested_dtype: str, address: str | None
) -> str:
    """The CPU path enabled here and Ray started (or joined) for it; returns the CPU run's
    parameter dtype, which ``--drpo.cpu_dtype`` decides."""
    logger.warning("CPU run: vLLM CPU engines, gloo weight sync (docs/cpu.md)")
    param_dtype = cpu_dtype.resolve(requested_dtype)  # before Ray: the engines' env has it
    if "--ds.param_dtype" in openrlhf_argv and args["ds.param_dtype"] != param_dtype:
        logger.warning(
            "--ds.param_dtype %s is a GPU run's; on CPU --drpo.cpu_dtype decides (%s)",
            args["ds.param_dtype"],
            param_dtype,
        )
    cpu_support.enable()
    with process_tree.keeping_sigterm():
        init_cpu_ray(args, address)
    return param_dtype


def run_openrlhf(openrlhf_argv: list[str], run: RunOptions) -> None:
    """``python -m openrlhf.cli.train_ppo_ray <openrlhf_argv>`` with DRPO's update, or, when
    ``run.method`` names a baseline, with PPO on shaped rewards; ``run.max_steps`` ends it.

    OpenRLHF's ``__main__`` looks up ``PolicyModelActor``, ``PPOTrainer`` (or
    ``PPOTrainerAsync``), ``create_vllm_engines`` and ``hierarchize`` at run time, so
    replacing the module attributes before ``runpy`` runs it is enough: its own parsing,
    validation, placement
    groups, vLLM engines, checkpoints and logging stay untouched. ``run`` (the entry point's
    ``runtime/options.RunOptions``) travels to every Ray actor inside ``strategy.args`` as
    ``args.drpo_run``, its ``DRPOConfig`` also as ``args.drpo``. GPU or CPU is decided
    from the Ray cluster (``device.resolve_mode``, ``--drpo.device``), not from this process;
    on CPU, ``cpu_support`` is enabled here and in every Ray worker.
    """
    allow_job_env_overlap()
    process_tree.quiet_ray_tip()  # before every ray.init: the probe's, ours, OpenRLHF's
    cluster, cpu_args = _resolve_device(openrlhf_argv, run.device)
    upstream.verify()  # before anything starts: every patched symbol is as read
    if cluster.address is None:  # ray.init starts a local cluster: the run owns its processes
        process_tree.own_until_exit(shutdown_ray, _report_leftovers)
    param_dtype = None  # a GPU run keeps --ds.param_dtype
    if cpu_args is not None:
        param_dtype = _start_cpu_ray(openrlhf_argv, cpu_args, run.cpu_dtype, cluster.address)
    cpu = cpu_args is not None

    from drpo_openrlhf.runtime.async_trainer import DRPOAsyncTrainer
    from drpo_openrlhf.runtime.engine_actors import CPURolloutRayActor, GPURolloutRayActor
    from drpo_openrlhf.runtime.policy_actors import BaselinePolicyModelActor, DRPOPolicyModelActor
    from drpo_openrlhf.runtime.ray_actors import GroupAwarePPOTrainer

    def with_drpo(hierarchize):
        def hierarchize_with_drpo(args):
            nested = hierarchize(args)
            nested.drpo = run.drpo
            nested.drpo_run = run
            if not run.method:  # DRPO's correction is run.drpo's (see hide_ppo_correction)
                hide_ppo_correction(nested)
            if param_dtype:  # fp32 is no choice of OpenRLHF's flag, but of its DeepSpeed config
                nested.ds.param_dtype = param_dtype
            return nested

        return hierarchize_with_drpo

    upstream.apply(
        "driver",
        {
            "hierarchize": with_drpo,
            "PolicyModelActor": BaselinePolicyModelActor if run.method else DRPOPolicyModelActor,
            "RolloutRayActor": CPURolloutRayActor if cpu else GPURolloutRayActor,
            "PPOTrainer": GroupAwarePPOTrainer,
            "PPOTrainerAsync": DRPOAsyncTrainer,  # --train.async_enable (async_trainer.py)
            "create_vllm_engines": with_rollout_logprobs,
        },
    )
    sys.argv = [TRAIN_MODULE, *openrlhf_argv]
    runpy.run_module(TRAIN_MODULE, run_name="__main__", alter_sys=True)
