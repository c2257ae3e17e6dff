"""Helpers of ``scripts/install_gpu.sh``: which flash-attn to install, whether torch has CUDA,
and the final import check of every component.

``python scripts/gpu_install.py flash-attn``  prints ``wheel URL`` (a prebuilt release wheel
    matches this torch/CUDA/Python/C++-ABI) or ``source`` (build it: 25-60 min).
``python scripts/gpu_install.py torch-cuda``  exits 1 with the reason when torch cannot use CUDA.
``python scripts/gpu_install.py check``       prints each component's version or why it is
    missing; exits 1 when any is missing.

Plain standard library at import time: it runs before anything else is installed.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

FLASH_ATTN = "2.8.3"
RELEASES = "https://github.com/Dao-AILab/flash-attention/releases/download"


@dataclass(frozen=True)
class Build:
    """What a flash-attn wheel must match: torch's version and the CUDA it was built with
    (not the system's), the Python and the C++ ABI torch was compiled with."""

    torch: str  # torch.__version__, e.g. "2.8.0+cu128"
    cuda: str  # torch.version.cuda, e.g. "12.8"
    python: tuple[int, int]
    cxx11_abi: bool
    platform: str = "linux_x86_64"


def wheel_name(build: Build, version: str = FLASH_ATTN) -> str:
    """The file name flash-attention's release workflow gives its wheel for ``build``: CUDA by
    major version only (one build per major), torch by major.minor, e.g.
    ``flash_attn-2.8.3+cu12torch2.8cxx11abiTRUE-cp311-cp311-linux_x86_64.whl``."""
    torch_mm = ".".join(build.torch.split("+")[0].split(".")[:2])
    cuda_major = build.cuda.split(".")[0]
    py = f"cp{build.python[0]}{build.python[1]}"
    abi = "TRUE" if build.cxx11_abi else "FALSE"
    local = f"cu{cuda_major}torch{torch_mm}cxx11abi{abi}"
    return f"flash_attn-{version}+{local}-{py}-{py}-{build.platform}.whl"


def wheel_url(build: Build, version: str = FLASH_ATTN) -> str:
    return f"{RELEASES}/v{version}/{wheel_name(build, version)}"


def url_exists(url: str, timeout: float = 20.0) -> bool:
    """Whether ``url`` answers a HEAD request (GitHub redirects release assets; urllib
    follows). No network counts as no wheel: the source build needs none from GitHub."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout):
            return True
    except (urllib.error.URLError, TimeoutError, OSError):
        return False


def flash_attn_choice(build: Build, exists: Callable[[str], bool] = url_exists) -> str:
    """``wheel URL`` when the release has a wheel for ``build``, else ``source``."""
    url = wheel_url(build)
    return f"wheel {url}" if exists(url) else "source"


def current_build() -> Build:
    import torch

    if torch.version.cuda is None:
        raise SystemExit(f"torch {torch.__version__} is not a CUDA build: no flash-attn for it")
    return Build(
        torch=torch.__version__,
        cuda=torch.version.cuda,
        python=sys.version_info[:2],
        cxx11_abi=bool(torch._C._GLIBCXX_USE_CXX11_ABI),
    )


def torch_cuda_problem() -> str | None:
    """Why torch cannot run on this node's GPUs, or None."""
    import torch

    if torch.version.cuda is None:
        return (
            f"torch {torch.__version__} is a CPU-only build: install the CUDA build "
            "(TORCH_INDEX_URL=https://download.pytorch.org/whl/cuXYZ to pick one)"
        )
    if not torch.cuda.is_available():
        return (
            f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU: the driver is "
            "missing or older than this CUDA needs (compare nvidia-smi's 'CUDA Version')"
        )
    return None


def _version(module: str, dist: str | None = None) -> Callable[[], str]:
    """Import ``module`` (it must load, not merely be installed), then its distribution's
    version: a stand-in module on the path (the CPU tests' flash_attn) has none."""

    def probe() -> str:
        importlib.import_module(module)
        return importlib.metadata.version(dist or module)

    return probe


def _torch_cuda() -> str:
    import torch

    problem = torch_cuda_problem()
    if problem:
        raise RuntimeError(problem)
    return (
        f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} x {torch.cuda.get_device_name()}"
    )


def _ring_flash_attn() -> str:
    """Ring attention (``--ds.ring_attn_size``) as OpenRLHF imports it: after its patch, without
    which ring-flash-attn 0.1.8 cannot import under transformers 5.15."""
    from openrlhf.models.ring_attn_utils import patch_transformers_for_ring_flash_attn

    patch_transformers_for_ring_flash_attn()
    return _version("ring_flash_attn", "ring-flash-attn")()


def _fused_adam() -> str:
    """DeepSpeed's FusedAdam op: loads the prebuilt op or JIT-compiles it (minutes, once per
    cache directory), as its first optimizer step would."""
    from deepspeed.ops.op_builder import FusedAdamBuilder

    builder = FusedAdamBuilder()
    if not builder.is_compatible(verbose=False):
        raise RuntimeError("FusedAdamBuilder is not compatible with this machine")
    builder.load(verbose=False)
    return "loaded"


COMPONENTS: list[tuple[str, Callable[[], str]]] = [
    ("torch", _version("torch")),
    ("torch CUDA", _torch_cuda),
    ("flash_attn", _version("flash_attn", "flash-attn")),
    ("ring_flash_attn", _ring_flash_attn),
    ("vllm", _version("vllm")),
    ("deepspeed", _version("deepspeed")),
    ("deepspeed FusedAdam", _fused_adam),
    ("ray", _version("ray")),
    ("transformers", _version("transformers")),
    ("openrlhf", _version("openrlhf")),
    ("math_verify", _version("math_verify", "math-verify")),
    ("drpo_openrlhf", _version("drpo_openrlhf")),
]


def check(components: list[tuple[str, Callable[[], str]]] | None = None) -> list[str]:
    """Print ``ok NAME: VERSION`` or ``MISSING NAME: why`` per component (``COMPONENTS`` by
    default); returns the missing names. Every probe runs even after a failure, so one run
    lists everything to fix."""
    missing = []
    for name, probe in COMPONENTS if components is None else components:
        try:
            print(f"ok      {name}: {probe()}", flush=True)
        except Exception as error:  # an import or build failure of any kind is the report
            missing.append(name)
            print(f"MISSING {name}: {type(error).__name__}: {error}", flush=True)
    return missing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["flash-attn", "torch-cuda", "check"])
    command = parser.parse_args(argv).command
    if command == "flash-attn":
        print(flash_attn_choice(current_build()))
        return 0
    if command == "torch-cuda":
        problem = torch_cuda_problem()
        print(problem or "torch CUDA ok", file=sys.stderr if problem else sys.stdout)
        return 1 if problem else 0
    missing = check()
    if missing:
        print(f"missing: {', '.join(missing)}", file=sys.stderr)
        return 1
    print("all components present")
    return 0


if __name__ == "__main__":
    sys.exit(main())
