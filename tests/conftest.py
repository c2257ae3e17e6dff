"""Shared test set-up: offline, deterministic, no torch.compile."""

import functools
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import settings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray runs its workers at nice 15; the tests' clusters run them at the priority of the test
# that started them, so that the pipeline's runs keep the CPU from the unit tests' worker
# (nice 19) under ``make test``'s two workers (PIPELINE_MODULES below)
os.environ.setdefault("RAY_worker_niceness", "0")
# The venv's ninja first on the PATH of every process the tests start, as under the Slurm
# tests' jobs: torch's extension cache has one build of DeepSpeed's shm_comm op, and ninja
# 1.13 (the venv's) and an older system ninja hash its commands differently, so each switch
# between the two recompiled it (25-50 s of both cores inside a pipeline run; issue 36)
os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])

import time_bounds
import toy_base
from drpo_actor_harness import FIXTURE as SHARED_RANKS_FIXTURE
from drpo_actor_harness import SHARED_RANKS_MODULES
from stand_ins import install_stand_ins

install_stand_ins()
# no per-example time limit: under ``make test``'s two workers the unit tests run at a low
# priority beside the pipeline's, and a starved example is slow, not wrong
settings.register_profile("suite", deadline=None)
settings.load_profile("suite")


def pytest_configure(config: pytest.Config) -> None:
    """The time scale of this process's bounds (``tests/time_bounds.py``), measured before
    any test loads the machine."""
    time_bounds.calibration()


def pytest_report_header(config: pytest.Config) -> str:
    return f"time bounds: {time_bounds.calibration().describe()}"


# ``make test`` runs two pytest workers (``-n 2 --dist loadscope``, scheduled by the groups
# below): the modules that start the real pipeline run one after another on one worker, first;
# the Slurm modules start at once on the other worker, at the same priority, whose jobs spend
# much of their time waiting (Ray's head starting, submissions, polls); then every other
# module runs whole (its module fixtures once) on whichever worker is free, at a lower
# priority. Two pipeline runs side by side gain almost nothing on two cores (each is CPU-bound
# in its start-up, and two need about 14 of the machine's 24 GB), while unit tests can use
# what a run's waits leave (docs/cpu.md, "The test environment").
PIPELINE_MODULES = frozenset(
    {  # every module with a test marked e2e or a local Ray cluster (both checked at
        # collection) but the Slurm ones
        "test_e2e_pipeline.py",
        "test_e2e_async.py",
        "test_e2e_interrupt.py",
        "test_e2e_positive_reward.py",
        "test_e2e_real_model.py",
        "test_faults.py",
        "test_smoke_gpu.py",
        "test_sweep_e2e.py",
        "test_weight_places_guard.py",
        "test_weight_sync_guard.py",
        "test_ray_actors.py",
        "test_device_mode.py",
    }
)
SLURM_MODULES = frozenset({"test_slurm_recipes.py", "test_sweep_slurm.py"})  # one cluster at a time
# the modules whose timing bounds need the CPU share of a normal priority
NORMAL_PRIORITY_MODULES = PIPELINE_MODULES | SLURM_MODULES
PIPELINE_GROUP, SLURM_GROUP = "pipeline", "slurm"
RAY_CLUSTER_FIXTURE = "fake_gpu_ray"
# The niceness of the worker beside the pipeline's. A nice-19 process gets about 1.5% of a
# CPU that a nice-0 process also wants: beside two busy loops (issue 36's flake check) that
# worker had 20 CPU-s in its first 260 s, too little to finish in hours.
# DRPO_TEST_UNIT_NICENESS=0 runs it at normal priority on a machine with other load.
UNIT_NICENESS = int(os.environ.get("DRPO_TEST_UNIT_NICENESS", "19"))


def xdist_group(path: str) -> str:
    """The group of a test module (its path in a node id): the pipeline's, the exactness
    modules' (one spawn of ranks serves them all: ``drpo_actor_harness``) or its own."""
    name = Path(path).name
    if name in PIPELINE_MODULES:
        return PIPELINE_GROUP
    if name in SLURM_MODULES:
        return SLURM_GROUP
    if name in SHARED_RANKS_MODULES:
        return SHARED_RANKS_FIXTURE
    return path


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadscope`` by ``xdist_group`` (pytest-xdist's own ``loadgroup`` does not
    group under pytest 9, whose node ids ignore the suffix it adds)."""
    if config.getoption("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # by size, it would put unit modules first

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(nodeid.split("::", 1)[0])

    return GroupScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every pipeline test is in a pipeline module and every user of the shared ranks in an
    exactness module (so that two workers never start both); in a worker, the pipeline's
    and the Slurm modules come first (``_start_order``)."""
    for item in items:
        name = item.path.name
        if item.get_closest_marker("e2e") and name not in NORMAL_PRIORITY_MODULES:
            raise pytest.UsageError(f"{name} runs the pipeline: add it to PIPELINE_MODULES")
        if name not in NORMAL_PRIORITY_MODULES and _starts_ray(item):
            # Ray gives a new node 30 s to register (a constant in ray/_private/node.py); at
            # nice 19 beside a pipeline run its GCS and raylet took longer (a CI failure)
            raise pytest.UsageError(f"{name} starts a Ray cluster: add it to PIPELINE_MODULES")
        if SHARED_RANKS_FIXTURE in item.fixturenames and name not in SHARED_RANKS_MODULES:
            raise pytest.UsageError(f"{name} shares the ranks: add it to SHARED_RANKS_MODULES")
    _scale_timeouts(config, items)
    if hasattr(config, "workerinput"):
        items.sort(key=_start_order)  # stable


