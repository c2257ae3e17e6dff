"""The driver's and the Ray workers' exit, without the interpreter's teardown.

``python -m drpo_openrlhf.train`` imports torch, DeepSpeed, transformers, vLLM and OpenRLHF.
When it returns, the interpreter's teardown garbage-collects all their objects, module by
module: 4 s of a 40-s toy run on 2 cores (measured with py-spy in ``gc_collect_main``), for a
process that is ending anyway, paid by every run of the test suite. Freezing the
objects instead (``gc.freeze``) skips the walk but leaves triton's nanobind objects alive at
its own check, which then prints some 70 lines of "leaked" warnings.

The run's Ray actors (trainer, policy, vLLM engine) hold the same libraries and tore down
for another 2-3 s after the driver had ended (py-spy: no Python frame, the GIL held), each
time the tests waited for them to go; ``end_workers_without_teardown`` ends them the same way.
"""

from __future__ import annotations

import atexit
import functools
import os
import sys
import threading
from typing import NoReturn

from drpo_openrlhf import upstream


def exit_now(code: int | str | None) -> NoReturn:
    """End the process as ``sys.exit(code)`` would, in the interpreter's own order (a string
    printed to stderr with status 1; the non-daemon threads waited for, as
    ``threading._shutdown`` does first at any exit; the exit handlers, e.g. Ray's shutdown and
    logging's flush; the standard streams flushed), then without the teardown."""
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def end_workers_without_teardown() -> None:
    """Make this process, a Ray worker, end through ``exit_now`` once its task loop ends: Ray's
    ``Worker.main_loop`` (``ray/_private/worker.py``, Ray 2.55) then calls ``sys.exit(0)``, or
    its SIGTERM handler raises ``SystemExit(1)``, and both reach the wrapper. Idempotent."""
    upstream.apply("ray_worker_exit", {"Worker.main_loop": _then_exit_now})


def _then_exit_now(main_loop):
    @functools.wraps(main_loop)
    def main_loop_then_exit_now(self) -> None:
        try:
            main_loop(self)
        except SystemExit as end:
            exit_now(end.code)

    return main_loop_then_exit_now
