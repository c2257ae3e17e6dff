"""bf16 against fp32 on this CPU, side by side in one run: the matrix product that shows the
CPU class, and an actor's training micro-step (forward and backward) and a no-grad scoring
forward on the real test model, SmolLM2-135M-Instruct (``make real-model``).

What ``--drpo.cpu_dtype auto`` decides here is printed first (``runtime/cpu_dtype.py``); the
ratios say whether that decision is the faster one on this machine. To see the AVX2 class on
a CPU with native bf16, hold oneDNN and torch to AVX2:
``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 python scripts/bench_cpu_dtype.py``.

    python scripts/bench_cpu_dtype.py [--threads 1] [--repeats 5] [--tokens 256] [--batch 4]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from drpo_openrlhf.runtime import cpu_dtype

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def median_s(work: Callable[[], object], repeats: int) -> float:
    work()  # warm-up: oneDNN's kernel selection, allocator
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_case(dtype: torch.dtype) -> Callable[[], object]:
    a, b = torch.randn(64, 576, dtype=dtype), torch.randn(576, 1536, dtype=dtype)
    return lambda: a @ b


def model_cases(batch: int, tokens: int) -> dict[str, Callable[[torch.dtype], Callable]]:
    from transformers import AutoModelForCausalLM

    from drpo_openrlhf.models.smollm2 import build

    path = build()  # a stamp check once converted
    ids = torch.randint(0, 49152, (batch, tokens), generator=torch.Generator().manual_seed(0))

    def load(dtype: torch.dtype) -> torch.nn.Module:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")

    def train_step(dtype: torch.dtype) -> Callable[[], object]:
        model = load(dtype).train()

        def step() -> None:
            logits = model(ids).logits
            logits.float().log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None]).mean().backward()
            model.zero_grad(set_to_none=True)

        return step

    def score(dtype: torch.dtype) -> Callable[[], object]:
        model = load(dtype).eval()

        @torch.no_grad()
        def forward() -> None:
            model(ids).logits.float().log_softmax(-1)

        return forward

    return {"train micro-step": train_step, "scoring forward": score}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--no-model", action="store_true", help="the matrix product only")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    chosen, line = cpu_dtype.choose("auto", cpu_dtype.read_kernels())
    print(line)
    print(f"threads {args.threads}, median of {args.repeats}")
    cases = {"matmul 64x576 @ 576x1536": lambda dtype: matmul_case(dtype)}
    if not args.no_model:
        cases.update(model_cases(args.batch, args.tokens))
    print("| case | fp32 s | bf16 s | bf16/fp32 | faster |\n|---|---:|---:|---:|---|")
    for name, build in cases.items():
        fp32, bf16 = (median_s(build(DTYPES[d]), args.repeats) for d in ("fp32", "bf16"))
        faster = "bf16" if bf16 < fp32 else "fp32"
        print(f"| {name} | {fp32:.4g} | {bf16:.4g} | {bf16 / fp32:.3g} | {faster} |")
    print(f"auto chooses {chosen}")


if __name__ == "__main__":
    main()
