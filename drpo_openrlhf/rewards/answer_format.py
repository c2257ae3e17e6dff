"""Whether a model's answers follow a ``</think>``, decided from its chat template.

The math and K&K graders read the answer after ``</think>`` (the DRPO authors' contract for
R1-style models) and score 0 a response without one, so a model that never thinks (a ChatML
or Llama 3 instruct model) would score 0 on every answer, silently. The entry point,
drpo-eval and the sweep therefore decide once, here, from the template the prompts are
rendered with, unless a flag says which:

- ``thinking`` (``</think>`` required): what the template writes after the user's turn (its
  generation prompt) opens ``<think>`` (DeepSeek-R1, QwQ), or the template drops an earlier
  answer's reasoning before ``</think>`` from the conversation (DeepSeek-R1-Distill's first
  release, whose generation prompt is the bare assistant marker);
- ``plain`` (the whole response is the answer, or the text after a ``</think>`` if one is
  written): neither (ChatML, Llama 3), or the generation prompt closes an empty thinking
  block itself;
- refused (``AnswerFormatError``): a template variable named like a thinking switch (Qwen3's
  ``enable_thinking``) changes the generation prompt, so the template cannot say;
- no template: ``thinking``, the authors' default, said in the decision's line.

The template is rendered (transformers' renderer, as ``apply_chat_template`` renders it) with
and without the generation prompt rather than searched for strings: most thinking templates
mention ``<think>`` in their history handling too, and only what the rendered prompt ends
with says what the model is asked to write next. Importing this module is cheap;
transformers is imported when a template is rendered.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from drpo_openrlhf.rewards.answer_extraction import THINK_END

FORMATS = ("auto", "thinking", "plain")
# What the plugins read when no caller passes ``require_think_end`` (stock OpenRLHF).
ENV_FALLBACK = "DRPO_REWARD_REQUIRE_THINK_END"
THINK_START = "<think>"
# Where a local model keeps its template, in transformers 5's order of precedence: the
# default template file, the default of a ``chat_templates/`` folder, then the older
# ``chat_template`` entry of tokenizer_config.json (a string, or a list of named templates).
TEMPLATE_FILES = ("chat_template.jinja", "chat_templates/default.jinja")
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")
# Markers of the probe conversations: plain words, which no template rewrites.
_QUESTION, _FIRST = "drpo-probe-question", "drpo-probe-first"
_REASONING, _ANSWER = "drpo-probe-reasoning", "drpo-probe-answer"
_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")
_RENDER_ARGUMENTS = {"messages", "add_generation_prompt", "tools", "documents"}


class AnswerFormatError(ValueError):
    """The answer format cannot be decided without the flag (the message says why)."""


@dataclass(frozen=True)
class AnswerFormat:
    """``thinking`` or ``plain``, why, and whether a flag said so (not the template)."""

    name: str
    reason: str
    explicit: bool = False

    @property
    def require_think_end(self) -> bool:
        return self.name == "thinking"

    def line(self) -> str:
        return f"answer format: {self.name} ({self.reason})"


@dataclass(frozen=True)
class ChatTemplate:
    """A model's default chat template, the special tokens it may write, and where it was
    found (named in the decision's line)."""

    text: str
    special_tokens: dict[str, str]
    source: str


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json stores it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _json_file(file: Path) -> dict:
    return json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}


def _template_from_config(config: dict, model: str) -> str | None:
    entry = config.get("chat_template")
    if isinstance(entry, list):  # named templates: the one transformers uses by default
        named = {t.get("name"): t.get("template") for t in entry if isinstance(t, dict)}
        if named and "default" not in named:
            raise AnswerFormatError(
                f"{model}: tokenizer_config.json names chat templates {sorted(map(str, named))} "
                "but no 'default' one"
            )
        entry = named.get("default")
    return entry if isinstance(entry, str) and entry.strip() else None


