"""OpenRLHF 0.11.2's own argument parser, obtained without importing its GPU-only modules.

OpenRLHF builds its parser inside ``if __name__ == "__main__":`` of
``openrlhf/cli/train_ppo_ray.py``, a module whose imports pull in vLLM. We read that file's
source, execute only the statements that build the parser, and so accept every OpenRLHF flag
unchanged, with its own defaults, help and choices, on any machine (a login node, a laptop).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
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


def openrlhf_parser() -> argparse.ArgumentParser:
    """The ``argparse`` parser of ``python -m openrlhf.cli.train_ppo_ray``."""
    spec = importlib.util.find_spec(TRAIN_MODULE)
    if spec is None or spec.origin is None:
        raise ImportError(f"{TRAIN_MODULE} not found: install openrlhf==0.11.2")
    source = Path(spec.origin).read_text()
    guard = next(node for node in ast.parse(source).body if _is_main_guard(node))
    statements = []
    for node in guard.body:
        if _is_parse_args(node):
            break
        statements.append(node)
    else:
        raise RuntimeError(
            f"no 'args = parser.parse_args()' in {spec.origin}: unsupported OpenRLHF"
        )
    namespace = {"argparse": argparse, "os": os, "datetime": datetime}
    code = compile(ast.Module(body=statements, type_ignores=[]), spec.origin, "exec")
    exec(code, namespace)  # only argparse calls: the statements before parse_args()
    return namespace["parser"]
