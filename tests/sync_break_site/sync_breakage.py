"""Broken weight syncs for the guard's tests, chosen per vLLM engine by
``DRPO_TEST_SYNC_BREAK`` (JSON: engine index -> breakage). Engine ``i`` is the one whose
vLLM seed is ``--train.seed`` (42) + ``i`` (OpenRLHF's ``create_vllm_engines``).

- ``"nothing": true``: receive every tensor, load none (issue 22, finding 5);
- ``"skip": NAME``: do not load NAME;
- ``"rename": [NAME, OTHER]``: load NAME's tensor under OTHER's name;
- ``"lag": true``: from the second sync on, load each tensor of the sync before.
"""

from __future__ import annotations

import json
import os

import torch

BASE_SEED = 42


def _breakage(worker) -> dict:
    table = json.loads(os.environ["DRPO_TEST_SYNC_BREAK"])
    return table.get(str(worker.model_config.seed - BASE_SEED), {})


def install(worker_class) -> None:
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
        self.model_runner.model.load_weights(weights=[(name, weight)])

    worker_class.update_weight = update_weight
