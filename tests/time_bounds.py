"""The suite's time bounds, stretched to this machine's speed.

A bound in the tests is written for the reference machine (an Intel Xeon with AMX, 2 cores:
docs/cpu.md's table) with a margin for the suite's own two-worker load stated beside it. A
slower CPU stretches every bound by one factor, measured once per process: a fixed workload
(pure Python, and a small fp32 matrix product on one thread) against its time on the
reference. Each part is timed as the best of short repetitions, so that other processes'
load does not count: load is what the stated margins are for, this factor is the CPU.

The factor is never below 1 (a faster machine keeps the stated bound) and at most
``MAX_SCALE`` (a measurement disturbed past that is more likely than such a CPU, and a bound
that proves something fast must stay able to fail); ``DRPO_TEST_TIME_SCALE`` sets it instead,
to any value from 1 up. A bound that fails says which bound, the factor and what it measured.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

ENV_VAR = "DRPO_TEST_TIME_SCALE"
MAX_SCALE = 4.0
# The workload's best times on the reference machine (torch 2.13.0, fp32 through MKL): the
# median over 20 processes, each the best of REPEATS, at nice 10 and a load average of 6-11
# from other work; their spread in brackets. Measuring costs 0.06-0.16 s there.
REFERENCE_PYTHON_S = 2.2e-3  # [2.1, 3.2] ms
REFERENCE_MATMUL_S = 1.8e-3  # two 64x576 by 576x1536 products: [1.7, 3.3] ms
REPEATS = 9


@dataclass(frozen=True)
class Calibration:
    """The factor the suite's bounds are stretched by, and where it came from."""

    scale: float
    source: str  # "measured" or the environment variable's name
    python_ratio: float = 1.0  # this machine's time over the reference's, per part
    matmul_ratio: float = 1.0
    cost_s: float = 0.0  # what measuring it cost

    def describe(self) -> str:
        if self.source != "measured":
            return f"time scale {self.scale:.2f} (set by {self.source})"
        return (
            f"time scale {self.scale:.2f} (measured in {self.cost_s:.2f} s: Python "
            f"{self.python_ratio:.2f}x, fp32 matmul {self.matmul_ratio:.2f}x the reference)"
        )


def _python_work() -> int:
    """Interpreter-bound work like the graders' and the launchers' Python: ints, strings, a
    dict."""
    counts: dict[str, int] = {}
    total = 0
    for i in range(10_000):
        total += i * i % 7
        key = f"w{i % 97}"
        counts[key] = counts.get(key, 0) + 1
    return total + len(counts)


def _best_of(work: Callable[[], object], repeats: int) -> float:
    """The shortest of ``repeats`` timings: the CPU's speed, least disturbed by other load."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - started)
    return best


def measure(repeats: int = REPEATS) -> Calibration:
    """Times the workload on this machine (0.06-0.16 s on the reference); on one torch
    thread, as the suite's processes mostly have a core each."""
    import torch

    started = time.perf_counter()
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(64, 576, generator=generator)
    b = torch.randn(576, 1536, generator=generator)

    def matmul() -> None:
        torch.mm(a, b)
        torch.mm(a, b)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        matmul()  # MKL's first call sets itself up
        python_s = _best_of(_python_work, repeats)
        matmul_s = _best_of(matmul, repeats)
    finally:
        torch.set_num_threads(threads)
    python_ratio, matmul_ratio = python_s / REFERENCE_PYTHON_S, matmul_s / REFERENCE_MATMUL_S
    return Calibration(
        scale=min(MAX_SCALE, max(1.0, python_ratio, matmul_ratio)),
        source="measured",
        python_ratio=python_ratio,
        matmul_ratio=matmul_ratio,
        cost_s=time.perf_counter() - started,
    )


