"""On-disk cache of generations, so that an interrupted evaluation resumes where it stopped.

One JSONL file per (model, dataset, settings): a header line holding the settings key, then
one line per finished prompt, appended and flushed as soon as its batch is generated. The
file name carries a hash of the key, which includes a fingerprint of the model files, so a
changed setting or a re-exported checkpoint never reuses stale samples. Each line also
records a hash of the prompt's token ids: a reordered or edited dataset (or a new chat
template) regenerates the affected prompts only.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from drpo_openrlhf.eval.generation import Sample


def _digest(payload: Any) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def prompt_digest(prompt_ids: Sequence[int]) -> str:
    return _digest(list(prompt_ids))[:16]


def model_fingerprint(model_path: str) -> list:
    """Name, size and modification time of the model directory's files (cheap, no hashing
    of multi-GB weights). A path that is not a directory (a hub id) stands for itself."""
    directory = Path(model_path)
    if not directory.is_dir():
        return [model_path]
    return [
        [f.name, f.stat().st_size, f.stat().st_mtime_ns]
        for f in sorted(directory.iterdir())
        if f.is_file()
    ]


def _parse(line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "x"


class GenerationCache:
    """Samples of one model on one dataset under one settings key."""

    def __init__(self, cache_dir: str | Path, model_path: str, dataset: str, key: Mapping):
        self.key = json.loads(json.dumps(key, sort_keys=True))
        model_dir = f"{_slug(Path(model_path).name)}-{_digest(str(Path(model_path).resolve()))[:8]}"
        name = f"{_slug(dataset)}-{_digest(self.key)[:16]}.jsonl"
        self.path = Path(cache_dir) / model_dir / name

    def load(self) -> dict[int, tuple[str, list[Sample]]]:
        """``index -> (prompt digest, samples)`` of the prompts already generated.

        A last line cut short by an interruption is dropped (and removed from the file, so
        that appending continues on a clean line).
        """
        if not self.path.exists():
            return {}
        lines = self.path.read_text(encoding="utf-8").splitlines()
        header = _parse(lines[0]) if lines else None
        if header is None:  # interrupted while creating the file
            self.path.unlink()
            return {}
        if header != {"key": self.key}:
            raise ValueError(f"{self.path} does not hold the expected settings")
        records, valid = {}, lines[:1]
        for line in lines[1:]:
            row = _parse(line)
            if row is None:
                continue
            records[row["index"]] = (row["prompt"], [Sample(**s) for s in row["samples"]])
            valid.append(line)
        if len(valid) != len(lines):
            self.path.write_text("".join(f"{line}\n" for line in valid), encoding="utf-8")
        return records

    def append(self, rows: Sequence[tuple[int, str, list[Sample]]]) -> None:
        """Records finished prompts as ``(index, prompt digest, samples)``."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        new = not self.path.exists()
        with self.path.open("a", encoding="utf-8") as handle:
            if new:
                handle.write(json.dumps({"key": self.key}) + "\n")
            for index, digest, samples in rows:
                record = {"index": index, "prompt": digest, "samples": [asdict(s) for s in samples]}
                handle.write(json.dumps(record, ensure_ascii=False) + "\n")
            handle.flush()
