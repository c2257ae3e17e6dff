"""The vLLM side of the weight check: where each sent tensor lives in the model's parameters,
which parameter each received tensor went into in a sync, and the digest of every sent
tensor as the model holds it (``weight_digest``).

A mixin of the worker extensions (``vllm_cpu_worker.CPUWorkerWrap`` on CPU,
``GPUWorkerWrap`` below on GPUs), so its methods run in every vLLM worker through the engine
actor's ``collective_rpc``. Recording wraps each parameter's ``weight_loader`` (the call every
vLLM model loader ends in), so a tensor that never reaches a parameter, or reaches the wrong
one, shows.

Places come from vLLM's own loaders: ``map_weight_layout`` (once, before the first rollout)
passes each of the actor's tensor names through the model's ``load_weights`` a few times,
each time with a tensor holding one base-255 digit of each element's row or column index
(``weight_digest.digit_tensor``), and lets each parameter's loader write it into a zeroed
uint8 stand-in of the parameter (on the CPU, the real parameter untouched). What the loader
wrote in all passes says which block of the parameter holds which block of the sent tensor
(renamed, fused into ``qkv_proj`` / ``gate_up_proj``, sharded by rows or columns, KV heads
replicated, vocabulary padded): ``weight_digest.Block``. The digit tensor is one row or column
broadcast, and each stand-in is reduced to its ``Trace`` (vectors) as soon as its loader
returns, so the map's host memory peaks at about one byte per element of the largest
parameter (549 MB at the 7B's shapes, where full-size position tensors took 9.27 GB:
docs/performance.md). Decoder layers load alike, so once a tensor's first two layers map to
the same places (layer index aside), the other layers reuse that map instead of running the
loaders again: the map then costs two layers and the embeddings, not the whole model.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any

import torch
from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap

from drpo_openrlhf.sync import engine_settings
from drpo_openrlhf.sync.weight_digest import (
    Block,
    Digest,
    LayoutError,
    Trace,
    as_matrix,
    block_from_traces,
    digit_passes,
    digit_tensor,
    trace,
)


def _shard_label(args: tuple, kwargs: dict) -> str:
    """The shard id(s) a loader was called with ('q', 0, an expert id, ...), for messages."""
    values = [*args, *kwargs.values()]
    return ",".join(str(v) for v in values if not isinstance(v, torch.Tensor))


LAYER = re.compile(r"\.layers\.(\d+)\.")


def in_layer(name: str, layer: str) -> str:
    """``name`` with its decoder-layer index replaced by ``layer`` (unchanged outside layers)."""
    return LAYER.sub(f".layers.{layer}.", name, count=1)


class WeightSyncRecorder:
    """Worker-extension mixin: maps where each sent tensor lives, records each sync's loads
    and digests what the model holds."""

    _drpo_loads: dict[str, list[tuple[str, str]]] | None = None
    _drpo_current: str | None = None
    _drpo_traces: list[tuple[str, Trace | None]] | None = None  # set while mapping
    _drpo_axis = 0  # of the digits being mapped
    _drpo_buffer: torch.Tensor | None = None  # the stand-ins' memory while mapping
    _drpo_layout: dict[str, list[tuple[str, Block | None]]] | None = None

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
            name = self._drpo_current
            if self._drpo_traces is not None and name is not None:
                return self._drpo_trace(
                    name, param_name, loader, param, loaded_weight, args, kwargs
                )
            if self._drpo_loads is not None and name is not None:
                place = (param_name, _shard_label(args, kwargs))
                self._drpo_loads.setdefault(name, []).append(place)
            return loader(param, loaded_weight, *args, **kwargs)

        return recording

    def _drpo_trace(self, name, param_name, loader, param, digits, args, kwargs) -> None:
        """Run ``loader`` with ``digits`` into a zeroed uint8 stand-in of ``param`` and keep
        the ``Trace`` of what it wrote (the stand-in's memory goes to the next call)."""
        stand_in = self._drpo_stand_in(param.shape)
        real, grad = param.data, param.requires_grad
        param.requires_grad_(False)  # an integer stand-in cannot require gradients
        param.data = stand_in
        try:
            loader(param, digits, *args, **kwargs)
        finally:
            param.data = real
            param.requires_grad_(grad)
        where = f"{name!r} into vLLM parameter {param_name!r}"
        self._drpo_traces.append((param_name, trace(as_matrix(stand_in), self._drpo_axis, where)))

    def _drpo_stand_in(self, shape: torch.Size) -> torch.Tensor:
        """A zeroed uint8 tensor of ``shape`` in memory kept from one loader call to the next
        and grown to the largest parameter: a fresh one per call would be page-faulted anew
        (about 1 s per pass of a 7B's embedding)."""
        numel = math.prod(shape)
        if self._drpo_buffer is None or self._drpo_buffer.numel() < numel:
            self._drpo_buffer = None  # freed before the larger one is allocated
            self._drpo_buffer = torch.empty(numel, dtype=torch.uint8)
        return self._drpo_buffer[:numel].view(shape).zero_()

    def _drpo_map(self, name: str, shape: tuple[int, ...]) -> None:
        """Load ``name`` once per digit pass and keep the block each loader call wrote; a
        loader that sends it to other parameters from one pass to the next places it by its
        values, which no map can follow."""
        calls = []  # per pass: (parameter, trace) per loader call
        for axis, digit in digit_passes(shape):
            self._drpo_traces, self._drpo_axis = [], axis
            self._drpo_model().load_weights(weights=[(name, digit_tensor(shape, axis, digit))])
            calls.append(self._drpo_traces)
        self._drpo_traces = None
        params = [param for param, _ in calls[0]]
        if any([param for param, _ in call] != params for call in calls):
            raise LayoutError(f"{name!r}: vLLM's loaders put it into other parameters per load")
        for i, param in enumerate(params):
            where = f"{name!r} into vLLM parameter {param!r}"
            block = block_from_traces([call[i][1] for call in calls], shape, where)
            self._drpo_layout.setdefault(name, []).append((param, block))

    def map_weight_layout(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """Find, through vLLM's loaders, the block(s) of this worker's parameters that hold
        each of the actor's tensors (``shapes``: name -> shape as sent). A tensor of a third
        or later decoder layer reuses its first layer's map when the first two layers mapped
        alike and its own parameters have the same shapes; anything else goes through the
        loaders."""
        self._drpo_instrument()
        model = self._drpo_model()
        params = dict(model.named_parameters())
        self._drpo_layout = {}
        first: dict[tuple[str, tuple[int, ...]], str] = {}  # per tensor kind: its first layer
        alike: set[tuple[str, tuple[int, ...]]] = set()
        try:
            with torch.no_grad():
                for name, shape in shapes.items():
                    kind = (in_layer(name, "*"), tuple(shape)) if LAYER.search(name) else None
                    if kind in alike and self._drpo_reuse(first[kind], name, params):
                        continue
                    self._drpo_map(name, tuple(shape))
                    if kind is None:
                        continue
                    if kind not in first:
                        first[kind] = name
                    elif self._drpo_layout.get(name) == self._drpo_moved(first[kind], name):
                        alike.add(kind)
        finally:
            self._drpo_traces = self._drpo_buffer = None

    def _drpo_moved(self, source: str, name: str) -> list[tuple[str, Block | None]] | None:
        """``source``'s map with its parameters moved to ``name``'s decoder layer."""
        blocks = self._drpo_layout.get(source)
        if blocks is None:
            return None
        layer = LAYER.search(name).group(1)
        return [(in_layer(param, layer), block) for param, block in blocks]

    def _drpo_reuse(self, source: str, name: str, params: dict[str, torch.Tensor]) -> bool:
        """Give ``name`` ``source``'s map in its own layer if its parameters exist there with
        the same shapes."""
        moved = self._drpo_moved(source, name)
        same = moved is not None and all(
            p in params and params[p].shape == params[q].shape
            for (p, _), (q, _) in zip(moved, self._drpo_layout[source], strict=True)
        )
        if same:
            self._drpo_layout[name] = moved
        return same

    def begin_weight_sync(self) -> None:
        """Start recording which parameter each received tensor is loaded into."""
        self._drpo_instrument()
        self._drpo_loads = {}

    def weight_sync_report(self) -> dict[str, Any]:
        """This sync's loads (name -> [(parameter, shard)]; empty outside a sync), and per
        mapped name the digest (``(numel, value)``) of what holds it and that parameter's
        name, and the parameters that hold no mapped name; ends the recording."""
        if self._drpo_layout is None:
            raise RuntimeError("weight_sync_report before map_weight_layout")
        params = dict(self._drpo_model().named_parameters())
        held, home = {}, {}
        for name, blocks in self._drpo_layout.items():
            d = sum((b.digest(params[p]) for p, b in blocks if b is not None), Digest())
            held[name], home[name] = (d.numel, d.value), blocks[0][0]
        loads, self._drpo_loads = self._drpo_loads or {}, None
        unloaded = sorted(set(params) - set(home.values()))
        return {"loads": loads, "held": held, "param": home, "unloaded": unloaded}

    def engine_settings(self) -> dict[str, str]:
        """What this worker runs, for the driver's comparison with the actor
        (``engine_settings``)."""
        return engine_settings.engine_settings(self)


class GPUWorkerWrap(WeightSyncRecorder, WorkerWrap):
    """OpenRLHF's worker extension (NCCL broadcast, CUDA IPC) with the sync recorder."""


GPU_WORKER_EXTENSION = f"{__name__}.GPUWorkerWrap"
