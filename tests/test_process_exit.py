"""``exit_now``: the driver's exit keeps what ``sys.exit`` promises (exit handlers, flushed
output, the status) and drops only the interpreter's teardown."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from time_bounds import scaled

PROLOGUE = """
import atexit, sys, threading, time
from drpo_openrlhf.runtime.process_exit import exit_now

class Teardown:
    def __del__(self):
        print("torn down", flush=True)

kept = Teardown()  # a module global: freed only by the interpreter's teardown
atexit.register(lambda: print("exit handler ran"))
print("buffered", end="")
sys.stderr.write("partial line ")
"""


def run(body: str) -> subprocess.CompletedProcess:
    script = PROLOGUE + textwrap.dedent(body)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # buffered stdout
    command = [sys.executable, "-c", script]
    # a hang guard: the slowest test's process (a 0.5 s sleep) 0.6 s (2 cores at load 4-7)
    return subprocess.run(command, capture_output=True, text=True, timeout=scaled(60), env=env)


@pytest.mark.parametrize(("code", "status"), [(0, 0), (None, 0), (3, 3), ("bad flag", 1)])
def test_exit_handlers_run_output_is_flushed_and_the_status_kept(code, status):
    done = run(f"exit_now({code!r})")
    assert done.returncode == status, done.stderr
    assert done.stdout == "bufferedexit handler ran\n"
    assert done.stderr == "partial line " + ("bad flag\n" if isinstance(code, str) else "")


def test_the_teardown_is_skipped():
    """The control (``sys.exit``) shows the teardown's work that ``exit_now`` leaves out."""
    assert "torn down" in run("sys.exit(0)").stdout
    assert "torn down" not in run("exit_now(0)").stdout


def test_running_threads_are_waited_for_first_and_still_no_teardown():
    """As at any exit: a non-daemon thread is joined and an executor's queued work done (its
    idle worker threads, which a Ray actor's event loop leaves, let it end) before the exit
    handlers; then no teardown."""
    done = run(
        """
        from concurrent.futures import ThreadPoolExecutor

        def late(what):
            time.sleep(0.5)
            print(what, "finished", flush=True)

        threading.Thread(target=late, args=("thread",)).start()
        pool = ThreadPoolExecutor(2)
        pool.submit(late, "queued job")
        atexit.register(lambda: print("handler after the threads:", threading.active_count()))
        exit_now(4)
        """
    )
    assert done.returncode == 4, done.stderr
    assert "thread finished" in done.stdout and "queued job finished" in done.stdout
    assert "handler after the threads: 1\n" in done.stdout and "exit handler ran" in done.stdout
    assert "torn down" not in done.stdout
