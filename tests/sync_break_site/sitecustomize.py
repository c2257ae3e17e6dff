"""Test-only (``tests/test_weight_sync_guard.py``): on this path with ``DRPO_TEST_SYNC_BREAK``
set, every process that imports the CPU worker extension gets ``sync_breakage``'s broken
``update_weight`` instead. Nothing outside the tests puts this directory on the path."""

import importlib.abc
import importlib.machinery
import os
import sys

TARGET = "drpo_openrlhf.sync.vllm_cpu_worker"


class _BreakSyncOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        exec_module = spec.loader.exec_module

        def exec_then_break(module):
            exec_module(module)
            import sync_breakage

            sync_breakage.install(module.CPUWorkerWrap)

        spec.loader.exec_module = exec_then_break
        return spec


if os.environ.get("DRPO_TEST_SYNC_BREAK"):
    sys.meta_path.insert(0, _BreakSyncOnImport())
