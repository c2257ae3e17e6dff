"""A persistent pool of grader processes with per-answer deadlines.

Why processes: math-verify bounds its own time with ``signal.alarm``, which only works in
the main thread, while OpenRLHF calls reward functions from worker threads
(``asyncio.to_thread``) inside the vLLM engine actors. sympy can also get stuck inside C
code (big-integer powers) where no signal or thread trick can interrupt it. The only
reliable bound is a separate process that can be killed.

How it works: ``num_workers`` child processes (``_grader_worker.py``, started with
``subprocess`` so that nothing is forked from a multi-threaded, CUDA-holding parent) each
have one manager thread here. Callers, from any number of threads, put jobs on one shared
queue and wait on futures. A manager takes a job, sends it to its child and waits at most
``timeout_s + grace_s``; inside the child a ``SIGALRM`` timer answers ``"timeout"`` at
``timeout_s`` (the common case, the child survives); if the child does not answer by the
hard deadline, or dies, it is killed and replaced and the job goes to the fresh child once
more (a hung or killed worker must not turn a right answer into a wrong one); lost again,
the job scores ``"timeout"`` (or ``"error"``). The deadline starts when a child receives the
job, so a batch larger than the pool only queues; a caller's wait is bounded because every
job a manager takes ends by two deadlines.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

_WORKER_SCRIPT = Path(__file__).with_name("_grader_worker.py")

DEFAULT_GRACE_S = 0.5
DEFAULT_STARTUP_TIMEOUT_S = 120.0
DEFAULT_MEMORY_MB = 4096
_MAX_BACKOFF_S = 30.0


def default_num_workers() -> int:
    """``$DRPO_REWARD_WORKERS`` if set, else ``min(4, CPU count)``."""
    env = os.environ.get("DRPO_REWARD_WORKERS", "").strip()
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            pass
    return max(1, min(4, os.cpu_count() or 1))


@dataclass
class _Job:
    gold: object  # a label's forms, or one string (see _grader_worker's message format)
    pred: object
    timeout_s: float
    future: Future


class _Slot:
    """One child process and the manager thread that feeds it."""

    def __init__(self, pool: GraderPool, index: int):
        self.pool = pool
        self.index = index
        self.proc: subprocess.Popen | None = None
        self.conn: Connection | None = None
        self.failures = 0
        self.retry_at = 0.0
        self.last_error = ""
        self._ids = itertools.count()
        self.thread = threading.Thread(target=self._serve, name=f"drpo-grader-{index}", daemon=True)

    # -- child process lifecycle ---------------------------------------------------

    def _alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and self.conn is not None

    def _start(self) -> None:
        if time.monotonic() < self.retry_at:
            raise RuntimeError(f"grader worker failed to start recently: {self.last_error}")
        parent_sock, child_sock = socket.socketpair()
        try:
            fd = child_sock.fileno()
            proc = subprocess.Popen(
                [
                    sys.executable,
                    str(self.pool.worker_script),
                    str(fd),
                    str(self.pool.memory_mb),
                    str(os.getpid()),
                ],
                pass_fds=(fd,),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                close_fds=True,
            )
        except BaseException:
            parent_sock.close()
            child_sock.close()
            raise
        child_sock.close()
        conn = Connection(parent_sock.detach())
        self.proc, self.conn = proc, conn
        try:
            if not conn.poll(self.pool.startup_timeout_s):
                raise RuntimeError("grader worker did not start in time")
            msg = conn.recv()
            if not msg or msg[0] != "ready":
                raise RuntimeError(f"grader worker failed to start: {msg!r}")
        except BaseException as exc:
            self._kill()
            self.failures += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            self.retry_at = time.monotonic() + min(_MAX_BACKOFF_S, 2.0**self.failures)
            raise
        self.failures = 0

    def _kill(self) -> None:
        proc, conn = self.proc, self.conn
        self.proc, self.conn = None, None
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.close()
        if proc is not None:
            with contextlib.suppress(OSError):
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)

    def _ensure_started(self) -> bool:
        if self._alive():
            return True
        self._kill()
        if self.pool.closed:
            return False
        try:
            self._start()
        except Exception:
            return False
        return True

    # -- serving ---------------------------------------------------------------------

    def _run(self, job: _Job) -> tuple[bool, str]:
        """Grades ``job``. A child lost while grading (it died: killed from outside or out of
        memory; or it hung past the hard deadline, where its own SIGALRM could not answer)
        is replaced and the job graded once more, so that a lost worker does not turn a
        right answer into a wrong one; lost twice, the job scores ``error`` / ``timeout``."""
        outcome, lost = self._run_once(job)
        if lost:
            outcome, _ = self._run_once(job)
        return outcome

    def _run_once(self, job: _Job) -> tuple[tuple[bool, str], bool]:
        """The outcome, and whether the child was lost with the job."""
        if not self._ensure_started():
            return (False, "error"), False
        job_id = next(self._ids)
        conn = self.conn
        try:
            conn.send(("grade", job_id, job.gold, job.pred, job.timeout_s))
            if not conn.poll(job.timeout_s + self.pool.grace_s):
                self.pool.count("killed")
                self._kill()
                return (False, "timeout"), True
            msg = conn.recv()
        except (EOFError, OSError, ValueError):
            self.pool.count("crashed")
            self._kill()
            return (False, "error"), True
        if not (
            isinstance(msg, tuple) and len(msg) == 5 and msg[0] == "result" and msg[1] == job_id
        ):
            self._kill()
            return (False, "error"), False
        _, _, correct, reason, restart = msg
        if restart:
            self.pool.count("restarted")
            self._kill()
        return (bool(correct), str(reason)), False

    def _serve(self) -> None:
        jobs = self.pool.jobs
        while True:
            if not self._ensure_started() and not self.pool.closed and self.pool.any_alive():
                # Could not (re)start our child: leave the work to the healthy slots and
                # retry later. Only when no slot has a child do we take jobs (and fail them
                # fast), so that callers never wait on a pool that cannot grade.
                time.sleep(min(1.0, max(0.05, self.retry_at - time.monotonic())))
                continue
            job = jobs.get()
            if job is None:
                break
            if not job.future.set_running_or_notify_cancel():
                continue
            try:
                result = self._run(job)
            except BaseException:  # never let a manager thread die
                self._kill()
                result = (False, "error")
            job.future.set_result(result)
            if not self._alive() and not self.pool.closed:
                self._ensure_started()  # replace a killed child before the next job
        self._kill()


class GraderPool:
    """Thread-safe pool of ``num_workers`` grader processes; see the module docstring.

    ``memory_mb`` caps each child's address space (``RLIMIT_AS``; 0: no cap), ``grace_s``
    is how long past its deadline a child may take before it is killed, and
    ``worker_script`` replaces the child program (tests use it to simulate a child stuck
    in C code).
    """

    def __init__(
        self,
        num_workers: int | None = None,
        *,
        memory_mb: int = DEFAULT_MEMORY_MB,
        grace_s: float = DEFAULT_GRACE_S,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        worker_script: str | os.PathLike | None = None,
    ):
        self.num_workers = num_workers or default_num_workers()
        self.worker_script = Path(worker_script) if worker_script else _WORKER_SCRIPT
        self.memory_mb = memory_mb
        self.grace_s = grace_s
        self.startup_timeout_s = startup_timeout_s
        self.pid = os.getpid()
        self.closed = False
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._counts_lock = threading.Lock()
        self.counts: dict[str, int] = {"killed": 0, "crashed": 0, "restarted": 0}
        self._slots = [_Slot(self, i) for i in range(self.num_workers)]
        for slot in self._slots:
            slot.thread.start()

    def count(self, what: str) -> None:
        with self._counts_lock:
            self.counts[what] = self.counts.get(what, 0) + 1

    def any_alive(self) -> bool:
        return any(s._alive() for s in self._slots)

    def healthy(self) -> bool:
        return not self.closed and any(s.thread.is_alive() for s in self._slots)

    def worker_pids(self) -> list[int]:
        return [s.proc.pid for s in self._slots if s.proc is not None]

    def submit(self, gold: object, pred: object, timeout_s: float) -> Future:
        future: Future = Future()
        if self.closed:
            future.set_result((False, "error"))
        else:
            self.jobs.put(_Job(gold, pred, float(timeout_s), future))
        return future

    def wait(self, future: Future) -> tuple[bool, str]:
        """The result of a submitted job. Every job a manager takes finishes by its
        deadline, so this only polls in case the pool itself is shut down meanwhile."""
        while True:
            try:
                return future.result(timeout=1.0)
            except FutureTimeout:
                if not self.healthy():
                    future.cancel()
                    if future.cancelled():
                        return False, "error"

    def grade_many(
        self, pairs: Sequence[tuple[object, object]], timeout_s: float
    ) -> list[tuple[bool, str]]:
        futures = [self.submit(gold, pred, timeout_s) for gold, pred in pairs]
        return [self.wait(f) for f in futures]

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for _ in self._slots:
            self.jobs.put(None)
        for slot in self._slots:
            slot.thread.join(timeout=5)
            slot._kill()
        # Fail anything still queued.
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None and job.future.set_running_or_notify_cancel():
                job.future.set_result((False, "error"))


_pool: GraderPool | None = None
_pool_lock = threading.Lock()
_pool_kwargs: dict = {}


def get_pool() -> GraderPool:
    """The process-wide pool, started on first use (and again after a fork)."""
    global _pool
    pool = _pool
    if pool is not None and not pool.closed and pool.pid == os.getpid():
        return pool
    with _pool_lock:
        if _pool is None or _pool.closed or _pool.pid != os.getpid():
            _pool = GraderPool(**_pool_kwargs)
        return _pool


def configure_pool(num_workers: int | None = None, memory_mb: int | None = None) -> None:
    """Set the size (and per-process memory cap) of the shared pool; restarts it if running."""
    global _pool
    with _pool_lock:
        if num_workers is not None:
            _pool_kwargs["num_workers"] = num_workers
        if memory_mb is not None:
            _pool_kwargs["memory_mb"] = memory_mb
        old, _pool = _pool, None
    if old is not None and old.pid == os.getpid():
        old.close()


def shutdown_pool() -> None:
    """Stop the shared pool's processes (also registered with :mod:`atexit`)."""
    global _pool
    with _pool_lock:
        old, _pool = _pool, None
    if old is not None and old.pid == os.getpid():
        old.close()


atexit.register(shutdown_pool)
