"""Run by tests/test_llama_model.py in a process of its own (it sets vLLM's global config and a
one-rank gloo group): vLLM's own ``LlamaForCausalLM`` built from a model directory on CPU,
its weight layout mapped and a sync of the Hugging Face model's bf16 tensors recorded by the
weight check's recorder (``vllm_sync_worker``), as an engine's worker does. Prints JSON: the
problems of a whole sync, the places each name went, the problems of a sync without
``lm_head.weight`` (what a sender that takes the model for tied would send), how many names
the layout map ran through vLLM's loaders, and whether its map equals the one made name by
name (where no layer can reuse another's).

Usage: ``python tests/llama_sync_layout.py MODEL_DIR``.
"""

from __future__ import annotations

import json
import socket
import sys
from types import SimpleNamespace

import torch
from transformers import AutoModelForCausalLM
from vllm.config import DeviceConfig, ModelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed.parallel_state import (
    init_distributed_environment,
    initialize_model_parallel,
)
from vllm.model_executor.models.llama import LlamaForCausalLM

from drpo_openrlhf.sync.sync_check import worker_report
from drpo_openrlhf.sync.vllm_sync_worker import WeightSyncRecorder
from drpo_openrlhf.sync.weight_digest import digest, engine_problems


class Worker(WeightSyncRecorder):
    def __init__(self, model: torch.nn.Module) -> None:
        self.model_runner = SimpleNamespace(model=model)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(model_dir: str) -> None:
    config = VllmConfig(
        model_config=ModelConfig(model=model_dir, dtype="bfloat16", enforce_eager=True),
        device_config=DeviceConfig("cpu"),
    )
    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
            backend="gloo",
        )
        initialize_model_parallel(1, 1)
        torch.set_default_dtype(torch.bfloat16)  # as vLLM's model loader does
        worker = Worker(LlamaForCausalLM(vllm_config=config))
        torch.set_default_dtype(torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    sent = {name: tensor.detach() for name, tensor in hf.named_parameters()}
    shapes = {name: tuple(t.shape) for name, t in sent.items()}
    worker.map_weight_layout({})  # instrument the model, then count the loads of the map
    model = worker.model_runner.model
    load_weights, loaded = model.load_weights, []
    model.load_weights = lambda weights: load_weights(
        loaded.extend(n for n, _ in weights) or weights
    )
    worker.map_weight_layout(shapes)
    model.load_weights = load_weights
    layout = dict(worker._drpo_layout)
    one_by_one = {}
    for name, shape in shapes.items():
        worker.map_weight_layout({name: shape})
        one_by_one.update(worker._drpo_layout)
    worker.map_weight_layout(shapes)

    def sync(tensors: dict) -> tuple[list[str], dict]:
        worker.begin_weight_sync()
        worker.model_runner.model.load_weights(tensors.items())
        raw = worker.weight_sync_report()
        problems = engine_problems({n: digest(t) for n, t in tensors.items()}, [worker_report(raw)])
        return problems, raw["loads"]

    problems, loads = sync(sent)
    without_head, _ = sync({n: t for n, t in sent.items() if n != "lm_head.weight"})
    result = {"problems": problems, "loads": loads, "without_head": without_head}
    result.update(mapped=len(set(loaded)), names=len(shapes), same_map=layout == one_by_one)
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
