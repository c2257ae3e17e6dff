"""Shared test set-up: offline, deterministic, no torch.compile."""

import os
import shutil
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import toy_base
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


def _toy(root: Path, architecture: str) -> dict[str, Path]:
    """The demo's quick base policy (about half its rollouts correct), shipped with the tests
    (``tests/toy_base.py``) and copied, and its data (``base``: an HF model dir;
    ``train``/``eval``: jsonl)."""
    from drpo_openrlhf.demo.run import DemoConfig, make_problems
    from drpo_openrlhf.demo.toy_task import write_jsonl

    train_problems, eval_problems = make_problems(DemoConfig.quick())
    return {
        "base": Path(shutil.copytree(toy_base.FIXTURES / architecture, root / "base")),
        "train": write_jsonl(train_problems, root / "train.jsonl"),
        "eval": write_jsonl(eval_problems[:16], root / "eval.jsonl"),
    }


@pytest.fixture(scope="session")
def toy(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The toy task on a Qwen2 policy, for the tests that run the real pipeline."""
    return _toy(tmp_path_factory.mktemp("toy"), "qwen2")


@pytest.fixture(scope="session")
def toy_llama(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same on a Llama policy with DeepSeek-R1-Distill-Llama's chat format (the 8B
    recipe's architecture; ``drpo_openrlhf/tiny_model.py``)."""
    return _toy(tmp_path_factory.mktemp("toy-llama"), "llama")
