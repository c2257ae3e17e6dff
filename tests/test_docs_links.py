"""What the README and docs/ point at exists: the README stays a short guide (<= 170 lines)
whose repository paths, `make` targets, `python -m` modules, console scripts and `--flags`
resolve; every relative link in README.md and docs/*.md (and its #anchor) resolves; and every
`file:function` hop of docs/how-a-step-runs.md names a function or method that exists.

Each check returns its problems as text, so the tests below also feed it a broken input."""

from __future__ import annotations

import ast
import importlib.util
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 170
STEP_PAGE = ROOT / "docs" / "how-a-step-runs.md"

REPO_PATH = re.compile(
    r"(?<![\w./-])((?:drpo_openrlhf|scripts|slurm|tests|docs|\.ci)/[\w./-]*\w/?)"
)
TOP_FILE = re.compile(r"`([\w.-]+\.(?:txt|toml|md|cfg))`")
MAKE_TARGET = re.compile(r"\bmake ([a-z][\w-]*)")
MODULE = re.compile(r"\bpython -m ([\w.]+)")
CONSOLE_SCRIPT = re.compile(r"(?<![\w/-])(drpo-[a-z]+)(?![\w./-])")
FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w.*-]*")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HOP = re.compile(r"`((?:drpo_openrlhf|openrlhf)/[\w/]+\.py):([A-Za-z_][\w.]*)`")

# flags of other programs the README's commands call: `ray start`, `ray job submit`, `sbatch`
EXTERNAL_FLAGS = {
    "--head": "ray start",
    "--num-gpus": "ray start",
    "--address": "ray job submit",
    "--runtime-env-json": "ray job submit",
    "--nodes": "sbatch",
    "--gpus-per-node": "sbatch",
}


@cache
def train_flags() -> frozenset[str]:
    """Every option string ``python -m drpo_openrlhf.train`` accepts (OpenRLHF's and ours)."""
    from drpo_openrlhf.train import build_parser

    return frozenset(build_parser()._option_string_actions)


@cache
def project_sources() -> str:
    """The text of the project's own programs, where its other tools define their flags."""
    files = [*(ROOT / "drpo_openrlhf").rglob("*.py"), *(ROOT / "scripts").glob("*")]
    files += (ROOT / "slurm").glob("*")
    return "\n".join(p.read_text(errors="replace") for p in files if p.is_file())


def flag_problem(flag: str) -> str | None:
    """Why ``flag`` resolves nowhere, or None. A dotted flag (``--drpo.lam``,
    ``--actor.model_name_or_path``) must be accepted by the entry point's parser; others by it,
    by one of the project's tools (defined in its sources) or by a known external program."""
    if flag in train_flags():
        return None
    if "." in flag:
        return f"{flag}: not accepted by python -m drpo_openrlhf.train"
    if flag in EXTERNAL_FLAGS or re.search(rf"['\"\s]{re.escape(flag)}\b", project_sources()):
        return None
    return f"{flag}: no parser of the project or known external program defines it"


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    headings = re.findall(r"^#{1,6}\s+(.*)$", markdown, flags=re.MULTILINE)
    return {github_anchor(h) for h in headings}


