"""Names a torch extension build lock that a start is waiting on.

torch builds a C++ op on first use (DeepSpeed's ``shm_comm`` on CPU, its FusedAdam on a GPU
without prebuilt ops) under a ``lock`` file in the op's build directory, and a process that
finds the file waits until it goes (``torch.utils.file_baton.FileBaton.wait``), without a
word and without a limit. A build killed mid-way leaves the file, so every later start
stalls silently. The watch below runs beside an actor's start and, once that start has
taken ``after_s``, names every lock it finds there, with what to do.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from types import TracebackType

logger = logging.getLogger(__name__)

AFTER_S = 60.0
"""How long a start runs before the watch looks for locks: DeepSpeed's ``shm_comm`` build
took 25-50 s of a 2-core CPU (docs/cpu.md), so a lock seen later is a long build or a
dead one; the message says both."""


def extension_root() -> Path:
    """Where torch builds its extensions: ``$TORCH_EXTENSIONS_DIR`` as torch reads it, else
    torch's per-user cache (whose per-Python/CUDA subfolders the scan below enters)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root)
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root())


def held_locks(root: Path) -> list[Path]:
    """The ``lock`` files of the op build directories under ``root`` (an op's folder sits
    directly under ``root`` when ``$TORCH_EXTENSIONS_DIR`` names it, one level down in
    torch's default cache)."""
    return sorted({*root.glob("*/lock"), *root.glob("*/*/lock")})


def lock_message(lock: Path, waited_s: float) -> str:
    try:
        age = f"{time.time() - lock.stat().st_mtime:.0f} s old"
    except OSError:
        age = "just released"
    return (
        f"this start has taken {waited_s:.0f} s and torch's extension build lock {lock} "
        f"exists ({age}): torch waits, without a limit, until it goes. Either a build of "
        f"that op is running (a ninja or compiler process), or one was killed mid-way and "
        f"left it; then remove the file, and the next start builds the op again"
    )


class BuildLockWatch:
    """Context manager: a daemon thread that, ``after_s`` into the block, then every
    ``every_s`` until it ends, names each lock it has not named yet (a warning: a Ray
    actor's stderr reaches the driver's console)."""

    def __init__(self, after_s: float = AFTER_S, every_s: float = 10.0) -> None:
        self.after_s, self.every_s = after_s, every_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="build-lock-watch", daemon=True)
        self.named: list[Path] = []

    def __enter__(self) -> BuildLockWatch:
        self._start = time.monotonic()
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._done.set()
        self._thread.join()

    def _watch(self) -> None:
        if self._done.wait(self.after_s):
            return
        root = extension_root()
        while not self._done.is_set():
            for lock in held_locks(root):
                if lock not in self.named:
                    self.named.append(lock)
                    logger.warning(lock_message(lock, time.monotonic() - self._start))
            self._done.wait(self.every_s)
