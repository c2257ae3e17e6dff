"""Helpers of ``scripts/install_gpu.sh``: the node's CUDA checked before anything is built,
the flash-attn build sized for the job, and the import check of every component.

``python scripts/gpu_install.py preflight``   the driver, the GPUs and nvcc against the CUDA
    major of the pinned GPU set; exits 1 naming what to load or install when they disagree.
``python scripts/gpu_install.py build-env``   ``KEY=VALUE`` lines for the flash-attn build:
    CUDA_HOME (the nvcc checked), MAX_JOBS (the job's CPUs and memory), FLASH_ATTN_CUDA_ARCHS
    (the GPUs present); a value already in the environment is kept.
``python scripts/gpu_install.py flash-attn``  prints ``wheel URL`` (a prebuilt release wheel
    matches this torch/CUDA/Python/C++-ABI) or ``source`` (build it).
``python scripts/gpu_install.py resolve REQUIREMENTS PINS``  pip's resolution of the whole set
    against the pins (``--dry-run --report``, nothing installed); exits 1 naming pip's
    conflict; notes a companion of torch that vLLM pins for another torch.
``python scripts/gpu_install.py torch-cuda``  exits 1 with the reason when torch cannot use CUDA
    or is another CUDA major than nvcc and vLLM.
``python scripts/gpu_install.py vllm-cuda``   exits 1 with the reason when vLLM's CUDA kernels
    do not load or compute wrong on this GPU.
``python scripts/gpu_install.py check``       prints each component's version or why it is
    missing; exits 1 when any is missing.

Plain standard library at import time: it runs before anything else is installed.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

FLASH_ATTN = "2.8.3"
RELEASES = "https://github.com/Dao-AILab/flash-attention/releases/download"
# The CUDA major of the pinned GPU set: PyPI's torch 2.13.0 requires cuda-toolkit 13.0.3 and
# nvidia-*-cu13, and vLLM 0.29.0's only x86_64 wheel links libcudart.so.13
# (tests/test_install_gpu.py reads both from the index). flash-attn is built here, so its nvcc
# must be this major too: torch's BuildExtension refuses another one.
CUDA_MAJOR = 13
PINNED = "torch 2.13.0 and vLLM 0.29.0 from PyPI"
# The oldest driver branch per CUDA major (NVIDIA's minor-version compatibility table).
MIN_DRIVER = {13: 580}
# flash-attn 2.8.3's setup.py builds sm_80/90/100/120 kernels (FLASH_ATTN_CUDA_ARCHS); a
# cubin runs on the GPUs of its major with an equal or higher minor (8.6 and 8.9 run sm_80).
FLASH_ATTN_ARCHS = {8: "80", 9: "90", 10: "100", 12: "120"}
# flash-attn's setup.py: "each JOB peak memory cost is ~8-9GB when threads = 4"; it divides the
# free memory by 9 GiB and halves the CPU count.
GIB_PER_COMPILE_JOB = 9
LOAD_CUDA = (
    f"load a CUDA {CUDA_MAJOR} toolkit (e.g. `module load cuda/{CUDA_MAJOR}.0`; `module avail "
    "cuda` lists yours) or set CUDA_HOME to one, then rerun"
)


class Stop(Exception):
    """A reason to stop the install before it builds anything, naming what to do."""


# ------------------------------------------------------------------------- the node's CUDA
@dataclass(frozen=True)
class Gpu:
    name: str
    driver: str  # e.g. "580.65.06"
    compute_cap: str  # e.g. "9.0"


def parse_gpus(csv: str) -> list[Gpu]:
    """``nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader``."""
    gpus = []
    for line in csv.strip().splitlines():
        name, driver, cap = (field.strip() for field in line.rsplit(",", 2))
        gpus.append(Gpu(name, driver, cap))
    return gpus


def driver_problem(driver: str, cuda_major: int = CUDA_MAJOR) -> str | None:
    """Why this driver cannot run CUDA ``cuda_major`` builds, or None."""
    need = MIN_DRIVER[cuda_major]
    if int(driver.split(".")[0]) >= need:
        return None
    return (
        f"NVIDIA driver {driver} is older than {need}, the oldest that runs CUDA {cuda_major}: "
        f"{PINNED} are CUDA {cuda_major} builds. Use a node with driver >= {need} (ask the "
        "admins; data-center GPUs can also use NVIDIA's forward-compatibility package, "
        f"cuda-compat-{cuda_major}-x)"
    )


def flash_attn_archs(caps: list[str]) -> str:
    """``FLASH_ATTN_CUDA_ARCHS`` for the GPUs of these compute capabilities (only their
    kernels are compiled); ValueError for a GPU flash-attn 2 cannot run on."""
    archs = set()
    for cap in caps:
        arch = FLASH_ATTN_ARCHS.get(int(cap.split(".")[0]))
        if arch is None:
            raise ValueError(
                f"compute capability {cap}: flash-attn {FLASH_ATTN} has kernels for 8.x, 9.x, "
                "10.x and 12.x only (Ampere or newer)"
            )
        archs.add(arch)
    return ";".join(sorted(archs, key=int))


def find_nvcc(env: Mapping[str, str]) -> str | None:
    """The nvcc a build will use, found as torch's cpp_extension finds CUDA_HOME: NVCC (this
    script's override), else CUDA_HOME or CUDA_PATH, else nvcc on PATH, else /usr/local/cuda."""
    if env.get("NVCC"):
        return shutil.which(env["NVCC"])
    home = env.get("CUDA_HOME") or env.get("CUDA_PATH")
    if home:
        return shutil.which(str(Path(home) / "bin" / "nvcc"))
    return shutil.which("nvcc", path=env.get("PATH")) or shutil.which("/usr/local/cuda/bin/nvcc")


