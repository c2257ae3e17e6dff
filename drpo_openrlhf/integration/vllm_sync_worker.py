"""The vLLM side of the weight-sync check: which parameter each received tensor went into, and
the digest of every parameter as the model samples with it (``weight_digest``).

A mixin of the worker extensions (``vllm_cpu_worker.CPUWorkerWrap`` on CPU,
``GPUWorkerWrap`` below on GPUs), so its methods run in every vLLM worker through the engine
actor's ``collective_rpc``. Per sync: ``begin_weight_sync`` starts recording; each received
tensor is loaded by vLLM's own ``load_weights`` (renamed, fused into ``qkv_proj`` /
``gate_up_proj``, sharded); ``weight_sync_report`` returns what was recorded and the digests.
Recording wraps each parameter's ``weight_loader`` (the call every vLLM model loader ends in),
so a tensor that never reaches a parameter, or reaches the wrong one, shows.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap

from drpo_openrlhf.integration.weight_digest import digest


def _shard_label(args: tuple, kwargs: dict) -> str:
    """The shard id(s) a loader was called with ('q', 0, an expert id, ...), for messages."""
    values = [*args, *kwargs.values()]
    return ",".join(str(v) for v in values if not isinstance(v, torch.Tensor))


def padding_elements(model: torch.nn.Module) -> dict[str, int]:
    """Elements of vocabulary padding per parameter: vLLM pads embedding and LM-head rows to a
    multiple of 64 per rank and fills them with zeros (``VocabParallelEmbedding``'s
    ``weight_loader``); the actor has no such rows, so they are left out of the digest."""
    padding = {}
    for prefix, module in model.named_modules():
        indices = getattr(module, "shard_indices", None)
        weight = getattr(module, "weight", None)
        if indices is None or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            continue
        rows = indices.num_org_vocab_padding + indices.num_added_vocab_padding
        padding[f"{prefix}.weight" if prefix else "weight"] = rows * weight.shape[1]
    return padding


class WeightSyncRecorder:
    """Worker-extension mixin: records each sync's loads and digests the model's parameters."""

    _drpo_loads: dict[str, list[tuple[str, str]]] | None = None
    _drpo_current: str | None = None

    def _drpo_model(self) -> torch.nn.Module:
        return self.model_runner.model

    def _drpo_instrument(self) -> None:
        """Wrap every parameter's loader and the model's ``load_weights`` once."""
        model = self._drpo_model()
        if getattr(model, "_drpo_recording", False):
            return
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        for name, param in model.named_parameters():
            attr = "_weight_loader" if hasattr(param, "_weight_loader") else "weight_loader"
            original = getattr(param, attr, default_weight_loader)
            setattr(param, attr, self._drpo_recording_loader(name, original))
        load_weights = model.load_weights

        def recording_load_weights(weights, *args, **kwargs):
            def named():
                for name, tensor in weights:
                    self._drpo_current = name
                    yield name, tensor
                self._drpo_current = None

            return load_weights(named(), *args, **kwargs)

        model.load_weights = recording_load_weights
        model._drpo_recording = True

    def _drpo_recording_loader(self, param_name: str, loader):
        @functools.wraps(loader)
        def recording(param, loaded_weight, *args, **kwargs):
            if self._drpo_loads is not None and self._drpo_current is not None:
                place = (param_name, _shard_label(args, kwargs))
                self._drpo_loads.setdefault(self._drpo_current, []).append(place)
            return loader(param, loaded_weight, *args, **kwargs)

        return recording

    def begin_weight_sync(self) -> None:
        """Start recording which parameter each received tensor is loaded into."""
        self._drpo_instrument()
        self._drpo_loads = {}

    def weight_sync_report(self) -> dict[str, Any]:
        """This sync's loads (name -> [(parameter, shard)]) and every parameter's digest
        (``(numel, value)``, vocabulary padding excluded); ends the recording."""
        model = self._drpo_model()
        padding = padding_elements(model)
        params = {}
        for name, param in model.named_parameters():
            d = digest(param.data).without_zeros(padding.get(name, 0))
            params[name] = (d.numel, d.value)
        loads, self._drpo_loads = self._drpo_loads or {}, None
        return {"loads": loads, "params": params}


class GPUWorkerWrap(WeightSyncRecorder, WorkerWrap):
    """OpenRLHF's worker extension (NCCL broadcast, CUDA IPC) with the sync recorder."""


GPU_WORKER_EXTENSION = f"{__name__}.GPUWorkerWrap"