def _scale_timeouts(config: pytest.Config, items: list[pytest.Item]) -> None:
    """pytest-timeout's limit of each test (pyproject.toml's, or a module's mark) stretched by
    the time scale, as the bounds inside the tests are; one given by ``--timeout`` or
    ``PYTEST_TIMEOUT`` is the user's, and kept."""
    if config.getoption("timeout", None) is not None or os.environ.get("PYTEST_TIMEOUT"):
        return
    default = float(config.getini("timeout") or 0)
    for item in items:
        marker = item.get_closest_marker("timeout")
        args, kwargs = (marker.args, dict(marker.kwargs)) if marker else ((), {})
        seconds = float(kwargs.pop("timeout", args[0] if args else default))
        if seconds > 0:
            mark = pytest.mark.timeout(time_bounds.scaled(seconds), *args[1:], **kwargs)
            item.add_marker(mark, append=False)  # the closest: pytest-timeout reads it


def _start_order(item: pytest.Item) -> int:
    """The pipeline's group first and the Slurm group second in the collection, hence in the
    scheduler's queue (``loadscopereorder`` off): the two workers start with one each."""
    name = item.path.name
    return 0 if name in PIPELINE_MODULES else 1 if name in SLURM_MODULES else 2


def _starts_ray(item: pytest.Item) -> bool:
    """Whether a test uses a module's Ray cluster or its module calls ``ray.init`` itself."""
    clusters = {RAY_CLUSTER_FIXTURE, "ray_address"}
    return bool(clusters & set(item.fixturenames)) or _calls_ray_init(item.path)


@functools.cache
def _calls_ray_init(path: Path) -> bool:
    return "ray.init(" in path.read_text()


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A worker yields the CPU to the pipeline's and the Slurm tests' processes once it runs
    unit tests: their runs are the suite's critical path (a worker never returns to those
    groups, which come first); the processes its tests start inherit that."""
    if not hasattr(item.config, "workerinput") or item.path.name in NORMAL_PRIORITY_MODULES:
        return
    if os.getpriority(os.PRIO_PROCESS, 0) < UNIT_NICENESS:
        os.setpriority(os.PRIO_PROCESS, 0, UNIT_NICENESS)


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
    from drpo_openrlhf.demo.config import DemoConfig, make_problems
    from drpo_openrlhf.demo.toy_task import write_jsonl

    train_problems, eval_problems = make_problems(DemoConfig.quick())
    return {
        "base": Path(shutil.copytree(toy_base.FIXTURES / architecture, root / "base")),
        "train": write_jsonl(train_problems, root / "train.jsonl"),
        "eval": write_jsonl(eval_problems[:16], root / "eval.jsonl"),
    }


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    """A local Ray cluster with three fake GPUs for a module's pipeline runs to join, as the
    demo starts one (a module with its own breakages in its workers overrides it)."""
    from drpo_openrlhf.demo.training import local_ray_cluster

    with local_ray_cluster(num_gpus=3) as address:
        yield address


@pytest.fixture(scope="module")
def fake_gpu_ray() -> Iterator[str]:
    """A local Ray cluster advertising two GPUs on this GPU-less machine, as the tests, the
    demo and the Slurm fixture start them, with this process as its driver; yields its
    address. Its workers import OpenRLHF, hence vLLM and flash-attn: stand-ins on CPU."""
    import ray

    pythonpath = os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
    context = ray.init(
        address="local",  # a new cluster, never one a Ray address file on this machine names
        num_cpus=2,
        num_gpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={
            "worker_process_setup_hook": "stand_ins.install_stand_ins",
            "env_vars": {"PYTHONPATH": pythonpath, "TORCHDYNAMO_DISABLE": "1"},
        },
    )
    try:
        yield context.address_info["address"]
    finally:
        ray.shutdown()


@pytest.fixture(scope="session")
def toy(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The toy task on a Qwen2 policy, for the tests that run the real pipeline."""
    return _toy(tmp_path_factory.mktemp("toy"), "qwen2")


@pytest.fixture(scope="session")
def toy_llama(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same on a Llama policy with DeepSeek-R1-Distill-Llama's chat format (the 8B
    recipe's architecture; ``drpo_openrlhf/models/tiny.py``)."""
    return _toy(tmp_path_factory.mktemp("toy-llama"), "llama")


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct, the real pretrained model (``drpo_openrlhf/models/smollm2.py``): the
    per-machine cached build, which ``make test`` makes before the tests; built here (about
    20-60 s) if missing."""
    from drpo_openrlhf.models.smollm2 import build

    return build()
