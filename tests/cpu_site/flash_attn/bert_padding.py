"""Plain-torch equivalents of the padding helpers OpenRLHF's packed-sample path uses."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rearrange(tensor: torch.Tensor, pattern: str, **_: int) -> torch.Tensor:
    if pattern.replace(" ", "") != "bs...->(bs)...":
        raise NotImplementedError(f"stand-in rearrange only flattens 'b s ...', got {pattern!r}")
    return tensor.reshape(-1, *tensor.shape[2:])


def index_first_axis(tensor: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    return tensor[indices]


def unpad_input(hidden: torch.Tensor, attention_mask: torch.Tensor, *_: object):
    seqlens = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden.reshape(-1, *hidden.shape[2:])[indices]
    return flat, indices, cu_seqlens, int(seqlens.max()), seqlens


def pad_input(hidden: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int):
    out = hidden.new_zeros(batch * seqlen, *hidden.shape[1:])
    out[indices] = hidden
    return out.reshape(batch, seqlen, *hidden.shape[1:])
