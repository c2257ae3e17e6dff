"""``scripts/smoke_weight_sync.py`` (``smoke_gpu.py``'s ``sync`` check): the parts that run
without a GPU. Its engine side needs CUDA (vLLM's GPU worker, NCCL, CUDA IPC) and has not run
here; what is checked is what it decides from an engine's reports, that its verdict needs the
sent weights exactly and sees a sync that did nothing, and how ``smoke_gpu.py`` reads it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
import smoke_gpu  # noqa: E402
import smoke_weight_sync as sws  # noqa: E402

WEIGHTS = {
    "model.embed_tokens.weight": torch.randn(16, 8, generator=torch.Generator().manual_seed(0)),
    "model.norm.weight": torch.ones(8),
}


def raw_report(held: dict[str, torch.Tensor], loaded: bool = True) -> dict:
    """One worker's ``weight_sync_report`` (``vllm_sync_worker``) for a model whose parameters
    are the tensors' own names, holding ``held``."""
    digests = {name: sws.digest(t) for name, t in held.items()}
    return {
        "loads": {name: [(name, "")] for name in held} if loaded else {},
        "held": {name: (d.numel, d.value) for name, d in digests.items()},
        "param": {name: name for name in held},
        "unloaded": [],
    }


def test_ipc_runs_on_one_gpu_and_nccl_needs_a_second():
    assert sws.paths(1) == ["cuda-ipc"]
    assert sws.paths(2) == sws.paths(8) == ["cuda-ipc", "nccl"]


@pytest.mark.parametrize("path", list(sws.CHANGES))
def test_each_path_sends_weights_that_differ_exactly_in_bf16(path):
    weights = {n: t.bfloat16() for n, t in WEIGHTS.items()}
    sent = sws.changed(weights, path)
    for name, tensor in weights.items():
        assert sent[name].dtype == torch.bfloat16
        assert torch.equal(sent[name].float(), sws.CHANGES[path](tensor.float()))  # no rounding
        assert sws.digest(sent[name]) != sws.digest(tensor)
    other = next(p for p in sws.CHANGES if p != path)
    assert sws.digests(sent) != sws.digests(sws.changed(weights, other))


def test_an_engine_holding_what_was_sent_passes_and_a_stale_one_is_named():
    before = {n: t.bfloat16() for n, t in WEIGHTS.items()}
    sent = sws.changed(before, "cuda-ipc")
    assert sws.sync_outcome(sws.digests(before), [raw_report(before)]) == []  # start check
    assert sws.sync_outcome(sws.digests(sent), [raw_report(sent)], sws.digests(before)) == []
    # received every tensor but holds the old weights: a load that went nowhere
    stale = sws.sync_outcome(sws.digests(sent), [raw_report(before)], sws.digests(before))
    assert any("holds other values or places" in p for p in stale), stale
    assert "the check finds no difference from the weights before this sync" in stale
    nothing = sws.sync_outcome(
        sws.digests(sent), [raw_report(before, loaded=False)], sws.digests(before)
    )
    assert any("was sent but not loaded" in p for p in nothing), nothing


def test_a_sync_that_changes_nothing_fails_the_negative_control():
    weights = {n: t.bfloat16() for n, t in WEIGHTS.items()}
    problems = sws.sync_outcome(sws.digests(weights), [raw_report(weights)], sws.digests(weights))
    assert problems == ["the check finds no difference from the weights before this sync"]


def test_smoke_gpu_reads_the_result_line():
    ok = {"start": [], "cuda-ipc": [], "skipped": ["nccl: needs a second GPU"]}
    log = f"vLLM says things\n{sws.RESULT}{json.dumps(ok)}\nshutting down\n"
    outcome = smoke_gpu.synced_outcome(log, 0)
    assert outcome.passed, outcome.detail
    assert "start, cuda-ipc" in outcome.detail and "skipped nccl" in outcome.detail
    bad = {"start": [], "cuda-ipc": [], "nccl": ["'x' was sent but not loaded"]}
    outcome = smoke_gpu.synced_outcome(f"{sws.RESULT}{json.dumps(bad)}", 1)
    assert not outcome.passed and "nccl: 'x' was sent but not loaded" in outcome.detail
    crashed = smoke_gpu.synced_outcome("Traceback ...\nRuntimeError: NCCL error", 1)
    assert not crashed.passed and "no result" in crashed.detail and "NCCL error" in crashed.detail


def test_without_a_gpu_the_check_says_so_and_the_script_refuses(tmp_path, capsys):
    outcome = smoke_gpu.check_sync(smoke_gpu.Setup(work=tmp_path, gpus=0))
    assert outcome.passed and "no CUDA device" in outcome.detail
    assert "sync" in smoke_gpu.CHECKS
    assert sws.main(["--model", str(tmp_path), "--gpus", "0"]) == 1
    assert "no CUDA device" in capsys.readouterr().out


def test_an_engine_call_s_error_in_its_thread_reaches_the_caller():
    def fails():
        raise RuntimeError("the worker's broadcast failed")

    assert sws._in_thread(lambda: 7)() == 7
    with pytest.raises(RuntimeError, match="broadcast failed"):
        sws._in_thread(fails)()


class RecordingEngine:
    """Stands in for ``vllm.LLM``: records each ``collective_rpc`` call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        self.calls.append((method, args))
        return [None]


def test_each_engine_call_binds_to_the_gpu_worker_extension_s_method(monkeypatch):
    """Every call the script makes on the engine, over both paths, fits the signature of the
    method of that name on ``GPUWorkerWrap`` (OpenRLHF's ``WorkerWrap`` and the recorder), as
    the worker will receive it; the NCCL path broadcasts each tensor from rank 0."""
    import inspect

    from openrlhf.trainer.ray import utils as openrlhf_ray_utils
    from openrlhf.utils import distributed_util

    from drpo_openrlhf.sync.vllm_sync_worker import GPUWorkerWrap

    broadcasts = []

    class Group:
        def broadcast(self, tensor, src, stream):
            broadcasts.append((tensor.shape, src))

    monkeypatch.setattr(openrlhf_ray_utils, "get_physical_gpu_id", lambda: "GPU-uuid")
    monkeypatch.setattr(distributed_util, "stateless_init_process_group", lambda *a: Group())
    for name in ("synchronize", "current_stream"):
        monkeypatch.setattr(torch.cuda, name, lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    engine = RecordingEngine()
    weights = {n: t.bfloat16() for n, t in WEIGHTS.items()}
    sws.sync_over_cuda_ipc(engine, weights)
    sws.sync_over_nccl(engine, weights)
    methods = [method for method, _ in engine.calls]
    assert methods == [
        *["update_weight_cuda_ipc"] * 2,
        "init_process_group",
        *["update_weight"] * 2,
    ]
    for method, args in engine.calls:
        inspect.signature(getattr(GPUWorkerWrap, method)).bind(None, *args)
    ipc_args = engine.calls[0][1]
    assert set(ipc_args[3]) == {"GPU-uuid"} and ipc_args[1] == torch.bfloat16
    assert engine.calls[2][1][2:4] == (1, 2)  # the worker is rank 1 of 2
    assert broadcasts == [(t.shape, 0) for t in weights.values()]
