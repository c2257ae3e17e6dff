"""The vLLM engine actor classes a run uses in place of OpenRLHF's ``RolloutRayActor``: our
worker extension, the run's CPU dtype, the reward guard, DRPO's positive reward, engine and
weight-version tags on each response, the sync reports.

An engine's process imports this module (Ray pickles the classes by reference) and only
vLLM's side of OpenRLHF: as OpenRLHF keeps DeepSpeed out of the vLLM engines' environment
(``openrlhf/trainer/__init__.py``), nothing here imports it or the driver's trainer; the
engine's start-up is the lighter for it (about 3 CPU-s of each engine's imports).
"""

from __future__ import annotations

import os

import ray
from openrlhf.trainer.ray import vllm_engine

from drpo_openrlhf.rewards.positive_engine import PositiveRewardEngine
from drpo_openrlhf.rewards.reward_guard import RewardOptionsEngine, guard_engine_rewards
from drpo_openrlhf.runtime import cpu_dtype
from drpo_openrlhf.runtime.cpu_support import CPU_WORKER_EXTENSION
from drpo_openrlhf.sync.engine_tag import EngineTaggingEngine
from drpo_openrlhf.sync.sync_check import SyncReportingEngine
from drpo_openrlhf.sync.vllm_sync_worker import GPU_WORKER_EXTENSION
from drpo_openrlhf.sync.weight_version import WeightVersionEngine


# The engine actors' mixins add remote methods; only generate_responses is chained: a call
# passes through WeightVersionEngine, EngineTaggingEngine and PositiveRewardEngine (the bases'
# order) to OpenRLHF's RolloutRayActor.
class _RolloutRayActor(
    WeightVersionEngine,
    EngineTaggingEngine,
    RewardOptionsEngine,
    PositiveRewardEngine,
    SyncReportingEngine,
    vllm_engine.RolloutRayActor.__ray_actor_class__,
):
    """OpenRLHF's vLLM engine actor whose workers get ``worker_extension`` (they record and
    digest each weight sync), with the reward guard (``reward_guard``) and DRPO's positive
    reward (``positive_engine``)."""

    worker_extension: str

    async def __init__(self, *args, **kwargs):
        kwargs["worker_extension_cls"] = self.worker_extension
        await super().__init__(*args, **kwargs)
        guard_engine_rewards(self.executor)


class _CPURolloutRayActor(_RolloutRayActor):
    """The engine actor of a CPU run: the CPU worker extension (``cpu_support``) and the
    run's CPU dtype (``cpu_dtype``).

    Its one worker runs inside vLLM's engine-core process: vLLM's CPU platform turns
    OpenRLHF's single-process executor into a multiprocess one unless V1 multiprocessing is
    off, which costs a third process importing vLLM (about 10 s of every CPU start-up)."""

    worker_extension = CPU_WORKER_EXTENSION

    async def __init__(self, *args, **kwargs):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        kwargs["dtype"] = cpu_dtype.engine_dtype()  # create_vllm_engines says bfloat16
        await super().__init__(*args, **kwargs)


class _GPURolloutRayActor(_RolloutRayActor):
    worker_extension = GPU_WORKER_EXTENSION


# OpenRLHF's create_vllm_engines creates them through the name RolloutRayActor, which
# launch.run_openrlhf's "driver" site of upstream.TABLE points at.
CPURolloutRayActor = ray.remote(_CPURolloutRayActor)
GPURolloutRayActor = ray.remote(_GPURolloutRayActor)
