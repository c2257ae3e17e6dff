"""``all_gather`` as OpenRLHF's ring-attention helpers call it: along the first dimension,
differentiable like flash-attn's (the backward sums each rank's gradient of the gathered
tensor and hands every rank its own slice: a reduce-scatter)."""

from __future__ import annotations

import torch
import torch.distributed as dist


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        out = tensor.new_empty(world * tensor.shape[0], *tensor.shape[1:])
        dist.all_gather_into_tensor(out, tensor.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        world = dist.get_world_size(ctx.group)
        mine = grad.new_empty(grad.shape[0] // world, *grad.shape[1:])
        dist.reduce_scatter_tensor(mine, grad.contiguous(), group=ctx.group)
        return mine, None


def all_gather(tensor: torch.Tensor, group=None) -> torch.Tensor:
    return _AllGather.apply(tensor, group)
