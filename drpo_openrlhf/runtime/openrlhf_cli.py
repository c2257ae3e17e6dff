"""OpenRLHF 0.11.2's own argument parser, obtained without importing its GPU-only modules.

OpenRLHF builds its parser inside ``if __name__ == "__main__":`` of
``openrlhf/cli/train_ppo_ray.py``, a module whose imports pull in vLLM. We read that file's
source, execute only the statements that build the parser, and so accept every OpenRLHF flag
unchanged, with its own defaults, help and choices, on any machine (a login node, a laptop).
The statements after ``parse_args()`` (OpenRLHF's own checks of its flags) run the same way
before anything starts (``check_openrlhf_validation``).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import io
import itertools
import os
from datetime import datetime
from pathlib import Path

TRAIN_MODULE = "openrlhf.cli.train_ppo_ray"


def _is_main_guard(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test).replace("'", '"') == (
        '__name__ == "__main__"'
    )


def _is_parse_args(node: ast.stmt) -> bool:
    return isinstance(node, ast.Assign) and ast.unparse(node.value) == "parser.parse_args()"


def _main_guard() -> tuple[str, list[ast.stmt]]:
    """The path of OpenRLHF's entry point and the statements of its ``__main__`` block."""
    spec = importlib.util.find_spec(TRAIN_MODULE)
    if spec is None or spec.origin is None:
        raise ImportError(f"{TRAIN_MODULE} not found: install openrlhf==0.11.2")
    source = Path(spec.origin).read_text()
    guard = next(node for node in ast.parse(source).body if _is_main_guard(node))
    if not any(_is_parse_args(node) for node in guard.body):
        raise RuntimeError(
            f"no 'args = parser.parse_args()' in {spec.origin}: unsupported OpenRLHF"
        )
    return spec.origin, guard.body


def openrlhf_parser() -> argparse.ArgumentParser:
    """The ``argparse`` parser of ``python -m openrlhf.cli.train_ppo_ray``."""
    origin, body = _main_guard()
    statements = list(itertools.takewhile(lambda node: not _is_parse_args(node), body))
    namespace = {"argparse": argparse, "os": os, "datetime": datetime}
    code = compile(ast.Module(body=statements, type_ignores=[]), origin, "exec")
    exec(code, namespace)  # only argparse calls: the statements before parse_args()
    return namespace["parser"]


def _is_hierarchize_import(node: ast.stmt) -> bool:
    return isinstance(node, ast.ImportFrom) and node.module == "openrlhf.utils.config"


def _is_train_call(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and ast.unparse(node) == "train(args)"


def _hierarchize():
    """``openrlhf.utils.config.hierarchize``, loaded from its file alone: the package's
    ``__init__`` imports transformers (seconds)."""
    spec = importlib.util.find_spec(TRAIN_MODULE)
    path = Path(spec.origin).parents[1] / "utils" / "config.py"
    module_spec = importlib.util.spec_from_file_location("_openrlhf_config", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.hierarchize


def check_openrlhf_validation(argv: list[str]) -> None:
    """Run OpenRLHF's own checks of its flags on ``argv``: the statements of its ``__main__``
    between ``parse_args()`` and ``train(args)`` (assertions, and the defaults they derive),
    which otherwise run only once the run has started Ray (on CPU). Its warnings are
    silenced (the run prints them). Raises ``ValueError`` with OpenRLHF's message."""
    origin, body = _main_guard()
    after = list(itertools.dropwhile(lambda node: not _is_parse_args(node), body))[1:]
    statements = [
        node
        for node in itertools.takewhile(lambda node: not _is_train_call(node), after)
        if not _is_hierarchize_import(node)
    ]
    namespace = {"args": openrlhf_parser().parse_args(argv), "hierarchize": _hierarchize()}
    code = compile(ast.Module(body=statements, type_ignores=[]), origin, "exec")
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            exec(code, namespace)
    except Exception as error:  # whatever fails here, the flags made it fail
        text = str(error) or type(error).__name__
        raise ValueError(f"OpenRLHF refuses these flags: {text}") from None
