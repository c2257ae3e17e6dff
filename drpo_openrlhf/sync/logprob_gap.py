"""How far each rollout engine's token log-probs are from the trainer's on the same weights.

After a weight sync vLLM and the actor hold the same policy, so the log-probs vLLM reported
while sampling should equal the actor's own up to numerical precision. A large gap means the
sync did not happen (an engine still sampling from old or uninitialised weights) or the
engine computes something else (precision, attention kernel, rotary settings), both of which
bias every update silently.

The gap is checked per engine: pooled over 16 engines, one engine at 20 times the honest gap
moves the mean only 2.2-fold. How large the honest gap is depends on the model, hardware,
kernels and precision (measured, mean |vLLM - actor| per sampled token: toy 2-layer models on
CPU 0.0005-0.0025 nats; SmolLM2-135M-Instruct, 30 layers, bf16, on CPU vLLM 0.039, with
single tokens up to 0.46-0.82), so the limit is derived from a rollout whose weights are
known to be exact (``GapLimit``), within an absolute cap (``HONEST_CAP``), and saved with the
checkpoint so that a resumed run is held to the level the run started at.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

Gap = tuple[float, float, int]  # mean and max of |rollout - actor| over ``count`` tokens


def logprob_gap(
    rollout_log_probs: torch.Tensor, actor_log_probs: torch.Tensor, action_mask: torch.Tensor
) -> Gap:
    """``(mean, max, count)`` of ``|rollout - actor|`` over the action tokens of a batch
    (``(B, A)`` tensors). ``count`` lets batches be pooled; an empty mask gives ``(0, 0, 0)``."""
    if rollout_log_probs.shape != actor_log_probs.shape:
        raise ValueError(
            f"rollout log-probs {tuple(rollout_log_probs.shape)} and actor log-probs "
            f"{tuple(actor_log_probs.shape)} differ in shape"
        )
    mask = action_mask.bool()
    gap = (rollout_log_probs.double() - actor_log_probs.double()).abs()[mask]
    if gap.numel() == 0:
        return 0.0, 0.0, 0
    return gap.mean().item(), gap.max().item(), gap.numel()


def pooled_gap(parts: Iterable[Gap]) -> tuple[float, float]:
    """Mean and max of the gap over several batches' ``logprob_gap`` results."""
    parts = list(parts)
    count = sum(n for _, _, n in parts)
    if count == 0:
        return 0.0, 0.0
    return sum(m * n for m, _, n in parts) / count, max(x for _, x, _ in parts)


def gaps_by_engine(
    batches: Iterable[tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]],
) -> dict[int, Gap]:
    """Each engine's gap over a rollout: ``batches`` holds, per experience batch, the engine
    index of each row and the ``(B, A)`` rollout log-probs, actor log-probs and action mask.
    Engines with no action token in the rollout are left out."""
    parts: dict[int, list[Gap]] = {}
    for engines, rollout, actor, mask in batches:
        if len(engines) != rollout.shape[0]:
            raise ValueError(f"{len(engines)} engine tags for {rollout.shape[0]} responses")
        for engine in sorted(set(engines)):
            rows = torch.tensor([e == engine for e in engines])
            parts.setdefault(engine, []).append(logprob_gap(rollout[rows], actor[rows], mask[rows]))
    gaps = {}
    for engine, engine_parts in sorted(parts.items()):
        count = sum(n for _, _, n in engine_parts)
        if count:
            gaps[engine] = (*pooled_gap(engine_parts), count)
    return gaps


