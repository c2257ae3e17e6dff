"""The positional weight digest and its comparison (``sync/weight_digest.py``), without
vLLM: exactness about values and places, sums over pieces (fusing, sharding, replicated KV
heads), the layout found from a loader's writes, and every way an engine can differ."""

from __future__ import annotations

import pytest
import torch

from drpo_openrlhf.sync.weight_digest import (
    MASK64,
    Block,
    Digest,
    LayoutError,
    Trace,
    WeightSyncError,
    WorkerReport,
    as_matrix,
    block_from_traces,
    check_sync,
    digest,
    digit_passes,
    digit_tensor,
    engine_problems,
    splitmix64,
    trace,
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


def test_digest_is_the_sum_of_position_and_bits_hashes():
    x = torch.randn(7, 5, generator=torch.Generator().manual_seed(0)).bfloat16()
    bits = x.view(torch.int16).flatten().tolist()
    expected = sum(splitmix64_reference((i << 16) | (b & 0xFFFF)) for i, b in enumerate(bits))
    assert digest(x) == Digest(35, expected & MASK64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_digest_sees_every_bit_and_every_place(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 64, generator=g).to(dtype)
    assert digest(x) == digest(x.t().contiguous().t())  # memory layout does not matter
    assert digest(x) != digest(x.flatten()[torch.randperm(x.numel(), generator=g)].view(64, 64))
    assert digest(x) != digest(x.flip(0))  # rows permuted
    assert digest(x) != digest(x.t())  # transposed
    assert digest(x) != digest(torch.cat([x[32:], x[:32]]))  # halves swapped
    for flat_index in (0, 1000, x.numel() - 1):
        y = x.clone().flatten()
        y.view(torch.int16 if x.element_size() == 2 else torch.int32)[flat_index] ^= 1  # 1 bit
        assert digest(y.view(64, 64)) != digest(x)
    assert digest(x[1:]) != digest(x)
    symmetric = x + x.t()
    assert digest(symmetric.t()) == digest(symmetric)  # same values in the same places


def test_digest_chunks_add_up(monkeypatch):
    x = torch.randn(100, 10).bfloat16()
    whole = digest(x)
    monkeypatch.setattr("drpo_openrlhf.sync.weight_digest.CHUNK", 7)
    assert digest(x) == whole


def test_pieces_at_their_sent_positions_add_up():
    """What vLLM does with q/k/v (fused by rows), tensor-parallel rows and columns (split) and
    replicated KV heads (copied)."""
    q = torch.randn(8, 6).bfloat16()
    rows = [Block(0, 0, 4, 6, 0, 0, 6), Block(0, 0, 4, 6, 4, 0, 6)]
    assert rows[0].digest(q[:4]) + rows[1].digest(q[4:]) == digest(q)
    cols = [Block(0, 0, 8, 3, 0, 0, 6), Block(0, 0, 8, 3, 0, 3, 6)]
    assert cols[0].digest(q[:, :3]) + cols[1].digest(q[:, 3:]) == digest(q)
    assert cols[0].digest(q[:, 3:]) + cols[1].digest(q[:, :3]) != digest(q)
    fused = torch.cat([torch.zeros(2, 6, dtype=q.dtype), q])  # q after two rows of another
    assert Block(2, 0, 8, 6, 0, 0, 6).digest(fused) == digest(q)
    assert digest(q) * 3 == digest(q) + digest(q) + digest(q)


def map_block(src: tuple[int, ...], param: tuple[int, ...], load) -> Block | None:
    """The block ``load(stand_in, sent)`` writes, mapped as a vLLM worker maps it: one load per
    digit pass into a zeroed uint8 stand-in of the parameter."""
    traces = []
    for axis, digit in digit_passes(src):
        stand_in = torch.zeros(param, dtype=torch.uint8)
        load(stand_in, digit_tensor(src, axis, digit))
        traces.append(trace(as_matrix(stand_in), axis, "x"))
    return block_from_traces(traces, src, "x")


def test_layout_is_read_from_what_a_loader_wrote():
    src = (300, 4)  # row indices of two base-255 digits
    assert digit_passes(src) == [(0, 0), (0, 1), (1, 0)]
    assert [len(digit_passes((n,))) for n in (1, 255, 256, 255**2, 255**2 + 1)] == [2, 2, 3, 3, 4]

    def column_shard(param, sent):  # shard 1 of 2, after two rows of another tensor
        param[2:302] = sent[:, 2:]

    def vocabulary_shard(param, sent):  # rows 297..299 on this rank, padding after
        param[:3] = sent[297:]
        param[3:] = 0

    def through_bf16(param, sent):  # a loader that casts to the weights' dtype first
        param.copy_(sent.to(torch.bfloat16))

    assert map_block(src, (310, 2), column_shard) == Block(2, 0, 300, 2, 0, 2, 4)
    assert map_block(src, (8, 4), vocabulary_shard) == Block(0, 0, 3, 4, 297, 0, 4)
    assert map_block(src, src, through_bf16) == Block(0, 0, 300, 4, 0, 0, 4)
    assert map_block((2, 3, 4), (2, 12), lambda p, s: p.copy_(s.reshape(2, 12))).cols == 12
    assert map_block(src, (2, 2), lambda p, s: None) is None  # a rank of padding only
    wrong = {
        (300, 4): lambda p, s: p.copy_(s.flip(0)),  # rows permuted
        (4, 300): lambda p, s: p.copy_(s.t()),  # transposed
        (300, 5): lambda p, s: p[:, 1:].copy_(s.roll(1, 1)),  # columns rotated
        (301, 4): lambda p, s: (p[:5].copy_(s[:5]), p[6:].copy_(s[5:])),  # a row skipped
        (1200,): lambda p, s: p.copy_(s.reshape(-1)),  # flattened
    }
    for param, load in wrong.items():
        with pytest.raises(LayoutError, match="one rectangle of it in order"):
            map_block(src, param, load)
    assert as_matrix(torch.zeros(2, 3, 4)).shape == (2, 12)


def test_a_trace_is_one_filled_rectangle_of_one_digit_per_row_or_column():
    written = torch.zeros(5, 4, dtype=torch.uint8)
    written[1:4, 1:] = torch.tensor([7, 8, 9], dtype=torch.uint8)[:, None]
    found = trace(written, 0, "x")
    assert (found.row, found.col, found.rows, found.cols) == (1, 1, 3, 3)
    assert found.digits.tolist() == [7, 8, 9]
    assert trace(written.t(), 1, "x").digits.tolist() == [7, 8, 9]
    assert trace(torch.zeros(5, 4, dtype=torch.uint8), 0, "x") is None
    for axis, row, col, value in [(0, 2, 2, 5), (0, 2, slice(None), 0), (1, 1, 1, 0)]:
        broken = written.clone()
        broken[row, col] = value  # a row of two digits / an empty row / a hole
        with pytest.raises(LayoutError, match="'w' into p: the loader did not copy"):
            trace(broken if axis == 0 else broken.t(), axis, "'w' into p")


def test_every_pass_must_write_the_same_rectangle():
    def rows(row: int) -> Trace:
        return Trace(row, 0, 2, 3, torch.tensor([1, 2], dtype=torch.uint8))

    column = Trace(0, 0, 2, 3, torch.tensor([1, 2, 3], dtype=torch.uint8))
    assert block_from_traces([rows(0), column], (2, 3), "x") == Block(0, 0, 2, 3, 0, 0, 3)
    for traces in ([rows(1), column], [rows(0), None], [None, column]):
        with pytest.raises(LayoutError, match="other elements from one load to the next"):
            block_from_traces(traces, (2, 3), "x")
    assert block_from_traces([None, None], (2, 3), "x") is None


# A two-layer "model": HF names q,k,v,o per layer; vLLM fuses q,k,v into qkv.
def hf_weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        f"l{i}.{p}": torch.randn(4, 4, generator=g).bfloat16()
        for i in range(2)
        for p in ("q", "k", "v", "o")
    }


def home(name: str) -> tuple[str, int]:
    """The parameter a name lives in, and its row offset there (q, k, v fused by rows)."""
    layer, part = name.split(".")
    return (f"{layer}.qkv", 4 * "qkv".index(part)) if part in "qkv" else (name, 0)


def vllm_load(
    weights: dict[str, torch.Tensor],
    into: dict[str, str] | None = None,
    rows: dict[str, tuple[int, int]] | None = None,
) -> WorkerReport:
    """One worker's report after a load, correct or (``into``) with some tensors loaded under
    another name, which is the name the worker then sees; ``rows``: name -> (first, count)
    of the rows this worker holds (a tensor-parallel shard), all by default."""
    params = {
        f"l{i}.{p}": torch.zeros(12 if p == "qkv" else 4, 4) for i in range(2) for p in ("qkv", "o")
    }
    params = {n: p.bfloat16() for n, p in params.items()}
    rows = rows or {}
    loads = {}
    for name, tensor in weights.items():
        target = (into or {}).get(name, name)
        param, offset = home(target)
        first, count = rows.get(target, (0, 4))
        loads.setdefault(target, []).append((param, target[-1]))
        params[param][offset : offset + count] = tensor[first : first + count]
    held, where = {}, {}
    for name in hf_weights(0):
        param, offset = home(name)
        first, count = rows.get(name, (0, 4))
        held[name] = Block(offset, 0, count, 4, first, 0, 4).digest(params[param])
        where[name] = param
    return WorkerReport(loads=loads, held=held, param=where)


def sent_of(weights):
    return {name: digest(t) for name, t in weights.items()}


def test_a_correct_sync_passes():
    w = hf_weights(0)
    assert engine_problems(sent_of(w), [vllm_load(w)]) == []
    check_sync(sent_of(w), [[vllm_load(w)], [vllm_load(w)]], "after rollout step 1")


def test_tensor_parallel_shards_and_replicas_pass():
    w = hf_weights(0)
    full = vllm_load(w)
    halves = [vllm_load(w, rows={n: (2 * r, 2) for n in w}) for r in range(2)]
    assert engine_problems(sent_of(w), halves) == []  # every tensor sharded over 2 ranks
    assert engine_problems(sent_of(w), [full, full]) == []  # replicated on 2 ranks
    assert engine_problems(sent_of(w), [full, halves[0]]) != []
    assert engine_problems(sent_of(w), [halves[0], halves[0]]) != []  # one half twice


def test_q_sharded_with_kv_heads_replicated_passes():
    """vLLM's tensor-parallel size above the KV-head count: q split over the ranks, k and v
    copied to several (``num_kv_head_replicas``); found as a false alarm in issue 35."""
    w = hf_weights(0)
    ranks = [
        vllm_load(
            w,
            rows={
                f"l{i}.{p}": (r, 1) if p in "qo" else (r // 2 * 2, 2)
                for i in range(2)
                for p in "qkvo"
            },
        )
        for r in range(4)
    ]  # 4 ranks, 2 KV heads of 2 rows: each head on 2 ranks
    assert engine_problems(sent_of(w), ranks) == []
    ranks[3] = vllm_load(
        w, rows={f"l{i}.{p}": (3, 1) if p in "qo" else (0, 2) for i in range(2) for p in "qkvo"}
    )  # head 0 on 3 ranks
    problems = engine_problems(sent_of(w), ranks)
    assert len(problems) == 4 and "'l0.k'" in problems[0]


def test_each_breakage_is_named():
    old, new = hf_weights(0), hf_weights(1)
    sent = sent_of(new)

    nothing = vllm_load(old)
    nothing.loads = {}
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
    assert any("'l0.o' holds other values or places than the actor's 'l0.o'" in p for p in problems)

    gate_up = vllm_load(new, into={"l0.q": "l0.k", "l0.k": "l0.q"})  # fused halves swapped
    problems = engine_problems(sent, [gate_up])
    assert [p.split(" (")[0] for p in problems] == [
        "vLLM parameter 'l0.qkv' holds other values or places than the actor's 'l0.q'",
        "vLLM parameter 'l0.qkv' holds other values or places than the actor's 'l0.k'",
    ]

    wrong = vllm_load(new, into={"l0.k": "l0.q"})  # k loaded as q: q twice, k never
    problems = engine_problems(sent, [wrong])
    assert problems[0] == "'l0.q' was loaded 2 times: [('l0.qkv', 'q'), ('l0.qkv', 'q')]"
    assert problems[1] == "'l0.k' was sent but not loaded"

    stale = vllm_load(old)  # loads recorded as usual, but of last sync's tensors
    problems = engine_problems(sent, [stale])
    assert len(problems) == 8 and all("holds other values" in p for p in problems)

    before_rollout = engine_problems(sent, [stale], synced=False)  # no loads to look at
    assert len(before_rollout) == 8 and all("holds other values" in p for p in before_rollout)
    unfilled = vllm_load(new)
    unfilled.unloaded = ["l9.extra"]
    assert engine_problems(sent, [unfilled], synced=False) == [
        "vLLM parameter 'l9.extra' holds no tensor the actor has"
    ]

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
    with pytest.raises(WeightSyncError, match=r"before the first rollout: .* the actor has"):
        check_sync(sent_of(new), [[vllm_load(old)]], "before the first rollout", synced=False)


def test_long_lists_are_cut():
    new = hf_weights(1)
    nothing = vllm_load(new)
    nothing.loads = {}
    with pytest.raises(WeightSyncError, match=r"\.\.\. and 4 more"):
        check_sync(sent_of(new), [[nothing]], "after rollout step 1")
