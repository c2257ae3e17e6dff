#!/usr/bin/env python
"""Benchmark the math reward: throughput on R1-style responses, worst case on adversarial ones.

    python scripts/bench_reward.py            # full run (a few minutes)
    python scripts/bench_reward.py --quick    # smaller, for a smoke test

Measures, on this machine:

1. ``grade_responses`` on a batch of realistic R1-style responses (thousands of tokens of
   reasoning, then ``</think>`` and a boxed answer; a mix of identical, equivalent,
   wrong, unboxed and truncated answers): responses per second.
2. The OpenRLHF plugin called as OpenRLHF calls it: one sample per ``reward_func`` call,
   ``--threads`` calls in flight through ``asyncio.to_thread``: responses per second and
   per-call latency.
3. Plain math-verify in one process (its main thread, its own signal timeouts): extract the
   box, ``parse`` label and answer, ``verify``; the baseline the pool is compared with
   (ratio printed; the goal is >= 2x in OpenRLHF's call pattern).
4. The "unbounded" style for comparison (math-verify called directly in worker threads,
   its signal-based timeouts disabled because they cannot work off the main thread;
   this is how a thread-pool reward manager like the authors' verl/DeepScaleR one ends
   up calling a grader): responses per second.
5. K&K grading (pure Python, in the calling thread): responses per second.
6. Adversarial answers: wall time of one bounded grading (fresh single-worker pool per
   input) and of the unbounded style (fresh process per input, killed after
   ``--unbounded-cap`` seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from drpo_openrlhf.rewards import grading, math_reward  # noqa: E402
from drpo_openrlhf.rewards.answer_extraction import (  # noqa: E402
    answer_part,
    last_boxed,
    normalize_label,
)
from drpo_openrlhf.rewards.grader_pool import GraderPool, get_pool  # noqa: E402
from drpo_openrlhf.rewards.grading import grade_responses  # noqa: E402

SQUAREFREE = (2, 3, 5, 6, 7, 10, 11)


def answer_triple(rng: random.Random) -> tuple[str, str, str]:
    """A random MATH-style ``(label, equivalent answer in another form, wrong answer)``."""
    a, b = rng.randint(1, 40), rng.choice((2, 4, 5, 8, 10))
    kind = rng.randrange(12)
    if kind == 0:
        a = a * 2 + 1 if b % 2 == 0 else a
        return f"\\frac{{{a}}}{{{b}}}", repr(a / b), f"\\frac{{{a + 1}}}{{{b}}}"
    if kind == 1:
        n = rng.randint(0, 99_999)
        eq = f"{n:,}".replace(",", "{,}") if n >= 1000 else f"{n}.0"
        return str(n), eq, str(n + rng.choice((-1, 1, 10)))
    if kind == 2:
        c = rng.choice(SQUAREFREE)
        return f"{a}\\sqrt{{{c}}}", f"\\sqrt{{{a * a * c}}}", f"{a + 1}\\sqrt{{{c}}}"
    if kind == 3:
        return (
            f"\\frac{{{a}\\pi}}{{{b + 1}}}",
            f"\\frac{{{a}}}{{{b + 1}}}\\pi",
            f"\\frac{{{a + 1}\\pi}}{{{b + 1}}}",
        )
    if kind == 4:
        return f"({-a}, {b}]", f"({-a},{b}]", f"[{-a}, {b})"
    if kind == 5:
        return f"x^2 + {2 * a}x + {a * a}", f"(x+{a})^2", f"x^2 + {a * a}"
    if kind == 6:
        return f"{a}\\%", repr(a / 100), f"{a + 1}\\%"
    if kind == 7:
        return f"\\{{{a}, {a + b}\\}}", f"\\{{{a + b}, {a}\\}}", f"\\{{{a}, {a + b + 1}\\}}"
    if kind == 8:
        return f"{a} + {b}i", f"{b}i + {a}", f"{a} - {b}i"
    if kind == 9:
        letters = "ABCDE"
        i = rng.randrange(5)
        return f"\\text{{({letters[i]})}}", letters[i], f"\\text{{({letters[(i + 1) % 5]})}}"
    if kind == 10:
        a = a * 2 + 1 if b % 2 == 0 else a
        return f"-\\frac{{{a}}}{{{b}}}", repr(-a / b), f"\\frac{{{a}}}{{{b}}}"
    q, r = rng.randint(1, 9), rng.randint(1, b - 1)
    return (
        f"\\frac{{{q * b + r}}}{{{b}}}",
        f"{q}\\frac{{{r}}}{{{b}}}",
        f"\\frac{{{q * b + r + 1}}}{{{b}}}",
    )


SENTENCES = [
    "Let me think about this step by step.",
    "First, I need to understand what the problem is asking.",
    "So we have $f(x) = x^2 + 3x - 4$, and we want the roots.",
    "Wait, maybe I should double-check that calculation.",
    "If we substitute $x = 2$, we get $4 + 6 - 4 = 6$.",
    "Hmm, that doesn't seem right. Let me reconsider.",
    "Using the quadratic formula, $x = \\frac{-b \\pm \\sqrt{b^2 - 4ac}}{2a}$.",
    "The sum of the interior angles is $(n-2) \\cdot 180^\\circ$.",
    "Alternatively, we could consider the problem modulo 7.",
    "So $\\binom{10}{3} = 120$, which matches the count above.",
    "Let me verify: $3^4 = 81$ and $81 \\bmod 5 = 1$.",
    "Therefore the probability is $\\frac{3}{8}$ in this case.",
    "But we also need to account for the overlapping cases.",
    "Okay, so combining everything, the expression simplifies nicely.",
    "I think the answer might be \\boxed{7}, but let me make sure.",
    "Now, let's compute the area: $\\frac{1}{2} \\cdot 6 \\cdot 8 = 24$.",
]

ADVERSARIAL = {
    "deep parentheses": "(" * 990 + ")" * 990,
    "\\left( x 300": "\\left(" * 300,
    "nested \\frac x 150": "\\frac{" * 150 + "1" + "}{2}" * 150,
    "9^{9^{9}}": "9^{9^{9}}",
    "10^{10^{15}}": "10^{10^{15}}",
    "(10^{9})!": "(10^{9})!",
    "a^a^...^a (990)": "a^" * 990 + "a",
    "x+x+...+x (990)": "x+" * 990 + "x",
    "1 MB boxed answer": "1+" * 500_000 + "1",
}


def reasoning(rng: random.Random, tokens: int) -> str:
    parts, n = [], 0
    while n < tokens * 4:  # ~4 characters per token
        s = rng.choice(SENTENCES)
        parts.append(s)
        n += len(s) + 1
    return " ".join(parts)


def make_responses(
    n: int, tokens: int, group: int = 8, seed: int = 0
) -> tuple[list[str], list[str], list[str]]:
    """Responses (model output only), labels and the kind of each response; ``group``
    responses share a problem (OpenRLHF's ``n_samples_per_prompt``)."""
    rng = random.Random(seed)
    responses, labels, kinds = [], [], []
    for i in range(n):
        if i % group == 0:
            label, equivalent, wrong = answer_triple(rng)
        u = rng.random()
        if u < 0.35:
            kind, final = "identical", label
        elif u < 0.65:
            kind, final = "equivalent", equivalent
        elif u < 0.85:
            kind, final = "wrong", wrong
        elif u < 0.95:
            kind, final = "no_boxed", None
        else:
            kind, final = "truncated", None
        text = reasoning(rng, tokens)
        if kind == "truncated":
            resp = text
        elif final is None:
            resp = f"{text}\n</think>\n\nI believe the answer is {equivalent}."
        else:
            resp = (
                f"{text}\n</think>\n\nPutting it all together, the answer is "
                f"$\\boxed{{{final}}}$.<｜end▁of▁sentence｜>"
            )
        responses.append(resp)
        labels.append(label)
        kinds.append(kind)
    return responses, labels, kinds


def unbounded_grade(response: str, label: str) -> bool:
    """In-thread math-verify with no deadline (the authors' thread-pool style)."""
    from math_verify import parse, verify

    answer = answer_part(response)
    pred = last_boxed(answer) if answer is not None else None
    if pred is None:
        return False
    gold = parse("\\boxed{" + (normalize_label(label) or "") + "}", parsing_timeout=None)
    return bool(
        verify(gold, parse("\\boxed{" + pred + "}", parsing_timeout=None), timeout_seconds=None)
    )


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def bench_batch(responses, labels, timeout_s):
    start = time.perf_counter()
    results = grade_responses(responses, labels, timeout_s=timeout_s)
    elapsed = time.perf_counter() - start
    return elapsed, results


def bench_openrlhf_style(prompt, responses, labels, threads):
    queries = [prompt + r for r in responses]
    latencies: list[float] = []

    def call(q, label):
        t = time.perf_counter()
        out = math_reward.reward_func([q], [prompt], [label])
        latencies.append(time.perf_counter() - t)
        return out

    async def main():
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(max_workers=threads))
        return await asyncio.gather(
            *(asyncio.to_thread(call, q, lab) for q, lab in zip(queries, labels, strict=True))
        )

    start = time.perf_counter()
    outs = asyncio.run(main())
    elapsed = time.perf_counter() - start
    return elapsed, latencies, outs


