"""DRPO's gradient on this machine's device against an fp64 reference (``scripts/smoke_gpu.py``).

The same randomly initialised toy policy (Qwen2 layout, the shape vLLM and flash-attention
accept) scores one synthetic rollout twice through OpenRLHF's ``Actor`` and DRPO's mini-batch
loss (``drpo_openrlhf.algo``): once as training runs it on the device (bf16, flash-attention 2
with packed samples on a GPU; the run's dtype and attention elsewhere; log-probs in chunks, as
``--drpo.logprob_chunk_tokens`` does by default), once in fp64 with eager attention on padded
rows on the CPU, unchunked. The relative error of the whole gradient must stay under a
tolerance measured for that precision; a corrupted loss (the rollout's prompt groups shifted by
one response) must exceed it, or the check cannot tell a wrong gradient from rounding.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch

PROMPTS, N, MAX_RESPONSE, MAX_PROMPT = 8, 4, 48, 12
# Relative gradient error ||g - g64|| / ||g64|| allowed per compute dtype: the geometric mean of
# the largest honest error and the smallest corrupted-loss error measured on CPU over seeds 0-4
# (fp32: 2.2e-6 vs 0.276; bf16 with sdpa: 0.018 vs 0.276; docs/gpu.md, "The gradient check").
TOLERANCE = {torch.float32: 7.8e-4, torch.bfloat16: 0.07}
CHUNK_TOKENS = 64  # several chunks per micro-batch, none aligned with a response


@dataclass(frozen=True)
class GradientResult:
    error: float  # relative error of the gradient against fp64
    corrupted_error: float  # the same with the prompt groups shifted by one response
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.error <= self.tolerance < self.corrupted_error


def synthetic_rollout(vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """PROMPTS x N right-padded responses; every prompt has correct and incorrect ones."""
    gen = torch.Generator().manual_seed(seed)
    b = PROMPTS * N
    prompt_len = torch.randint(4, MAX_PROMPT + 1, (PROMPTS,), generator=gen).repeat_interleave(N)
    response_len = torch.randint(4, MAX_RESPONSE + 1, (b,), generator=gen)
    total = prompt_len + response_len
    width = int(total.max())
    positions = torch.arange(width)
    prompts = torch.randint(3, vocab, (PROMPTS, width), generator=gen).repeat_interleave(N, 0)
    tokens = torch.randint(3, vocab, (b, width), generator=gen)
    is_prompt = positions < prompt_len[:, None]
    attention_mask = (positions < total[:, None]).long()
    sequences = torch.where(is_prompt, prompts, tokens) * attention_mask
    correct = torch.rand(b, generator=gen) < 0.5
    correct[0::N], correct[1::N] = True, False
    return dict(
        sequences=sequences,
        attention_mask=attention_mask,
        action_mask=(~is_prompt & attention_mask.bool())[:, 1:],
        correct=correct,
        group=torch.arange(PROMPTS).repeat_interleave(N),
    )


def _actor(model_dir: Path, dtype: torch.dtype, attn: str, device: str, packing: bool):
    from openrlhf.models import Actor
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attn)
    model.config.use_cache = False  # packed rows must not attend to each other
    actor = Actor(model.to(device), temperature=0.6)
    actor.packing_samples = packing
    return actor


def drpo_gradient(actor, data, old_log_probs, group, device: str) -> torch.Tensor:
    """The flattened fp64 gradient of DRPO's mini-batch loss (lambda 0.1, tau 10, the
    released trust region; the hinge is active: ``old_log_probs`` sit away from the policy)."""
    from drpo_openrlhf.algo import DRPOConfig, minibatch_loss, response_scalars

    actor.zero_grad(set_to_none=True)
    on = {k: v.to(device) for k, v in data.items()}
    log_probs = actor(on["sequences"], on["action_mask"], attention_mask=on["attention_mask"])
    scalars = response_scalars(
        log_probs.double(),
        old_log_probs.to(device),
        on["action_mask"],
        on["correct"],
        group.to(device),
    )
    loss, _ = minibatch_loss(scalars, DRPOConfig(lam=0.1, max_len=MAX_RESPONSE))
    loss.backward()
    return torch.cat([p.grad.double().flatten().cpu() for p in actor.parameters()])


def check_gradient(
    model_dir: Path, device: str, dtype: torch.dtype, attn: str, packing: bool, seed: int = 0
) -> GradientResult:
    from drpo_openrlhf.update import chunked_actor

    torch.manual_seed(seed)
    reference = _actor(model_dir, torch.float64, "eager", "cpu", packing=False)
    data = synthetic_rollout(reference.model.config.vocab_size, seed)
    with torch.no_grad():
        policy = reference(
            data["sequences"], data["action_mask"], attention_mask=data["attention_mask"]
        )
    noise = torch.randn(policy.shape, generator=torch.Generator().manual_seed(seed + 1))
    old = (policy + 0.05 * noise) * data["action_mask"]
    expected = drpo_gradient(reference, data, old, data["group"], "cpu")
    actor = _actor(model_dir, dtype, attn, device, packing)
    chunked_actor.install(actor, CHUNK_TOKENS)
    got = drpo_gradient(actor, data, old, data["group"], device)
    shifted = data["group"].roll(1)
    wrong = drpo_gradient(actor, data, old, shifted, device)
    scale = float(expected.norm())
    return GradientResult(
        error=float((got - expected).norm()) / scale,
        corrupted_error=float((wrong - expected).norm()) / scale,
        tolerance=TOLERANCE[dtype],
    )


def main() -> None:
    """Measure the errors over seeds (how TOLERANCE was set)."""
    from drpo_openrlhf.demo.toy_model import build_toy_model

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    p.add_argument("--attn", default="sdpa")
    p.add_argument("--packing", action="store_true")
    p.add_argument("--seeds", type=int, default=5)
    args = p.parse_args()
    model = build_toy_model(args.work / "toy-init", hidden_size=64, seed=0)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    for seed in range(args.seeds):
        r = check_gradient(model, args.device, dtype, args.attn, args.packing, seed)
        print(f"seed {seed}: error {r.error:.3g} corrupted {r.corrupted_error:.3g}")


if __name__ == "__main__":
    main()
