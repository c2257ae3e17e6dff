"""The build-lock watch: a torch extension build killed mid-way leaves a lock on which every
later DeepSpeed start waits forever; the watch names it within its bound, and only then."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from drpo_openrlhf.runtime import build_lock
from drpo_openrlhf.runtime.build_lock import BuildLockWatch, held_locks

WATCH_S = 0.2


def plant(root: Path, *parts: str) -> Path:
    lock = root.joinpath(*parts, "lock")
    lock.parent.mkdir(parents=True)
    lock.touch()
    return lock


def test_locks_are_found_where_torch_puts_them(tmp_path):
    """Directly under ``$TORCH_EXTENSIONS_DIR``, or one level down in torch's own cache
    (``py311_cpu/<op>``); an op's other files are not locks."""
    flat = plant(tmp_path, "deepspeed_shm_comm")
    nested = plant(tmp_path, "py311_cpu", "fused_adam")
    (tmp_path / "py311_cpu" / "fused_adam" / "build.ninja").touch()
    assert held_locks(tmp_path) == sorted([flat, nested])
    assert held_locks(tmp_path / "missing") == []


def test_the_root_is_torchs(monkeypatch, tmp_path):
    from torch.utils.cpp_extension import get_default_build_root

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert build_lock.extension_root() == tmp_path
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    assert build_lock.extension_root() == Path(get_default_build_root())


def watched(caplog, after_s: float, seconds: float, until_named: bool = False) -> list[str]:
    """The watch's messages over a block of ``seconds`` (or, ``until_named``, until it has
    named a lock, then three more scans: on a loaded machine its thread may start late)."""
    with (
        caplog.at_level(logging.WARNING, logger=build_lock.__name__),
        BuildLockWatch(after_s=after_s, every_s=0.02) as watch,
    ):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not (until_named and watch.named):
            time.sleep(0.01)
        time.sleep(0.06 if until_named else 0)
    return [r.getMessage() for r in caplog.records if r.name == build_lock.__name__]


def test_a_lock_is_named_once_after_the_bound(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = plant(tmp_path, "deepspeed_shm_comm")
    (message,) = watched(caplog, WATCH_S, seconds=60, until_named=True)
    assert str(lock) in message and "remove the file" in message and "s old" in message


def test_nothing_is_said_before_the_bound_or_without_a_lock(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert watched(caplog, WATCH_S, seconds=WATCH_S + 0.3) == []  # no lock
    plant(tmp_path, "deepspeed_shm_comm")
    caplog.clear()
    assert watched(caplog, 60, seconds=0.05) == []  # a start quicker than the bound
    assert not [t for t in threading.enumerate() if t.name == "build-lock-watch"]


def test_the_actors_start_under_the_watch(monkeypatch):
    """Both policy actors run OpenRLHF's start (where DeepSpeed builds its ops) inside the
    watch: the parent's start, replaced, sees the watch's thread."""
    from openrlhf.trainer.ray import ppo_actor

    from drpo_openrlhf.runtime import policy_actors
    from drpo_openrlhf.sync import engine_start

    class Seen(Exception):
        pass

    def parent_start(self, strategy, *args, **kwargs):
        raise Seen([t.name for t in threading.enumerate()])

    monkeypatch.setattr(
        ppo_actor.PolicyModelActor.__ray_actor_class__, "init_model_from_pretrained", parent_start
    )
    monkeypatch.setattr(engine_start, "install", lambda: None)
    for actor in (policy_actors._DRPOPolicyModelActor, policy_actors._BaselinePolicyModelActor):
        with pytest.raises(Seen) as seen:
            actor.init_model_from_pretrained(object.__new__(actor), None)
        assert "build-lock-watch" in seen.value.args[0]


KILLED_BUILD_BOUND_S = 120.0
"""How long the real DeepSpeed start below may take to name the lock: the watch's 1 s and
the imports of torch and DeepSpeed (about 5-10 s on a 2-core CPU), with a margin for a
loaded machine."""


def test_a_killed_deepspeed_build_then_a_start_names_its_lock(tmp_path):
    """The real failure: DeepSpeed's shm_comm build is killed once it holds its lock, and a
    second build of the same op then stalls on it (torch waits without a limit) and the
    watch names the lock."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    build = "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
    first = subprocess.Popen([sys.executable, "-c", build], env=env, start_new_session=True)
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    deadline = time.monotonic() + KILLED_BUILD_BOUND_S
    while not lock.exists() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    assert lock.exists(), "the first build never took its lock"

    watched = "\n".join(
        [
            "from drpo_openrlhf.runtime.build_lock import BuildLockWatch",
            "with BuildLockWatch(after_s=1):",
            f"    {build}",
        ]
    )
    second = subprocess.Popen(
        [sys.executable, "-c", watched],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(second.stderr), daemon=True)
    reader.start()
    start = time.monotonic()
    try:
        while not any(str(lock) in line for line in lines) and second.poll() is None:
            assert time.monotonic() - start < KILLED_BUILD_BOUND_S, "".join(lines)[-3000:]
            time.sleep(0.1)
        assert second.poll() is None, "".join(lines)[-3000:]  # stalled on the lock, not done
    finally:
        os.killpg(second.pid, signal.SIGKILL)
        second.wait()
    named = next(line for line in lines if str(lock) in line)
    assert "remove the file" in named
