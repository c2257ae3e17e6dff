"""No number of this project's own development sessions or issues in the package, scripts/,
slurm/, the Makefile, the README or the user guides (docs/*.md): they mean nothing to a user
and the history lives in git and CHANGELOG.md (not scanned: it is that history). References
to upstream projects ("OpenRLHF #922", "vLLM issue 1234", "pytorch/pytorch#123") name their
project and stay."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("drpo_openrlhf", "scripts", "slurm", "Makefile", "README.md")
SCANNED_GLOBS = ("docs/*.md",)
BINARY_SUFFIXES = {".pyc", ".safetensors", ".bin", ".pt", ".gguf", ".png", ".parquet"}

SESSION = re.compile(r"\bsessions?[\s-]+\d+", re.IGNORECASE)
ISSUE = re.compile(r"\b(?:issues?|PRs?|pull requests?)[\s-]*#?\d+", re.IGNORECASE)
HASH = re.compile(r"(?<![\w/&$])#\d+\b")
# what may stand right before an issue number: an upstream project's name or owner/repo
UPSTREAM = re.compile(
    r"(?:\b(?:openrlhf|vllm|deepspeed|ray|pytorch|torch|transformers|flash[-_]attn|"
    r"math[-_]verify|verl|slurm|ninja|hugging\s?face|accelerate|triton|nccl)(?:'s)?"
    r"|\b[\w.-]+/[\w.-]+)"
    r"\s*(?:issues?|PRs?|pull requests?)?[\s-]*$",
    re.IGNORECASE,
)
# "[[methods]] #2": a program's message naming an entry of a TOML array of tables
TABLE_ENTRY = re.compile(r"\]\]\s*$")


def project_numbers(text: str) -> list[str]:
    """The project session and issue numbers in ``text``, as ``line N: match``."""
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        for match in SESSION.finditer(line):
            found.append(f"line {number}: {match.group()!r}")
        covered: list[range] = []  # "issue #5" is one number, not two
        for pattern in (ISSUE, HASH):
            for match in pattern.finditer(line):
                if any(match.start() in span for span in covered):
                    continue
                covered.append(range(match.start(), match.end()))
                before = line[: match.start()]
                if pattern is HASH and TABLE_ENTRY.search(before):
                    continue
                if not UPSTREAM.search(before):
                    found.append(f"line {number}: {match.group()!r}")
    return found


def scanned_files(root: Path) -> list[Path]:
    files = []
    for name in SCANNED:
        path = root / name
        candidates = sorted(path.rglob("*")) if path.is_dir() else [path]
        files += [
            p
            for p in candidates
            if p.is_file()
            and "__pycache__" not in p.parts
            and p.suffix not in BINARY_SUFFIXES
            and b"\0" not in p.read_bytes()[:4096]
        ]
    for pattern in SCANNED_GLOBS:
        files += sorted(p for p in root.glob(pattern) if p.is_file())
    return files


def problems_under(root: Path) -> list[str]:
    problems = []
    for path in scanned_files(root):
        text = path.read_text(errors="replace")
        problems += [f"{path.relative_to(root)} {hit}" for hit in project_numbers(text)]
    return problems


def test_no_session_or_issue_numbers_in_the_package_scripts_slurm_makefile_readme_docs():
    problems = problems_under(ROOT)
    assert not problems, "project session/issue numbers (say what, not when):\n" + "\n".join(
        problems
    )


def test_the_scan_flags_project_numbers_and_keeps_upstream_references(tmp_path):
    package = tmp_path / "drpo_openrlhf"
    package.mkdir()
    (package / "bad.py").write_text(
        "# found in session 12\n"
        "# see Session 18 and sessions 8-9\n"
        "x = 1  # issue 47\n"
        "# the fix of #46\n"
    )
    (package / "good.py").write_text(
        "# OpenRLHF #922: its loss\n"
        "# vLLM issue 1234, DeepSpeed's PR #77, pytorch/pytorch#123\n"
        "color = '#ffaa00'  # session state, an issue of style\n"
        "total = len(xs)  # step 3 of 4\n"
    )
    (tmp_path / "README.md").write_text("Fixed in issue #5.\n")
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "guide.md").write_text(
        "Measured in session 12 (see CHANGELOG.md).\n"
        "  - [[methods]] #1: unknown method 'grpo'\n"
        "OpenRLHF #922 and vLLM PR 77 stay.\n"
    )
    (tmp_path / "CHANGELOG.md").write_text("## Session 12, issue 36\n")
    problems = problems_under(tmp_path)
    assert problems == [
        "drpo_openrlhf/bad.py line 1: 'session 12'",
        "drpo_openrlhf/bad.py line 2: 'Session 18'",
        "drpo_openrlhf/bad.py line 2: 'sessions 8'",
        "drpo_openrlhf/bad.py line 3: 'issue 47'",
        "drpo_openrlhf/bad.py line 4: '#46'",
        "README.md line 1: 'issue #5'",
        "docs/guide.md line 1: 'session 12'",
    ]
