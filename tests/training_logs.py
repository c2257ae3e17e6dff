"""A run's tensorboard log as OpenRLHF 0.11.2 writes it (``TensorboardLogger``: ``train/`` and
``eval/`` prefixes, one scalar per tag and step), for tests that read costs back."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

PHASE_ORDER = ("generation", "make_experience", "ppo_train", "broadcast")


def write_run_log(
    directory: Path,
    steps: Mapping[int, tuple[float, float, float, float, float, float]],
    evaluations: Mapping[int, Mapping[str, float]] | None = None,
) -> None:
    """``steps``: step -> (generation, make_experience, ppo_train, broadcast seconds, mean
    response length, responses); ``evaluations``: step -> datasource -> pass@1."""
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(directory) as writer:
        for step, (*phases, length, responses) in steps.items():
            for phase, seconds in zip(PHASE_ORDER, phases, strict=True):
                writer.add_scalar(f"train/timing/{phase}", seconds, step)
            writer.add_scalar("train/timing/step_total", sum(phases), step)
            writer.add_scalar("train/rollout/response_length_mean", length, step)
            writer.add_scalar("train/rollout/num_samples", responses, step)
            for source, accuracy in (evaluations or {}).get(step, {}).items():
                writer.add_scalar(f"eval/eval_{source}_pass1", accuracy, step)
                writer.add_scalar(f"eval/eval_{source}_pass4", min(1.0, 2 * accuracy), step)
            writer.add_scalar("eval/eval_response_length_mean", 30.0, step)
