"""The weight-sync group of a run without a GPU: gloo, outside ``torch.distributed``'s default
group (which DeepSpeed and vLLM already own), between actor rank 0 and every vLLM worker.

OpenRLHF's default, vLLM's NCCL communicator, disables itself without CUDA and turns every
broadcast into a silent no-op (``runtime/cpu_support.py`` installs this group in its place).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

SYNC_TIMEOUT = timedelta(minutes=10)


class GlooBroadcastGroup:
    """The weight-sync group: a gloo process group outside ``torch.distributed``'s default
    group, with the ``broadcast(tensor, src, stream)`` call OpenRLHF makes on vLLM's NCCL
    communicator (``trainer/ray/ppo_actor.py``: ``_broadcast_param``)."""

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int):
        store = dist.TCPStore(
            master_address, master_port, world_size, is_master=rank == 0, timeout=SYNC_TIMEOUT
        )
        self.group = dist.ProcessGroupGloo(
            dist.PrefixStore("drpo_weight_sync", store), rank, world_size, SYNC_TIMEOUT
        )
        self.store = store  # the group keeps a reference, but the master must outlive it

    def broadcast(self, tensor: torch.Tensor, src: int = 0, stream: Any = None) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = src
        self.group.broadcast([tensor], options).wait()
