"""Make the ``flash_attn`` stand-in (``tests/cpu_site``) importable where the real package
is missing: in this process, and through ``PYTHONPATH`` in the processes it starts.

``make venv`` already puts ``tests/cpu_site`` on the CPU environment's path (a ``.pth``
file); this covers a test run from another environment. vLLM is the real CPU build.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
from pathlib import Path

CPU_SITE = str(Path(__file__).resolve().parent / "cpu_site")


def install_stand_ins() -> None:
    """Put ``tests/cpu_site`` on the path only where ``flash_attn`` cannot be found."""
    if importlib.util.find_spec("flash_attn") is not None:
        return
    sys.path.append(CPU_SITE)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join([*paths, CPU_SITE])


def flash_attn_is_stand_in() -> bool:
    """Whether ``flash_attn`` is a stand-in (importable, but no flash-attn distribution is
    installed): the CPU ring-attention tests run on its kernels (the real ones need CUDA
    tensors)."""
    if importlib.util.find_spec("flash_attn") is None:
        return False
    try:
        importlib.metadata.version("flash-attn")
    except importlib.metadata.PackageNotFoundError:
        return True
    return False