def plain_grade(response: str, label: str) -> bool:
    """Single-process math-verify as a user would call it: parse both, verify."""
    from math_verify import parse, verify

    answer = answer_part(response)
    pred = last_boxed(answer) if answer is not None else None
    if pred is None:
        return False
    gold = parse("\\boxed{" + (normalize_label(label) or "") + "}")
    return bool(verify(gold, parse("\\boxed{" + pred + "}")))


def bench_plain(responses, labels, warmup):
    """Plain math-verify, warmed up first on ``warmup`` (the pairs the grader processes
    graded before the plugin phase): ANTLR's parser and sympy get faster as they see more
    answers, and each process warms up on its own."""
    for response, label in zip(*warmup, strict=True):
        plain_grade(response, label)
    start = time.perf_counter()
    outs = [plain_grade(r, lab) for r, lab in zip(responses, labels, strict=True)]
    return time.perf_counter() - start, outs


def bench_unbounded_threads(responses, labels, threads):
    from math_verify import parse

    parse("\\boxed{1}", parsing_timeout=None)  # import and warm up outside the timing
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=threads) as ex:
        outs = list(ex.map(unbounded_grade, responses, labels))
    return time.perf_counter() - start, outs


def bounded_worst_case(latex: str, timeout_s: float) -> tuple[float, str]:
    pool = GraderPool(num_workers=1)
    try:
        pool.grade_many([("1", "1.0")], timeout_s)  # wait for the child to start
        response = "reasoning</think>\\boxed{" + latex + "}"
        # what grade_responses does, on this fresh pool instead of the shared one
        start = time.perf_counter()
        prepared = grading.prepare(response, "5")
        if isinstance(prepared, grading.GradeResult):
            reason = prepared.reason
        else:
            reason = pool.grade_many([prepared], timeout_s)[0][1]
        return time.perf_counter() - start, reason
    finally:
        pool.close()


