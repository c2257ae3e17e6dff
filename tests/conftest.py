"""Shared test set-up: offline, deterministic, no torch.compile."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from stand_ins import install_stand_ins

install_stand_ins()


@pytest.fixture
def float64_default():
    """Float64 as torch's default dtype for one test, restored afterwards (a module-level
    ``set_default_dtype`` would leak into every later test module)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)
