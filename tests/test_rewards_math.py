"""Math grading: math-verify equivalences, reasons, deadlines, threads, garbage input."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from time_bounds import Deadline, assert_within, scaled, within

from drpo_openrlhf.rewards.grader_pool import DEFAULT_GRACE_S, GraderPool, _Slot, get_pool
from drpo_openrlhf.rewards.math_reward import (
    DEFAULT_TIMEOUT_S,
    REASONS,
    GradeResult,
    grade_responses,
)

STUCK_WORKER = Path(__file__).parent / "fixtures" / "rewards" / "stuck_worker.py"
# What killing a stuck child and handing the job on may add to its two deadlines: measured
# 0.03-0.05 s at load 3.7 on 2 cores (5 runs); 20x that, stretched by the time scale
STUCK_SLACK_S = 1.0
# A grader child's start-up with the machine quiet (0.5 s measured on the reference, over 3 s
# at load 11, 49.9 s once beside a pipeline run in a full suite). The kill, the reaping and the
# thread hops around a deadline slow down with the same contention: a bound's slack grows by
# the start-up's slowdown seen in its window, up to MAX_CONTENTION (past that a bound on the
# mechanism's own deadlines proves nothing, but a child never killed still fails it).
QUIET_STARTUP_S = 0.5
MAX_CONTENTION = 20.0

# (label, final boxed answer, correct): equivalences as math-verify decides them.
TRICKY_PAIRS = [
    ("\\frac{1}{2}", "0.5", True),
    ("0.5", "\\dfrac{1}{2}", True),
    ("\\boxed{\\frac{1}{2}}", "1/2", True),  # boxed label
    ("$\\frac{1}{2}$", "\\tfrac12", True),
    ("\\dfrac{3}{4}", "\\frac{6}{8}", True),
    ("1.5", "\\frac32", True),
    ("\\frac{14}{3}", "4\\frac{2}{3}", True),  # mixed number
    ("\\frac{1}{3}", "0.333333", True),  # equal to 6 decimals
    ("2\\sqrt{2}", "\\sqrt{8}", True),
    ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}", True),
    ("\\sqrt[3]{2}", "2^{1/3}", True),
    ("2^{10}", "1024", True),
    ("x^2+2x+1", "(x+1)^2", True),
    ("a+b", "b+a", True),
    ("6\\pi", "6 \\pi", True),
    ("-1", "- 1", True),
    ("1000", "1,000", True),
    ("3", "x=3", True),
    ("k=5", "5", True),
    ("y = 2x + 3", "2x+3", True),
    ("(1,2]", "(1, 2]", True),  # intervals
    ("(-\\infty, 3)", "(-\\infty,3)", True),
    ("\\{1,2,3\\}", "\\{3,2,1\\}", True),  # sets
    ("2, 3", "3, 2", True),
    ("\\begin{pmatrix}1\\\\2\\end{pmatrix}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", True),
    ("10\\%", "0.1", True),  # percentages
    ("0.25", "25\\%", True),
    ("5\\text{ cm}", "5", True),  # units
    ("90^\\circ", "90", True),
    ("\\$18.90", "18.9", True),
    ("\\text{(C)}", "C", True),  # text answers
    ("\\text{Evelyn}", "\\text{ Evelyn}", True),
    ("\\text{Monday}", "\\text{monday}", True),
    ("2", "3", False),
    ("-2", "2", False),
    ("12", "21", False),
    ("\\frac{1}{2}", "\\frac{1}{3}", False),
    ("\\frac{1}{3}", "0.33", False),
    ("\\pi", "3.14", False),
    ("\\sqrt{2}", "2", False),
    ("x^2+1", "(x+1)^2", False),
    ("x=3", "x=-3", False),
    ("[1,2)", "(1,2)", False),
    ("(-\\infty, 3)", "(-\\infty, 3]", False),
    ("(1,2)", "(2,1)", False),
    ("\\{1,2\\}", "\\{1,2,3\\}", False),
    ("5\\text{ cm}", "6", False),
    ("\\text{yes}", "\\text{no}", False),
    ("\\text{Monday}", "\\text{Tuesday}", False),
]

# Inputs that keep sympy busy far longer than any deadline (see scripts/bench_reward.py).
ADVERSARIAL = [
    "(" * 990 + ")" * 990,
    "\\left(" * 300,
    "9^{9^{9}}",
    "10^{10^{15}}",
    "(10^{9})!",
]


def r1(answer: str, reasoning: str = "Let me think step by step. " * 50) -> str:
    return f"{reasoning}</think>\n\nThe final answer is $\\boxed{{{answer}}}$."


# The grading deadlines given to answers that must not time out (1-10 s) are not stretched:
# a warm child grades such an answer in 0.004-0.025 s (2 cores at load 8), 40x below the
# shortest of them; the deadlines that must fire are the mechanism's, fixed.
@pytest.fixture(scope="module", autouse=True)
def warm_pool():
    grade_responses([r1("1")], ["2"])  # start the shared pool outside of timed sections


def test_tricky_pairs():
    results = grade_responses([r1(p) for _, p, _ in TRICKY_PAIRS], [g for g, _, _ in TRICKY_PAIRS])
    wrong = [
        (gold, pred, res)
        for (gold, pred, expected), res in zip(TRICKY_PAIRS, results, strict=True)
        if res.correct != expected
        or res.reason not in (("ok",) if expected else ("wrong", "text_mismatch"))
    ]
    assert not wrong


@pytest.mark.parametrize(
    ("response", "label", "require", "reason"),
    [
        ("reasoning \\boxed{2}", "2", True, "no_think_end"),  # truncated: no </think>
        ("\\boxed{2} in thoughts</think> but not after", "2", True, "no_boxed"),
        ("</think>\\boxed{}", "2", True, "unparsable"),
        ("</think>\\boxed{$$}", "2", True, "unparsable"),
        ("</think>\\boxed{2}", None, True, "bad_label"),
        ("</think>\\boxed{2}", "", True, "bad_label"),
        ("</think>\\boxed{2}", "\\text{}", True, "bad_label"),
        ("</think>\\boxed{" + "1+" * 2000 + "1}", "2", True, "too_long"),
        ("no thinking at all: \\boxed{2}", "2", False, "ok"),
        ("no thinking at all: \\boxed{\\frac{4}{2}}", "2", False, "ok"),
        ("a</think>b \\boxed{3}</think> \\boxed{2}", "2", True, "ok"),
        ("</think>\\boxed 2", "2", True, "ok"),
        ("</think>\\fbox{2}", "2", True, "ok"),
    ],
)
def test_reasons(response, label, require, reason):
    (result,) = grade_responses([response], [label], require_think_end=require)
    assert result == GradeResult(reason == "ok", reason)
    assert result.reason in REASONS


def test_result_type_and_signature():
    assert DEFAULT_TIMEOUT_S > 0
    result = grade_responses([r1("1/2")], ["0.5"], require_think_end=True, timeout_s=3.0)[0]
    assert result.correct is True and result.reason == "ok"
    with pytest.raises(AttributeError):
        result.correct = False  # frozen
    assert grade_responses([], []) == []
    with pytest.raises(ValueError):
        grade_responses(["a"], [])
    with pytest.raises(ValueError):
        grade_responses(["a"], ["1"], timeout_s=0)


def test_garbage_never_raises():
    responses = [
        None,
        b"</think>\\boxed{2}",
        b"\xff\xfe</think>\\boxed{2}",
        12,
        "</think>\\boxed{\x00}",
        "</think>\\boxed{\ud800}",  # lone surrogate
        "</think>" + "\\boxed{" * 10_000,
        "x" * 3_000_000 + "</think>\\boxed{2}",
        "</think>" + "{" * 3_000_000 + "\\boxed{2}",
        "</think>\\boxed{" + "\\frac{" * 5000 + "}",
        object(),
    ]
    labels = ["2", "2", "2", "2", None, b"2", 2, "2", 2.0, "2", object()]
    # 0.03-0.2 s measured (2 cores at load 7-9); 30 s is over 100x that: a hang guard
    with within(30, "grading megabytes of garbage"):
        results = grade_responses(responses, labels, timeout_s=2.0)
    assert all(isinstance(r, GradeResult) and r.reason in REASONS for r in results)
    assert [r.correct for r in results[:4]] == [False, True, True, False]
    assert results[7].correct and results[8].correct  # megabytes of text, answer at the end


@pytest.fixture
def child_startups(monkeypatch) -> list[tuple[float, float]]:
    """(began, seconds) of every grader child's start-up from here on. A start-up is the
    machine's time, not the pool's (0.5 s quiet, over 3 s at load 11): bounds leave it out."""
    startups: list[tuple[float, float]] = []
    start_child = _Slot._start

    def timed_start(slot: _Slot) -> None:
        began = time.monotonic()
        try:
            start_child(slot)
        finally:
            startups.append((began, time.monotonic() - began))

    monkeypatch.setattr(_Slot, "_start", timed_start)
    return startups


def starting_between(startups: list[tuple[float, float]], start: float, end: float) -> float:
    return sum(s for began, s in startups if start <= began < end)


def contention(startups: list[tuple[float, float]], start: float, end: float) -> float:
    """How much slower than quiet the slowest child start-up in the window ran (1 with none,
    at most ``MAX_CONTENTION``): the load the window's other work ran under."""
    slowest = max((s for began, s in startups if start <= began < end), default=0.0)
    return round(min(MAX_CONTENTION, max(1.0, slowest / scaled(QUIET_STARTUP_S))), 2)