def read_local_template(model_dir: Path) -> ChatTemplate | None:
    """The default chat template of a local model directory, or None when it has none."""
    config = _json_file(model_dir / "tokenizer_config.json")
    tokens_map = _json_file(model_dir / "special_tokens_map.json")
    tokens = {}
    for name in SPECIAL_TOKENS:
        text = _token_text(config.get(name)) or _token_text(tokens_map.get(name))
        if text is not None:
            tokens[name] = text
    for name in TEMPLATE_FILES:
        file = model_dir / name
        if file.is_file():
            return ChatTemplate(file.read_text(encoding="utf-8"), tokens, name)
    text = _template_from_config(config, str(model_dir))
    return ChatTemplate(text, tokens, "tokenizer_config.json's chat_template") if text else None


def _hub_snapshot(model: str) -> Path:
    """The local snapshot folder of a Hub model's tokenizer config and template files; raises
    when even the config cannot be had. The cache answers first: when it holds the config and
    knows of every template file (cached, or known missing), no request is made. Otherwise one
    request without retries tells whether the Hub can be reached: a login node without
    internet would wait out the Hub client's back-off (five retries, 23 s) on every file, and
    then reads what the cache has, as transformers does offline."""
    from huggingface_hub import (
        get_hf_file_metadata,
        hf_hub_download,
        hf_hub_url,
        try_to_load_from_cache,
    )

    names = ("tokenizer_config.json", *TEMPLATE_FILES, "special_tokens_map.json")
    cached = {name: try_to_load_from_cache(model, name) for name in names}
    config = cached["tokenizer_config.json"]
    if isinstance(config, str) and all(found is not None for found in cached.values()):
        return Path(config).parent
    try:
        get_hf_file_metadata(hf_hub_url(model, "tokenizer_config.json"), timeout=10)
    except Exception:
        if isinstance(config, str):
            return Path(config).parent
        raise
    folder = Path(hf_hub_download(model, "tokenizer_config.json")).parent
    for name in names[1:]:
        try:
            hf_hub_download(model, name)
        except Exception:
            continue
    return folder


def read_chat_template(model: str) -> ChatTemplate | None:
    """``model``'s default chat template: from the files of a local directory or of a Hub
    model's snapshot. Raises ``OSError`` (and the Hub's errors) when they cannot be read."""
    path = Path(model).expanduser()
    return read_local_template(path if path.is_dir() else _hub_snapshot(model))


def _render(template: ChatTemplate, messages: list[dict], generation: bool, **extra) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(
        [messages],
        chat_template=template.text,
        add_generation_prompt=generation,
        **{**template.special_tokens, **extra},
    )
    return rendered[0]


def _after_question(template: ChatTemplate, generation: bool, **extra) -> str:
    """What the template writes after a one-question conversation's question."""
    text = _render(template, [{"role": "user", "content": _QUESTION}], generation, **extra)
    at = text.rfind(_QUESTION)
    if at < 0:
        raise ValueError("the rendered prompt does not hold the user's message")
    return text[at + len(_QUESTION) :]


def _switches(template: ChatTemplate) -> dict[str, tuple[str, str]]:
    """Variables named like a thinking switch that change the generation prompt: name ->
    (what follows the question with it True, with it False). A name that is no variable
    changes nothing and is dropped, so the names need only be candidates."""
    names = {
        name
        for name in _IDENTIFIER.findall(template.text)
        if ("think" in name.lower() or "reason" in name.lower()) and name not in _RENDER_ARGUMENTS
    }
    found = {}
    for name in sorted(names):
        try:
            on = _after_question(template, True, **{name: True})
            off = _after_question(template, True, **{name: False})
        except Exception:
            continue  # a value the template refuses is no switch we can use
        if on != off:
            found[name] = (on, off)
    return found


def _drops_reasoning(template: ChatTemplate) -> bool:
    """The template keeps an earlier answer but not its reasoning before ``</think>``."""
    messages = [
        {"role": "user", "content": _FIRST},
        {"role": "assistant", "content": f"{THINK_START}\n{_REASONING}\n{THINK_END}\n\n{_ANSWER}"},
        {"role": "user", "content": _QUESTION},
    ]
    try:
        text = _render(template, messages, True)
    except Exception:
        return False  # a template without earlier turns: no evidence either way
    return _ANSWER in text and _REASONING not in text


