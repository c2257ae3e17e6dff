"""Running OpenRLHF 0.11.2 on a machine without a GPU: vLLM's CPU build, DeepSpeed on gloo.

OpenRLHF assumes CUDA in a handful of places; each patch below names the upstream line it
works around and is a row of ``drpo_openrlhf.upstream`` (installed by its ``apply``).
``enable()`` installs them in the calling process (OpenRLHF's once its model side is
imported) and does nothing where CUDA is available, so a GPU run is never touched.
``launch.run_openrlhf`` makes Ray call it at the start of every worker process of a CPU run
(``worker_process_setup_hook``), and the vLLM engines get ``vllm_cpu_worker.CPUWorkerWrap``
as their worker extension, which receives weights over gloo.

Weight sync on CPU is the gloo group of ``sync/gloo_group.py``; Ray's collective gloo group
would re-use the process's default group, which DeepSpeed and vLLM already own.
"""

from __future__ import annotations

import importlib.abc
import logging
import sys
from collections.abc import Callable

import torch

from drpo_openrlhf import upstream
from drpo_openrlhf.runtime.process_exit import end_workers_without_teardown
from drpo_openrlhf.sync.gloo_group import GlooBroadcastGroup

logger = logging.getLogger(__name__)

CPU_WORKER_EXTENSION = "drpo_openrlhf.sync.vllm_cpu_worker.CPUWorkerWrap"
_enabled = False  # in this process


def has_gpu() -> bool:
    return torch.cuda.is_available()


def check_layout(
    zero_stage: int, actor_ranks: int, ring_attn_size: int = 1, vllm_tensor_parallel: int = 1
) -> None:
    """Refuse what a CPU run cannot do reliably. ZeRO-3 over several gloo ranks: OpenRLHF
    loads the model under ``zero.Init``, whose gathers wait on the last of their async gloo
    all-gathers only; on CPU the others can still be running and some loaded shards come out
    as uninitialised memory (CHANGELOG.md, flakes). NCCL completes them in order, so GPUs are fine.
    Ring attention: it runs on flash-attn's kernels, which exist only for CUDA. vLLM tensor
    parallelism: OpenRLHF runs such engines on vLLM's Ray executor, which vLLM's CPU platform
    refuses (``ValueError: current platform cpu does not support ray``)."""
    if vllm_tensor_parallel > 1:
        raise ValueError(
            "--vllm.tensor_parallel_size > 1 runs vLLM's Ray executor, which vLLM's CPU build "
            "does not support: use --vllm.tensor_parallel_size 1 (more --vllm.num_engines "
            "instead)"
        )
    if ring_attn_size > 1:
        raise ValueError(
            "--ds.ring_attn_size > 1 needs flash-attn's CUDA kernels (ring_flash_attn), which "
            "a CPU run does not have: drop it"
        )
    if zero_stage == 3 and actor_ranks > 1:
        raise ValueError(
            "--ds.zero_stage 3 with several actor ranks is not supported without a GPU (gloo "
            "can corrupt the weights OpenRLHF loads under zero.Init): use --ds.zero_stage 2, "
            "or one actor rank"
        )


def _stateless_gloo_group(master_address, master_port, rank, world_size, device=None):
    """Replaces ``utils/distributed_util.py: stateless_init_process_group`` (PyNcclCommunicator)."""
    return GlooBroadcastGroup(master_address, master_port, rank, world_size)


class _CPUDevice(str):
    """``torch.cuda.current_device()`` on CPU: ``"cpu"``, which every ``device=`` and ``.to()``
    in OpenRLHF accepts (``replay_buffer.py``, ``ppo_actor.py: ppo_train``,
    ``deepspeed.py: all_reduce/all_gather``, ``launcher.py: forward``)."""


def _torch_adam(train_config):
    """``utils/deepspeed/deepspeed.py: get_ds_train_config`` asks for DeepSpeed's FusedAdam, a
    C++ op JIT-compiled on first use (a minute on 2 cores); torch's AdamW is the same update."""

    def torch_adam_config(self, *args, **kwargs):
        config = train_config(self, *args, **kwargs)
        if "optimizer" in config:
            config["optimizer"].setdefault("params", {})["torch_adam"] = True
            config["zero_allow_untested_optimizer"] = True
        return config

    return torch_adam_config


