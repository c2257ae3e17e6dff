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
- ``"start_from": PATH``: vLLM loads the model's first weights from the checkpoint in PATH
  instead of the one it was started with (the actor's).
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


def install(worker_class) -> None:
    _start_from_another_checkpoint()

    def update_weight(self, name, dtype, shape, empty_cache=False):
        weight = torch.empty(shape, dtype=dtype, device=self.device)
        self._model_update_group.broadcast(weight, src=0)
        breakage = _breakage(self)
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
