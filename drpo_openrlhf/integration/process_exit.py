"""The driver's exit, without the interpreter's teardown.

``python -m drpo_openrlhf.train`` imports torch, DeepSpeed, transformers, vLLM and OpenRLHF.
When it returns, the interpreter's teardown garbage-collects all their objects, module by
module: 4 s of a 40-s toy run on 2 cores (measured with py-spy in ``gc_collect_main``), for a
process that is ending anyway, paid by every run of the test suite (issue 36). Freezing the
objects instead (``gc.freeze``) skips the walk but leaves triton's nanobind objects alive at
its own check, which then prints some 70 lines of "leaked" warnings.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def exit_now(code: int | str | None) -> NoReturn:
    """End the process as ``sys.exit(code)`` would: the exit handlers run (Ray's shutdown,
    logging's flush), the standard streams are flushed, a string is printed to stderr with
    status 1; then the process ends without the teardown. Where a non-daemon thread is still
    running, which the teardown would wait for, it is the ordinary ``sys.exit``."""
    others = [t for t in threading.enumerate() if t is not threading.main_thread()]
    if any(not t.daemon for t in others):
        sys.exit(code)
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
