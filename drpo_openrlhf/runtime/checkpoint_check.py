"""A model checkpoint's own files checked against the run before launch.

A real checkpoint can be inconsistent in ways that surface minutes into a run, inside a Ray
actor or a vLLM engine, or never: a tokenizer naming another end-of-sequence token than the
generation config (converted checkpoints: a GGUF-converted SmolLM2 names ``<|im_start|>``),
no padding token, ``--data.apply_chat_template`` on a base model without a template, added
tokens beyond the embedding, ``--data.max_len`` beyond the model's positions. Read here from
``config.json``, ``generation_config.json`` and the tokenizer (transformers loads it once per
launch: ``tokenizer_check.load_tokenizer``), for a local directory or a Hub id already in the
Hugging Face cache (nothing is downloaded; an uncached Hub id is not checked). Errors are
what breaks the run; warnings what it survives, said once at launch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from drpo_openrlhf.runtime.tokenizer_check import load_tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# vLLM's keys for a model's context (transformers_utils/model_arch_config_convertor.py): the
# smallest present counts, and ``model_max_length`` (Command-R) overrides them.
POSITION_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
# RoPE types whose max_position_embeddings already is the scaled context (Llama 3.1's 131,072);
# vLLM multiplies the others' by their factor (``config/model.py``, _get_and_verify_max_len).
SCALED_ALREADY = frozenset({"su", "longrope", "llama3"})
# vLLM's override of its refusal of a longer max_model_len (its envs.py); honoured here too.
LONG_LEN_ENV = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"


@dataclass(frozen=True)
class Finding:
    error: bool
    message: str


@dataclass(frozen=True)
class Checkpoint:
    """The files a run reads from a model: where they are, config.json (its ``text_config``
    for a multimodal model), generation_config.json (None: absent) and the tokenizer (None:
    no tokenizer files)."""

    directory: Path
    config: dict
    generation: dict | None
    tokenizer: Any


def _json(file: Path) -> dict:
    try:
        data = json.loads(file.read_text())
    except ValueError as error:
        raise ValueError(f"{file}: not JSON ({error})") from None
    return data if isinstance(data, dict) else {}


def _cached_snapshot(name: str) -> tuple[Path, str] | None:
    """The cache directory of a Hub id's files and the cache's root, if its config.json is
    in the Hugging Face cache."""
    from huggingface_hub import constants, try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(name, "config.json", cache_dir=constants.HF_HUB_CACHE)
    except ValueError:  # not a valid Hub id either: check_model has judged the path
        return None
    return (Path(cached).parent, constants.HF_HUB_CACHE) if isinstance(cached, str) else None


def read_checkpoint(name: str) -> Checkpoint | None:
    """``name``'s files, or None when there is nothing local to read (an uncached Hub id,
    no config.json)."""
    path = Path(name).expanduser()
    cache_dir = None
    if path.is_dir():
        directory = path
    elif name.count("/") == 1 and not name.startswith(("/", ".", "~")):
        found = _cached_snapshot(name)
        if found is None:
            return None
        directory, cache_dir = found
    else:
        return None
    if not (directory / "config.json").is_file():
        return None
    config = _json(directory / "config.json")
    text_config = config.get("text_config")
    generation_file = directory / "generation_config.json"
    tokenizer = None
    if any((directory / file).is_file() for file in TOKENIZER_FILES):
        # a Hub id by its name: transformers special-cases some ids (tokenizer_check.py)
        tokenizer = load_tokenizer(str(path) if cache_dir is None else name, cache_dir)
    return Checkpoint(
        directory=directory,
        config={**config, **text_config} if isinstance(text_config, dict) else config,
        generation=_json(generation_file) if generation_file.is_file() else None,
        tokenizer=tokenizer,
    )


def _ids(value: object) -> list[int]:
    """An ``eos_token_id`` (an int or a list of them, as Llama 3.1's) as a list."""
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def _token(tokenizer: Any, token_id: int) -> str:
    return f"{tokenizer.convert_ids_to_tokens(token_id)!r} (id {token_id})"


def eos_findings(checkpoint: Checkpoint) -> list[Finding]:
    """The tokenizer's eos among the generation config's eos ids (generation_config.json, or
    config.json where there is none, as vLLM reads them). A warning: vLLM stops a response
    at any of them, and OpenRLHF sets no stop tokens of its own, so a run still ends each
    response where the model ends its turn; what goes wrong is an early end wherever the
    model writes the other token, and templates closing turns with the wrong one."""
    tokenizer = checkpoint.tokenizer
    if tokenizer is None or tokenizer.eos_token_id is None:
        return []
    source = "config.json" if checkpoint.generation is None else "generation_config.json"
    settings = checkpoint.config if checkpoint.generation is None else checkpoint.generation
    allowed = _ids(settings.get("eos_token_id"))
    eos = tokenizer.eos_token_id
    if not allowed or eos in allowed:
        return []
    named = ", ".join(_token(tokenizer, i) for i in allowed)
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    closes = " and its chat template closes turns with it," if "eos_token" in template else ""
    return [
        Finding(
            False,
            f"{checkpoint.directory}: the tokenizer's eos_token {_token(tokenizer, eos)} is not "
            f"among {source}'s eos_token_id ({named}). vLLM ends a rollout at any of them (it "
            "adds the generation config's ids to the tokenizer's eos; OpenRLHF sets no stop "
            f"tokens), so responses also end wherever the model writes "
            f"{tokenizer.eos_token!r},{closes} a sign of a converted checkpoint naming the "
            'wrong token. Set "eos_token" in tokenizer_config.json to the token that ends the '
            f"model's turns, or add {eos} to eos_token_id in {source} if "
            f"{tokenizer.eos_token!r} really ends them",
        )
    ]


def pad_findings(checkpoint: Checkpoint) -> list[Finding]:
    """No pad token: OpenRLHF pads with the eos token (``openrlhf/utils/utils.py``,
    ``get_tokenizer``). Padding is masked out of rollouts and losses, so the run is sound;
    said because the checkpoints it saves then name eos as their pad token."""
    tokenizer = checkpoint.tokenizer
    if tokenizer is None or tokenizer.pad_token is not None:
        return []
    return [
        Finding(
            False,
            f"{checkpoint.directory}: the tokenizer has no pad_token, so OpenRLHF pads with its "
            f"eos_token {tokenizer.eos_token!r} (padding is masked out of rollouts and losses; "
            "the saved checkpoints will name it as their pad token). To choose one, set "
            '"pad_token" in tokenizer_config.json to a special token the model does not '
            "otherwise write",
        )
    ]


def template_findings(checkpoint: Checkpoint, chat_template: bool) -> list[Finding]:
    """``--data.apply_chat_template`` needs a template: without one OpenRLHF's prompt dataset
    raises inside the trainer, after Ray and the engines have started."""
    tokenizer = checkpoint.tokenizer
    if not chat_template or tokenizer is None or tokenizer.chat_template:
        return []
    return [
        Finding(
            True,
            f"--data.apply_chat_template: {checkpoint.directory} has no chat template (no "
            'chat_template.jinja, no "chat_template" in tokenizer_config.json); OpenRLHF '
            "would fail rendering the first prompt, after Ray has started. A base model "
            "reads the prompts as written: drop --data.apply_chat_template (--data."
            "input_template can wrap them), or add the template of its instruct model",
        )
    ]


def vocab_findings(checkpoint: Checkpoint) -> list[Finding]:
    """Every token id has a row in the embedding: ``vocab_size`` may exceed the tokenizer
    (Qwen pads its embedding to 151,936 rows for 151,665 tokens), never the reverse."""
    tokenizer, vocab_size = checkpoint.tokenizer, checkpoint.config.get("vocab_size")
    if tokenizer is None or not isinstance(vocab_size, int):
        return []
    beyond = sorted((i, t) for t, i in tokenizer.get_vocab().items() if i >= vocab_size)
    if not beyond:
        return []
    shown = ", ".join(f"{t!r} (id {i})" for i, t in beyond[:3])
    more = f" and {len(beyond) - 3} more" if len(beyond) > 3 else ""
    return [
        Finding(
            True,
            f"{checkpoint.directory}: the tokenizer has {len(tokenizer)} tokens but config.json's "
            f"vocab_size is {vocab_size}: {shown}{more} have no row in the model's embedding. "
            "A prompt, template or response holding one indexes past it (a CUDA device-side "
            "assert in the actor or the vLLM engines; vLLM accepts ids up to the tokenizer's "
            "largest). Resize the embedding to the tokenizer (model.resize_token_embeddings"
            f"({len(tokenizer)}), then save_pretrained) or remove the added tokens from "
            "tokenizer.json",
        )
    ]


def context(config: dict) -> tuple[int, int, str] | None:
    """``(positions, limit, scaling)``: the model's trained positions, the longest
    max_model_len vLLM accepts (positions times a RoPE scaling factor, as vLLM derives it)
    and the scaling in words ("" without one); None when config.json names no length."""
    lengths = [config[k] for k in POSITION_KEYS if isinstance(config.get(k), int)]
    if isinstance(config.get("model_max_length"), int):
        lengths = [config["model_max_length"]]
    if not lengths:
        return None
    positions = base = min(lengths)
    rope = config.get("rope_parameters") or config.get("rope_scaling")
    if not isinstance(rope, dict) or "gemma3" in str(config.get("model_type")):
        return positions, positions, ""  # Gemma 3's length is already the scaled one
    layers = list(rope.values()) if all(isinstance(v, dict) for v in rope.values()) else [rope]
    factor, kind = 1.0, ""
    for layer in layers:
        kind = str(layer.get("rope_type") or layer.get("type") or "default")
        if kind not in SCALED_ALREADY:
            factor = layer.get("factor") or factor
            if kind == "yarn":
                base = layer.get("original_max_position_embeddings") or base
    if factor == 1.0:
        return positions, positions, ""
    return positions, int(base * factor), f"{kind} rope scaling x{factor:g}"


def length_findings(checkpoint: Checkpoint, max_len: int) -> list[Finding]:
    """``--data.max_len`` (OpenRLHF 0.11.2's whole budget: prompt + response, and vLLM's
    ``max_model_len``; ``--rollout.max_new_tokens`` is part of it) within the model's
    context. Beyond what vLLM derives it refuses to start its engines; between the trained
    positions and a RoPE scaling's reach the run works on the scaled positions."""
    found = context(checkpoint.config)
    if found is None or max_len <= found[0]:
        return []
    positions, limit, scaling = found
    where = f"{checkpoint.directory}/config.json"
    if max_len <= limit:
        return [
            Finding(
                False,
                f"--data.max_len {max_len} is beyond the {positions} positions of {where}; "
                f"its {scaling} extends the context to {limit} (vLLM and the actor both apply "
                "it), so the run starts, and responses that long rely on the scaling",
            )
        ]
    allowed = os.environ.get(LONG_LEN_ENV, "0").strip().lower() in ("1", "true")
    scaled = f" ({scaling}: {limit})" if scaling else ""
    return [
        Finding(
            not allowed,
            f"--data.max_len {max_len} (prompt + response; vLLM's max_model_len) is beyond the "
            f"context of {where}: {positions} positions{scaled}. "
            + (
                f"{LONG_LEN_ENV} is set, so vLLM starts, but positions past {limit} were "
                "never trained (RoPE models give garbage or NaN there)"
                if allowed
                else "vLLM refuses to start its engines with a longer max_model_len. Lower "
                f"--data.max_len to {limit} or less (the recipes: PROMPT_MAX_LEN + "
                "MAX_NEW_TOKENS), or train a model with a longer context"
            ),
        )
    ]


def findings(checkpoint: Checkpoint, max_len: int, chat_template: bool) -> list[Finding]:
    return [
        *eos_findings(checkpoint),
        *pad_findings(checkpoint),
        *template_findings(checkpoint, chat_template),
        *vocab_findings(checkpoint),
        *length_findings(checkpoint, max_len),
    ]


def check_checkpoint(name: str, max_len: int, chat_template: bool) -> list[str]:
    """The warnings for ``--actor.model_name_or_path name``; raises ``ValueError`` with
    every error (one line: the sweep reports a run's last line)."""
    checkpoint = read_checkpoint(name)
    if checkpoint is None:
        return []
    found = findings(checkpoint, max_len, chat_template)
    errors = [f.message for f in found if f.error]
    if errors:
        raise ValueError(f"--actor.model_name_or_path {name}: " + " Also: ".join(errors))
    return [f.message for f in found]
