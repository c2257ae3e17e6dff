"""Which checkpoint a run can resume from, and what a stopped run says about it.

DeepSpeed writes ``_actor/latest`` on rank 0 once rank 0's own files are written, before the
barrier that waits for the other ranks' optimizer shards (``DeepSpeedEngine.save_checkpoint``):
a job killed in between leaves ``latest`` naming a checkpoint that is not there in full, and
a resume fails on it or, worse, loads a mix. So after every save (all ranks past DeepSpeed's
and OpenRLHF's barriers) rank 0 writes ``drpo_complete.json`` into the tag's folder, listing
every file and its size, by an atomic rename. Before a resume, ``prepare_resume`` points
``latest`` at the newest tag whose files all match its list and sets newer, incomplete tags
aside. Checkpoints without any such list (saved by OpenRLHF itself, or by an older version
of this package) are resumed as OpenRLHF would: from ``latest``.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import torch.distributed as dist

from drpo_openrlhf.runtime.graceful_stop import stop_request_file
from drpo_openrlhf.sync.engine_start import start_failure

MARKER = "drpo_complete.json"
ASIDE = "_incomplete"  # under --ckpt.path, beside _actor, out of OpenRLHF's rotation

# What the innermost exception means, for the causes a long run meets (docs/reliability.md).
HINTS = {
    "EngineDeadError": "a vLLM engine process died (killed, out of memory or crashed)",
    "ActorDiedError": "a Ray actor process died (killed, out of memory or crashed)",
    "RayActorError": "a Ray actor process died (killed, out of memory or crashed)",
    "OutOfMemoryError": "a GPU ran out of memory (docs/launch.md, Memory plan)",
    "PositiveRewardError": "the positive reward (--drpo.positive_reward) failed in a vLLM "
    "engine (docs/positive_rewards.md)",
}
# Ray's own OutOfMemoryError (same name as torch's GPU one) is its memory monitor killing a
# worker because the node's RAM is nearly full: seen with several runs on one CPU machine
RAY_OOM = (
    "a node ran out of host memory and Ray's memory monitor killed a worker (fewer runs or "
    "engines per node, or more RAM; RAY_memory_usage_threshold sets where it kills)"
)


def _files(folder: Path) -> dict[str, int]:
    return {
        str(f.relative_to(folder)): f.stat().st_size
        for f in sorted(folder.rglob("*"))
        if f.is_file() and f.name != MARKER
    }


def mark_complete(folder: Path) -> None:
    """Record ``folder``'s files and sizes; the marker appears whole or not at all."""
    tmp = folder / f".{MARKER}.tmp"
    tmp.write_text(json.dumps({"files": _files(folder)}, indent=1))
    os.replace(tmp, folder / MARKER)


def is_complete(folder: Path) -> bool:
    """Every file the marker lists is there with its size."""
    try:
        listed = json.loads((folder / MARKER).read_text())["files"]
    except (OSError, ValueError, KeyError):
        return False
    present = _files(folder)
    return all(present.get(name) == size for name, size in listed.items())


def _step(tag: str) -> int:
    match = re.fullmatch(r"global_step(\d+)", tag)
    return int(match.group(1)) if match else -1


def _tags(actor_dir: Path) -> list[Path]:
    """The checkpoint folders, newest step last."""
    folders = [p for p in actor_dir.iterdir() if p.is_dir() and _step(p.name) >= 0]
    return sorted(folders, key=lambda p: _step(p.name))


def _marked(actor_dir: Path) -> bool:
    return any((p / MARKER).exists() for p in _tags(actor_dir))


def last_checkpoint(ckpt_path: str | None) -> Path | None:
    """The checkpoint a resume loads: the newest complete tag, or ``latest``'s for
    checkpoints saved without markers."""
    actor_dir = Path(ckpt_path) / "_actor" if ckpt_path else None
    if actor_dir is None or not actor_dir.is_dir():
        return None
    if _marked(actor_dir):
        complete = [p for p in _tags(actor_dir) if is_complete(p)]
        return complete[-1] if complete else None
    latest = actor_dir / "latest"
    tag = latest.read_text().strip() if latest.is_file() else ""
    return actor_dir / tag if tag and (actor_dir / tag).is_dir() else None