def _cpu_target(buffer_init):
    """``trainer/ppo_utils/replay_buffer.py``: target_device = torch.device(f"cuda:{...}")."""

    def cpu_buffer_init(self, *args, **kwargs):
        current = torch.cuda.current_device
        torch.cuda.current_device = lambda: 0  # for this call only
        try:
            buffer_init(self, *args, **kwargs)
        finally:
            torch.cuda.current_device = current
        self.target_device = torch.device("cpu")

    return cpu_buffer_init


def _fp32_dtype(convert):
    """``utils/utils.py: convert_to_torch_dtype`` knows bf16 and fp16; a CPU run without
    native bf16 asks for fp32 (``runtime/cpu_dtype.py``)."""

    def convert_with_fp32(param_dtype: str) -> torch.dtype:
        return torch.float32 if param_dtype == "fp32" else convert(param_dtype)

    return convert_with_fp32


# The OpenRLHF module every process that runs a model or the trainer imports (the policy,
# reference and reward actors' base classes; ppo_trainer's actor groups), and a vLLM engine's
# does not: the OpenRLHF patches wait for it, so that an engine's process, whose Ray worker
# runs ``enable`` too, imports no DeepSpeed (about 3 CPU-s of every engine's start-up).
MODEL_SIDE = "openrlhf.trainer.ray.launcher"


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``then`` once the module ``name`` has been executed, the first time it is imported
    (Python has no post-import hook): its spec comes from the finders after this one, in
    Python's own order, and its loader runs ``then`` after the module's code."""

    def __init__(self, name: str, then: Callable[[], None]):
        self.name, self.then = name, then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = next(
            (s for f in sys.meta_path if (s := f.find_spec(fullname, path, target)) is not None),
            None,
        )
        if spec is not None and spec.loader is not None:
            exec_module = spec.loader.exec_module

            def exec_then(module):
                exec_module(module)
                self.then()

            spec.loader.exec_module = exec_then  # type: ignore[method-assign]
        return spec


def _patch_openrlhf() -> None:
    """The OpenRLHF patches; run once ``MODEL_SIDE`` is imported, when every module they patch
    can be (``ppo_actor``, if it is the importer, is past the names patched)."""

    from torch.distributed.device_mesh import init_device_mesh

    upstream.apply(
        "cpu_openrlhf",
        {
            # utils/deepspeed/deepspeed.py: init_device_mesh("cuda", ...) in setup_distributed
            "init_device_mesh": lambda _device, *a, **k: init_device_mesh("cpu", *a, **k),
            # utils/distributed_util.py and ppo_actor.py: the weight-sync group is
            # PyNcclCommunicator
            "stateless_init_process_group": _stateless_gloo_group,
            "DeepspeedStrategy.get_ds_train_config": _torch_adam,
            "NaiveReplayBuffer.__init__": _cpu_target,
            "convert_to_torch_dtype": _fp32_dtype,
        },
    )


def enable() -> None:
    """Install the CPU patches in this process; a no-op where CUDA is available. Idempotent."""
    global _enabled
    if has_gpu() or _enabled:
        return
    # torch.cuda queries OpenRLHF makes unconditionally (utils/distributed_util.py:
    # torch_dist_barrier_and_cuda_sync; deepspeed.py: set_device(local_rank); ppo_actor.py:
    # broadcast(..., stream=torch.cuda.current_stream()))
    upstream.apply(
        "cpu_torch",
        {
            "current_device": lambda: _CPUDevice("cpu"),
            "synchronize": lambda *a, **k: None,
            "set_device": lambda *a, **k: None,
            "current_stream": lambda *a, **k: None,
        },
    )
    _enabled = True
    if MODEL_SIDE in sys.modules:
        _patch_openrlhf()
    else:
        sys.meta_path.insert(0, _AfterImport(MODEL_SIDE, _patch_openrlhf))
    end_workers_without_teardown()
    logger.info("no CUDA device: OpenRLHF runs on CPU (drpo_openrlhf.runtime.cpu_support)")
