"""The weight check's start-up layout map (``vllm_sync_worker.map_weight_layout``) on vLLM's own
``Qwen2ForCausalLM`` at the shapes of DeepSeek-R1-Distill-Qwen-7B (vocabulary 152,064, hidden
3,584, intermediate 18,944, 28 query and 4 KV heads, untied LM head) or -1.5B, cut to a few
decoder layers, on CPU as one tensor-parallel rank of one: its wall time and its peak of host
memory.

The memory is torch's own CPU allocator accounting (``allocator_peak``): the profiler's
allocation events carry the bytes the allocator holds for tensors allocated since profiling
began, so the peak counts every tensor the map and vLLM's loaders allocate, temporaries
included, and nothing else (not the model's parameters, which ``torch.empty`` leaves untouched
and unprofiled). RSS would mix in the allocator's and the kernel's page reuse.

Usage: ``python scripts/bench_weight_map.py [--model 7b|1.5b] [--layers 2] [--only NAME_PART]``;
prints JSON.
"""

from __future__ import annotations

import argparse
import json
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile


def allocator_peak(fn: Callable[[], Any]) -> tuple[Any, int, int]:
    """``fn()``, the most bytes torch's CPU allocator held at once during it for tensors
    allocated during it, and the bytes of those it left allocated."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()

    def walk(events) -> Iterator:
        for event in events:
            yield event
            yield from walk(event.children)

    tree = prof.profiler.kineto_results.experimental_event_tree()
    events = sorted(
        (e for e in walk(tree) if e.tag == _EventType.Allocation), key=lambda e: e.start_time_ns
    )
    if not events:
        return result, 0, 0
    totals = [e.extra_fields.total_allocated for e in events]
    base = totals[0] - events[0].extra_fields.alloc_size  # held before the first allocation
    return result, max(totals) - base, totals[-1] - base


SHAPES = {  # vocabulary, hidden, intermediate, query heads, KV heads
    "7b": (152064, 3584, 18944, 28, 4),
    "1.5b": (151936, 1536, 8960, 12, 2),
}


def qwen(model: str, layers: int):
    """vLLM's Qwen2ForCausalLM at ``model``'s shapes with ``layers`` decoder layers
    (parameters allocated, not written), in a one-rank gloo group."""
    from transformers import Qwen2Config
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

    vocab, hidden, intermediate, heads, kv_heads = SHAPES[model]
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    with tempfile.TemporaryDirectory() as model_dir:
        config.save_pretrained(model_dir)
        model_config = ModelConfig(
            model=model_dir, dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True
        )
    vllm_config = VllmConfig(model_config=model_config, device_config=DeviceConfig("cpu"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, backend="gloo")
        initialize_model_parallel(1, 1)
        torch.set_default_dtype(torch.bfloat16)  # as vLLM's model loader does
        model = Qwen2ForCausalLM(vllm_config=vllm_config)
        torch.set_default_dtype(torch.float32)
    return model, config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="7b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--only", default="", help="map only the names containing this")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    from drpo_openrlhf.sync.vllm_sync_worker import WeightSyncRecorder

    model, config = qwen(args.model, args.layers)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config)
    shapes = {n: tuple(p.shape) for n, p in hf.named_parameters() if args.only in n}
    worker = WeightSyncRecorder()
    worker.model_runner = SimpleNamespace(model=model)
    worker.map_weight_layout({})  # the loaders wrapped once, outside what is measured
    start = time.perf_counter()
    worker.map_weight_layout(shapes)
    seconds = time.perf_counter() - start
    _, peak, kept = allocator_peak(lambda: worker.map_weight_layout(shapes))
    largest = max(p.numel() for p in model.parameters())
    result = {
        "names": len(shapes),
        "elements": sum(torch.Size(s).numel() for s in shapes.values()),
        "seconds": round(seconds, 2),
        "threads": torch.get_num_threads(),
        "peak_bytes": peak,
        "bytes_kept": kept,
        "largest_parameter_elements": largest,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