def from_environment(environ: Mapping[str, str]) -> Calibration | None:
    """``DRPO_TEST_TIME_SCALE`` as the factor, if set: a number from 1 up."""
    value = environ.get(ENV_VAR, "").strip()
    if not value:
        return None
    try:
        scale = float(value)
    except ValueError:
        scale = float("nan")
    if not scale >= 1.0 or scale == float("inf"):
        raise ValueError(f"{ENV_VAR}={value!r}: the tests' time scale is a number from 1 up")
    return Calibration(scale=scale, source=ENV_VAR)


@functools.cache
def calibration() -> Calibration:
    """This process's factor: the environment's, else measured (once; conftest measures it
    at the session's start, before the tests load the machine)."""
    return from_environment(os.environ) or measure()


def scale() -> float:
    return calibration().scale


def scaled(seconds: float) -> float:
    """A timeout or poll deadline for this machine: ``seconds`` on the reference machine."""
    return seconds * scale()


def bound_s(slack_s: float, fixed_s: float = 0.0) -> float:
    """The bound on this machine: ``fixed_s``, a time the test fixes (a deadline under test,
    a timer: it does not stretch), plus ``slack_s`` of the reference machine, stretched."""
    return fixed_s + scaled(slack_s)


def over_bound(
    what: str, measured_s: float, slack_s: float, fixed_s: float = 0.0, note: str = ""
) -> str:
    """What a failed bound says: which bound, how it is made up, and what was measured
    (``note``: how, beside the number)."""
    parts = f"{slack_s:g} s x time scale {scale():.2f}"
    if fixed_s:
        parts = f"{fixed_s:g} s fixed by the test + {parts} of slack"
    measured = f"{measured_s:.2f} s" + (f" ({note})" if note else "")
    return (
        f"{what}: {measured}, over its bound of {bound_s(slack_s, fixed_s):.2f} s "
        f"({parts}; {calibration().describe()}; {ENV_VAR} overrides the scale)"
    )


def assert_within(
    measured_s: float, slack_s: float, what: str, *, fixed_s: float = 0.0, note: str = ""
) -> None:
    """Fails, saying what it measured, if ``measured_s`` is past the bound (``bound_s``)."""
    if measured_s >= bound_s(slack_s, fixed_s):
        raise AssertionError(over_bound(what, measured_s, slack_s, fixed_s, note))


@contextlib.contextmanager
def within(slack_s: float, what: str, *, fixed_s: float = 0.0, cpu: bool = False) -> Iterator[None]:
    """Times the block and ``assert_within`` it (a block that raises is not timed). With
    ``cpu``, the bound is on this process's CPU time: for work done in this process alone,
    which a starved worker (nice 19 beside a pipeline run) does slowly but not wrongly; a
    runaway regex or loop still spends it. Its failure gives both clocks."""
    wall_started, cpu_started = time.monotonic(), time.process_time()
    yield
    wall_s, cpu_s = time.monotonic() - wall_started, time.process_time() - cpu_started
    if cpu:
        assert_within(cpu_s, slack_s, what, fixed_s=fixed_s, note=f"CPU; wall {wall_s:.2f} s")
    else:
        note = f"wall; this process's CPU {cpu_s:.2f} s"
        assert_within(wall_s, slack_s, what, fixed_s=fixed_s, note=note)


class Deadline:
    """A poll loop's deadline, started now: ``check`` fails as ``assert_within`` does."""

    def __init__(self, slack_s: float, what: str, *, fixed_s: float = 0.0):
        self.slack_s, self.what, self.fixed_s = slack_s, what, fixed_s
        self.started = time.monotonic()
        self.ends = self.started + bound_s(slack_s, fixed_s)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def expired(self) -> bool:
        return time.monotonic() >= self.ends

    def check(self, detail: str = "") -> None:
        """Fails if the deadline has passed; ``detail`` (a log's tail) goes below the reason."""
        if self.expired():
            message = over_bound(self.what, self.elapsed(), self.slack_s, self.fixed_s)
            raise AssertionError(f"{message}\n{detail}" if detail else message)
