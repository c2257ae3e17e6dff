"""The dtype of a CPU run: bf16 where the CPU multiplies bf16 natively, fp32 everywhere else.

OpenRLHF runs everything in bf16 (``--ds.param_dtype`` offers bf16 or fp16; its vLLM engines
are created with ``dtype="bfloat16"``). On GPUs that is right. On a CPU, torch hands bf16
matrix products to oneDNN, which is fast only with bf16 instructions (AVX512_BF16, AMX):
measured with torch 2.13.0, one thread, 64x576 by 576x1536, bf16 took 0.34 ms against fp32's
0.87 ms on an AMX CPU, 3.9 ms against 0.93 ms with oneDNN held to AVX-512 without bf16, and
56-90 ms against 0.9-2.0 ms on AVX2 (docs/cpu.md). So a CPU run without those instructions
runs actor, reference and engines in fp32, the same arithmetic at a fraction of the time.

``resolve`` is the one place that decides, in the driver, once: the actor side reads the
result from ``args.ds.param_dtype`` (``launch.run_openrlhf`` sets it), the vLLM engines from
``ENV`` in the job's runtime environment (``engine_actors.CPURolloutRayActor``). A GPU run never
calls it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

CPU_DTYPES = ("auto", "bf16", "fp32")
VLLM_DTYPE = {"bf16": "bfloat16", "fp32": "float32"}
ENV = "DRPO_CPU_DTYPE"  # the decided dtype, for the engine actors
# ONEDNN_MAX_CPU_ISA values that hold oneDNN below its bf16 instructions (oneDNN's names)
_ONEDNN_BELOW_BF16 = frozenset(
    {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}
)


@dataclass(frozen=True)
class CPUKernels:
    """What decides the speed of a bf16 matrix product on this CPU."""

    capability: str  # torch.backends.cpu.get_cpu_capability(): torch's own vector kernels
    bf16_instructions: bool  # AVX512_BF16 or AMX tiles, as torch's cpuinfo reports
    onednn_max_isa: str | None  # ONEDNN_MAX_CPU_ISA, when set: oneDNN uses nothing above it

    @property
    def native_bf16(self) -> bool:
        capped = (self.onednn_max_isa or "").upper() in _ONEDNN_BELOW_BF16
        return self.bf16_instructions and not capped

    def describe(self) -> str:
        isa = f", ONEDNN_MAX_CPU_ISA={self.onednn_max_isa}" if self.onednn_max_isa else ""
        bf16 = "native bf16" if self.native_bf16 else "no native bf16"
        return f"{bf16} (torch capability {self.capability}{isa})"


def read_kernels() -> CPUKernels:
    return CPUKernels(
        capability=torch.backends.cpu.get_cpu_capability(),
        bf16_instructions=bool(
            torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
        ),
        onednn_max_isa=os.environ.get("ONEDNN_MAX_CPU_ISA") or None,
    )


def choose(requested: str, kernels: CPUKernels) -> tuple[str, str]:
    """``(dtype, the log line)`` for ``--drpo.cpu_dtype requested`` on ``kernels``."""
    if requested not in CPU_DTYPES:
        raise ValueError(f"--drpo.cpu_dtype must be one of {CPU_DTYPES}, got {requested!r}")
    if requested == "auto":
        dtype = "bf16" if kernels.native_bf16 else "fp32"
        why = f"--drpo.cpu_dtype auto: {kernels.describe()}"
    else:
        dtype = requested
        why = f"--drpo.cpu_dtype {requested}; this CPU: {kernels.describe()}"
    return dtype, f"CPU run in {dtype}: actor, reference and vLLM engines ({why})"


def resolve(requested: str) -> str:
    """Decide the CPU run's dtype, log it in one line and export it for the engines."""
    dtype, line = choose(requested, read_kernels())
    logger.warning(line)
    os.environ[ENV] = dtype
    return dtype


def engine_dtype() -> str:
    """The vLLM ``dtype`` a CPU engine is created with: the driver's decision."""
    try:
        return VLLM_DTYPE[os.environ[ENV]]
    except KeyError:
        raise RuntimeError(
            f"a CPU vLLM engine found no dtype decision ({ENV}={os.environ.get(ENV)!r}): the "
            "driver's resolve() exports it through the job's runtime environment"
        ) from None
