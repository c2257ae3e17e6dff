"""The weight-sync check's pieces on CPU without a vLLM engine: the worker-side layout map and
recorder on a model that loads the way vLLM's do (fused q/k/v through each parameter's
``weight_loader``, padded vocabulary rows), and the actor-side digests taken from the engine
calls of OpenRLHF's sync loop, NCCL and CUDA-IPC variants alike. vLLM's own loaders under
tensor parallelism: ``test_weight_layout_vllm.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from drpo_openrlhf.sync import sync_check
from drpo_openrlhf.sync.sync_check import digests_of_sent, worker_report
from drpo_openrlhf.sync.vllm_sync_worker import WeightSyncRecorder
from drpo_openrlhf.sync.weight_digest import digest, engine_problems

VOCAB, PADDED, DIM = 10, 16, 4


class ToyVLLMModel(nn.Module):
    """Loads HF names q/k/v into a fused ``qkv`` (shard ids) and the embedding into padded
    rows, like vLLM's Qwen2 (``load_weights`` -> ``param.weight_loader``)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Parameter(torch.zeros(3 * DIM, DIM, dtype=torch.bfloat16))
        self.qkv.weight_loader = self._load_qkv
        self.embed = nn.Module()
        self.embed.weight = nn.Parameter(torch.zeros(PADDED, DIM, dtype=torch.bfloat16))
        self.embed.weight.weight_loader = self._load_embed
        self.embed.shard_indices = SimpleNamespace(
            num_org_vocab_padding=PADDED - VOCAB, num_added_vocab_padding=0
        )

    @staticmethod
    def _load_qkv(param, loaded, shard_id):
        index = "qkv".index(shard_id)
        param.data[index * DIM : (index + 1) * DIM].copy_(loaded)

    @staticmethod
    def _load_embed(param, loaded):
        param.data[:VOCAB].copy_(loaded)
        param.data[VOCAB:].fill_(0)

    def load_weights(self, weights):
        for name, tensor in weights:
            if name.startswith("attn."):
                self.qkv.weight_loader(self.qkv, tensor, name[-1])
            else:
                param = self.embed.weight
                param.weight_loader(param, tensor)


class Worker(WeightSyncRecorder):
    def __init__(self) -> None:
        self.model_runner = SimpleNamespace(model=ToyVLLMModel())

    def update_weight(self, name: str, weight: torch.Tensor) -> None:  # as CPUWorkerWrap
        self.model_runner.model.load_weights(weights=[(name, weight)])


