"""A CPU run's dtype (``runtime/cpu_dtype.py``): decided once, in the driver, from the CPU's
bf16 instructions and oneDNN's cap, for each CPU class the project has met; and each side of
the run (the actor's OpenRLHF args, the engines' environment) gets that one decision."""

from __future__ import annotations

import pytest
import torch

from drpo_openrlhf.runtime import cpu_dtype, cpu_support
from drpo_openrlhf.runtime.cpu_dtype import CPUKernels

AVX2 = CPUKernels("AVX2", bf16_instructions=False, onednn_max_isa=None)  # e.g. AMD EPYC Zen 2/3
AVX512 = CPUKernels("AVX512", bf16_instructions=False, onednn_max_isa=None)  # Skylake-SP
AVX512_BF16 = CPUKernels("AVX512", bf16_instructions=True, onednn_max_isa=None)  # Zen 4, SPR
# a native-bf16 CPU held to AVX2 (how docs/cpu.md measures the AVX2 class on such a machine)
HELD_TO_AVX2 = CPUKernels("AVX2", bf16_instructions=True, onednn_max_isa="AVX2")
HELD_TO_AVX512 = CPUKernels("AVX512", bf16_instructions=True, onednn_max_isa="avx512_core")
HELD_TO_AMX = CPUKernels("AVX512", bf16_instructions=True, onednn_max_isa="AVX512_CORE_AMX")
# torch's own vector kernels held to AVX2 do not touch oneDNN's bf16 matrix products
ATEN_AVX2 = CPUKernels("AVX2", bf16_instructions=True, onednn_max_isa=None)


@pytest.mark.parametrize(
    ("kernels", "dtype"),
    [
        (AVX2, "fp32"),
        (AVX512, "fp32"),
        (AVX512_BF16, "bf16"),
        (HELD_TO_AVX2, "fp32"),
        (HELD_TO_AVX512, "fp32"),
        (HELD_TO_AMX, "bf16"),
        (ATEN_AVX2, "bf16"),
    ],
)
def test_auto_follows_the_cpus_bf16_instructions(kernels, dtype):
    chosen, line = cpu_dtype.choose("auto", kernels)
    assert chosen == dtype
    assert line.startswith(f"CPU run in {dtype}: ")
    assert ("no native bf16" in line) == (dtype == "fp32")
    assert f"torch capability {kernels.capability}" in line


@pytest.mark.parametrize("requested", ["bf16", "fp32"])
@pytest.mark.parametrize("kernels", [AVX2, AVX512_BF16])
def test_an_explicit_dtype_is_kept_and_the_line_says_what_the_cpu_has(requested, kernels):
    chosen, line = cpu_dtype.choose(requested, kernels)
    assert chosen == requested
    assert f"--drpo.cpu_dtype {requested}; this CPU: " in line


def test_an_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match=r"--drpo\.cpu_dtype must be one of"):
        cpu_dtype.choose("fp16", AVX2)


def test_read_kernels_sees_onednns_cap(monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    held = cpu_dtype.read_kernels()
    assert held.onednn_max_isa == "AVX2" and not held.native_bf16
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    free = cpu_dtype.read_kernels()
    assert free.capability == torch.backends.cpu.get_cpu_capability()
    expected = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert free.native_bf16 == expected


def test_resolve_exports_the_decision_for_the_engines(monkeypatch, caplog):
    monkeypatch.delenv(cpu_dtype.ENV, raising=False)
    with pytest.raises(RuntimeError, match="found no dtype decision"):
        cpu_dtype.engine_dtype()
    monkeypatch.setattr(cpu_dtype, "read_kernels", lambda: AVX2)
    with caplog.at_level("WARNING"):
        assert cpu_dtype.resolve("auto") == "fp32"
    assert "CPU run in fp32" in caplog.text
    assert cpu_dtype.engine_dtype() == "float32"
    monkeypatch.setenv(cpu_dtype.ENV, "bf16")
    assert cpu_dtype.engine_dtype() == "bfloat16"


def test_openrlhfs_dtype_conversion_takes_fp32_on_cpu():
    from openrlhf.utils.utils import convert_to_torch_dtype

    convert = cpu_support._fp32_dtype(convert_to_torch_dtype)
    assert convert("fp32") is torch.float32
    assert convert("bf16") is torch.bfloat16
    with pytest.raises(ValueError, match="Invalid param_dtype"):
        convert("fp8")
