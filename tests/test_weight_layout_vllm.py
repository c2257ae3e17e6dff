"""The weight check with vLLM's own loaders at every tensor-parallel size the recipes' models
allow: fused q/k/v (KV heads replicated when the size exceeds their count), fused gate/up,
row-parallel o/down, padded vocabulary.

OpenRLHF starts tensor-parallel engines with vLLM's Ray executor, which vLLM's CPU build
refuses, so no CPU run has a TP engine. Here each rank's layers are vLLM's
``QKVParallelLinear``, ``MergedColumnParallelLinear``, ``RowParallelLinear``,
``VocabParallelEmbedding`` and ``ParallelLMHead``, built for that rank by setting the
tensor-parallel rank and size they read at construction (vLLM's own functions, patched), and
loaded through their own ``weight_loader``s the way vLLM's Qwen2 and Llama ``load_weights``
call them. Heads are scaled down in size, not in number."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from vllm.model_executor import parameter as vllm_parameter
from vllm.model_executor.layers import linear, vocab_parallel_embedding

from drpo_openrlhf.sync.sync_check import worker_report
from drpo_openrlhf.sync.vllm_sync_worker import WeightSyncRecorder
from drpo_openrlhf.sync.weight_digest import LayoutError, digest, engine_problems

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from bench_weight_map import allocator_peak

HEAD, HIDDEN, FFN, VOCAB = 2, 8, 16, 150  # vocabulary padded to 64 per rank by vLLM
MODELS = {  # (q heads, KV heads) of the recipes' models
    "R1-Distill-Qwen-1.5B": (12, 2),
    "R1-Distill-Qwen-7B": (28, 4),
    "R1-Distill-Llama-8B": (32, 8),
}
STACKED = {  # HF name part -> (vLLM parameter part, shard id), as vLLM's Qwen2/Llama map them
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def tensor_parallel(monkeypatch, rank: int, size: int) -> None:
    for module in (linear, vllm_parameter, vocab_parallel_embedding):
        monkeypatch.setattr(module, "get_tensor_model_parallel_rank", lambda: rank)
        monkeypatch.setattr(module, "get_tensor_model_parallel_world_size", lambda: size)


class OneLayerModel(nn.Module):
    """One decoder layer's linear layers and the embeddings, loaded like vLLM's Qwen2."""

    def __init__(self, heads: int, kv_heads: int) -> None:
        super().__init__()
        dtype = torch.bfloat16
        self.qkv_proj = linear.QKVParallelLinear(
            HIDDEN, HEAD, heads, kv_heads, bias=True, params_dtype=dtype
        )
        self.o_proj = linear.RowParallelLinear(heads * HEAD, HIDDEN, bias=False, params_dtype=dtype)
        self.gate_up_proj = linear.MergedColumnParallelLinear(
            HIDDEN, [FFN, FFN], bias=False, params_dtype=dtype
        )
        self.down_proj = linear.RowParallelLinear(FFN, HIDDEN, bias=False, params_dtype=dtype)
        self.embed_tokens = vocab_parallel_embedding.VocabParallelEmbedding(
            VOCAB, HIDDEN, params_dtype=dtype
        )
        self.lm_head = vocab_parallel_embedding.ParallelLMHead(VOCAB, HIDDEN, params_dtype=dtype)

    def load_weights(self, weights) -> None:
        params = dict(self.named_parameters())
        for name, tensor in weights:
            module, kind = name.split(".")
            if module in STACKED:
                target, shard = STACKED[module]
                param = params[f"{target}.{kind}"]
                param.weight_loader(param, tensor, shard)
            else:
                param = params[name]
                param.weight_loader(param, tensor)


def hf_weights(heads: int, kv_heads: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "q_proj.weight": (heads * HEAD, HIDDEN),
        "q_proj.bias": (heads * HEAD,),
        "k_proj.weight": (kv_heads * HEAD, HIDDEN),
        "k_proj.bias": (kv_heads * HEAD,),
        "v_proj.weight": (kv_heads * HEAD, HIDDEN),
        "v_proj.bias": (kv_heads * HEAD,),
        "o_proj.weight": (HIDDEN, heads * HEAD),
        "gate_proj.weight": (FFN, HIDDEN),
        "up_proj.weight": (FFN, HIDDEN),
        "down_proj.weight": (HIDDEN, FFN),
        "embed_tokens.weight": (VOCAB, HIDDEN),
        "lm_head.weight": (VOCAB, HIDDEN),
    }
    return {n: torch.randn(s, generator=g).bfloat16() for n, s in shapes.items()}


class Worker(WeightSyncRecorder):
    def __init__(self, model: nn.Module) -> None:
        self.model_runner = SimpleNamespace(model=model)


def engine(monkeypatch, model: str, tp: int) -> list[Worker]:
    """One engine's workers, each with its rank's layers, layout mapped."""
    heads, kv_heads = MODELS[model]
    workers = []
    for rank in range(tp):
        tensor_parallel(monkeypatch, rank, tp)
        worker = Worker(OneLayerModel(heads, kv_heads))
        worker.map_weight_layout(
            {n: tuple(t.shape) for n, t in hf_weights(*MODELS[model], 0).items()}
        )
        workers.append(worker)
    return workers


def sync(workers: list[Worker], received: list[dict], sent: dict) -> list[str]:
    """Each worker loads its ``received`` tensors; the engine is checked against ``sent``."""
    reports = []
    for worker, tensors in zip(workers, received, strict=True):
        worker.begin_weight_sync()
        worker.model_runner.model.load_weights(tensors.items())
        reports.append(worker_report(worker.weight_sync_report()))
    return engine_problems({n: digest(t) for n, t in sent.items()}, reports)


LAYOUTS = [(m, tp) for m in MODELS for tp in (1, 2, 4, 8)]


@pytest.mark.parametrize(("model", "tp"), LAYOUTS, ids=[f"{m}-tp{tp}" for m, tp in LAYOUTS])
def test_vllm_loaders_at_every_tensor_parallel_size(monkeypatch, model, tp):
    heads, kv_heads = MODELS[model]
    if heads % tp:
        with pytest.raises(AssertionError, match="is not divisible by"):
            engine(monkeypatch, model, tp)
        return  # vLLM refuses this layout: no run can use it
    workers = engine(monkeypatch, model, tp)
    qkv = workers[0].model_runner.model.qkv_proj
    assert qkv.num_kv_head_replicas == max(1, tp // kv_heads)
    weights = hf_weights(heads, kv_heads, 1)
    assert sync(workers, [weights] * tp, weights) == []
    assert sync(workers, [weights] * tp, hf_weights(heads, kv_heads, 2)) != []  # stale

    broken = [dict(weights) for _ in range(tp)]
    first = broken[0]  # rank 0 gets them wrong (the last may hold only vocabulary padding)
    first["k_proj.weight"] = weights["k_proj.weight"].flip(0)  # rows permuted
    first["gate_proj.weight"], first["up_proj.weight"] = (
        weights["up_proj.weight"],
        weights["gate_proj.weight"],
    )
    first["embed_tokens.weight"] = weights["embed_tokens.weight"].roll(1, 0)
    problems = sync(workers, broken, weights)
    for name in ("k_proj.weight", "gate_proj.weight", "up_proj.weight", "embed_tokens.weight"):
        assert any(f"actor's {name!r}" in p for p in problems), (name, problems)
    assert len(problems) == 4, problems


def test_a_square_matrix_loaded_transposed(monkeypatch):
    heads, kv_heads = 4, 4  # o_proj is HIDDEN x HIDDEN
    workers = []
    for rank in range(2):
        tensor_parallel(monkeypatch, rank, 2)
        worker = Worker(OneLayerModel(heads, kv_heads))
        worker.map_weight_layout(
            {n: tuple(t.shape) for n, t in hf_weights(heads, kv_heads, 0).items()}
        )
        workers.append(worker)
    weights = hf_weights(heads, kv_heads, 1)
    assert weights["o_proj.weight"].shape == (HIDDEN, HIDDEN)
    assert sync(workers, [weights] * 2, weights) == []
    transposed = {**weights, "o_proj.weight": weights["o_proj.weight"].t()}
    problems = sync(workers, [transposed] * 2, weights)
    assert len(problems) == 1 and "'o_proj.weight'" in problems[0], problems


class Layers(nn.Module):
    """Four layers of one 3 x 3 weight each, loaded into the top half of a 6 x 3 parameter;
    layer ``odd`` loads into the bottom half (a loader that depends on the layer)."""

    def __init__(self, odd: int | None) -> None:
        super().__init__()
        self.weights = nn.ParameterDict({str(i): nn.Parameter(torch.zeros(6, 3)) for i in range(4)})
        self.odd = odd

    def named_parameters(self, *args, **kwargs):
        for i, param in self.weights.items():
            yield f"model.layers.{i}.w", param

    @staticmethod
    def into_rows(param: torch.Tensor, tensor: torch.Tensor, row: int) -> None:
        param.data[row : row + 3] = tensor

    def load_weights(self, weights) -> None:
        for name, tensor in weights:
            layer = int(name.split(".")[2])
            param = self.weights[str(layer)]
            param.weight_loader(param, tensor, 3 if layer == self.odd else 0)


@pytest.mark.parametrize("odd", [1, 2, None])
def test_layers_reuse_the_first_layers_map_only_where_it_holds(odd):
    """A layer whose loader differs among the first two: no layer reuses a map, and every
    place is the loaders' own. One that differs later gets the first layer's places (the map
    cannot see it without running its loader); its digest then differs, so the check stops
    the run naming it: loud, never a wrong weight accepted. vLLM's loaders belong to the
    parameter's class, not to its layer."""
    names = {f"model.layers.{i}.w": (3, 3) for i in range(4)}
    model = Layers(odd)
    for param in model.weights.values():
        param.weight_loader = Layers.into_rows
    worker = Worker(model)
    worker.map_weight_layout(names)
    one_by_one = {}
    for name, shape in names.items():
        worker.map_weight_layout({name: shape})
        one_by_one.update(worker._drpo_layout)
    worker.map_weight_layout(names)
    if odd != 2:  # mapped through the loaders, or reused where every layer loads alike
        assert worker._drpo_layout == one_by_one
    else:  # layer 2 reuses layer 0's map; the check below sees it differs from its loader
        assert worker._drpo_layout != one_by_one
    sent = {name: torch.randn(shape) for name, shape in names.items()}
    problems = sync([worker], [sent], sent)
    if odd != 2:
        assert problems == []
    else:
        assert len(problems) == 1 and "'model.layers.2.w'" in problems[0], problems


