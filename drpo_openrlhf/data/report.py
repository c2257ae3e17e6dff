"""Human summary (counts per source, reasons) and a full machine-readable JSON report."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from drpo_openrlhf.data.validate import Prepared


def _counts(result: Prepared, dropped: bool) -> Counter[str]:
    return Counter(issue.kind for issue in result.issues if issue.dropped == dropped)


def _reasons(counts: Counter[str]) -> str:
    return ", ".join(f"{kind} ({n})" for kind, n in sorted(counts.items()))


def summary(prepared: list[Prepared], outputs: dict[str, str]) -> str:
    """A table of read/kept/dropped/excluded/warnings per source, then the reasons."""
    header = ("source", "read", "kept", "dropped", "excluded", "warnings", "output")
    table = [header]
    notes: list[str] = []
    for result in prepared:
        dropped, warned = _counts(result, True), _counts(result, False)
        excluded = sum(result.excluded.values())
        table.append(
            (
                result.source,
                str(result.read),
                str(len(result.rows)),
                str(sum(dropped.values())),
                str(excluded),
                str(sum(warned.values())),
                outputs.get(result.source, "-"),
            )
        )
        if dropped:
            notes.append(f"{result.source}: dropped: {_reasons(dropped)}")
        if warned:
            notes.append(f"{result.source}: kept with warnings: {_reasons(warned)}")
        if excluded:
            notes.append(f"{result.source}: excluded: {_reasons(result.excluded)}")
        if result.list_labels:
            notes.append(
                f"{result.source}: {result.list_labels} kept rows have a list of acceptable "
                "answers (label: JSON array of strings)"
            )
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = [
        "  ".join(
            cell.ljust(w) if i in (0, 6) else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in table
    ]
    return "\n".join(lines + notes)


def issue_lines(prepared: list[Prepared], limit: int) -> list[str]:
    """Up to ``limit`` issues per source, each naming file and row, plus what was left out."""
    lines: list[str] = []
    for result in prepared:
        lines.extend(str(issue) for issue in result.issues[:limit])
        hidden = len(result.issues) - limit
        if hidden > 0:
            lines.append(
                f"... and {hidden} more issues in {result.source} (--report FILE lists all)"
            )
    return lines


def write_report(path: Path, prepared: list[Prepared], outputs: dict[str, str]) -> None:
    """Every issue and count as JSON, for review or for scripts."""
    report = {
        "sources": {
            result.source: {
                "read": result.read,
                "kept": len(result.rows),
                "dropped": dict(_counts(result, True)),
                "warnings": dict(_counts(result, False)),
                "excluded": dict(result.excluded),
                "list_labels": result.list_labels,
                "output": outputs.get(result.source),
            }
            for result in prepared
        },
        "issues": [asdict(issue) for result in prepared for issue in result.issues],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
