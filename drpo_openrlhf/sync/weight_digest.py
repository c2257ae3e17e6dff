"""Exact, cheap digests of weight tensors that see places as well as values, and the check that
an engine holds exactly the weights the actor has.

A digest is ``(numel, sum of h(position, bits(x)) mod 2**64)`` over a tensor's elements, where
``position`` is the element's row-major index in the tensor the actor sends (its Hugging Face
shape) and ``h`` is splitmix64's finaliser of position and bits together. Being a sum, it adds
up over pieces: a vLLM worker digests each block of a parameter that holds a piece of a sent
tensor (a q/k/v or gate/up part of a fused parameter, a tensor-parallel shard, a replicated KV
head) with the positions that piece had in the sent tensor (``Block``), and the pieces of all
workers sum to the sent tensor's digest, times the number of copies. The same values in other
places (rows permuted, a square matrix transposed, gate and up swapped) give another sum,
except with probability about 2**-64; so does a single changed bit.

Pure torch (no OpenRLHF or vLLM import): the actor, the vLLM workers and the tests share it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

MASK64 = (1 << 64) - 1
CHUNK = 1 << 24  # elements hashed at a time: bounds the int64 temporaries to a few 128 MiB
_C0, _C1, _C2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


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


def element_hashes(positions: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``h(position, bits)`` per element (int64 tensors of ``values``' shape). Up to 2-byte
    dtypes (bf16: what OpenRLHF syncs) the position and the unsigned bits are packed into one
    word and mixed once; wider values are mixed with a mixed position."""
    size = values.element_size()
    bits = values.contiguous().view(_BITS[size]).to(torch.int64)
    if size > 2:
        return splitmix64(splitmix64(positions) ^ bits)
    return splitmix64((positions << (8 * size)) | (bits & ((1 << (8 * size)) - 1)))


@dataclass(frozen=True)
class Digest:
    """Element count and positional hash of one or more pieces of a tensor; digests add."""

    numel: int = 0
    value: int = 0

    def __add__(self, other: Digest) -> Digest:
        return Digest(self.numel + other.numel, (self.value + other.value) & MASK64)

    def __mul__(self, times: int) -> Digest:
        return Digest(self.numel * times, (self.value * times) & MASK64)