def _prompt(tail: str, without: str) -> str:
    """The generation prompt: what the template adds after the question when asked to."""
    return tail[len(without) :] if tail.startswith(without) else tail


def _short(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def decide(
    template: ChatTemplate | None,
    flag: str = "auto",
    *,
    model: str = "the model",
    option: str = "--drpo.answer_format",
) -> AnswerFormat:
    """The answer format ``flag`` (one of ``FORMATS``) asks for, or ``template``'s for
    ``auto``; raises ``AnswerFormatError`` when the template has a thinking switch or cannot
    be rendered. ``model`` and ``option`` name the model and the flag in the messages."""
    if flag not in FORMATS:
        raise AnswerFormatError(f"{option} must be one of {FORMATS}, got {flag!r}")
    if flag != "auto":
        return AnswerFormat(flag, f"{option} {flag}", explicit=True)
    if template is None:
        return AnswerFormat(
            "thinking",
            f"{model} has no chat template: the authors' default, answers after {THINK_END}; "
            f"{option} plain for a model that does not think",
        )
    where = template.source
    try:
        tail = _after_question(template, True)
        without = _after_question(template, False)
    except Exception as error:
        raise AnswerFormatError(
            f"{model}: {where} does not render a one-question conversation "
            f"({type(error).__name__}: {error}); say the answer format with {option} thinking "
            "or plain"
        ) from None
    switches = _switches(template)
    if switches:
        name, (on, off) = next(iter(switches.items()))
        default = "as with True" if tail == on else "as with False" if tail == off else "neither"
        raise AnswerFormatError(
            f"{model}: {where} has a thinking switch ({', '.join(switches)}): its generation "
            f"prompt is {_short(_prompt(on, without))} with {name}=True and "
            f"{_short(_prompt(off, without))} with {name}=False, and OpenRLHF renders prompts "
            f"without it ({default}). Whether answers follow {THINK_END} is for you to say: "
            f"{option} thinking or {option} plain"
        )
    prompt = _prompt(tail, without)
    opened, closed = tail.rfind(THINK_START), tail.rfind(THINK_END)
    if opened >= 0 and opened > closed:
        return AnswerFormat(
            "thinking", f"the generation prompt of {where} opens {THINK_START}: {_short(prompt)}"
        )
    if opened >= 0:
        return AnswerFormat(
            "plain",
            f"the generation prompt of {where} closes an empty thinking block: {_short(prompt)}",
        )
    if _drops_reasoning(template):
        return AnswerFormat(
            "thinking",
            f"{where} drops an earlier answer's reasoning before {THINK_END}, as "
            "DeepSeek-R1-Distill's does",
        )
    return AnswerFormat(
        "plain",
        f"the generation prompt of {where}, {_short(prompt)}, opens no {THINK_START}: "
        f"answers are graded whole, or after a {THINK_END} if one is written",
    )


def answer_format(
    model: str, flag: str = "auto", option: str = "--drpo.answer_format"
) -> AnswerFormat:
    """The answer format of ``model`` under ``flag``: ``decide`` on its chat template, not
    read when the flag says which. A Hub model whose files cannot be had here (offline and
    not cached) keeps the default, ``thinking``, and its line says why."""
    if flag != "auto":
        return decide(None, flag, model=model, option=option)
    if Path(model).expanduser().is_dir():
        return decide(read_chat_template(model), flag, model=model, option=option)
    try:
        template = read_chat_template(model)
    except Exception as error:
        return AnswerFormat(
            "thinking",
            f"cannot read the chat template of {model} here ({type(error).__name__}): the "
            f"authors' default, answers after {THINK_END}; {option} plain for a model that "
            "does not think",
        )
    return decide(template, flag, model=model, option=option)
