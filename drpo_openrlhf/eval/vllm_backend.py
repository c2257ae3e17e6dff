"""vLLM generation backend (GPU), written against vLLM 0.29's offline ``LLM`` API.

vLLM is imported only inside the functions that need it (``--backend hf`` runs without it).
vLLM's CPU build runs this module too with ``enforce_eager`` (no torch.compile), which is how
``scripts/smoke_gpu.py --checks eval`` exercises it without a GPU.

Tensor parallelism is vLLM's own (``tensor_parallel_size``). Data parallelism is done here
rather than through vLLM's data-parallel engine options, which change between releases: each
of ``data_parallel_size`` worker processes owns ``tensor_parallel_size`` GPUs (a slice of
``CUDA_VISIBLE_DEVICES``), loads the model once, and answers a contiguous shard of every
batch of prompts.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import traceback
from collections.abc import Sequence
from typing import Any

from drpo_openrlhf.eval.generation import Sample, SamplingSettings

# (text, num_tokens, truncated): plain tuples pickle faster than dataclasses across pipes.
_RawSample = tuple[str, int, bool]


def _visible_devices(count: int) -> list[str]:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = [d for d in env.split(",") if d.strip()] if env else [str(i) for i in range(count)]
    if len(devices) < count:
        raise ValueError(f"need {count} GPUs, CUDA_VISIBLE_DEVICES lists {len(devices)}")
    return devices[:count]


def _make_llm(model_path: str, llm_kwargs: dict[str, Any]):
    from vllm import LLM

    return LLM(model=model_path, **llm_kwargs)


def _generate_raw(
    llm, prompt_ids: Sequence[Sequence[int]], sampling: SamplingSettings, use_tqdm: bool
) -> list[list[_RawSample]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(
        n=sampling.n,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        max_tokens=sampling.max_new_tokens,
        skip_special_tokens=True,
    )
    prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in prompt_ids]
    outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    # vLLM's token_ids include the EOS token of a stopped response; "length" = truncated.
    return [
        [(c.text, len(c.token_ids), c.finish_reason == "length") for c in out.outputs]
        for out in outputs
    ]


def _worker(conn, devices: list[str], model_path: str, llm_kwargs: dict[str, Any]) -> None:
    """Data-parallel rank: owns ``devices``, serves generation requests until told to stop."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    try:
        llm = _make_llm(model_path, llm_kwargs)
        conn.send(("ready", None))
        while (request := conn.recv()) is not None:
            prompt_ids, sampling, use_tqdm = request
            conn.send(("ok", _generate_raw(llm, prompt_ids, sampling, use_tqdm)))
    except Exception:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


class VLLMBackend:
    """Generation with vLLM over ``tensor_parallel_size * data_parallel_size`` GPUs.

    The engine is seeded once with the sampling seed (plus the rank); the per-call ``seed``
    of the backend interface is not used, because vLLM's per-request seeds slow sampling
    down and its batched GPU kernels are not bitwise reproducible anyway.
    """

    def __init__(
        self,
        model_path: str,
        *,
        seed: int,
        tensor_parallel_size: int = 1,
        data_parallel_size: int = 1,
        dtype: str = "auto",
        gpu_memory_utilization: float = 0.9,
        max_model_len: int | None = None,
        enforce_eager: bool = False,
        progress: bool = True,
    ) -> None:
        self.progress = progress
        llm_kwargs: dict[str, Any] = {
            "tensor_parallel_size": tensor_parallel_size,
            "dtype": dtype,
            "gpu_memory_utilization": gpu_memory_utilization,
            "seed": seed,
            "enforce_eager": enforce_eager,
        }
        if max_model_len is not None:
            llm_kwargs["max_model_len"] = max_model_len
        self._llm = None
        self._workers: list[tuple[Any, Any]] = []
        if data_parallel_size == 1:
            self._llm = _make_llm(model_path, llm_kwargs)
            return
        devices = _visible_devices(tensor_parallel_size * data_parallel_size)
        context = multiprocessing.get_context("spawn")
        for rank in range(data_parallel_size):
            parent, child = context.Pipe()
            rank_devices = devices[rank * tensor_parallel_size : (rank + 1) * tensor_parallel_size]
            process = context.Process(
                target=_worker,
                args=(child, rank_devices, model_path, {**llm_kwargs, "seed": seed + rank}),
            )
            process.start()
            child.close()
            self._workers.append((process, parent))
        for _, conn in self._workers:
            self._receive(conn)

    def _receive(self, conn):
        status, payload = conn.recv()
        if status == "error":
            self.close()
            raise RuntimeError(f"vLLM data-parallel worker failed:\n{payload}")
        return payload

    def generate(
        self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingSettings, seed: int
    ) -> list[list[Sample]]:
        if self._llm is not None:
            raw = _generate_raw(self._llm, prompt_ids, sampling, self.progress)
        else:
            size = max(1, -(-len(prompt_ids) // len(self._workers)))
            shards = [prompt_ids[i : i + size] for i in range(0, len(prompt_ids), size)]
            for (_, conn), shard in zip(self._workers, shards, strict=False):
                # Only rank 0 draws a progress bar; the ranks advance together.
                conn.send((list(shard), sampling, self.progress and conn is self._workers[0][1]))
            raw = [
                row
                for (_, conn), _ in zip(self._workers, shards, strict=False)
                for row in self._receive(conn)
            ]
        return [[Sample(*s) for s in row] for row in raw]

    def close(self) -> None:
        for process, conn in self._workers:
            with contextlib.suppress(BrokenPipeError, OSError):
                conn.send(None)
            process.join(timeout=60)
            if process.is_alive():
                process.terminate()
        self._workers = []
        self._llm = None
