"""Broken weight syncs for the guard's tests, chosen per vLLM engine by
``DRPO_TEST_SYNC_BREAK`` (JSON: engine index -> breakage; ``@PATH``: read that JSON file on
every call, so one Ray cluster serves several tests). Engine ``i`` is the one whose vLLM seed
is ``--train.seed`` (42) + ``i`` (OpenRLHF's ``create_vllm_engines``).

- ``"nothing": true``: receive every tensor, load none (issue 22, finding 5);
- ``"skip": NAME``: do not load NAME;
- ``"rename": [NAME, OTHER]``: load NAME's tensor under OTHER's name;
- ``"swap": [NAME, OTHER]``: load each of the two under the other's name;
- ``"permute": NAME``: load NAME with its rows in reverse order;
- ``"transpose": NAME``: load the square matrix NAME transposed;
- ``"lag": true``: from the second sync on, load each tensor of the sync before;
- ``"from_sync": N``: the breakages above start at the N-th sync (default 1), so a run
  can train normally first;
- ``"start_from": PATH``: vLLM loads the model's first weights from the checkpoint in PATH
  instead of the one it was started with (the actor's).

Faults in what the engine computes, which its weights (and so the digests) do not show:

- ``"rope_theta": FACTOR``: the rotary embeddings' base times FACTOR (a wrong ``rope_theta``);
- ``"fp16_linear": true``: the linear layers compute in fp16 (the weights stay bf16);
- ``"temperature": T``: the engine samples (and reports log-probs) at temperature T whatever
  the request asks; prompt log-probs (the weight probe's) are left alone.

Settings an engine is created with otherwise than the run asked, set in its model's config
before vLLM builds the model (so the model computes with them, as if created so):

- ``"dtype": NAME``: the model's dtype (``"float16"``), weights and compute;
- ``"max_model_len": N``: the longest sequence the engine accepts;
- ``"kv_cache_dtype": NAME``: the KV cache's dtype (``"fp8"``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

BASE_SEED = 42


def _table() -> dict:
    value = os.environ["DRPO_TEST_SYNC_BREAK"]
    return json.loads(Path(value[1:]).read_text() if value.startswith("@") else value)


def _breakage(worker) -> dict:
    return _table().get(str(worker.model_config.seed - BASE_SEED), {})


def _start_from_another_checkpoint() -> None:
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    get_all_weights = DefaultModelLoader.get_all_weights

    def from_checkpoint(self, model_config, model):
        path = _table().get(str(model_config.seed - BASE_SEED), {}).get("start_from")
        if path is None:
            return get_all_weights(self, model_config, model)
        print(f"SYNC BREAK: first weights loaded from {path}", flush=True)
        source = DefaultModelLoader.Source(path, None, prefix="", fall_back_to_pt=True)
        return self._get_weights_iterator(source)

    DefaultModelLoader.get_all_weights = from_checkpoint


def _compute_otherwise(model, breakage: dict) -> None:
    import torch.nn.functional as F
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase

    factor = breakage.get("rope_theta")
    rotaries = {id(m): m for m in model.modules() if isinstance(m, RotaryEmbeddingBase)}
    for rotary in rotaries.values() if factor else ():  # vLLM shares one among the layers
        rotary.base *= factor
        cache = rotary.cos_sin_cache
        rotary.cos_sin_cache = rotary._compute_cos_sin_cache().to(cache.device, cache.dtype)
        if getattr(rotary, "cos_sin_cache_bf16", None) is not None:
            rotary.cos_sin_cache_bf16 = rotary.cos_sin_cache.bfloat16()
    if factor:
        print(f"SYNC BREAK: rotary base x {factor} in {len(rotaries)} module(s)", flush=True)
    if breakage.get("fp16_linear"):
        layers = [m for m in model.modules() if hasattr(m, "cpu_linear")]

        def half(x, weight, bias):
            bias = None if bias is None else bias.half()
            return F.linear(x.half(), weight.half(), bias).to(x.dtype)

        for layer in layers:
            layer.cpu_linear = half
        print(f"SYNC BREAK: {len(layers)} linear layers compute in fp16", flush=True)


def _configure_otherwise(vllm_config, breakage: dict) -> None:
    """``dtype`` / ``max_model_len`` / ``kv_cache_dtype``: the engine's config, before the
    model is built with it."""
    model_config, cache_config = vllm_config.model_config, vllm_config.cache_config
    if "dtype" in breakage:
        model_config.dtype = getattr(torch, breakage["dtype"])
        print(f"SYNC BREAK: the engine's model in {breakage['dtype']}", flush=True)
    if "max_model_len" in breakage:
        model_config.max_model_len = breakage["max_model_len"]
        print(f"SYNC BREAK: max_model_len {breakage['max_model_len']}", flush=True)
    if "kv_cache_dtype" in breakage:
        cache_config.cache_dtype = breakage["kv_cache_dtype"]
        print(f"SYNC BREAK: KV cache in {breakage['kv_cache_dtype']}", flush=True)


def _load_model_then_break() -> None:
    """Apply ``rope_theta`` / ``fp16_linear`` to the engine's model once vLLM has built it
    (after ``process_weights_after_loading``, which sets each linear layer's CPU kernel)."""
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    load_model = BaseModelLoader.load_model

    def load_then_break(self, vllm_config, model_config, prefix=""):
        breakage = _table().get(str(model_config.seed - BASE_SEED), {})
        _configure_otherwise(vllm_config, breakage)
        model = load_model(self, vllm_config, model_config, prefix=prefix)
        _compute_otherwise(model, breakage)
        return model

    BaseModelLoader.load_model = load_then_break


_said: dict[str, bool] = {}


def _sample_at_another_temperature() -> None:
    """In vLLM's engine core (the process that imports the worker extension), where each
    request arrives with its sampling settings."""
    from vllm.v1.engine.core import EngineCore

    add_request = EngineCore.add_request

    def at_temperature(self, request, *args, **kwargs):
        seed = self.vllm_config.model_config.seed
        temperature = _table().get(str(seed - BASE_SEED), {}).get("temperature")
        params = request.sampling_params
        if temperature is not None and params is not None and params.prompt_logprobs is None:
            if not _said.get("temperature"):
                _said["temperature"] = True
                print(
                    f"SYNC BREAK: sampling at temperature {temperature} instead of "
                    f"{params.temperature}",
                    flush=True,
                )
            params.temperature = temperature
        return add_request(self, request, *args, **kwargs)

    EngineCore.add_request = at_temperature


def install(worker_class) -> None:
    _start_from_another_checkpoint()
    _load_model_then_break()
    _sample_at_another_temperature()

    def update_weight(self, name, dtype, shape, empty_cache=False):
        weight = torch.empty(shape, dtype=dtype, device=self.device)
        self._model_update_group.broadcast(weight, src=0)
        breakage = _breakage(self)
        syncs = self.__dict__.setdefault("_syncs", {})  # how many times NAME was received
        syncs[name] = syncs.get(name, 0) + 1
        if syncs[name] < breakage.get("from_sync", 1):
            breakage = {}
        if breakage.get("nothing") or breakage.get("skip") == name:
            print(f"SYNC BREAK: {name} not loaded", flush=True)
            return
        if breakage.get("lag"):
            held = self.__dict__.setdefault("_held", {})
            previous, held[name] = held.get(name), weight.clone()
            if previous is not None:
                print(f"SYNC BREAK: {name} of the sync before loaded", flush=True)
                weight = previous
        source, target = breakage.get("rename", (None, None))
        if name == source:
            print(f"SYNC BREAK: {name} loaded as {target}", flush=True)
            name = target
        pair = breakage.get("swap", ())
        if name in pair:
            other = pair[1 - pair.index(name)]
            print(f"SYNC BREAK: {name} loaded as {other}", flush=True)
            name = other
        if breakage.get("permute") == name:
            print(f"SYNC BREAK: {name} loaded with its rows reversed", flush=True)
            weight = weight.flip(0)
        if breakage.get("transpose") == name:
            print(f"SYNC BREAK: {name} loaded transposed", flush=True)
            weight = weight.t().contiguous()
        self.model_runner.model.load_weights(weights=[(name, weight)])

    worker_class.update_weight = update_weight