def test_the_map_holds_one_byte_per_element_of_the_largest_parameter(monkeypatch):
    """The layout map's peak of host memory, by torch's CPU allocator (every tensor the map or
    vLLM's loaders allocate), is one byte per element of the largest parameter and a few
    vectors per row and column, whatever the rest of the model: uint8 stand-ins in one reused
    buffer (freed with the map done), broadcast digit tensors, each stand-in reduced to
    vectors. Full-size int32
    position tensors took about 17 bytes per element of the largest, here the embedding."""
    monkeypatch.setitem(globals(), "HIDDEN", 256)
    monkeypatch.setitem(globals(), "VOCAB", 4096)  # embedding and LM head: 1M elements each
    tensor_parallel(monkeypatch, 0, 1)
    heads, kv_heads = MODELS["R1-Distill-Qwen-1.5B"]
    worker = Worker(OneLayerModel(heads, kv_heads))
    weights = hf_weights(heads, kv_heads, 0)
    _, peak, kept = allocator_peak(
        lambda: worker.map_weight_layout({n: tuple(t.shape) for n, t in weights.items()})
    )
    largest = max(p.numel() for p in worker.model_runner.model.parameters())
    assert largest == VOCAB * HIDDEN
    assert largest <= peak <= largest + 64 * (VOCAB + HIDDEN), (peak, largest)
    assert kept == 0  # the map is plain numbers: its stand-ins and vectors are all freed
    assert sync([worker], [weights], weights) == []


class ByValue(nn.Module):
    """Loads a tensor into ``a`` or ``b`` depending on one of its values."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Parameter(torch.zeros(4, 3)), nn.Parameter(torch.zeros(4, 3))

    def load_weights(self, weights) -> None:
        for _, tensor in weights:
            param = self.a if int(tensor[-1, 0]) % 2 else self.b
            param.weight_loader(param, tensor)


def test_a_loader_that_places_by_value_is_refused():
    """The map sends other values in each pass, and rests on loaders placing elements
    whatever their values; one that does not is refused when it shows, at start-up."""
    worker = Worker(ByValue())
    with pytest.raises(LayoutError, match="'w': vLLM's loaders put it into other parameters"):
        worker.map_weight_layout({"w": (4, 3)})