HONEST_FACTOR = 10.0  # the derived limit: this many times the honest gap...
MIN_LIMIT = 0.005  # ...and at least this (nats), so an exact kernel match does not stop a run
FALLBACK_LIMIT = 0.05  # the CPU-measured limit, when no honest gap can be measured (docs/cpu.md)
# The most an honest gap may be at the run's first rollout: 2.5x the largest honest level
# measured (SmolLM2-135M bf16 on CPU vLLM, 0.039 nats per token; the toy models' 0.0005-0.0025
# are 40x under it) and 2x the largest one-setting difference measured on SmolLM2's sampled
# text (sdpa against eager attention, 0.044-0.047). On that text a rotary base 10x too small
# gives 0.33, 5x too large 0.20, the prompt without its chat template 0.86
# (docs/reliability.md); fp32 against bf16 (0.030-0.039) is indistinguishable from an honest
# bf16 gap. A stop here costs one rollout; a silent fault costs the run.
HONEST_CAP = 0.1
# A resumed run's first rollout may be at most this many times the honest gap saved with the
# checkpoint (at least MIN_LIMIT): the toy runs' honest gap moved 2-fold over 32 steps.
RESUME_FACTOR = 3.0
CHECK = (
    "check that the engines and the actor run the same dtype, attention backend, RoPE "
    "settings (rope_theta, rope_scaling), tokenizer and chat template, and the vLLM version "
    "this package supports"
)


class LogprobGapError(RuntimeError):
    """vLLM's rollout log-probs are far from the actor's on the same weights."""


def derived_limit(honest: float) -> float:
    """The limit on each engine's mean gap derived from the run's honest gap."""
    return max(HONEST_FACTOR * honest, MIN_LIMIT)


