"""Refuse a local model whose tokenizer transformers would load as another tokenizer.

OpenRLHF and vLLM load the tokenizer with ``AutoTokenizer.from_pretrained(path)``. In
transformers 5, a ``tokenizer_config.json`` naming ``LlamaTokenizerFast`` over a byte-level
``tokenizer.json`` (Llama 3's kind: DeepSeek-R1-Distill-Llama-8B ships exactly that) gets
``LlamaTokenizer``, which rebuilds a SentencePiece-style tokenizer around the vocabulary: spaces
vanish from every prompt and the decoded responses are garbled, silently (transformers issue
45488). transformers special-cases the Hub ids ``deepseek-ai/deepseek-r1-distill-*``, so a run
from the Hub id works and the same files downloaded to a local directory (an offline cluster)
do not. Compared here: the tokenizer as loaded against ``tokenizer.json`` itself.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

# spaces, digits, punctuation and line breaks: what a rebuilt tokenizer gets wrong
PROBE = "What is 12 + 345? Let me check:\n  the sum is 357."


def load_tokenizer(source: str, cache_dir: str | None = None) -> Any:
    """``AutoTokenizer`` of a local directory or a cached Hub id, as OpenRLHF loads it, never
    downloading; loaded once per launch for this module's and ``checkpoint_check``'s checks,
    again when a local directory's files change (tests rewrite them)."""
    folder = Path(source)
    files = sorted(folder.iterdir()) if folder.is_dir() else []
    stamp = tuple((f.name, f.stat().st_mtime_ns, f.stat().st_size) for f in files if f.is_file())
    return _load_tokenizer(source, cache_dir, stamp)


@lru_cache(maxsize=2)
def _load_tokenizer(source: str, cache_dir: str | None, stamp: tuple) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        source, trust_remote_code=True, local_files_only=True, cache_dir=cache_dir
    )


def tokenizer_problem(model_dir: Path) -> str | None:
    """What is wrong with ``model_dir``'s tokenizer as transformers loads it, or None (also
    when the directory has no ``tokenizer.json`` to compare with)."""
    file = model_dir / "tokenizer.json"
    if not file.is_file():
        return None
    from tokenizers import Tokenizer

    expected = Tokenizer.from_file(str(file)).encode(PROBE, add_special_tokens=False).ids
    loaded = load_tokenizer(str(model_dir))
    got = loaded(PROBE, add_special_tokens=False)["input_ids"]
    if got == expected:
        return None
    config = model_dir / "tokenizer_config.json"
    declared = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
    return (
        f"transformers loads its tokenizer as {type(loaded).__name__} (tokenizer_config.json "
        f"names {declared!r}), which encodes text otherwise than its tokenizer.json "
        f"({len(got)} tokens instead of {len(expected)} for {PROBE!r}; decoded back: "
        f'{loaded.decode(got)!r}). Training would see garbled prompts. Set "tokenizer_class": '
        '"PreTrainedTokenizerFast" in tokenizer_config.json of this copy (the Hub id '
        "deepseek-ai/DeepSeek-R1-Distill-Llama-8B is special-cased by transformers)"
    )


def check_tokenizer(name: str, flag: str = "--actor.model_name_or_path") -> None:
    """Raise ``ValueError`` naming ``flag`` when a local model's tokenizer loads wrong."""
    path = Path(name).expanduser()
    if not path.is_dir():
        return  # a Hub id: transformers' own special cases apply
    problem = tokenizer_problem(path)
    if problem:
        raise ValueError(f"{flag} {name}: {problem}")