def hf(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    weights = {f"attn.{p}": torch.randn(DIM, DIM, generator=g) for p in "qkv"}
    weights["embed"] = torch.randn(VOCAB, DIM, generator=g)
    return {n: t.bfloat16() for n, t in weights.items()}


def mapped_worker() -> Worker:
    worker = Worker()
    worker.map_weight_layout({n: tuple(t.shape) for n, t in hf(0).items()})
    return worker


def sync(worker: Worker, weights: dict[str, torch.Tensor], sent=None) -> list[str]:
    worker.begin_weight_sync()
    for name, tensor in weights.items():
        worker.update_weight(name, tensor)
    report = worker_report(worker.weight_sync_report())
    sent = weights if sent is None else sent
    return engine_problems({n: digest(t) for n, t in sent.items()}, [report])


def test_layout_map_leaves_the_model_untouched_and_finds_each_block():
    worker = Worker()
    before = {n: p.clone() for n, p in worker.model_runner.model.named_parameters()}
    worker.map_weight_layout({n: tuple(t.shape) for n, t in hf(0).items()})
    for name, param in worker.model_runner.model.named_parameters():
        assert param.dtype == torch.bfloat16 and torch.equal(param, before[name])
    layout = worker._drpo_layout
    assert [(p, b.row, b.rows) for p, b in layout["attn.v"]] == [("qkv", 2 * DIM, DIM)]
    assert [(p, b.rows, b.src_row) for p, b in layout["embed"]] == [("embed.weight", VOCAB, 0)]


def test_recorder_sees_fused_and_padded_loads_exactly():
    worker = mapped_worker()
    assert sync(worker, hf(0)) == []
    report = worker_report(worker.weight_sync_report())  # recording ended with the report
    assert report.loads == {}
    worker.begin_weight_sync()
    worker.update_weight("attn.k", hf(1)["attn.k"])
    raw = worker.weight_sync_report()
    assert raw["loads"] == {"attn.k": [("qkv", "k")]}
    assert raw["held"]["embed"][0] == VOCAB * DIM  # padding rows left out
    assert sync(worker, hf(2)) == []  # instrumented once, stays exact


@pytest.mark.parametrize(
    "break_it",
    [
        lambda w: {**w, "attn.q": w["attn.q"].flip(0)},  # rows permuted
        lambda w: {**w, "attn.v": w["attn.v"].t()},  # a square matrix transposed
        lambda w: {**w, "attn.q": w["attn.k"], "attn.k": w["attn.q"]},  # halves swapped
        lambda w: {**w, "embed": w["embed"].roll(1, dims=0)},
    ],
    ids=["rows-permuted", "transposed", "swapped", "embedding-rows-rolled"],
)
def test_same_values_in_other_places_are_caught(break_it):
    weights = hf(1)
    problems = sync(mapped_worker(), break_it(weights), sent=weights)
    assert problems and all("holds other values or places" in p for p in problems), problems


def test_initial_check_catches_an_engine_from_another_checkpoint():
    worker = mapped_worker()
    sync(worker, hf(0))
    report = worker_report(worker.weight_sync_report())
    assert engine_problems({n: digest(t) for n, t in hf(0).items()}, [report], False) == []
    problems = engine_problems({n: digest(t) for n, t in hf(1).items()}, [report], False)
    assert len(problems) == 4 and "'qkv' holds other values" in problems[0]


def test_recorder_catches_a_stale_and_a_skipped_load():
    worker = mapped_worker()
    sync(worker, hf(0))
    worker.begin_weight_sync()
    new, old = hf(1), hf(0)
    for name in ("attn.q", "attn.k", "attn.v"):
        worker.update_weight(name, old[name] if name == "attn.v" else new[name])
    report = worker_report(worker.weight_sync_report())
    problems = engine_problems({n: digest(t) for n, t in new.items()}, [report])
    assert problems == [
        "'embed' was sent but not loaded",
        "vLLM parameter 'embed.weight' was not loaded by this sync",
    ]
    report.loads["embed"] = [("embed.weight", "")]
    problems = engine_problems({n: digest(t) for n, t in new.items()}, [report])
    assert [p.split(" (")[0] for p in problems] == [
        "vLLM parameter 'qkv' holds other values or places than the actor's 'attn.v'",
        "vLLM parameter 'embed.weight' holds other values or places than the actor's 'embed'",
    ]


def test_recorder_wraps_vllm_parameter_classes_private_loader():
    """vLLM's ``BasevLLMParameter`` exposes ``weight_loader`` as a read-only property over
    ``_weight_loader``."""

    class VLLMParameter(nn.Parameter):
        @property
        def weight_loader(self):
            return self._weight_loader

    worker = Worker()
    model = worker.model_runner.model
    param = VLLMParameter(torch.zeros(3 * DIM, DIM, dtype=torch.bfloat16))
    param._weight_loader = ToyVLLMModel._load_qkv
    model.qkv = param
    worker.map_weight_layout({"attn.q": (DIM, DIM)})
    worker.begin_weight_sync()
    worker.update_weight("attn.q", hf(0)["attn.q"])
    raw = worker.weight_sync_report()
    assert raw["loads"] == {"attn.q": [("qkv", "q")]}
    assert worker_report(raw).held["attn.q"] == digest(hf(0)["attn.q"])


class Handle:
    """A Ray actor handle's method as OpenRLHF calls it (``engine.update_weight.remote``)."""

    def __init__(self, calls: list) -> None:
        self.calls = calls
        self.update_weight = SimpleNamespace(remote=lambda *a, **k: calls.append(("nccl", a)))
        self.update_weight_cuda_ipc = SimpleNamespace(
            remote=lambda *a, **k: calls.append(("ipc", a))
        )
        self.reset_prefix_cache = "untouched"


@pytest.mark.parametrize("method", ["update_weight", "update_weight_cuda_ipc"])
def test_rank0_digests_each_sent_tensor_once_at_send_time(monkeypatch, method):
    monkeypatch.setattr(sync_check.torch.distributed, "get_rank", lambda: 0)
    model = nn.Linear(DIM, 2)
    calls: list = []
    engines = [Handle(calls), Handle(calls)]
    trainer = SimpleNamespace(
        vllm_engines=engines,
        actor=SimpleNamespace(model=SimpleNamespace(module=model)),
    )
    expected = {}
    with digests_of_sent(trainer) as sent:
        for name, param in model.named_parameters():  # OpenRLHF's loop, inside the gather
            expected[name] = digest(param)
            for engine in trainer.vllm_engines:
                getattr(engine, method).remote(name, dtype=param.dtype, shape=param.shape)
            with torch.no_grad():
                param.add_(1)  # what the engines got is what was digested, not the later value
        assert trainer.vllm_engines[0].reset_prefix_cache == "untouched"
    assert trainer.vllm_engines is engines
    assert len(calls) == 4 and [c[1][0] for c in calls] == ["weight", "weight", "bias", "bias"]
    assert sent == expected


def test_other_ranks_send_nothing_and_digest_nothing(monkeypatch):
    monkeypatch.setattr(sync_check.torch.distributed, "get_rank", lambda: 1)
    engines = [Handle([])]
    trainer = SimpleNamespace(vllm_engines=engines)
    with digests_of_sent(trainer) as sent:
        assert trainer.vllm_engines is engines
    assert sent == {}
