"""``drpo-data`` / ``python -m drpo_openrlhf.data``: prepare training and evaluation JSONL files.

Each selected source is read from local files (``--input NAME=PATH``) or the Hugging Face
Hub, converted to ``{"prompt", "label", "datasource"}`` rows, validated, and written to
``OUT_DIR/NAME.jsonl``. Exit status: 0 done, 1 strict mode found issues or a source kept no
row (nothing written for it), 2 usage error or a source could not be read.
``drpo-data audit FILE...`` grades the labels of written files (see ``audit``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from drpo_openrlhf.data.readers import RawRow, SourceError, read_hub, read_local
from drpo_openrlhf.data.report import issue_lines, summary, write_report
from drpo_openrlhf.data.sources import GROUPS, Source, build_sources
from drpo_openrlhf.data.validate import Prepared, flag_cross_source_duplicates, prepare


def people_range(text: str) -> range:
    """``"3-7"`` -> range(3, 8); ``"5"`` -> range(5, 6)."""
    low, _, high = text.partition("-")
    try:
        lo, hi = int(low), int(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or N-M, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected 1 <= N <= M, got {text!r}")
    return range(lo, hi + 1)


def input_spec(text: str) -> tuple[str, Path]:
    """``NAME=PATH`` of --input."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name, Path(path)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="drpo-data",
        description="Prepare DRPO training/evaluation JSONL files (prompt, label, datasource).",
        epilog="Check written files with: drpo-data audit FILE... . Groups: all, "
        + ", ".join(f"{g} ({' '.join(n)})" for g, n in GROUPS.items()),
    )
    parser.add_argument("sources", nargs="*", help="source names or groups (see --list)")
    parser.add_argument(
        "--input",
        action="append",
        type=input_spec,
        default=[],
        metavar="NAME=PATH",
        help="read source NAME from a local .json/.jsonl/.parquet file or folder instead of "
        "the Hub (repeatable; several paths for one source are concatenated)",
    )
    parser.add_argument("--out-dir", type=Path, default=Path("data"), help="default: data")
    parser.add_argument("--strict", action="store_true", help="fail on any issue, write nothing")
    parser.add_argument(
        "--drop-duplicates", action="store_true", help="drop repeated problems (keep the first)"
    )
    parser.add_argument(
        "--drop-unparsable", action="store_true", help="drop answers math-verify cannot parse"
    )
    parser.add_argument("--kk-train-people", type=people_range, default=range(3, 8))
    parser.add_argument("--kk-test-people", type=people_range, default=range(2, 9))
    parser.add_argument("--report", type=Path, help="write every issue and count as JSON")
    parser.add_argument(
        "--show-issues", type=int, default=20, metavar="N", help="issues printed per source"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--list", action="store_true", help="list sources and exit")
    return parser


def _selected(parser, requested: Sequence[str], inputs: dict, sources: dict) -> list[str]:
    names: set[str] = set(inputs)
    for name in requested:
        if name == "all":
            names.update(sources)
        elif name in GROUPS:
            names.update(GROUPS[name])
        elif name in sources:
            names.add(name)
        else:
            parser.error(f"unknown source {name!r}; known: {', '.join(sources)}")
    unknown = set(inputs) - set(sources)
    if unknown:
        parser.error(f"--input names unknown source(s) {sorted(unknown)}")
    if not names:
        parser.error("name at least one source or group, or give --input (see --list)")
    return [name for name in sources if name in names]


def _rows(source: Source, paths: list[Path] | None) -> list[RawRow]:
    """All raw rows up front, so that the progress bar knows its total (cheap next to parsing)."""
    if paths is None:
        return list(read_hub(source.hub, source.name))
    return list(itertools.chain.from_iterable(read_local(path) for path in paths))


def _write_jsonl(path: Path, result: Prepared) -> None:
    """Write atomically so that an interrupted run never leaves a truncated file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as out:
        for row in result.rows:
            record = {"prompt": row.prompt, "label": row.label, "datasource": row.datasource}
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def _list(sources: dict[str, Source]) -> None:
    for source in sources.values():
        hub = source.hub
        where = f"{hub.repo}" + (f" [{hub.config}]" if hub.config else "")
        print(f"{source.name:14} {source.description}\n{'':14} hub: {where} {','.join(hub.splits)}")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["audit"]:
        from drpo_openrlhf.data.audit import main as audit_main

        return audit_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    sources = build_sources(args.kk_train_people, args.kk_test_people)
    if args.list:
        _list(sources)
        return 0
    inputs: dict[str, list[Path]] = {}
    for name, path in args.input:
        inputs.setdefault(name, []).append(path)
    selected = _selected(parser, args.sources, inputs, sources)
    if args.show_issues < 0:
        parser.error("--show-issues must be >= 0")
    missing = [str(p) for paths in inputs.values() for p in paths if not p.exists()]
    if missing:
        parser.error(f"--input path(s) not found: {', '.join(missing)}")

    prepared: list[Prepared] = []
    for name in selected:
        try:
            prepared.append(
                prepare(
                    sources[name],
                    _rows(sources[name], inputs.get(name)),
                    drop_duplicates=args.drop_duplicates,
                    drop_unparsable=args.drop_unparsable,
                    progress=False if args.no_progress else None,
                )
            )
        except SourceError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    flag_cross_source_duplicates(prepared)

    for line in issue_lines(prepared, args.show_issues):
        print(line, file=sys.stderr)
    n_issues = sum(len(result.issues) for result in prepared)
    outputs: dict[str, str] = {}
    if not (args.strict and n_issues):
        for result in prepared:
            if result.rows:
                path = args.out_dir / f"{result.source}.jsonl"
                _write_jsonl(path, result)
                outputs[result.source] = str(path)
    print(summary(prepared, outputs))
    if args.report:
        write_report(args.report, prepared, outputs)
    if args.strict and n_issues:
        print(f"error: --strict: {n_issues} issue(s) found; no file written", file=sys.stderr)
        return 1
    empty = [result.source for result in prepared if not result.rows]
    if empty:
        print(
            f"error: no usable row in {', '.join(empty)}; nothing written for it", file=sys.stderr
        )
        return 1
    return 0