def _set_aside(path: Path, ckpt_path: Path) -> Path:
    target = ckpt_path / ASIDE / f"{path.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(path, target)
    return target


def prepare_resume(ckpt_path: str) -> str:
    """Make ``_actor/latest`` name the newest complete checkpoint (atomically), setting newer
    incomplete ones aside; with none complete, set ``_actor`` aside (a fresh start). Returns
    what it found and did, for the log."""
    root = Path(ckpt_path)
    actor_dir = root / "_actor"
    if not actor_dir.is_dir():
        return f"no checkpoint in {root}: starting from the beginning"
    chosen = last_checkpoint(ckpt_path)
    if chosen is None:
        aside = _set_aside(actor_dir, root)
        return f"no complete checkpoint in {actor_dir}: moved it to {aside}, starting afresh"
    notes = []
    for folder in _tags(actor_dir):
        if _step(folder.name) > _step(chosen.name):
            notes.append(f"set aside incomplete {folder.name} in {_set_aside(folder, root)}")
    latest = actor_dir / "latest"
    if not latest.is_file() or latest.read_text().strip() != chosen.name:
        tmp = actor_dir / ".latest.tmp"
        tmp.write_text(chosen.name)
        os.replace(tmp, latest)
        notes.append(f"'latest' now names {chosen.name}")
    return f"resuming from {chosen}" + "".join(f"; {n}" for n in notes)


class CompleteCheckpointActor:
    """Mixin of the actor's Ray class: marks each checkpoint complete once every rank has
    written it (``save_checkpoint`` ends with DeepSpeed's and OpenRLHF's barriers)."""

    def save_checkpoint(self, tag, *args, **kwargs):
        result = super().save_checkpoint(tag, *args, **kwargs)
        args_ = self.strategy.args
        if not self.disable_ds_ckpt and dist.get_rank() == 0:
            mark_complete(Path(args_.ckpt.path) / "_actor" / tag)
        return result


def innermost(error: BaseException) -> BaseException:
    """The exception at the bottom of Ray's and Python's wrapping."""
    seen = set()
    while id(error) not in seen:
        seen.add(id(error))
        inner = getattr(error, "cause", None) or error.__cause__
        if not isinstance(inner, BaseException):
            break
        error = inner
    return error


def stop_message(error: BaseException, ckpt_path: str | None) -> str:
    """The cause of a stop and the checkpoint to resume from, in two sentences."""
    cause = innermost(error)
    name = type(cause).__name__
    lines = str(cause).strip().splitlines()
    line = f"{name}: {lines[0]}" if lines else name
    ray_oom = name == "OutOfMemoryError" and type(cause).__module__.startswith("ray")
    hint = RAY_OOM if ray_oom else HINTS.get(name)
    text = f"the run stopped: {hint} ({line})" if hint else f"the run stopped: {line}"
    failed_start = start_failure(cause)  # Ray's first line names the actor, not the error
    if failed_start:
        text = f"the run stopped: {failed_start}"
    checkpoint = last_checkpoint(ckpt_path)
    if checkpoint is None:
        return text + ". No complete checkpoint: a rerun starts from the beginning."
    # a cause that the same command would meet again says what to rerun with instead
    advice = getattr(
        cause, "resume_advice", "rerun the same command with --ckpt.load_enable to resume from it"
    )
    return f"{text}. Last complete checkpoint: {checkpoint}; {advice}."


def interrupt_message(signal_name: str, ckpt_path: str | None) -> str:
    """The last line of a run stopped by Ctrl-C or SIGTERM: what happened, the checkpoint to
    resume from, and the stop that saves first (``graceful_stop``)."""
    text = f"the run stopped on {signal_name}"
    checkpoint = last_checkpoint(ckpt_path)
    if checkpoint is None:
        text += ". No complete checkpoint: a rerun starts from the beginning"
    else:
        text += (
            f". Last complete checkpoint: {checkpoint}; rerun the same command with "
            "--ckpt.load_enable to resume from it"
        )
    if not ckpt_path:
        return text + "."
    return (
        f"{text} (to stop at the next step with a checkpoint instead: touch "
        f"{stop_request_file(ckpt_path)})."
    )
