"""Stand-ins for ``vllm`` and ``flash_attn``, which cannot be installed without CUDA.

OpenRLHF imports both at module import time. Tests install these only when the real import
fails; production code never imports this file. ``flash_attn.bert_padding`` gets plain-torch
equivalents so that OpenRLHF's packed-sample path runs on CPU; there is deliberately no
``flash_attn.ops`` so OpenRLHF falls back to its torch log-prob path.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types

import torch
import torch.nn.functional as F


def _module(name: str, package: bool = False, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
    if package:
        module.__path__ = []
    module.__dict__.update(attrs)
    sys.modules[name] = module
    return module


def _rearrange(tensor: torch.Tensor, pattern: str, **_: int) -> torch.Tensor:
    if pattern.replace(" ", "") != "bs...->(bs)...":
        raise NotImplementedError(f"stand-in rearrange only flattens 'b s ...', got {pattern!r}")
    return tensor.reshape(-1, *tensor.shape[2:])


def _index_first_axis(tensor: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    return tensor[indices]


def _unpad_input(hidden: torch.Tensor, attention_mask: torch.Tensor, *_: object):
    seqlens = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden.reshape(-1, *hidden.shape[2:])[indices]
    return flat, indices, cu_seqlens, int(seqlens.max()), seqlens


def _pad_input(hidden: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int):
    out = hidden.new_zeros(batch * seqlen, *hidden.shape[1:])
    out[indices] = hidden
    return out.reshape(batch, seqlen, *hidden.shape[1:])


def _all_gather(tensor: torch.Tensor, group=None) -> torch.Tensor:
    world = torch.distributed.get_world_size(group)
    parts = [torch.empty_like(tensor) for _ in range(world)]
    torch.distributed.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts)


class _SamplingParams:
    def __init__(self, **kwargs: object) -> None:
        self.__dict__.update(kwargs)


def _install_vllm() -> None:
    inputs = _module("vllm.inputs", TokensPrompt=dict)
    utils = _module("vllm.utils", random_uuid=lambda: "stand-in")
    _module(
        "vllm",
        package=True,
        __version__="0.0.0-stand-in",
        SamplingParams=_SamplingParams,
        inputs=inputs,
        utils=utils,
    )


def _install_flash_attn() -> None:
    padding = _module(
        "flash_attn.bert_padding",
        index_first_axis=_index_first_axis,
        pad_input=_pad_input,
        unpad_input=_unpad_input,
        rearrange=_rearrange,
    )
    distributed = _module("flash_attn.utils.distributed", all_gather=_all_gather)
    utils = _module("flash_attn.utils", package=True, distributed=distributed)
    _module("flash_attn", package=True, bert_padding=padding, utils=utils)


def install_stand_ins() -> None:
    """Install each stand-in only where the real package cannot be found."""
    if importlib.util.find_spec("vllm") is None:
        _install_vllm()
    if importlib.util.find_spec("flash_attn") is None:
        _install_flash_attn()