def unbounded_worst_case(latex: str, cap_s: float) -> float | None:
    """Seconds the unbounded style needs, in a fresh process; None if over ``cap_s``."""
    code = textwrap.dedent(
        f"""
        import sys, time, threading
        sys.path.insert(0, {str(REPO)!r})
        sys.path.insert(0, {str(REPO / "scripts")!r})
        import logging; logging.disable(logging.CRITICAL)
        from bench_reward import unbounded_grade
        from math_verify import parse
        parse("\\\\boxed{{1}}", parsing_timeout=None)
        latex = sys.stdin.read()
        out = {{}}
        def run():
            t = time.perf_counter()
            unbounded_grade("reasoning</think>\\\\boxed{{" + latex + "}}", "5")
            out["s"] = time.perf_counter() - t
        th = threading.Thread(target=run); th.start(); th.join()
        print(out["s"])
        """
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code],
            input=latex,
            capture_output=True,
            text=True,
            timeout=cap_s + 30,  # the child's own start-up is not counted
        )
    except subprocess.TimeoutExpired:
        return None
    try:
        seconds = float(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return float("nan")
    return seconds if seconds <= cap_s else None


# responses, labels and the kind of each (``make_responses``)
Batch = tuple[list[str], list[str], list[str]]


def parse_args() -> argparse.Namespace:
    """The command line; ``--quick`` shrinks the run to a smoke test."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=2000, help="realistic responses")
    parser.add_argument("--tokens", type=int, default=3000, help="reasoning tokens each")
    parser.add_argument("--group", type=int, default=8, help="responses per problem")
    parser.add_argument("--threads", type=int, default=32, help="concurrent reward calls")
    parser.add_argument("--timeout", type=float, default=math_reward.DEFAULT_TIMEOUT_S)
    parser.add_argument("--unbounded-cap", type=float, default=60.0)
    parser.add_argument("--quick", action="store_true", help="n=200, cap 10 s")
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args()
    if args.quick:
        args.n, args.unbounded_cap = 200, 10.0
    return args


def as_expected(kinds: list[str], correct: list[bool]) -> float:
    """The share graded as the response's kind says (identical and equivalent answers
    correct, the rest not): a fast grader only counts if it is also right."""
    good = sum((k in ("identical", "equivalent")) == c for k, c in zip(kinds, correct, strict=True))
    return good / len(kinds)


def batch_phase(args: argparse.Namespace, batch: Batch) -> dict:
    """Phase 1: ``grade_responses`` on the whole batch at once."""
    responses, labels, kinds = batch
    elapsed, results = bench_batch(responses, labels, args.timeout)
    entry = {
        "seconds": elapsed,
        "responses_per_s": args.n / elapsed,
        "as_expected": as_expected(kinds, [r.correct for r in results]),
    }
    print(
        f"[batch] grade_responses: {args.n / elapsed:,.0f} responses/s ({elapsed:.2f} s), "
        f"graded as expected: {entry['as_expected']:.1%}"
    )
    return entry


def plugin_phase(args: argparse.Namespace, batch: Batch) -> dict:
    """Phase 2: the OpenRLHF plugin, one sample per call, ``--threads`` calls in flight."""
    responses, labels, kinds = batch
    prompt = "<｜begin▁of▁sentence｜><｜User｜>Solve the problem.<｜Assistant｜><think>\n"
    elapsed, lat, outs = bench_openrlhf_style(prompt, responses, labels, args.threads)
    entry = {
        "threads": args.threads,
        "responses_per_s": args.n / elapsed,
        "latency_ms": {
            "p50": 1e3 * percentile(lat, 0.5),
            "p95": 1e3 * percentile(lat, 0.95),
            "p99": 1e3 * percentile(lat, 0.99),
            "max": 1e3 * max(lat),
        },
        "as_expected": as_expected(kinds, [bool(o["scores"][0]) for o in outs]),
    }
    print(
        f"[plugin] reward_func x1 via asyncio.to_thread ({args.threads} threads): "
        f"{args.n / elapsed:,.0f} responses/s; latency ms "
        + ", ".join(f"{k} {v:.1f}" for k, v in entry["latency_ms"].items())
    )
    return entry


def plain_phase(
    args: argparse.Namespace, batch: Batch, warmup: tuple[list[str], list[str]], plugin_rate: float
) -> dict:
    """Phase 3: plain single-process math-verify, the baseline the plugin's rate is
    compared with."""
    responses, labels, kinds = batch
    elapsed, plain = bench_plain(responses, labels, warmup)
    entry = {
        "responses_per_s": args.n / elapsed,
        "as_expected": as_expected(kinds, plain),
        "plugin_over_plain": plugin_rate / (args.n / elapsed),
    }
    print(
        f"[plain] single-process math-verify: {args.n / elapsed:,.0f} responses/s; "
        f"plugin / plain = {entry['plugin_over_plain']:.2f}x"
    )
    return entry


def unbounded_phase(args: argparse.Namespace, batch: Batch) -> dict:
    """Phase 4: math-verify in worker threads without deadlines (the unbounded style)."""
    responses, labels, kinds = batch
    elapsed, unb = bench_unbounded_threads(responses, labels, args.threads)
    entry = {
        "threads": args.threads,
        "responses_per_s": args.n / elapsed,
        "as_expected": as_expected(kinds, unb),
    }
    print(f"[unbounded] in-thread math-verify: {args.n / elapsed:,.0f} responses/s")
    return entry


def overhead_phase() -> dict:
    """The per-call overhead of one pool round trip on a trivial pair (``k+0`` is no plain
    number, so no fast path takes it)."""
    lat = []
    for k in range(200):  # a new pair each time: verdicts are cached per (label, answer)
        t = time.perf_counter()
        grade_responses([f"</think>\\boxed{{{k + 7}+0}}"], [str(k + 7)])
        lat.append(time.perf_counter() - t)
    entry = {"p50": 1e3 * percentile(lat, 0.5), "p99": 1e3 * percentile(lat, 0.99)}
    print(f"[overhead] one trivial (uncached) call through the pool: p50 {entry['p50']:.2f} ms")
    return entry


def kk_phase(args: argparse.Namespace) -> dict:
    """Phase 5: K&K grading, pure-Python parsing in the calling thread, no pool."""
    from drpo_openrlhf.rewards.kk_reward import grade_kk_responses

    rng = random.Random(3)
    names = ["Ella", "Zoey", "Scarlett", "Henry", "Amelia", "Oliver", "Mia"]
    kk_responses, kk_labels = [], []
    for _ in range(args.n):
        roles = [rng.random() < 0.5 for _ in names]
        kk_labels.append(
            "\n".join(
                f"({i}) {n} is a {'knight' if r else 'knave'}"
                for i, (n, r) in enumerate(zip(names, roles, strict=True), 1)
            )
        )
        answer = ", ".join(
            f"{n} is a {'knight' if r else 'knave'}" for n, r in zip(names, roles, strict=True)
        )
        kk_responses.append(f"{reasoning(rng, args.tokens)}</think>\nCONCLUSION:\n{answer}.")
    start = time.perf_counter()
    kk_results = grade_kk_responses(kk_responses, kk_labels)
    elapsed = time.perf_counter() - start
    entry = {
        "responses_per_s": args.n / elapsed,
        "correct": sum(r.correct for r in kk_results) / args.n,
    }
    print(f"[kk] grade_kk_responses: {args.n / elapsed:,.0f} responses/s (one thread)")
    return entry


def adversarial_phase(args: argparse.Namespace) -> dict:
    """Phase 6: each adversarial answer bounded and unbounded, then a 5 MB response."""
    entries: dict = {}
    print(f"\n{'adversarial answer':24} {'bounded':>18} {'unbounded (in-thread)':>24}")
    for name, latex in ADVERSARIAL.items():
        b_s, reason = bounded_worst_case(latex, args.timeout)
        u_s = unbounded_worst_case(latex, args.unbounded_cap)
        entries[name] = {"bounded_s": b_s, "reason": reason, "unbounded_s": u_s}
        u_txt = f"> {args.unbounded_cap:.0f} s" if u_s is None else f"{u_s:.2f} s"
        print(f"{name:24} {b_s:8.2f} s {reason:>8} {u_txt:>24}")
    big = "x" * 5_000_000 + "</think>\\boxed{\\frac{6}{8}}"
    t = time.perf_counter()
    (res,) = grade_responses([big], ["0.75"], timeout_s=args.timeout)
    big_s = time.perf_counter() - t
    entries["5 MB response"] = {"bounded_s": big_s, "reason": res.reason}
    print(f"{'5 MB response':24} {big_s:8.2f} s {res.reason:>8}")
    return entries


def main() -> None:
    args = parse_args()

    import logging

    logging.disable(logging.CRITICAL)
    report: dict = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "processor": platform.processor() or platform.machine(),
        },
        "grader_workers": get_pool().num_workers,
        "timeout_s": args.timeout,
    }
    import torch  # noqa: F401  (loaded in every OpenRLHF process; keep its import out of timings)

    get_pool().grade_many([("1", "1.0")], args.timeout)  # start the pool outside the timings
    # each phase gets its own problems (seed) so no phase grades answers cached by another
    data = [make_responses(args.n, args.tokens, args.group, seed=k) for k in range(4)]
    avg_chars = statistics.mean(len(r) for r in data[0][0])
    report["responses"] = {"n": args.n, "avg_chars": round(avg_chars), "group": args.group}
    print(f"{args.n} responses, ~{args.tokens} reasoning tokens ({avg_chars:.0f} chars) each")
    print(f"grader workers: {get_pool().num_workers}, CPUs: {os.cpu_count()}")

    report["batch"] = batch_phase(args, data[0])
    report["openrlhf_style"] = plugin_phase(args, data[1])
    plugin_rate = report["openrlhf_style"]["responses_per_s"]
    report["plain_single_process"] = plain_phase(args, data[3], data[0][:2], plugin_rate)
    report["unbounded_threads"] = unbounded_phase(args, data[2])
    report["single_call_ms"] = overhead_phase()
    report["kk"] = kk_phase(args)
    report["adversarial"] = adversarial_phase(args)
    report["pool_counts"] = dict(get_pool().counts)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