def nvcc_release(nvcc: str) -> tuple[int, int]:
    """(major, minor) from ``nvcc --version``'s ``release X.Y`` (what torch parses)."""
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    found = re.search(r"release (\d+)\.(\d+)", out)
    if found is None:
        raise Stop(f"'{nvcc} --version' names no release: {out.strip()}")
    return int(found.group(1)), int(found.group(2))


def nvcc_problem(release: tuple[int, int], cuda_major: int = CUDA_MAJOR) -> str | None:
    if release[0] == cuda_major:
        return None
    return (
        f"nvcc is CUDA {release[0]}.{release[1]}, but {PINNED} are CUDA {cuda_major} builds "
        f"and torch refuses to build flash-attn with another nvcc major: {LOAD_CUDA}"
    )


def query_gpus(env: Mapping[str, str]) -> list[Gpu]:
    smi = env.get("NVIDIA_SMI", "nvidia-smi")
    if shutil.which(smi, path=env.get("PATH")) is None:
        raise Stop(
            f"no NVIDIA driver: '{smi}' not found. Run this on a GPU node (e.g. inside "
            "srun --gres=gpu:1) with the driver installed."
        )
    query = [smi, "--query-gpu=name,driver_version,compute_cap", "--format=csv,noheader"]
    done = subprocess.run(query, capture_output=True, text=True)
    output = (done.stdout + done.stderr).strip()
    if done.returncode != 0:
        raise Stop(
            "nvidia-smi failed: the driver sees no GPU, or is too old to report compute_cap "
            f"(CUDA {CUDA_MAJOR} needs >= {MIN_DRIVER[CUDA_MAJOR]}): {output}"
        )
    if not output:
        raise Stop("nvidia-smi lists no GPU on this node")
    return parse_gpus(done.stdout)


