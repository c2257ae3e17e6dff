"""Every module of the package and every script imports from a copy of the tree that has no
``tests/``: nothing the product ships reaches into the tests (their set-up lives in
``drpo_openrlhf.testing``), and no script puts ``tests/`` on ``sys.path``. Each module is
imported in a fresh process from the copy (``__main__`` modules, which would run, only have
their imports resolved; scripts are loaded under another name, so their ``main`` does not run).
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from time_bounds import scaled

REPO = Path(__file__).resolve().parents[1]

# Run in the copy: imports each target, and reports what failed and any module loaded from
# outside the copy that belongs to the checkout (the venv's flash-attn stand-in aside).
CHECK = r"""
import ast, importlib, importlib.util, json, sys, traceback
from pathlib import Path

root, repo, targets = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
failures = {}

def resolve(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            module = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(module, alias.name):
                    importlib.import_module(f"{node.module}.{alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                importlib.import_module(alias.name)

for target in targets:
    try:
        if target.endswith(".py"):
            path = root / target
            spec = importlib.util.spec_from_file_location("script_" + path.stem, path)
            module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        elif target.endswith(".__main__"):
            resolve(root / (target.replace(".", "/") + ".py"))
        else:
            importlib.import_module(target)
    except BaseException:
        failures[target] = traceback.format_exc(limit=-3)

stand_in = repo / "tests" / "cpu_site"
for name, module in sorted(sys.modules.items()):
    file = getattr(module, "__file__", None)
    if not file:
        continue
    file = Path(file).resolve()
    own = name == "drpo_openrlhf" or name.startswith("drpo_openrlhf.")
    if own and not file.is_relative_to(root):
        failures[name] = f"loaded from {file}, not from the copy"
    elif file.is_relative_to(repo / "tests") and not file.is_relative_to(stand_in):
        failures[name] = f"loaded from the checkout's tests: {file}"
print(json.dumps(failures))
"""


def tree_copy(root: Path) -> Path:
    """The package and the scripts under ``root``, and nothing else of the checkout."""
    ignore = shutil.ignore_patterns("__pycache__", "bases")
    shutil.copytree(REPO / "drpo_openrlhf", root / "drpo_openrlhf", ignore=ignore)
    shutil.copytree(REPO / "scripts", root / "scripts", ignore=ignore)
    return root


def all_targets(root: Path) -> list[str]:
    """Every package module by dotted name, and every script by its path."""
    modules = []
    for path in sorted((root / "drpo_openrlhf").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        modules.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    scripts = [str(p.relative_to(root)) for p in sorted((root / "scripts").glob("*.py"))]
    return modules + scripts


def import_failures(root: Path, targets: list[str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(root)
    done = subprocess.run(
        [sys.executable, "-c", CHECK, str(root), str(REPO), *targets],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(600),  # a hang guard: every module in 19 s (2 cores at load 3-6)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def sys_path_edits_naming_tests(root: Path) -> list[str]:
    """``sys.path`` edits in the package or the scripts that name the tests' directory."""
    found = []
    for path in sorted([*(root / "drpo_openrlhf").rglob("*.py"), *(root / "scripts").glob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            call = node.func if isinstance(node, ast.Call) else None
            edits_path = (
                isinstance(call, ast.Attribute)
                and call.attr in ("insert", "append", "extend")
                and ast.unparse(call.value) == "sys.path"
            )
            if edits_path and "tests" in ast.unparse(node):
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


@pytest.mark.slow
def test_every_module_and_script_imports_without_the_tests(tmp_path: Path) -> None:
    root = tree_copy(tmp_path)
    targets = all_targets(root)
    assert "drpo_openrlhf.testing" in targets and "scripts/bench_actor_update.py" in targets
    assert import_failures(root, targets) == {}
    assert sys_path_edits_naming_tests(root) == []


def test_a_module_that_imports_a_tests_helper_is_reported(tmp_path: Path) -> None:
    root = tree_copy(tmp_path)
    module = root / "drpo_openrlhf" / "algo" / "groups.py"
    module.write_text(module.read_text() + "\nimport stand_ins\n")
    failures = import_failures(root, ["drpo_openrlhf.algo.groups", "drpo_openrlhf.demo.toy_task"])
    assert list(failures) == ["drpo_openrlhf.algo.groups"]
    assert "No module named 'stand_ins'" in failures["drpo_openrlhf.algo.groups"]


def test_a_module_loaded_from_the_checkout_is_reported(tmp_path: Path) -> None:
    root = tree_copy(tmp_path)
    script = root / "scripts" / "gpu_install.py"
    source = script.read_text()
    script.write_text(
        f"{source}\nimport sys\nsys.path.insert(0, {str(REPO / 'tests')!r})\nimport stand_ins\n"
    )
    failures = import_failures(root, ["scripts/gpu_install.py"])
    assert list(failures) == ["stand_ins"]
    assert "loaded from the checkout's tests" in failures["stand_ins"]
    edit = len(source.splitlines()) + 3
    assert sys_path_edits_naming_tests(root) == [f"scripts/gpu_install.py:{edit}"]