def test_deadline_holds_from_worker_thread(child_startups):
    """Adversarial answers from a worker thread (as OpenRLHF's asyncio.to_thread calls
    do): each is cut off at the deadline, and the pool keeps grading afterwards."""
    timeout_s = 1.0
    pool = get_pool()
    assert grade_responses([r1("\\frac{10}{2}")], ["5"])[0].correct  # the children started
    with ThreadPoolExecutor(max_workers=1) as ex:
        for latex in ADVERSARIAL:
            killed, start = pool.counts["killed"], time.monotonic()
            (result,) = ex.submit(grade_responses, [r1(latex)], ["5"], timeout_s=timeout_s).result()
            end = time.monotonic()
            assert result.reason in ("timeout", "wrong", "unparsable"), latex
            # the deadline and the pool's grace are the mechanism's (fixed), once more for a
            # child starved past its own alarm, killed and tried again (under load); 1 s of
            # slack past them for the kill and the thread hop (each answered 0.01 s past the
            # deadline alone, 2 cores at load 8); fresh children's start-ups left out
            deadlines = 1 + min(1, pool.counts["killed"] - killed)
            starting = starting_between(child_startups, start, end)
            load = contention(child_startups, start, end)
            assert_within(
                end - start - starting,
                1.0 * load,
                f"grading {latex[:12]!r}... from a worker thread",
                fixed_s=deadlines * (timeout_s + DEFAULT_GRACE_S),
                note=f"{deadlines} deadline(s); children's start-ups, {starting:.2f} s, left out; "
                f"slack x {load:.1f} for their slowdown",
            )
    assert threading.current_thread() is threading.main_thread()
    assert grade_responses([r1("\\frac{1}{2}")], ["0.5"])[0].correct