def preflight(env: Mapping[str, str], say: Callable[[str], None]) -> None:
    """Say what this node offers, one line each; Stop at the first thing that would fail
    later (the lines said before it show what was found)."""
    gpus = query_gpus(env)
    names = sorted({f"{g.name} (compute capability {g.compute_cap})" for g in gpus})
    say(f"GPUs: {len(gpus)}: {'; '.join(names)}, driver {gpus[0].driver}")
    for gpu in gpus:
        problem = driver_problem(gpu.driver)
        if problem:
            raise Stop(problem)
    try:
        archs = flash_attn_archs([g.compute_cap for g in gpus])
    except ValueError as error:
        raise Stop(f"{error}: this node's GPUs cannot run the training stack") from None
    say(f"driver >= {MIN_DRIVER[CUDA_MAJOR]}: runs CUDA {CUDA_MAJOR} ({PINNED})")
    nvcc = find_nvcc(env)
    if nvcc is None:
        where = env.get("NVCC") or "nvcc (CUDA_HOME, CUDA_PATH, PATH, /usr/local/cuda)"
        raise Stop(
            f"no CUDA toolkit: '{where}' not found (DeepSpeed's FusedAdam, and flash-attn when "
            f"no wheel matches, compile with it): {LOAD_CUDA}."
        )
    release = nvcc_release(nvcc)
    problem = nvcc_problem(release)
    if problem:
        raise Stop(f"{problem} ({nvcc})")
    say(f"nvcc {nvcc}: CUDA {release[0]}.{release[1]}, the major torch is built with")
    say(f"a flash-attn source build would use {build_plan(job_limits(env), archs)}")


# --------------------------------------------------------------- the job's CPUs and memory
@dataclass(frozen=True)
class JobLimits:
    """The CPUs and memory this process may use, and which limit bound each."""

    cpus: int
    cpus_from: str
    memory: int  # bytes
    memory_from: str


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cgroup_dirs(root: Path, controller: str) -> list[Path]:
    """The cgroup directories whose ``controller`` limits apply to this process, innermost
    first: its own cgroup and every parent up to the mount (cgroup v1 or v2). A cgroup path
    not under the mount (a container with its own cgroup namespace) means the mount itself."""
    base = root / "sys" / "fs" / "cgroup"
    entries = [line.split(":", 2) for line in (_read(root / "proc/self/cgroup") or "").split("\n")]
    entries = [e for e in entries if len(e) == 3]
    v1 = [(base / ctrls, path) for _, ctrls, path in entries if controller in ctrls.split(",")]
    v2 = [(base, path) for _, ctrls, path in entries if ctrls == ""]
    for mount, path in v1 or v2:
        here = mount / path.lstrip("/")
        if not here.is_dir():
            here = mount
        dirs = [here]
        while here != mount and here != here.parent:
            here = here.parent
            dirs.append(here)
        return dirs
    return []