def link_problems(path: Path) -> list[str]:
    """The relative links of one Markdown file whose file or #anchor does not exist."""
    problems = []
    for target in LINK.findall(path.read_text()):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists():
            problems.append(f"{path.name}: link {target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved.read_text()):
            problems.append(f"{path.name}: link {target}: no such heading")
    return problems


def readme_problems(text: str, root: Path) -> list[str]:
    problems = []
    lines = len(text.splitlines())
    if lines > README_MAX_LINES:
        problems.append(f"README has {lines} lines, more than {README_MAX_LINES}")
    for path in sorted(set(REPO_PATH.findall(text)) | set(TOP_FILE.findall(text))):
        if not (root / path).exists():
            problems.append(f"path {path}: does not exist")
    targets = set(re.findall(r"^([\w-]+):", (root / "Makefile").read_text(), re.MULTILINE))
    for target in sorted(set(MAKE_TARGET.findall(text)) - targets):
        problems.append(f"make {target}: no such Makefile target")
    for module in sorted(set(MODULE.findall(text))):
        if importlib.util.find_spec(module) is None:
            problems.append(f"python -m {module}: no such module")
    pyproject = (root / "pyproject.toml").read_text()  # no tomllib: Python 3.10 runs this
    section = pyproject.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    scripts = set(re.findall(r"^([\w-]+)\s*=", section, re.MULTILINE))
    for script in sorted(set(CONSOLE_SCRIPT.findall(text)) - scripts):
        problems.append(f"{script}: no such console script in pyproject.toml")
    flags = {f.rstrip(".-") for f in FLAG.findall(text) if "*" not in f}  # not `--drpo.*`
    for flag in sorted(flags):
        problem = flag_problem(flag)
        if problem:
            problems.append(problem)
    return problems


def _defines(body: list[ast.stmt], name: str) -> ast.stmt | None:
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name == name:
                return node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return node
    return None


def hop_file(path: str) -> Path:
    """A hop's file: the project's, or OpenRLHF's own in the installed package."""
    if path.startswith("openrlhf/"):
        spec = importlib.util.find_spec("openrlhf")
        return Path(spec.submodule_search_locations[0]).parent / path
    return ROOT / path


def hop_problem(path: str, qualified: str) -> str | None:
    """Why the hop ``path:qualified`` (a function, class or ``Class.method``) does not exist."""
    hop = f"{path}:{qualified}"
    file = hop_file(path)
    if not file.exists():
        return f"hop {hop}: no file {path}"
    body = ast.parse(file.read_text()).body
    for part in qualified.split("."):
        node = _defines(body, part)
        if node is None:
            return f"hop {hop}: {path} defines no {qualified}"
        body = node.body if isinstance(node, ast.ClassDef) else []
    return None


def step_hops(text: str) -> list[tuple[str, str]]:
    return HOP.findall(text)


def test_readme_is_short_and_everything_it_names_resolves():
    problems = readme_problems((ROOT / "README.md").read_text(), ROOT)
    assert not problems, "README.md:\n" + "\n".join(problems)


def test_readme_check_catches_each_broken_reference():
    text = (ROOT / "README.md").read_text()
    broken = (
        text
        + "\n`slurm/drpo_70b.sh` and `requirement.txt`; `make deploy`;"
        + " python -m drpo_openrlhf.trian; drpo-serve; --drpo.lamda 0.1; --no-such-flag\n"
        + "padding\n" * README_MAX_LINES
    )
    problems = readme_problems(broken, ROOT)
    assert problems == [
        f"README has {len(broken.splitlines())} lines, more than {README_MAX_LINES}",
        "path requirement.txt: does not exist",
        "path slurm/drpo_70b.sh: does not exist",
        "make deploy: no such Makefile target",
        "python -m drpo_openrlhf.trian: no such module",
        "drpo-serve: no such console script in pyproject.toml",
        "--drpo.lamda: not accepted by python -m drpo_openrlhf.train",
        "--no-such-flag: no parser of the project or known external program defines it",
    ]


def test_flags_resolve_where_they_are_defined():
    assert flag_problem("--drpo.lam") is None and flag_problem("--actor.model_name_or_path") is None
    assert flag_problem("--out-dir") is None  # drpo-data's
    assert flag_problem("--gpus-per-node") is None  # sbatch's
    assert flag_problem("--actor.no_such_option") is not None


def test_every_relative_link_in_readme_and_docs_resolves():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    problems = [p for page in pages for p in link_problems(page)]
    assert not problems, "\n".join(problems)


def test_link_check_catches_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## The trust region's noise floor\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md) [ok](other.md#the-trust-regions-noise-floor) [web](https://x.org/y)\n"
        "[gone](missing.md) [bad](other.md#no-such-section)\n"
    )
    assert link_problems(page) == [
        "page.md: link missing.md: no such file",
        "page.md: link other.md#no-such-section: no such heading",
    ]


def test_every_hop_of_how_a_step_runs_exists():
    hops = step_hops(STEP_PAGE.read_text())
    problems = [p for p in (hop_problem(path, name) for path, name in hops) if p]
    assert not problems, "docs/how-a-step-runs.md:\n" + "\n".join(problems)
    # the spine of the page: from the entry point to the objective
    for hop in [
        ("drpo_openrlhf/train.py", "main"),
        ("drpo_openrlhf/runtime/launch.py", "run_openrlhf"),
        ("openrlhf/cli/train_ppo_ray.py", "train"),
        ("drpo_openrlhf/update/actor_trainer.py", "DRPOActorTrainer.ppo_train"),
        ("drpo_openrlhf/algo/minibatch.py", "loss_coefficients"),
        ("drpo_openrlhf/algo/objective.py", "drpo_objective"),
    ]:
        assert hop in hops, f"docs/how-a-step-runs.md lost the hop {hop[0]}:{hop[1]}"


def test_hop_check_names_the_broken_hop():
    assert hop_problem("drpo_openrlhf/algo/objective.py", "drpo_objective") is None
    assert hop_problem("openrlhf/trainer/ppo_trainer.py", "PPOTrainer.fit") is None
    assert hop_problem("drpo_openrlhf/algo/gone.py", "f") == (
        "hop drpo_openrlhf/algo/gone.py:f: no file drpo_openrlhf/algo/gone.py"
    )
    assert hop_problem("drpo_openrlhf/update/actor_trainer.py", "DRPOActorTrainer.gone") == (
        "hop drpo_openrlhf/update/actor_trainer.py:DRPOActorTrainer.gone: "
        "drpo_openrlhf/update/actor_trainer.py defines no DRPOActorTrainer.gone"
    )
    assert step_hops("`drpo_openrlhf/train.py:main` and `openrlhf/a/b.py:C.d`") == [
        ("drpo_openrlhf/train.py", "main"),
        ("openrlhf/a/b.py", "C.d"),
    ]
