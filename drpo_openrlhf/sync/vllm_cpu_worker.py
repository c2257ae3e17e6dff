"""The worker extension of vLLM's CPU engines in a run without a GPU (``cpu_support``).

vLLM imports this module in its worker process (``worker_extension_cls``) before it loads the
model, which is when the patch below takes effect: vLLM's CPU backend otherwise repacks every
linear layer's weight into a oneDNN / sgl-kernel handle after loading and deletes the
parameter (``vllm/model_executor/layers/linear.py: process_weights_after_loading`` with
``remove_weight=True``), so a weight sync can neither load into it (``'Parameter' object has
no attribute 'weight_loader'``) nor reach the packed copy the layer computes with. Linear
layers here compute ``F.linear`` on their live parameters instead: slower than oneDNN, which
does not matter for the small models a CPU run trains, and every synced weight takes effect
(checked each step by ``drpo/rollout_logprob_gap``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from drpo_openrlhf import upstream
from drpo_openrlhf.sync.gloo_group import GlooBroadcastGroup
from drpo_openrlhf.sync.vllm_sync_worker import WeightSyncRecorder


def _live_linear(layer: torch.nn.Module, remove_weight: bool) -> None:
    """Replaces ``vllm/model_executor/layers/utils.py: dispatch_cpu_unquantized_gemm``."""
    layer.cpu_linear = lambda x, weight, bias: F.linear(x, weight, bias)


upstream.apply("vllm_cpu_worker", {"dispatch_cpu_unquantized_gemm": _live_linear})


class CPUWorkerWrap(WeightSyncRecorder):
    """OpenRLHF's ``WorkerWrap`` calls for CPU engines: its own allocates the received weight
    with ``device="cuda"`` (``trainer/ray/vllm_worker_wrap.py: update_weight``; the run hangs
    there) and joins an NCCL group; this one receives on the worker's device over gloo. Each
    sync is checked exactly (``WeightSyncRecorder``)."""

    def init_process_group(
        self,
        master_address,
        master_port,
        rank_offset,
        world_size,
        group_name,
        backend="gloo",
        use_ray=False,
    ):
        rank = torch.distributed.get_rank() + rank_offset
        self._model_update_group = GlooBroadcastGroup(master_address, master_port, rank, world_size)

    def update_weight(self, name, dtype, shape, empty_cache=False):
        if dtype != self.model_config.dtype:
            raise TypeError(f"weight sync dtype {dtype} != vLLM's {self.model_config.dtype}")
        weight = torch.empty(shape, dtype=dtype, device=self.device)
        self._model_update_group.broadcast(weight, src=0)
        self.model_runner.model.load_weights(weights=[(name, weight)])