def as_matrix(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` viewed as (first dimension, the rest): the frame ``Block`` works in."""
    if tensor.dim() == 0:
        return tensor.reshape(1, 1)
    return tensor.reshape(tensor.shape[0], -1)


@dataclass(frozen=True)
class Block:
    """Where one piece of a sent tensor sits in a parameter, both seen ``as_matrix``: the
    parameter's rows ``row:row+rows`` and columns ``col:col+cols`` hold the sent tensor's rows
    ``src_row:src_row+rows`` and columns ``src_col:src_col+cols`` (of ``src_cols``)."""

    row: int
    col: int
    rows: int
    cols: int
    src_row: int
    src_col: int
    src_cols: int

    @torch.no_grad()
    def digest(self, param: torch.Tensor) -> Digest:
        """The digest of what ``param`` holds in this block, at the sent tensor's positions."""
        held = as_matrix(param.detach())[self.row : self.row + self.rows]
        held = held[:, self.col : self.col + self.cols]
        step = max(1, CHUNK // max(1, self.cols))
        cols = torch.arange(self.cols, dtype=torch.int64, device=held.device) + self.src_col
        total = torch.zeros((), dtype=torch.int64, device=held.device)
        for start in range(0, self.rows, step):
            part = held[start : start + step]
            rows = torch.arange(part.shape[0], dtype=torch.int64, device=held.device)
            positions = (rows + self.src_row + start)[:, None] * self.src_cols + cols[None, :]
            total += element_hashes(positions, part).sum()
        return Digest(self.rows * self.cols, int(total) & MASK64)


def whole(tensor: torch.Tensor) -> Block:
    """The block that is all of ``tensor`` at its own positions."""
    rows, cols = as_matrix(tensor).shape
    return Block(0, 0, rows, cols, 0, 0, cols)


def digest(tensor: torch.Tensor) -> Digest:
    """The digest of a sent tensor (any dtype, any device, any layout)."""
    return whole(tensor).digest(tensor)


class LayoutError(RuntimeError):
    """A vLLM loader put a sent tensor into a parameter in a way ``Block`` cannot describe."""


BASE = 255  # a digit d is sent as 1 + d in uint8, so that 0 is what no loader wrote


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """The shape of a tensor of ``shape`` seen ``as_matrix``."""
    rows, cols = as_matrix(torch.empty(shape, device="meta")).shape
    return rows, cols


def digit_passes(shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """``(axis, digit)`` of each load that maps a sent tensor of ``shape``: every base-255
    digit of its row indices (axis 0), then of its column indices (axis 1), lowest first."""
    passes = []
    for axis, n in enumerate(matrix_shape(shape)):
        digits = 1
        while BASE**digits < n:
            digits += 1
        passes += [(axis, digit) for digit in range(digits)]
    return passes


def digit_tensor(shape: tuple[int, ...], axis: int, digit: int) -> torch.Tensor:
    """A uint8 tensor of ``shape`` holding at each element ``1 +`` the ``digit``-th base-255
    digit of its row (``axis`` 0) or column (1) index in the ``as_matrix`` frame. It is one
    column or row of memory broadcast over the other axis: loaders narrow and copy it like a
    weight, so only the parameter-sized stand-in it is copied into costs memory, one byte per
    element; and values up to 255 survive any dtype a loader may cast through (bf16 holds the
    integers up to 256), where a position would not."""
    rows, cols = matrix_shape(shape)
    values = (torch.arange((rows, cols)[axis]) // BASE**digit % BASE + 1).to(torch.uint8)
    frame = values[:, None] if axis == 0 else values[None, :]
    return frame.expand(rows, cols).reshape(shape)


@dataclass(frozen=True)
class Trace:
    """What one loader call wrote from a ``digit_tensor`` into a zeroed stand-in of its
    parameter (``as_matrix``): the rectangle of the parameter it wrote, and the one digit
    each of the rectangle's rows (a row digit) or columns (a column digit) holds."""

    row: int
    col: int
    rows: int
    cols: int
    digits: torch.Tensor = field(compare=False)


def trace(written: torch.Tensor, axis: int, where: str) -> Trace | None:
    """The ``Trace`` of ``written``, a stand-in after a loader copied a ``digit_tensor`` of
    ``axis`` into it; None if the loader wrote nothing (a rank whose vocabulary shard is all
    padding). Raises ``LayoutError`` unless the written elements form one rectangle whose rows
    (``axis`` 0) or columns (1) each hold one digit. Three reductions of the uint8 stand-in,
    no temporary of its size (a boolean mask's sum would copy it to int64)."""
    row_max, col_max = written.amax(dim=1), written.amax(dim=0)
    rows, cols = row_max.nonzero().flatten(), col_max.nonzero().flatten()
    if rows.numel() == 0:
        return None
    row, col = int(rows[0]), int(cols[0])
    n_rows, n_cols = int(rows[-1]) - row + 1, int(cols[-1]) - col + 1
    held = written[row : row + n_rows, col : col + n_cols]
    # nothing is written outside the rectangle, so its rows' (columns') maxima are the
    # rectangle's; each must be nonzero and also the row's (column's) minimum
    digits = row_max[row : row + n_rows] if axis == 0 else col_max[col : col + n_cols]
    if not (bool(digits.all()) and torch.equal(held.amin(dim=1 - axis), digits)):
        raise LayoutError(f"{where}: the loader did not copy one rectangle of it in order")
    return Trace(row, col, n_rows, n_cols, digits.clone())


def block_from_traces(
    traces: list[Trace | None], src_shape: tuple[int, ...], where: str
) -> Block | None:
    """The ``Block`` one loader call wrote, from its ``Trace`` in each of
    ``digit_passes(src_shape)``; None if it wrote nothing. Every pass wrote the same
    rectangle, one digit per row (row passes) or per column (column passes), so each row of
    it came from one row of the sent tensor, each column from one column: the block holds the
    sent tensor's rectangle in order if those rows and those columns are consecutive. That
    rests on one premise, a loader moves elements whatever their values, which any map that
    runs the loaders shares. Raises ``LayoutError`` otherwise."""
    if all(t is None for t in traces):
        return None
    first = next(t for t in traces if t is not None)
    index = [torch.zeros(first.rows, dtype=torch.int64), torch.zeros(first.cols, dtype=torch.int64)]
    for (axis, digit), found in zip(digit_passes(src_shape), traces, strict=True):
        if found != first:  # another rectangle than the first pass's (digits aside)
            raise LayoutError(f"{where}: the loader wrote other elements from one load to the next")
        index[axis] += (found.digits.to(torch.int64) - 1) * BASE**digit
    if not all(torch.equal(i, i[0] + torch.arange(len(i))) for i in index):
        raise LayoutError(f"{where}: the loader did not copy one rectangle of it in order")
    src_rows, src_cols = index
    return Block(
        first.row,
        first.col,
        first.rows,
        first.cols,
        int(src_rows[0]),
        int(src_cols[0]),
        matrix_shape(src_shape)[1],
    )


@dataclass
class WorkerReport:
    """What one vLLM worker says: which parameter each received name was loaded into in the
    last sync (``loads``: name -> [(parameter, shard), ...]; empty for the check before the
    first rollout), and per sent name the digest of the blocks of its parameter that hold that
    name's tensor, as the model samples with it (``held``)."""

    loads: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    held: dict[str, Digest] = field(default_factory=dict)
    param: dict[str, str] = field(default_factory=dict)  # name -> the parameter it lives in
    unloaded: list[str] = field(default_factory=list)  # parameters no sent name fills


class WeightSyncError(RuntimeError):
    """A vLLM engine does not hold exactly the weights the actor has."""


MAX_LISTED = 8  # problems listed per engine; the rest are counted


def _load_problems(sent: Mapping[str, Digest], worker: WorkerReport, where: str) -> list[str]:
    problems = []
    for name in sent:
        places = worker.loads.get(name, [])
        if not places:
            problems.append(f"{name!r} was sent but not loaded{where}")
        elif len(places) > 1:
            problems.append(f"{name!r} was loaded {len(places)} times: {places}{where}")
    for name in sorted(set(worker.loads) - set(sent)):
        problems.append(f"{name!r} was loaded but not sent in this sync{where}")
    loaded = {param for places in worker.loads.values() for param, _ in places}
    for param in sorted(set(worker.param.values()) - loaded):
        problems.append(f"vLLM parameter {param!r} was not loaded by this sync{where}")
    return problems


def engine_problems(
    sent: Mapping[str, Digest], workers: list[WorkerReport], synced: bool = True
) -> list[str]:
    """Everything in which one engine's workers (its tensor-parallel ranks) differ from the
    actor's tensors ``sent``; empty when the engine holds exactly them.

    Per worker, when ``synced`` (after a sync): every sent name was loaded exactly once,
    nothing else was loaded, and every parameter was loaded. Always: every parameter is filled
    by some sent name, and per sent name the workers' digests of the blocks holding it sum to
    ``m`` times its sent digest, ``m`` being how many copies of it the workers hold (1: sharded
    over the ranks or one rank; tensor-parallel size: replicated; in between: KV heads
    replicated on some ranks)."""
    problems: list[str] = []
    for rank, worker in enumerate(workers):
        where = f" (worker {rank})" if len(workers) > 1 else ""
        for param in worker.unloaded:
            problems.append(f"vLLM parameter {param!r} holds no tensor the actor has{where}")
        if synced:
            problems += _load_problems(sent, worker, where)
    if problems:
        return problems
    for name, expected in sent.items():
        held = sum((worker.held.get(name, Digest()) for worker in workers), Digest())
        param = next((w.param[name] for w in workers if name in w.param), None)
        if param is None:
            problems.append(f"{name!r} is in no vLLM parameter")
            continue
        copies, rest = divmod(held.numel, expected.numel) if expected.numel else (1, 0)
        if rest or not 1 <= copies <= len(workers) or held != expected * copies:
            problems.append(
                f"vLLM parameter {param!r} holds other values or places than the actor's "
                f"{name!r} ({held.numel} elements held, {expected.numel} sent)"
            )
    return problems


def check_sync(
    sent: Mapping[str, Digest],
    engines: Iterable[list[WorkerReport]],
    when: str,
    synced: bool = True,
) -> None:
    """Raise ``WeightSyncError`` naming the engine(s), parameters and ``when`` (the rollout
    step) if any engine does not hold exactly the actor's tensors ``sent``."""
    engines = list(engines)
    lines = []
    for index, workers in enumerate(engines):
        problems = engine_problems(sent, workers, synced)
        if problems:
            lines.append(f"  engine {index} of {len(engines)}:")
            lines += [f"    {p}" for p in problems[:MAX_LISTED]]
            if len(problems) > MAX_LISTED:
                lines.append(f"    ... and {len(problems) - MAX_LISTED} more")
    if lines:
        raise WeightSyncError(
            f"weight sync check failed {when}: the vLLM engines do not hold the weights the "
            f"actor {'sent' if synced else 'has'} ({len(sent)} tensors), so rollouts would "
            "come from a stale or broken policy:\n" + "\n".join(lines)
        )
