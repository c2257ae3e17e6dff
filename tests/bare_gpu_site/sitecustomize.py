"""Device checks only (``scripts/gpu_checks_bare.sh``): on a GPU machine that has torch but no
Ray or vLLM (this workplace's lent machine), OpenRLHF's actor modules still import both at the
top. This path answers those imports with modules whose every attribute is a ``MagicMock``, so
the actor update runs through OpenRLHF's real ``Actor``, ``DeepspeedStrategy`` and
``ActorPPOTrainer``. Anything that really *uses* Ray or vLLM gets a mock and fails loudly; the
checks run none of it. Nothing outside ``scripts/gpu_checks_bare.sh`` puts this on the path."""

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from unittest import mock

ABSENT = ("ray", "vllm")


class _MockModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = mock.MagicMock(name=f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _AbsentFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] not in ABSENT:
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        module = _MockModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


if not all(importlib.util.find_spec(name) for name in ABSENT):
    sys.meta_path.insert(0, _AbsentFinder())
