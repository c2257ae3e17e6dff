"""The import-only Ray/vLLM stand-ins of ``scripts/gpu_checks_bare.sh`` (tests/bare_gpu_site):
they answer the absent packages and their submodules, and nothing else."""

import importlib.util
import sys
from pathlib import Path
from unittest import mock

SITE = Path(__file__).resolve().parent / "bare_gpu_site" / "sitecustomize.py"


def load_site():
    spec = importlib.util.spec_from_file_location("bare_gpu_sitecustomize", SITE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_absent_packages_import_as_mocks_with_their_submodules(monkeypatch):
    site = load_site()
    finder = site._AbsentFinder()
    for name in [n for n in sys.modules if n.split(".")[0] in site.ABSENT]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    import ray
    from ray.util.placement_group import placement_group
    from vllm import SamplingParams

    assert isinstance(placement_group, mock.MagicMock)
    assert isinstance(SamplingParams, mock.MagicMock)
    assert ray.remote is ray.remote  # one mock per attribute, as a module's name is one object

    @ray.remote(num_gpus=1)
    class Worker:  # a decorated class still defines
        pass

    assert finder.find_spec("torch", None) is None
    assert finder.find_spec("rayleigh", None) is None


def test_present_packages_are_left_alone(monkeypatch):
    meta_path = list(sys.meta_path)
    load_site()  # ray and vllm are installed here: the finder must not go on the path
    assert sys.meta_path == meta_path
