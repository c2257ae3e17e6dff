"""Checks of a run's inputs before any Ray actor, vLLM engine or GPU is started.

Without them a missing model, a broken reward file or an unlabelled dataset row surfaces
minutes into a run, inside a Ray actor, as an error that names neither the flag nor the file
(OpenRLHF swallows reward-file errors in its engines; a missing label becomes ``None`` and
fails the reward). Each check raises ``ValueError`` with what to fix; ``train.parse`` turns
it into a usage error.
"""

from __future__ import annotations

import ast
import json
import os
from collections.abc import Iterator
from pathlib import Path

DATA_SUFFIXES = (".jsonl", ".json", ".parquet")


def _looks_local(name: str) -> bool:
    """A Hugging Face Hub id is ``name`` or ``org/name``; anything else is a path."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or Path(name).exists()


def check_model(name: str) -> None:
    """A local model directory must exist and hold a ``config.json``."""
    if not _looks_local(name):
        return
    path = Path(name).expanduser()
    if not path.is_dir():
        raise ValueError(f"--actor.model_name_or_path {name}: no such directory")
    if not (path / "config.json").is_file():
        raise ValueError(f"--actor.model_name_or_path {name}: no config.json (not an HF model)")


def check_writable(path: str, flag: str) -> None:
    """``path`` can be created and written: its nearest existing ancestor is a writable
    directory on a writable file system. Checked without creating anything, so that a bad
    checkpoint path fails now, not at the first save hours into the run."""
    current = Path(path).expanduser().absolute()
    while not current.exists():
        current = current.parent
    if not current.is_dir():
        raise ValueError(f"{flag} {path}: {current} is a file, not a directory")
    read_only = os.statvfs(current).f_flag & os.ST_RDONLY
    if read_only or not os.access(current, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: {current} is not writable")


def check_reward_file(path: str) -> None:
    """A reward plugin file must exist, parse, and define ``reward_func`` at top level."""
    if not path.endswith(".py"):
        return  # a reward server URL
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--reward.remote_url {path}: no such file")
    try:
        tree = ast.parse(file.read_text(), filename=path)
    except SyntaxError as error:
        raise ValueError(f"--reward.remote_url {path}: syntax error, line {error.lineno}") from None
    defined = {
        node.name for node in tree.body if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    }
    if "reward_func" not in defined:
        raise ValueError(
            f"--reward.remote_url {path}: defines no top-level "
            "reward_func(queries, prompts, labels, **kwargs)"
        )


def reward_takes(path: str, keyword: str) -> bool:
    """The reward file's top-level ``reward_func`` (the last one defined) takes ``keyword``,
    by name or through ``**kwargs``; False for a reward server or a file without one. Read
    from the source, without running the user's code."""
    if not path.endswith(".py") or not Path(path).is_file():
        return False
    takes = False
    for node in ast.parse(Path(path).read_text(), filename=path).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == "reward_func":
            named = [*node.args.args, *node.args.kwonlyargs]
            takes = node.args.kwarg is not None or keyword in {a.arg for a in named}
    return takes


def portable_path(path: str) -> str:
    """A plugin path as every Ray worker finds it: absolute, except inside a Ray
    ``working_dir`` copy (whose absolute path differs from node to node), where a relative
    path already names the same file on every node."""
    if Path(path).is_absolute() or "working_dir_files" in Path.cwd().resolve().parts:
        return path
    return str(Path(path).resolve())


def check_positive_reward(spec: str, max_len: int, length_shape: str) -> str:
    """Load ``--drpo.positive_reward`` and call it once on hand-written correct responses
    (``rewards.positive_reward.probe``): a missing file or function, a wrong signature, an
    exception, a wrong number of values or a non-finite one is refused here, naming the file
    and the problem. Returns the SPEC with portable file paths (``portable_path``)."""
    from drpo_openrlhf.rewards.positive_reward import probe, with_paths

    probe(spec, max_len, length_shape)  # PositiveRewardError is a ValueError
    return with_paths(spec, portable_path)


def _rows(file: Path) -> Iterator[tuple[int, object]]:
    """``(row number from 1, row)`` of a local JSONL, JSON (list) or parquet file."""
    if file.suffix == ".parquet":
        import pyarrow.parquet as pq

        yield from enumerate(pq.read_table(file).to_pylist(), start=1)
    elif file.suffix == ".json":
        rows = json.loads(file.read_text())
        yield from enumerate(rows if isinstance(rows, list) else [rows], start=1)
    else:
        with file.open(encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                if line.strip():
                    try:
                        yield number, json.loads(line)
                    except json.JSONDecodeError as error:
                        raise ValueError(f"{file}, line {number}: not JSON ({error.msg})") from None


def check_prompt_data(datasets: str, input_key: str, label_key: str | None) -> None:
    """Every row of a local prompt file has a non-empty prompt and, when a reward file grades
    against labels, a label; the first bad rows are named. Hub datasets are not checked."""
    for name in datasets.split(","):
        file = Path(name.strip())
        if file.suffix not in DATA_SUFFIXES or not _looks_local(str(file)):
            continue
        if not file.is_file():
            raise ValueError(f"--data.prompt_dataset {file}: no such file")
        bad = []
        for number, row in _rows(file):
            if not isinstance(row, dict) or row.get(input_key) in (None, "", []):
                bad.append(f"row {number}: no {input_key!r}")
            elif label_key and row.get(label_key) in (None, ""):
                bad.append(f"row {number}: no {label_key!r}")
        if bad:
            shown = "; ".join(bad[:5]) + (f"; and {len(bad) - 5} more" if len(bad) > 5 else "")
            raise ValueError(
                f"--data.prompt_dataset {file}: {len(bad)} bad row(s): {shown} "
                "(drpo-data validates and converts datasets: docs/data.md)"
            )
