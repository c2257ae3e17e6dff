"""Test-only (``tests/test_faults.py``): on this path with ``DRPO_TEST_FAULT_FILE`` set, the
modules ``fault_injection`` names are patched as they are imported, in every process of the
run (driver, Ray workers, vLLM engines). Nothing outside the tests puts this on the path."""

import importlib.abc
import importlib.machinery
import os
import sys

import fault_injection


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in fault_injection.PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        exec_module = spec.loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            fault_injection.PATCHES[name](module)

        spec.loader.exec_module = exec_then_patch
        return spec


if os.environ.get("DRPO_TEST_FAULT_FILE"):
    sys.meta_path.insert(0, _PatchOnImport())
