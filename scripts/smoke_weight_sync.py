"""The vLLM side of the GPU weight sync, on a real engine: ``smoke_gpu.py``'s ``sync`` check.

OpenRLHF sends the actor's weights to the engines over NCCL (engines on their own GPUs) or
CUDA IPC (``--train.colocate_all``: engines beside the actor); on the engine side both run in
the worker extension (``sync/vllm_sync_worker.py: GPUWorkerWrap``), which also records each
sync and digests what the engine holds for the weight check. This script starts one vLLM
engine with that extension on the toy policy and, as the actor's rank 0 would
(``openrlhf/trainer/ray/ppo_actor.py: broadcast_to_vllm``), from this process:

1. maps where each tensor lives (``map_weight_layout``) and checks that the engine holds the
   policy it loaded (the check before the first rollout);
2. sends every tensor, changed, over CUDA IPC (``update_weight_cuda_ipc``; same GPU);
3. sends every tensor, changed otherwise, over NCCL (``init_process_group``, ``update_weight``;
   this process on a second GPU: NCCL puts no two ranks on one GPU, so one GPU skips it);

and after each sync checks, as the run does (``weight_digest.engine_problems``), that every
tensor was loaded once and the engine holds exactly what was sent; and that the check sees an
engine that holds other weights (its report against the sync before: the negative control).
Prints one ``SYNC_RESULT {json}`` line; exits non-zero on any problem.

    python scripts/smoke_weight_sync.py --model DIR [--gpus N]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch

from drpo_openrlhf.sync.weight_digest import Digest, digest, engine_problems

GPU_WORKER_EXTENSION = "drpo_openrlhf.sync.vllm_sync_worker.GPUWorkerWrap"
RESULT = "SYNC_RESULT "
# how each path changes the weights it sends: both exact in bf16 and each other's opposite
# nowhere, so each sync's digests differ from the weights before it (a sync that loaded
# nothing cannot pass)
CHANGES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "cuda-ipc": lambda t: -t,
    "nccl": lambda t: t * 2,
}


def paths(gpus: int) -> list[str]:
    """The sync paths this node can run: CUDA IPC on any GPU, NCCL with a second one."""
    return ["cuda-ipc", "nccl"] if gpus >= 2 else ["cuda-ipc"]


def changed(tensors: Mapping[str, torch.Tensor], path: str) -> dict[str, torch.Tensor]:
    return {name: CHANGES[path](t).contiguous() for name, t in tensors.items()}


def digests(tensors: Mapping[str, torch.Tensor]) -> dict[str, Digest]:
    return {name: digest(t) for name, t in tensors.items()}


def sync_outcome(
    sent: Mapping[str, Digest],
    raw_reports: list[dict],
    before: Mapping[str, Digest] | None = None,
) -> list[str]:
    """The problems of one check of the engine (its workers' raw reports) against ``sent``:
    after a sync when ``before`` (the weights it held until the sync) is given, else of the
    weights it started with. After a sync, the negative control: against ``before`` the same
    reports must show problems, or the check cannot see a sync that did nothing."""
    from drpo_openrlhf.sync.sync_check import worker_report

    workers = [worker_report(raw) for raw in raw_reports]
    problems = engine_problems(sent, workers, synced=before is not None)
    if before is not None and not engine_problems(before, workers, synced=False):
        problems.append("the check finds no difference from the weights before this sync")
    return problems


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _in_thread(call: Callable[[], Any]) -> Callable[[], Any]:
    """Start ``call`` in a thread (an engine call that waits on this process's collective);
    the returned function joins it and gives its result or raises its error."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as error:  # re-raised by the join
            box["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def join() -> Any:
        thread.join()
        if "error" in box:
            raise box["error"]
        return box["value"]

    return join


def sync_over_cuda_ipc(llm, tensors: Mapping[str, torch.Tensor]) -> None:
    """As ``broadcast_to_vllm``'s ``_handle_cuda_ipc`` with one actor rank: a handle per
    tensor, keyed by the GPU's UUID, rebuilt by the worker on its device."""
    from openrlhf.trainer.ray.utils import get_physical_gpu_id
    from torch.multiprocessing.reductions import reduce_tensor

    for name, tensor in tensors.items():
        handles = {get_physical_gpu_id(): reduce_tensor(tensor)}
        llm.collective_rpc(
            "update_weight_cuda_ipc", args=(name, tensor.dtype, tuple(tensor.shape), handles)
        )
    torch.cuda.synchronize()


def sync_over_nccl(llm, tensors: Mapping[str, torch.Tensor]) -> None:
    """As ``_init_vllm_sync_group`` and ``_broadcast_param``: a two-rank group (this process
    rank 0, the engine's worker rank 1), then one broadcast per tensor while the worker's
    ``update_weight`` receives it."""
    from openrlhf.utils.distributed_util import stateless_init_process_group

    address, port = "127.0.0.1", free_port()
    joined = _in_thread(
        lambda: llm.collective_rpc(
            "init_process_group", args=(address, port, 1, 2, "smoke", "nccl", False)
        )
    )
    group = stateless_init_process_group(address, port, 0, 2, torch.cuda.current_device())
    joined()
    for name, tensor in tensors.items():
        received = _in_thread(
            lambda name=name, tensor=tensor: llm.collective_rpc(
                "update_weight", args=(name, tensor.dtype, tuple(tensor.shape))
            )
        )
        group.broadcast(tensor, src=0, stream=torch.cuda.current_stream())
        received()
    torch.cuda.synchronize()


def run(model: str, gpus: int) -> dict[str, list[str]]:
    """Each check's problems (empty: passed), by name; ``skipped`` lists what this node
    cannot run and why."""
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # IPC handles, dtypes
    from transformers import AutoModelForCausalLM
    from vllm import LLM

    llm = LLM(
        model=model,
        dtype="bfloat16",
        enforce_eager=True,
        gpu_memory_utilization=0.3,
        worker_extension_cls=GPU_WORKER_EXTENSION,
    )  # its worker on the first GPU
    actor = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
    weights = {name: p.detach() for name, p in actor.named_parameters()}
    llm.collective_rpc("map_weight_layout", args=({n: tuple(t.shape) for n, t in weights.items()},))
    held = digests(weights)
    outcome = {"start": sync_outcome(held, llm.collective_rpc("weight_sync_report"))}
    for path in paths(gpus):
        device = "cuda:0" if path == "cuda-ipc" else "cuda:1"  # IPC: the engine's GPU
        torch.cuda.set_device(device)
        sent = changed({n: t.to(device) for n, t in weights.items()}, path)
        llm.collective_rpc("begin_weight_sync")
        (sync_over_cuda_ipc if path == "cuda-ipc" else sync_over_nccl)(llm, sent)
        reports = llm.collective_rpc("weight_sync_report")
        outcome[path] = sync_outcome(digests(sent), reports, before=held)
        held = digests(sent)
    if gpus < 2:
        outcome["skipped"] = ["nccl: needs a second GPU (NCCL puts no two ranks on one GPU)"]
    return outcome


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True, help="a Hugging Face model directory (bf16-able)")
    p.add_argument("--gpus", type=int, default=None, help="default: every visible GPU")
    args = p.parse_args(argv)
    gpus = torch.cuda.device_count() if args.gpus is None else args.gpus
    if gpus < 1:
        print(RESULT + json.dumps({"error": ["no CUDA device: the GPU sync paths need one"]}))
        return 1
    outcome = run(args.model, gpus)
    print(RESULT + json.dumps(outcome), flush=True)
    return 1 if any(v for k, v in outcome.items() if k != "skipped") else 0


if __name__ == "__main__":
    sys.exit(main())