def test_many_threads_at_once(child_startups):
    """32 threads (asyncio's default to_thread pool size) grading one answer each, mixed
    with adversarial ones: every call returns, correct answers stay correct."""
    cases = []
    for i in range(64):
        if i % 8 == 0:
            cases.append((r1(ADVERSARIAL[0]), "5", False))
        elif i % 2:
            cases.append((r1(f"\\frac{{{2 * i}}}{{2}}"), str(i), True))
        else:
            cases.append((r1(str(i + 1)), str(i), False))
    # The mechanism's worst case: each adversarial answer loses its child at both hard
    # deadlines, queued on the pool's slots; the other answers take milliseconds; the
    # children's start-ups are left out. 1.1 s measured (2 cores, quiet); 30 s of slack is
    # a hang guard.
    timeout_s, adversarial = 1.0, 64 // 8
    per_slot = -(-adversarial // get_pool().num_workers)
    fixed_s = per_slot * 2 * (timeout_s + DEFAULT_GRACE_S)
    start = time.monotonic()
    with ThreadPoolExecutor(32) as ex:
        futures = [
            ex.submit(grade_responses, [resp], [lab], timeout_s=timeout_s) for resp, lab, _ in cases
        ]
        results = [f.result(timeout=scaled(120))[0] for f in futures]
    end = time.monotonic()
    starting = starting_between(child_startups, start, end)
    note = f"wall, less the children's start-ups ({starting:.1f} s)"
    assert_within(
        end - start - starting, 30, "64 answers graded from 32 threads", fixed_s=fixed_s, note=note
    )
    assert [r.correct for r in results] == [c for _, _, c in cases]


def test_batch_larger_than_pool_does_not_time_out():
    n = 10 * get_pool().num_workers
    results = grade_responses([r1("\\frac{2}{4}")] * n, ["0.5"] * n, timeout_s=2.0)
    assert all(r.correct for r in results)


def test_stuck_child_is_killed_and_replaced(child_startups):
    """A child stuck where SIGALRM cannot reach (C code) is killed at the hard deadline and
    the job tried once more in a fresh child; stuck again, it scores ``timeout``. A crashing
    child (twice) scores ``error``; the children are replaced and grading goes on."""
    pool = GraderPool(num_workers=1, grace_s=0.5, worker_script=STUCK_WORKER)
    try:
        assert pool.grade_many([("2", "2")], timeout_s=1.0) == [(True, "ok")]
        start = time.monotonic()
        assert pool.grade_many([("2", "HANG")], timeout_s=1.0) == [(False, "timeout")]
        end = time.monotonic()
        # two hard deadlines; the fresh child's start-up between them is left out
        starting = starting_between(child_startups, start, end)
        load = contention(child_startups, start, end)
        assert_within(
            end - start - starting,
            STUCK_SLACK_S * load,
            "a stuck job's two hard deadlines",
            fixed_s=2 * (1.0 + 0.5),
            note=f"the fresh child's start-up, {starting:.2f} s, left out; slack x {load:.1f} "
            "for its slowdown",
        )
        assert pool.counts["killed"] == 2
        assert pool.grade_many([("0.5", "\\frac12")], timeout_s=1.0) == [(True, "ok")]
        assert pool.grade_many([("2", "CRASH")], timeout_s=1.0) == [(False, "error")]
        assert pool.counts["crashed"] == 2  # graded once more in a fresh child, crashed again
        # a batch with a stuck answer in the middle: the others are graded normally
        out = pool.grade_many([("1", "1"), ("2", "HANG"), ("3", "3")], timeout_s=1.0)
        assert out == [(True, "ok"), (False, "timeout"), (True, "ok")]
    finally:
        pool.close()
    assert pool.grade_many([("1", "1")], timeout_s=1.0) == [(False, "error")]  # closed


@pytest.mark.parametrize(("fault", "count"), [("CRASHONCE", "crashed"), ("HANGONCE", "killed")])
def test_a_child_lost_mid_job_is_replaced_and_the_job_graded_again(tmp_path, fault, count):
    """A worker killed or hung while grading (from outside, by the memory cap) must not turn
    a right answer into a wrong one: the job goes to a fresh child once."""
    pool = GraderPool(num_workers=1, grace_s=0.5, worker_script=STUCK_WORKER)
    try:
        flag = tmp_path / "lost"
        out = pool.grade_many([("2", f"{fault}:{flag}:2")], timeout_s=1.0)
        assert flag.exists() and pool.counts[count] == 1
        assert out == [(True, "ok")]
    finally:
        pool.close()


def test_memory_cap_is_applied_and_survivable():
    pool = GraderPool(num_workers=1, memory_mb=150)
    try:
        assert pool.grade_many([("1", "1.0")], timeout_s=5.0) == [(True, "ok")]
        (pid,) = pool.worker_pids()
        limits = Path(f"/proc/{pid}/limits").read_text()
        line = next(x for x in limits.splitlines() if x.startswith("Max address space"))
        assert str(150 * 1024 * 1024) in line
        # a 2^(2^40) power does not fit in 150 MiB: not correct, and the pool goes on
        out = pool.grade_many([("1", "2^{2^{40}}"), ("1", "1.0")], timeout_s=10.0)
        assert out[0][0] is False
        assert out[1] == (True, "ok")
    finally:
        pool.close()


def test_children_die_with_their_parent(tmp_path):
    """A trainer process killed outright leaves no grader behind, even a stuck one."""
    script = textwrap.dedent(
        f"""
        import os, signal, sys, threading, time
        from drpo_openrlhf.rewards.grader_pool import GraderPool
        pool = GraderPool(num_workers=2, worker_script={str(STUCK_WORKER)!r})
        assert pool.grade_many([("1", "1")], timeout_s=5.0) == [(True, "ok")]
        threading.Thread(target=pool.grade_many, args=([("1", "HANG")], 600.0), daemon=True).start()
        time.sleep(1.0)
        print(" ".join(map(str, pool.worker_pids())), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    # the whole test takes 3.7 s (2 cores at load 7-9); both bounds are hang guards
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=scaled(120)
    )
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) == 2, proc.stderr[-2000:]
    deadline = Deadline(10, "the graders' end after their parent's")
    while alive := [pid for pid in pids if _alive(pid)]:
        deadline.check(f"still alive: {alive}")
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "State:\tZ" not in status  # a zombie is dead, only not yet reaped


def test_pool_that_cannot_start_fails_fast(tmp_path):
    broken = tmp_path / "broken_worker.py"
    broken.write_text("import sys\nsys.exit(1)\n")
    pool = GraderPool(num_workers=2, worker_script=broken)
    try:
        # 0.08 s measured (2 cores at load 8): no wait for the start-up limit (120 s)
        with within(20, "a pool that cannot start failing its jobs"):
            assert pool.grade_many([("1", "1.0")] * 3, timeout_s=1.0) == [(False, "error")] * 3
    finally:
        pool.close()


class _HeldFakePool:
    """Answers every job ``outcome`` once released, counting submissions: the test decides
    when a grading ends, not a timer racing the threads' start on a loaded machine."""

    def __init__(self, outcome: tuple[bool, str]):
        self.outcome, self.submitted, self.released = outcome, [], threading.Event()

    def submit(self, gold, pred, timeout_s):
        self.submitted.append(pred)
        return Future()

    def wait(self, future):
        assert self.released.wait(timeout=scaled(30)), "the test never released the pool"
        return self.outcome

    def grade_many(self, pairs, timeout_s):
        return [self.wait(self.submit(gold, pred, timeout_s)) for gold, pred in pairs]


@pytest.mark.parametrize(
    ("outcome", "cached"), [((False, "wrong"), True), ((False, "timeout"), False)]
)
def test_concurrent_repeats_share_one_grading(monkeypatch, outcome, cached):
    """OpenRLHF grades a group's responses in concurrent one-sample calls: a repeated answer
    that is being graded is waited for, not graded again; a final verdict is then cached,
    a timeout is not."""
    from drpo_openrlhf.rewards import grading

    pool = _HeldFakePool(outcome)
    monkeypatch.setattr(grading, "get_pool", lambda: pool)
    joined = threading.Semaphore(0)
    find_or_submit = grading._verdicts.find_or_submit

    def counted(*args):
        found = find_or_submit(*args)
        joined.release()
        return found

    monkeypatch.setattr(grading._verdicts, "find_or_submit", counted)
    label = f"{time.monotonic_ns()}\\sqrt{{2}}"  # a label no other test has graded
    response = r1("\\sqrt{3}")
    calls = 16
    with ThreadPoolExecutor(max_workers=calls) as ex:
        futures = [ex.submit(grade_responses, [response], [label]) for _ in range(calls)]
        for _ in range(calls):  # every call has found the grading under way...
            assert joined.acquire(timeout=scaled(30)), "a call never reached the verdicts"
        pool.released.set()  # ...before it ends
        results = [f.result()[0] for f in futures]
    assert {r.reason for r in results} == {outcome[1]}
    assert len(pool.submitted) == 1
    grade_responses([response], [label])
    assert len(pool.submitted) == (1 if cached else 2)
