"""The weight-sync digest and its comparison (``integration/weight_digest.py``), without vLLM:
exactness, order independence, fusing/sharding arithmetic, and every way a sync can differ."""

from __future__ import annotations

import pytest
import torch

from drpo_openrlhf.integration.weight_digest import (
    MASK64,
    Digest,
    WeightSyncError,
    WorkerReport,
    check_sync,
    digest,
    engine_problems,
    splitmix64,
)


def splitmix64_reference(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def test_splitmix64_matches_unsigned_reference():
    xs = [0, 1, 2, 65535, 2**31 - 1, -1, -(2**63), 2**63 - 1, 123456789]
    got = splitmix64(torch.tensor(xs, dtype=torch.int64)).tolist()
    assert [g & MASK64 for g in got] == [splitmix64_reference(x & MASK64) for x in xs]


def test_digest_is_the_sum_of_element_hashes():
    x = torch.randn(7, 5, generator=torch.Generator().manual_seed(0)).bfloat16()
    bits = x.view(torch.int16).flatten().tolist()
    expected = sum(splitmix64_reference(b & 0xFFFF) for b in bits) & MASK64
    assert digest(x) == Digest(35, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_digest_is_order_free_and_bit_exact(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 33, generator=g).to(dtype)
    assert digest(x) == digest(x.flatten()[torch.randperm(x.numel(), generator=g)])
    assert digest(x.t()) == digest(x)  # layout does not matter
    for flat_index in (0, 1000, x.numel() - 1):
        y = x.clone().flatten()
        y.view(torch.int16 if x.element_size() == 2 else torch.int32)[flat_index] ^= 1  # 1 bit
        assert digest(y) != digest(x)
    assert digest(x[1:]) != digest(x)


def test_digest_chunks_add_up(monkeypatch):
    x = torch.randn(1000).bfloat16()
    whole = digest(x)
    monkeypatch.setattr("drpo_openrlhf.integration.weight_digest.CHUNK", 7)
    assert digest(x) == whole


def test_fused_and_sharded_digests_add_up():
    """What vLLM does with q/k/v (concatenated) and with tensor-parallel rows (split)."""
    q, k, v = (torch.randn(8, 4).bfloat16() for _ in range(3))
    assert digest(torch.cat([q, k, v])) == digest(q) + digest(k) + digest(v)
    top, bottom = torch.cat([q, k]).chunk(2)
    assert digest(top) + digest(bottom) == digest(q) + digest(k)
    assert digest(q) * 3 == digest(q) + digest(q) + digest(q)


def test_padding_rows_are_removed_exactly():
    weight = torch.randn(10, 4).bfloat16()
    padded = torch.cat([weight, torch.zeros(6, 4, dtype=torch.bfloat16)])
    assert digest(padded).without_zeros(24) == digest(weight)
    assert digest(padded).without_zeros(20) != digest(weight)


# A two-layer "model": HF names q,k,v,o per layer; vLLM fuses q,k,v into qkv.
def hf_weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        f"l{i}.{p}": torch.randn(4, 4, generator=g).bfloat16()
        for i in range(2)
        for p in ("q", "k", "v", "o")
    }


def vllm_load(weights: dict[str, torch.Tensor], into: dict[str, str] | None = None):
    """The worker's report of a load, correct or (``into``) with some tensors loaded under
    another name, which is the name the worker then sees."""
    loads, params = {}, {}
    for i in range(2):
        params[f"l{i}.qkv"] = [None] * 3
        params[f"l{i}.o"] = [None]
    for name, tensor in weights.items():
        target = (into or {}).get(name, name)
        layer, part = target.split(".")
        param, shard = (f"{layer}.qkv", "qkv".index(part)) if part in "qkv" else (target, 0)
        loads.setdefault(target, []).append((param, str(shard)))
        params[param][shard] = tensor
    return WorkerReport(
        loads=loads,
        params={
            name: digest(torch.cat([t for t in ts if t is not None])) for name, ts in params.items()
        },
    )


def sent_of(weights):
    return {name: digest(t) for name, t in weights.items()}


def test_a_correct_sync_passes():
    w = hf_weights(0)
    assert engine_problems(sent_of(w), [vllm_load(w)]) == []
    check_sync(sent_of(w), [[vllm_load(w)], [vllm_load(w)]], "after rollout step 1")


def test_tensor_parallel_shards_and_replicas_pass():
    w = hf_weights(0)
    full = vllm_load(w)
    halves = []
    for half in range(2):  # every parameter split in two row blocks (sharded over 2 ranks)
        shard = {n: t.chunk(2)[half] for n, t in w.items()}
        report = vllm_load(shard)
        halves.append(WorkerReport(loads=full.loads, params=report.params))
    assert engine_problems(sent_of(w), halves) == []
    assert engine_problems(sent_of(w), [full, full]) == []  # replicated on 2 ranks
    assert engine_problems(sent_of(w), [full, halves[0]]) != []


def test_each_breakage_is_named():
    old, new = hf_weights(0), hf_weights(1)
    sent = sent_of(new)

    nothing = WorkerReport(loads={}, params=vllm_load(old).params)
    problems = engine_problems(sent, [nothing])
    assert "'l0.q' was sent but not loaded" in problems
    assert "vLLM parameter 'l0.qkv' was not loaded by this sync" in problems

    skipped = vllm_load({**new, "l1.o": old["l1.o"]})
    del skipped.loads["l1.o"]
    assert engine_problems(sent, [skipped]) == [
        "'l1.o' was sent but not loaded",
        "vLLM parameter 'l1.o' was not loaded by this sync",
    ]

    swapped = vllm_load(new, into={"l0.o": "l1.o", "l1.o": "l0.o"})  # loads cross over
    problems = engine_problems(sent, [swapped])
    assert any("'l0.o' holds other values than the actor sent for 'l0.o'" in p for p in problems)

    wrong = vllm_load(new, into={"l0.k": "l0.q"})  # k loaded as q: q twice, k never
    problems = engine_problems(sent, [wrong])
    assert problems[0] == "'l0.q' was loaded 2 times: [('l0.qkv', '0'), ('l0.qkv', '0')]"
    assert problems[1] == "'l0.k' was sent but not loaded"

    stale = vllm_load(old)  # loads recorded as usual, but of last sync's tensors
    problems = engine_problems(sent, [stale])
    assert len(problems) == 4 and all("holds other values" in p for p in problems)

    twice = vllm_load(new)
    twice.loads["l0.o"] = twice.loads["l0.o"] * 2
    assert "'l0.o' was loaded 2 times" in engine_problems(sent, [twice])[0]

    extra = vllm_load(new)
    extra.loads["l9.x"] = [("l0.o", "0")]
    assert "'l9.x' was loaded but not sent in this sync" in engine_problems(sent, [extra])


def test_check_sync_names_the_engine_and_step():
    old, new = hf_weights(0), hf_weights(1)
    with pytest.raises(WeightSyncError) as error:
        check_sync(sent_of(new), [[vllm_load(new)], [vllm_load(old)]], "after rollout step 7")
    message = str(error.value)
    assert "after rollout step 7" in message and "engine 1 of 2" in message
    assert "engine 0 of 2" not in message and "'l1.qkv'" in message


def test_long_lists_are_cut():
    new = hf_weights(1)
    nothing = WorkerReport(loads={}, params=vllm_load(new).params)
    with pytest.raises(WeightSyncError, match=r"\.\.\. and 4 more"):
        check_sync(sent_of(new), [[nothing]], "after rollout step 1")
