"""Exact, cheap digests of weight tensors, and the check that a weight sync arrived whole.

A digest is ``(numel, sum of h(bits(x)) mod 2**64)`` over a tensor's elements: an exact
multiset hash of the raw bits. Being a sum, it is independent of element order, so the
digest of a fused vLLM parameter (q, k and v in ``qkv_proj``) is the sum of the digests of
the Hugging Face tensors loaded into it, and tensor-parallel shards add up the same way. A
single changed bit changes the digest except with probability about 2**-64. ``h`` is
splitmix64's finaliser, precomputed as a 65536-entry table for 16-bit dtypes (bf16, the
only dtype OpenRLHF syncs) so a digest costs one table gather and one sum per element.

Pure torch (no OpenRLHF or vLLM import): the actor, the vLLM workers and the tests share it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

MASK64 = (1 << 64) - 1
CHUNK = 1 << 24  # elements hashed at a time: bounds the int64 temporaries to 128 MiB
_C0, _C1, _C2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's output function on int64 tensors (wrap-around arithmetic)."""
    z = x + _signed(_C0)
    z = (z ^ _shift_right(z, 30)) * _signed(_C1)
    z = (z ^ _shift_right(z, 27)) * _signed(_C2)
    return z ^ _shift_right(z, 31)


_TABLES: dict[torch.device, torch.Tensor] = {}


def _table(device: torch.device) -> torch.Tensor:
    if device not in _TABLES:
        _TABLES[device] = splitmix64(torch.arange(1 << 16, dtype=torch.int64)).to(device)
    return _TABLES[device]


def zero_hash() -> int:
    """The hash of one element whose bits are all zero (vLLM's vocabulary padding rows)."""
    return int(_table(torch.device("cpu"))[0]) & MASK64


@dataclass(frozen=True)
class Digest:
    """Element count and bit-multiset hash of one or more tensors; digests add."""

    numel: int = 0
    value: int = 0

    def __add__(self, other: Digest) -> Digest:
        return Digest(self.numel + other.numel, (self.value + other.value) & MASK64)

    def __mul__(self, times: int) -> Digest:
        return Digest(self.numel * times, (self.value * times) & MASK64)

    def without_zeros(self, count: int) -> Digest:
        """This digest less ``count`` all-zero-bit elements it is known to contain."""
        return Digest(self.numel - count, (self.value - count * zero_hash()) & MASK64)


@torch.no_grad()
def digest(tensor: torch.Tensor) -> Digest:
    """The digest of ``tensor``'s elements (any dtype, any device, any layout)."""
    flat = tensor.detach().contiguous().view(-1)
    if flat.element_size() == 2:
        bits, table = flat.view(torch.int16), _table(flat.device)
    elif flat.element_size() in (1, 4, 8):
        bits, table = (
            flat.view({1: torch.int8, 4: torch.int32, 8: torch.int64}[flat.element_size()]),
            None,
        )
    else:
        raise TypeError(f"no digest for {tensor.dtype}")
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, bits.numel(), CHUNK):
        chunk = bits[start : start + CHUNK].to(torch.int64)
        if table is not None:
            total += table.index_select(0, chunk & 0xFFFF).sum()
        else:
            total += splitmix64(chunk).sum()
    return Digest(flat.numel(), int(total) & MASK64)


@dataclass
class WorkerReport:
    """What one vLLM worker says after a sync: which parameter each received name was loaded
    into (``loads``: name -> [(parameter, shard), ...]) and the digest of every parameter as
    the model samples with it, vocabulary padding excluded (``params``)."""

    loads: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    params: dict[str, Digest] = field(default_factory=dict)


class WeightSyncError(RuntimeError):
    """A vLLM engine does not hold exactly the weights the actor sent in a sync."""


MAX_LISTED = 8  # problems listed per engine; the rest are counted


def engine_problems(sent: Mapping[str, Digest], workers: list[WorkerReport]) -> list[str]:
    """Everything in which one engine's workers (its tensor-parallel ranks) differ from the
    sync that ``sent`` describes; empty when the engine holds exactly what was sent.

    Per worker: every sent name was loaded exactly once, nothing else was loaded, and every
    parameter was loaded. Per parameter, over the workers: the digests sum to ``m`` times the
    sum of the sent digests of the names loaded into it, with one integer ``m`` in
    ``1..len(workers)`` (1: sharded over the ranks; tensor-parallel size: replicated)."""
    problems: list[str] = []
    for rank, worker in enumerate(workers):
        where = f" (worker {rank})" if len(workers) > 1 else ""
        for name in sent:
            places = worker.loads.get(name, [])
            if not places:
                problems.append(f"{name!r} was sent but not loaded{where}")
            elif len(places) > 1:
                problems.append(f"{name!r} was loaded {len(places)} times: {places}{where}")
        for name in sorted(set(worker.loads) - set(sent)):
            problems.append(f"{name!r} was loaded but not sent in this sync{where}")
        loaded = {param for places in worker.loads.values() for param, _ in places}
        for param in sorted(set(worker.params) - loaded):
            problems.append(f"vLLM parameter {param!r} was not loaded by this sync{where}")
    if problems:
        return problems
    into: dict[str, list[str]] = {}
    for name, places in workers[0].loads.items():
        into.setdefault(places[0][0], []).append(name)
    for param, names in sorted(into.items()):
        expected = sum((sent[name] for name in names), Digest())
        held = sum((worker.params.get(param, Digest()) for worker in workers), Digest())
        if not any(held == expected * m for m in range(1, len(workers) + 1)):
            problems.append(
                f"vLLM parameter {param!r} holds other values than the actor sent for "
                f"{', '.join(repr(n) for n in names)} ({held.numel} elements held, "
                f"{expected.numel} sent)"
            )
    return problems


def check_sync(
    sent: Mapping[str, Digest], engines: Iterable[list[WorkerReport]], when: str
) -> None:
    """Raise ``WeightSyncError`` naming the engine(s), parameters and ``when`` (the rollout
    step) if any engine does not hold exactly what the actor sent."""
    engines = list(engines)
    lines = []
    for index, workers in enumerate(engines):
        problems = engine_problems(sent, workers)
        if problems:
            lines.append(f"  engine {index} of {len(engines)}:")
            lines += [f"    {p}" for p in problems[:MAX_LISTED]]
            if len(problems) > MAX_LISTED:
                lines.append(f"    ... and {len(problems) - MAX_LISTED} more")
    if lines:
        raise WeightSyncError(
            f"weight sync check failed {when}: the vLLM engines do not hold the weights the "
            f"actor sent ({len(sent)} tensors), so rollouts would come from a stale or broken "
            "policy:\n" + "\n".join(lines)
        )
