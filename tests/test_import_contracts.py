"""``lint-imports`` (make lint) holds the package to its import contracts (pyproject.toml
``[tool.importlinter]``): each contract below is broken in a copy of the package by one added
import, inside a function as the package's lazy imports are, and the run fails naming it;
the unmodified copy passes."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from time_bounds import scaled

REPO = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
CONTRACTS = [
    c["name"]
    for c in tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"][
        "contracts"
    ]
]


def package_copy(root: Path) -> Path:
    """The package's sources and its pyproject.toml under ``root`` (no caches, no weights)."""
    shutil.copytree(
        REPO / "drpo_openrlhf",
        root / "drpo_openrlhf",
        ignore=shutil.ignore_patterns("__pycache__", "bases"),
    )
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    return root


def add_import(root: Path, module: str, statement: str) -> None:
    """Appends a function holding ``statement`` to ``module`` (dotted name) in the copy."""
    path = root / (module.replace(".", "/") + ".py")
    path.write_text(path.read_text() + f"\n\ndef _added():\n    {statement}\n")


def lint_imports(root: Path) -> tuple[int, str]:
    """Its exit status and its report on one line (it wraps long lines at spaces)."""
    done = subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"],
        cwd=root,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=scaled(300),  # a hang guard: 0.3-0.4 s measured (2 cores at load 4-7)
    )
    return done.returncode, " ".join((done.stdout + done.stderr).split())


def test_the_package_keeps_every_contract(tmp_path: Path) -> None:
    code, report = lint_imports(package_copy(tmp_path))
    assert code == 0, report
    assert all(f"{name} KEPT" in report for name in CONTRACTS), report
    assert f"Contracts: {len(CONTRACTS)} kept, 0 broken." in report


@pytest.mark.parametrize(
    ("module", "statement", "contract", "chain"),
    [
        (
            "drpo_openrlhf.algo.objective",
            "from drpo_openrlhf.runtime import launch",
            "The core is layered",
            "drpo_openrlhf.algo.objective -> drpo_openrlhf.runtime.launch",
        ),
        (
            "drpo_openrlhf.update.experience",
            "from drpo_openrlhf.sync import weight_digest",
            "The core is layered",
            "drpo_openrlhf.update.experience -> drpo_openrlhf.sync.weight_digest",
        ),
        (
            "drpo_openrlhf.sync.weight_digest",
            "from drpo_openrlhf.rewards import grading",
            "sync imports only algo",
            "drpo_openrlhf.sync.weight_digest -> drpo_openrlhf.rewards.grading",
        ),
        (
            "drpo_openrlhf.update.signal_watch",
            "from drpo_openrlhf.update import actor_trainer",
            "The update's driver side never imports the actor's side",
            "drpo_openrlhf.update.signal_watch -> drpo_openrlhf.update.actor_trainer",
        ),
        (
            "drpo_openrlhf.algo.groups",
            "import transformers",
            "algo is plain PyTorch",
            "drpo_openrlhf.algo.groups -> transformers",
        ),
        (
            "drpo_openrlhf.rewards.grading",
            "from drpo_openrlhf.eval import metrics",
            "The core never imports the tools built on it",
            "drpo_openrlhf.rewards.grading -> drpo_openrlhf.eval.metrics",
        ),
        (
            "drpo_openrlhf.eval.metrics",
            "from drpo_openrlhf.runtime import preflight",
            "Only the entry points (train, sweep) and the test set-up import runtime",
            "drpo_openrlhf.eval.metrics -> drpo_openrlhf.runtime.preflight",
        ),
        (
            "drpo_openrlhf.sweep.toy",
            "from drpo_openrlhf.demo.run import run_demo",
            "Command modules are not libraries",
            "drpo_openrlhf.sweep.toy -> drpo_openrlhf.demo.run",
        ),
        (
            "drpo_openrlhf.demo.bases",
            "from drpo_openrlhf.demo.run import run_demo",
            "The demo: its command on top of its library",
            "drpo_openrlhf.demo.bases -> drpo_openrlhf.demo.run",
        ),
        (  # keys <- experience already: the way back closes a cycle, which only it forbids
            "drpo_openrlhf.update.keys",
            "from drpo_openrlhf.update import experience",
            "No import cycle anywhere in the package",
            "No cycles are allowed in drpo_openrlhf.update. It could be made acyclic by "
            "removing 1 dependency: - .keys -> .experience",
        ),
    ],
)
def test_one_added_import_breaks_its_contract(
    tmp_path: Path, module: str, statement: str, contract: str, chain: str
) -> None:
    (name,) = [name for name in CONTRACTS if name.startswith(contract)]
    root = package_copy(tmp_path)
    add_import(root, module, statement)
    code, report = lint_imports(root)
    assert code == 1
    assert f"{name} BROKEN" in report, report
    assert chain in report, report
