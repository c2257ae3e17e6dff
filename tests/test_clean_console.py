"""A clean console: the CPU venv's processes start without torch's pynvml FutureWarning and
DeepSpeed's "Setting accelerator to CPU" warning, so that a user's first screen holds the
project's own lines (docs/cpu.md, "A clean console"). Each check starts the venv's python
afresh, without this process's DeepSpeed setting, so only what the venv sets at start-up
counts; both streams are read (DeepSpeed's logger writes to stdout)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from time_bounds import scaled

REPO = Path(__file__).resolve().parents[1]
PYNVML_WARNING = "The pynvml package is deprecated"
ACCELERATOR_WARNING = "Setting accelerator to CPU"


def venv_python(*args: str) -> subprocess.CompletedProcess[str]:
    """The venv's python in a fresh process: no DS_ACCELERATOR or warning filter inherited."""
    env = {k: v for k, v in os.environ.items() if k not in ("DS_ACCELERATOR", "PYTHONWARNINGS")}
    # a hang guard: 12 s measured for the slowest test's processes (importing torch and
    # DeepSpeed; 2 cores at load 4-7), 300 s is 25x that
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=scaled(300),
    )


def cpu_only_torch() -> bool:
    """Whether torch was built without any GPU backend: DeepSpeed has nothing but the CPU to
    find, and `make venv` names it (elsewhere its detection, and its warning, are its own)."""
    v = torch.version
    return not any((v.cuda, v.hip, getattr(v, "xpu", None), torch.backends.mps.is_built()))


def warnings_in(result: subprocess.CompletedProcess[str]) -> list[str]:
    """The two warnings this venv must not print that the process printed, on either stream."""
    unwanted = [PYNVML_WARNING, ACCELERATOR_WARNING] if cpu_only_torch() else [PYNVML_WARNING]
    return [w for w in unwanted if w in result.stdout + result.stderr]


def test_pynvml_is_nvidia_ml_py_and_the_deprecated_shim_is_not_installed() -> None:
    """torch imports the module `pynvml`; the `pynvml` distribution's import hook warns about
    any such import, so only nvidia-ml-py may provide it (`make venv` removes the shim)."""
    assert importlib.metadata.packages_distributions().get("pynvml") == ["nvidia-ml-py"]
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.distribution("pynvml")


@pytest.mark.slow
def test_importing_torch_and_deepspeed_prints_nothing() -> None:
    result = venv_python("-c", "import torch, deepspeed")
    assert result.returncode == 0, result.stderr
    assert warnings_in(result) == [], result.stdout + result.stderr
    if cpu_only_torch():
        assert (result.stdout, result.stderr) == ("", "")


@pytest.mark.slow
def test_the_entry_points_help_starts_with_its_usage() -> None:
    result = venv_python("-m", "drpo_openrlhf.train", "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: python -m drpo_openrlhf.train")
    assert warnings_in(result) == [], result.stderr
