"""Scalars a run logged to tensorboard, read back (the demo's report and the end-to-end tests
read what the real pipeline logged, not what they think it did)."""

from __future__ import annotations

from pathlib import Path


def read_scalars(tensorboard_dir: Path) -> dict[str, dict[int, float]]:
    """Every scalar under ``tensorboard_dir``: tag -> {step: value}. A step logged twice (a
    resumed run repeats the steps after its checkpoint) keeps the later file's value."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found: dict[str, dict[int, float]] = {}
    for events in sorted(Path(tensorboard_dir).rglob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            found.setdefault(tag, {}).update({e.step: e.value for e in accumulator.Scalars(tag)})
    return found
