"""Raw rows from local files (json, jsonl, parquet) or the Hugging Face Hub.

Every row carries a human-readable location (``FILE line N`` for JSON Lines, ``FILE row N``
for JSON arrays and parquet, ``REPO (CONFIG/SPLIT) row N`` for the Hub) so that validation
messages can point at the exact row. A JSON Lines line that does not parse is yielded as a
row with an ``error`` rather than aborting the whole file, so that it is reported like any
other bad row. Local reading never imports ``datasets``: it must work with no network.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

LOCAL_SUFFIXES = (".json", ".jsonl", ".parquet")


class SourceError(Exception):
    """A source cannot be read at all (missing file, unsupported format, Hub unreachable)."""


@dataclass(frozen=True)
class RawRow:
    """One input record and where it came from; ``error`` is set when it could not be parsed."""

    location: str
    record: object
    error: str | None = None


def read_local(path: Path) -> Iterator[RawRow]:
    """Rows of a .json/.jsonl/.parquet file, or of every such file in a folder (sorted)."""
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix.lower() in LOCAL_SUFFIXES)
        if not files:
            raise SourceError(f"{path}: folder holds no {'/'.join(LOCAL_SUFFIXES)} files")
        for file in files:
            yield from read_local(file)
        return
    if not path.is_file():
        raise SourceError(f"{path}: no such file or folder")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        yield from _read_parquet(path)
    elif suffix in (".json", ".jsonl"):
        yield from _read_json(path)
    else:
        raise SourceError(
            f"{path}: unsupported file type {suffix!r}; use {', '.join(LOCAL_SUFFIXES)}"
        )


def _read_json(path: Path) -> Iterator[RawRow]:
    """A JSON array, or JSON Lines (also under a .json name, as ``Dataset.to_json`` writes)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise SourceError(f"{path}: cannot read: {err}") from err
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as err:
            raise SourceError(f"{path}: invalid JSON array: {err}") from err
        for index, record in enumerate(rows, start=1):
            yield RawRow(f"{path} row {index}", record)
        return
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        location = f"{path} line {number}"
        try:
            yield RawRow(location, json.loads(line))
        except json.JSONDecodeError as err:
            yield RawRow(location, None, error=f"invalid JSON: {err.msg} (column {err.colno})")


def _read_parquet(path: Path) -> Iterator[RawRow]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (OSError, ValueError) as err:
        raise SourceError(f"{path}: cannot read parquet: {err}") from err
    for index, record in enumerate(table.to_pylist(), start=1):
        yield RawRow(f"{path} row {index}", record)


@dataclass(frozen=True)
class HubRef:
    """Where a source lives on the Hugging Face Hub."""

    repo: str
    config: str | None
    splits: tuple[str, ...]


def read_hub(hub: HubRef, source_name: str) -> Iterator[RawRow]:
    """Rows of every split of ``hub``; any failure becomes a SourceError saying how to go local."""
    for split in hub.splits:
        where = f"{hub.repo} ({hub.config}/{split})" if hub.config else f"{hub.repo} ({split})"
        try:
            import datasets

            rows = datasets.load_dataset(hub.repo, hub.config, split=split)
        except Exception as err:  # any failure has the same remedy: local files
            raise SourceError(
                f"cannot load {source_name} from the Hugging Face Hub: {where}: "
                f"{type(err).__name__}: {err}\n"
                f"  To prepare it offline, download the dataset files yourself (e.g. from "
                f"https://huggingface.co/datasets/{hub.repo} on a machine with access) and pass "
                f"them with --input {source_name}=PATH (a .json, .jsonl or .parquet file, or a "
                f"folder of them)."
            ) from err
        for index, record in enumerate(rows, start=1):
            yield RawRow(f"{where} row {index}", record)