def honest_level(means: Iterable[float]) -> float:
    """The honest gap of a rollout from exactly checked engines: the lower median of the
    engines' mean gaps (of two engines, the lower), so that engines computing something else,
    while fewer than half, neither raise it nor set their own limit."""
    ordered = sorted(means)
    return ordered[(len(ordered) - 1) // 2]


def _over(gaps: dict[int, Gap], limit: float) -> dict[int, Gap]:
    """The engines whose mean gap is above ``limit``."""
    return {i: g for i, g in gaps.items() if g[0] > limit}


def _engines(gaps: dict[int, Gap], count: int | None = None) -> str:
    shown = sorted(gaps.items(), key=lambda kv: -kv[1][0])[:count]
    return ", ".join(f"engine {i} {m:.3g} (max {x:.3g})" for i, (m, x, _) in shown)


@dataclass
class GapLimit:
    """The limit on each engine's mean log-prob gap in a rollout.

    ``fixed`` (``--drpo.max_logprob_gap``) when given. Otherwise derived from the honest gap
    (``honest``): measured at the run's first rollout when its weights were checked exactly
    equal to the actor's (``exact_start``: the check before the first rollout, or of a resumed
    run's first sync), and then at most ``HONEST_CAP``; or loaded from the checkpoint a run
    resumes from (``load_state_dict``), when that run's first rollout must stay within
    ``RESUME_FACTOR`` of it. ``FALLBACK_LIMIT`` when no honest gap is known and the weights
    were not checked."""

    fixed: float | None
    exact_start: bool
    honest: float | None = None
    honest_step: int | None = None  # the rollout step that measured ``honest``
    resumed: bool = False  # ``honest`` came from a checkpoint; no rollout compared with it yet

    def state_dict(self) -> dict[str, float | int | None] | None:
        if self.honest is None:
            return None
        return {"honest": self.honest, "step": self.honest_step}

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        if state is None:
            return
        self.honest, self.honest_step, self.resumed = state["honest"], state["step"], True

    def check(self, gaps: dict[int, Gap], step: int) -> tuple[float, str | None]:
        """Check the engines' gaps of rollout ``step``; return the limit that applied and a
        line to log when this rollout measured or compared the honest gap. Raises
        ``LogprobGapError`` naming the engines over the limit, and the step. ``gaps`` holds
        at least one engine."""
        if self.fixed is not None:
            self._raise_over(gaps, step, self.fixed, "--drpo.max_logprob_gap")
            return self.fixed, None
        if self.honest is None:
            if not self.exact_start:
                self._raise_over(gaps, step, FALLBACK_LIMIT, "weights unchecked: no honest gap")
                return FALLBACK_LIMIT, None
            return self._measure(gaps, step)
        limit = derived_limit(self.honest)
        honest = f"honest gap {self.honest:.3g} from rollout step {self.honest_step}"
        if self.resumed:
            self.resumed = False
            return self._compare_resumed(gaps, step, self.honest, limit, honest)
        self._raise_over(gaps, step, limit, f"{HONEST_FACTOR:g} x the {honest}")
        return limit, None

    def _measure(self, gaps: dict[int, Gap], step: int) -> tuple[float, str]:
        over_cap = _over(gaps, HONEST_CAP)
        if over_cap:
            raise LogprobGapError(
                f"rollout step {step}, the run's first (engines checked to hold the actor's "
                f"exact weights): vLLM's log-probs differ from the actor's by more than an "
                f"honest gap can ({HONEST_CAP:g} nats per token, 2.5x the largest measured): "
                f"{_engines(over_cap)}. The engines compute something other than the actor on "
                f"the same weights; {CHECK}. If this gap is honest for this model and "
                "hardware, --drpo.max_logprob_gap sets the limit by hand"
            )
        honest = honest_level(g[0] for g in gaps.values())
        limit = derived_limit(honest)
        self._raise_over(
            gaps, step, limit, f"{HONEST_FACTOR:g} x the other engines' honest gap {honest:.3g}"
        )
        self.honest, self.honest_step = honest, step
        return limit, (
            f"honest rollout log-prob gap {honest:.3g} nats per token (rollout step {step}, "
            f"engines checked to hold the actor's exact weights: {_engines(gaps, 4)}); limit "
            f"per engine from now on {limit:.3g} (max({HONEST_FACTOR:g} x honest, "
            f"{MIN_LIMIT:g}); saved with the checkpoints; --drpo.max_logprob_gap fixes it)"
        )

    def _compare_resumed(
        self, gaps: dict[int, Gap], step: int, saved: float, limit: float, honest: str
    ) -> tuple[float, str]:
        resume_limit = max(RESUME_FACTOR * saved, MIN_LIMIT)
        over = _over(gaps, resume_limit)
        if over:
            worst = max(g[0] for g in over.values())
            raise LogprobGapError(
                f"rollout step {step}, the first after resuming: vLLM's log-probs differ from "
                f"the actor's by up to {worst:.3g} nats per token, {worst / saved:.3g}x "
                f"the {honest} saved with the checkpoint (limit after a resume "
                f"{resume_limit:.3g}: max({RESUME_FACTOR:g} x saved, {MIN_LIMIT:g})): "
                f"{_engines(over, 8)}. The resumed run computes differently from the run that "
                f"saved it; {CHECK}. --drpo.max_logprob_gap sets the limit by hand"
            )
        return limit, (
            f"rollout log-prob gap after resuming: {_engines(gaps, 4)}, within "
            f"{RESUME_FACTOR:g}x the {honest} saved with the checkpoint; limit per engine "
            f"{limit:.3g}"
        )

    @staticmethod
    def _raise_over(gaps: dict[int, Gap], step: int, limit: float, source: str) -> None:
        over = _over(gaps, limit)
        if over:
            raise LogprobGapError(
                f"rollout step {step}: vLLM's rollout log-probs differ from the actor's by more "
                f"than {limit:.3g} nats per token ({source}) in {len(over)} of {len(gaps)} "
                f"engine(s): {_engines(over, 8)}. Those engines are not sampling from the "
                "actor's weights (broken weight sync) or compute differently (precision, "
                f"attention kernel, RoPE); {CHECK}; --drpo.max_logprob_gap sets the limit by hand"
            )


def probe_gap(actor: list[float], engine: list[float]) -> tuple[float, float]:
    """Mean and max of ``|engine - actor|`` over the tokens of the weight probe: the same fixed
    sequence scored token by token by a vLLM engine and by the actor."""
    if len(actor) != len(engine) or not actor:
        raise ValueError(f"probe log-probs of {len(actor)} and {len(engine)} tokens")
    gaps = [abs(e - a) for a, e in zip(actor, engine, strict=True)]
    return sum(gaps) / len(gaps), max(gaps)