def _cgroup_cpus(root: Path) -> int | None:
    found = []
    for d in cgroup_dirs(root, "cpu"):
        v2 = (_read(d / "cpu.max") or "max").split()
        quota, period = (v2[0], v2[1]) if v2[0] != "max" else (None, None)
        if quota is None and (_read(d / "cpu.cfs_quota_us") or "-1") != "-1":
            quota, period = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
        if quota is not None and period:
            found.append(max(1, int(quota) // int(period)))
    return min(found, default=None)


def _cgroup_memory(root: Path) -> int | None:
    found = []
    for d in cgroup_dirs(root, "memory"):
        for name in ("memory.max", "memory.limit_in_bytes"):
            value = _read(d / name)
            if value and value.isdigit() and int(value) < 2**62:  # v1's "no limit" is ~2**63
                found.append(int(value))
    return min(found, default=None)


def _slurm_cpus(env: Mapping[str, str]) -> tuple[int, str] | None:
    for name in ("SLURM_CPUS_PER_TASK", "SLURM_CPUS_ON_NODE", "SLURM_JOB_CPUS_PER_NODE"):
        found = re.match(r"\d+", env.get(name, ""))  # SLURM_JOB_CPUS_PER_NODE: "8(x2),4"
        if found:
            return int(found.group()), f"{name}={env[name]}"
    return None


def job_limits(
    env: Mapping[str, str], root: Path = Path("/"), affinity: int | None = None
) -> JobLimits:
    """The smallest of every limit that applies: the CPU affinity (Slurm's and containers'
    cpusets), the cgroup CPU quota and memory limit, Slurm's allocation and the memory the
    node has available. ``root`` and ``affinity`` stand in for the machine in tests."""
    if affinity is None:
        affinity = len(os.sched_getaffinity(0))
    cpus = [(affinity, "the CPU affinity")]
    if (quota := _cgroup_cpus(root)) is not None:
        cpus.append((quota, "the cgroup CPU quota"))
    if (slurm := _slurm_cpus(env)) is not None:
        cpus.append(slurm)
    cpu_count, cpus_from = min(cpus)
    memory = []
    meminfo = re.search(r"MemAvailable:\s+(\d+) kB", _read(root / "proc/meminfo") or "")
    if meminfo:
        memory.append((int(meminfo.group(1)) * 1024, "the node's available memory"))
    if (limit := _cgroup_memory(root)) is not None:
        memory.append((limit, "the cgroup memory limit"))
    mib = 2**20
    if env.get("SLURM_MEM_PER_NODE", "").isdigit():
        memory.append((int(env["SLURM_MEM_PER_NODE"]) * mib, "SLURM_MEM_PER_NODE"))
    if env.get("SLURM_MEM_PER_CPU", "").isdigit():
        per_cpu = int(env["SLURM_MEM_PER_CPU"]) * mib
        memory.append((per_cpu * cpu_count, f"SLURM_MEM_PER_CPU x {cpu_count} CPUs"))
    memory_bytes, memory_from = min(memory, default=(0, "nothing readable"))
    return JobLimits(cpu_count, cpus_from, memory_bytes, memory_from)


def max_jobs(limits: JobLimits) -> int:
    """flash-attn's own rule (half the CPUs, 9 GiB per compile job), fed the job's limits
    instead of the host's CPU count and free memory."""
    by_memory = limits.memory // (GIB_PER_COMPILE_JOB * 2**30)
    return max(1, min(limits.cpus // 2, by_memory))


def build_plan(limits: JobLimits, archs: str) -> str:
    return (
        f"MAX_JOBS={max_jobs(limits)} ({limits.cpus} CPUs: {limits.cpus_from}; "
        f"{limits.memory / 2**30:.1f} GiB: {limits.memory_from}; {GIB_PER_COMPILE_JOB} GiB and "
        f"2 CPUs per compile job) and FLASH_ATTN_CUDA_ARCHS={archs} (the GPUs present)"
    )


def build_env(env: Mapping[str, str], root: Path = Path("/")) -> dict[str, str]:
    """The flash-attn source build's environment: the nvcc the preflight checked as CUDA_HOME
    (torch's build takes its nvcc from there), MAX_JOBS and FLASH_ATTN_CUDA_ARCHS; a value
    the user already set is kept."""
    nvcc = find_nvcc(env)
    if nvcc is None:
        raise Stop(f"no CUDA toolkit: nvcc not found: {LOAD_CUDA}")
    out = {
        "CUDA_HOME": str(Path(nvcc).resolve().parent.parent),
        "MAX_JOBS": str(max_jobs(job_limits(env, root))),
        "FLASH_ATTN_CUDA_ARCHS": flash_attn_archs([g.compute_cap for g in query_gpus(env)]),
    }
    return {key: env.get(key) or value for key, value in out.items()}


# ------------------------------------------------------------------------------- flash-attn
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


def torch_cuda_problem(nvcc: tuple[int, int] | None = None) -> str | None:
    """Why torch cannot run on this node's GPUs, or is another CUDA major than vLLM's wheel
    and this node's nvcc (``nvcc``: its release, when known), or None."""
    import torch

    if torch.version.cuda is None:
        return (
            f"torch {torch.__version__} is a CPU-only build: a pip setting (index-url, "
            f"find-links) supplied it; install torch==2.13.0 from PyPI (CUDA {CUDA_MAJOR})"
        )
    major = int(torch.version.cuda.split(".")[0])
    if major != CUDA_MAJOR:
        return (
            f"torch {torch.__version__} is a CUDA {torch.version.cuda} build, but vLLM 0.29.0's "
            f"wheel is CUDA {CUDA_MAJOR} (it links libcudart.so.{CUDA_MAJOR}): a pip setting "
            f"(index-url, find-links) supplied it; install torch==2.13.0 from PyPI"
        )
    if nvcc is not None and nvcc[0] != major:
        return f"torch is CUDA {torch.version.cuda} but " + nvcc_problem(nvcc, major)
    if not torch.cuda.is_available():
        return (
            f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU: the driver is "
            f"missing or older than {MIN_DRIVER[CUDA_MAJOR]} (nvidia-smi's 'Driver Version')"
        )
    return None


# ----------------------------------------------------------------------- the kernels' check
def attention_error(attend: Callable, device: str) -> float:
    """Relative error of ``attend(q, k, v, causal=True)`` (flash-attn's layout: batch, tokens,
    heads, head dim; bf16) against causal attention in fp32 on the same inputs."""
    import torch

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 64, 4, 64, generator=gen).to(device, torch.bfloat16) for _ in "qkv")
    out = attend(q, k, v, causal=True).float()
    t = [x.float().transpose(1, 2) for x in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*t, is_causal=True).transpose(1, 2)
    return float((out - ref).norm() / ref.norm())


def rms_norm_error(rms_norm: Callable, device: str) -> float:
    """Relative error of vLLM's ``rms_norm(out, x, weight, eps)`` (bf16) against fp32."""
    import torch

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 256, generator=gen).to(device, torch.bfloat16)
    weight = (1 + torch.rand(256, generator=gen)).to(device, torch.bfloat16)
    out = torch.empty_like(x)
    rms_norm(out, x, weight, 1e-6)
    xf = x.float()
    ref = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float()
    return float((out.float() - ref).norm() / ref.norm())


KERNEL_TOLERANCE = 2e-2  # bf16 outputs: rounding alone stays well under 1e-2


def _flash_attn_kernels() -> str:
    """flash-attn's compiled extension (``flash_attn_2_cuda``) loads, and its kernels run and
    compute attention on every GPU model present: loading does not show which architectures
    were compiled (FLASH_ATTN_CUDA_ARCHS), a call does ('no kernel image'), here rather than
    in the first training step."""
    import flash_attn_2_cuda  # noqa: F401
    import torch
    from flash_attn import flash_attn_func

    seen = {}
    for index in range(torch.cuda.device_count()):
        seen.setdefault(torch.cuda.get_device_capability(index), index)
    for cap, index in seen.items():
        error = attention_error(flash_attn_func, f"cuda:{index}")
        if not error < KERNEL_TOLERANCE:
            raise RuntimeError(f"flash_attn_func on compute capability {cap}: error {error:.3g}")
    return "flash_attn_func ran on compute capability " + ", ".join(
        f"{major}.{minor}" for major, minor in seen
    )


def _vllm_cuda() -> str:
    """vLLM's CUDA platform and kernels: ``import vllm`` is lazy; the CUDA extension
    (``vllm._C_stable_libtorch``, linked against libcudart of its CUDA major) loads when
    ``vllm.platforms.cuda`` is imported, as the first engine does. Then one of its kernels
    runs on the GPU."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        raise RuntimeError(
            f"vLLM chose the '{current_platform.device_type or 'unspecified'}' platform, not "
            "CUDA (no GPU visible to NVML, or a CPU build of vLLM)"
        )
    import vllm.platforms.cuda  # noqa: F401
    from vllm import _custom_ops

    error = rms_norm_error(_custom_ops.rms_norm, "cuda")
    if not error < KERNEL_TOLERANCE:
        raise RuntimeError(f"vLLM's rms_norm kernel: error {error:.3g}")
    return "vllm._C_stable_libtorch loaded, rms_norm ran on the GPU"


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
    ("flash_attn CUDA kernels", _flash_attn_kernels),
    ("ring_flash_attn", _ring_flash_attn),
    ("vllm", _version("vllm")),
    ("vllm CUDA kernels", _vllm_cuda),
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


# ------------------------------------------------------------- the whole set, resolved first
# torch's companions whose releases follow torch's minor (torchaudio 2.11 is built for torch
# 2.11) without requiring it in their metadata, so pip accepts any torch beside them
TORCH_COMPANIONS = ("torchaudio",)
PIP_ADVICE = ("To fix this", "1. ", "2. ", "ERROR: ResolutionImpossible")


def resolve(requirements: Path, pins: Path) -> list[str]:
    """pip's resolution of ``requirements`` held to ``pins`` in this interpreter's
    environment (torch installed: flash-attn's and DeepSpeed's sdists import it for their
    metadata; nothing is built or installed). Returns notes; raises ``Stop`` with pip's
    conflict, which would otherwise surface midway through the install."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        command = [sys.executable, "-m", "pip", "--disable-pip-version-check", "install"]
        command += ["--dry-run", "--no-build-isolation", "--report", str(report)]
        command += ["-c", str(pins), "-r", str(requirements)]
        env = {**os.environ, "FLASH_ATTENTION_SKIP_CUDA_BUILD": "TRUE"}  # metadata only
        done = subprocess.run(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        if done.returncode != 0:  # pip explains a conflict on stdout, between its errors
            raise Stop(f"pip cannot resolve {requirements} with its pins:\n{conflict(done.stdout)}")
        installs = [item["metadata"] for item in json.loads(report.read_text())["install"]]
    torch = next((m["version"] for m in installs if m["name"].lower() == "torch"), None)
    torch = torch or importlib.metadata.version("torch")
    notes = [f"resolved: {len(installs)} packages to install beside torch {torch}"]
    for name in TORCH_COMPANIONS:
        note = companion_note(name, installs, torch)
        notes += [note] if note else []
    return notes


def conflict(output: str) -> str:
    """pip's output from its first error on, without its generic advice."""
    lines = [line.rstrip() for line in output.splitlines() if line.strip()]
    start = next((i for i, line in enumerate(lines) if line.startswith("ERROR:")), 0)
    kept = [line for line in lines[start:] if not line.strip().startswith(PIP_ADVICE)]
    return "\n".join(kept) or output.strip()


def companion_note(name: str, installs: list[dict], torch: str) -> str | None:
    """A note when pip chose ``name`` for another torch minor than ``torch``, naming who
    asks for it (``installs``: the report's metadata of each package it would install)."""
    version = next((m["version"] for m in installs if m["name"].lower() == name), None)
    if version is None or _minor(version) == _minor(torch):
        return None
    wanted = [
        f"{m['name']} {m['version']}"
        for m in installs
        if any(
            re.match(rf"{name}\b", line) and "extra ==" not in line  # asked for unconditionally
            for line in m.get("requires_dist") or []
        )
    ]
    return (
        f"note: {name} {version} (required by {', '.join(wanted) or 'nothing named'}) is "
        f"built for torch {'.'.join(_minor(version))}, beside torch {torch}: it may not load. "
        "Only vLLM's audio models import it; the text models trained here do not (the CPU "
        "pipeline runs without it installed)"
    )


def _minor(version: str) -> tuple[str, ...]:
    return tuple(version.split("+")[0].split(".")[:2])


def _stop(message: str) -> int:
    print(f"install_gpu.sh: {message}", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = [
        "preflight",
        "build-env",
        "resolve",
        "flash-attn",
        "torch-cuda",
        "vllm-cuda",
        "check",
    ]
    parser.add_argument("command", choices=commands)
    parser.add_argument("files", nargs="*", type=Path, help="resolve: REQUIREMENTS PINS")
    parsed = parser.parse_args(argv)
    command = parsed.command
    env = os.environ
    try:
        if command == "preflight":
            preflight(env, lambda line: print(f"   {line}", flush=True))
        elif command == "build-env":
            print("\n".join(f"{key}={value}" for key, value in build_env(env).items()))
        elif command == "resolve":
            if len(parsed.files) != 2:
                parser.error("resolve takes REQUIREMENTS and PINS")
            print("\n".join(f"   {note}" for note in resolve(*parsed.files)))
        elif command == "flash-attn":
            print(flash_attn_choice(current_build()))
        elif command == "torch-cuda":
            nvcc = find_nvcc(env)
            problem = torch_cuda_problem(nvcc_release(nvcc) if nvcc else None)
            if problem:
                return _stop(problem)
            print("   torch CUDA ok")
        elif command == "vllm-cuda":
            print(f"   {_vllm_cuda()}")
        else:
            missing = check()
            if missing:
                return _stop(f"missing: {', '.join(missing)}")
            print("all components present")
    except Stop as stop:
        return _stop(str(stop))
    except Exception as error:  # vllm-cuda: the reason is the report
        return _stop(f"{type(error).__name__}: {error}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
