"""A tiny, offline-built causal LM directory for tests and CPU demos.

No model hub is reachable on the development machines, so tests cannot download even a small
model. This module trains a byte-level BPE tokenizer on a built-in corpus of arithmetic
reasoning text and pairs it with a randomly initialised two-layer model (~100K parameters).
The directory it writes loads with ``AutoTokenizer`` / ``AutoModelForCausalLM`` like any
Hugging Face checkpoint, has a chat template, and generates (random text).

Two architectures, after the models the paper fine-tunes:

- ``qwen2`` (default), like DeepSeek-R1-Distill-Qwen-1.5B/7B: q/k/v biases, tied embeddings,
  ChatML (``<|im_start|>``, ``<|im_end|>`` as EOS, ``<|endoftext|>`` as padding), Qwen2's
  pre-tokenisation (digits split one by one);
- ``llama``, like DeepSeek-R1-Distill-Llama-8B (``LlamaForCausalLM``): no biases, untied
  embeddings and LM head, llama3 RoPE scaling, grouped-query attention, Llama 3's
  pre-tokenisation (digits in runs of up to three), a BOS token the tokenizer adds and the
  chat template writes, and DeepSeek's chat format: the system text first, then
  ``<｜User｜>`` and ``<｜Assistant｜>`` turns, EOS ``<｜end▁of▁sentence｜>`` (also padding).

In both, ``<think>`` and ``</think>`` are single added tokens but *not* special, so decoding
with ``skip_special_tokens=True`` keeps them, as the math reward needs ``</think>`` in the
response text.

Usage: ``python -m drpo_openrlhf.models.tiny OUTPUT_DIR [--seed N] [--architecture llama]``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
END_OF_TEXT = "<|endoftext|>"
THINK_TOKENS = ("<think>", "</think>")
SPECIAL_TOKENS = (END_OF_TEXT, IM_START, IM_END)

# Qwen2's pre-tokenisation (single digits, letters runs, punctuation runs, whitespace). We
# must use exactly this pipeline (plus NFC): transformers 5 loads every ``qwen2``-typed
# checkpoint's tokenizer as ``Qwen2Tokenizer``, which rebuilds it around our vocab and merges.
QWEN_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# The Llama variant's tokens and format (DeepSeek-R1-Distill-Llama's, fullwidth bars).
LLAMA_BOS = "<｜begin▁of▁sentence｜>"
LLAMA_EOS = "<｜end▁of▁sentence｜>"
LLAMA_USER, LLAMA_ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
# Llama 3's split: as Qwen2's, but digits are kept together in runs of up to three.
LLAMA_PRETOKENIZE_REGEX = QWEN_PRETOKENIZE_REGEX.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
# BOS, the system texts, then the turns; an earlier assistant turn keeps only its answer
# (the text after ``</think>``), as DeepSeek's template does. The generation prompt is the
# bare assistant marker of the models' first release (a later revision also opens
# ``<think>`` and a newline; the math reward needs only the closing ``</think>`` in the response).
LLAMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages if message['role'] == 'system' %}"
    "{{ message['content'] }}"
    "{% endfor %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<｜Assistant｜>' + message['content'].split('</think>')[-1] + eos_token }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)
ARCHITECTURES = ("qwen2", "llama")

# Written last; its presence (with the same seed and format) marks a complete build.
STAMP_FILE = "tiny_model.json"
FORMAT_VERSION = 2

VOCAB_SIZE = 512
HIDDEN_SIZE = 64
NUM_LAYERS = 2
NUM_HEADS = 2
NUM_KV_HEADS = 1
INTERMEDIATE_SIZE = 128
MAX_POSITIONS = 4096


def _corpus() -> list[str]:
    """Arithmetic problems with think-then-boxed answers, the shape of the real rollouts."""
    lines = [
        "system user assistant: You are a helpful assistant.",
        "Let's think step by step and output the final answer within \\boxed{}.",
        "What is the value of the expression? Compute the sum, the product and the answer.",
        "Wait, let me check that again. So the total is correct. Therefore the answer is",
        "The final answer is \\boxed{42}. Hmm, first, we add the numbers, then we multiply.",
        "\\frac{1}{2} + \\frac{1}{3} = \\frac{5}{6}, and \\sqrt{16} = 4, x^2 - 1 = (x-1)(x+1).",
    ]
    for a in range(0, 20):
        b = (7 * a + 3) % 13
        lines.append(
            f"What is {a} + {b}? <think>\nWe add {a} and {b} to get {a + b}.\n</think>\n"
            f"The answer is \\boxed{{{a + b}}}."
        )
        lines.append(
            f"Compute {a} * {b} - {b}. <think>\n{a} * {b} = {a * b}, so {a * b} - {b} = "
            f"{a * b - b}.\n</think>\n\\boxed{{{a * b - b}}}"
        )
    return lines


def _train_bpe(pretokenize_regex: str, special_tokens: list[str], plain_tokens: list[str]):
    """A byte-level BPE trained on the corpus; ``plain_tokens`` are added whole but not
    special (kept by ``skip_special_tokens``)."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pretokenize_regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(plain_tokens),
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain_tokens])
    return tokenizer


def _train_tokenizer(architecture: str = "qwen2"):
    """Trains the byte-level BPE of ``architecture`` and wraps it for transformers."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    if architecture == "llama":
        tokenizer = _train_bpe(
            LLAMA_PRETOKENIZE_REGEX,
            [LLAMA_BOS, LLAMA_EOS],
            [LLAMA_USER, LLAMA_ASSISTANT, *THINK_TOKENS],
        )
        # ``tokenizer(text)`` starts with BOS, as Llama 3's does; templates write it themselves
        bos_id = tokenizer.token_to_id(LLAMA_BOS)
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{LLAMA_BOS} $A", pair=f"{LLAMA_BOS} $A {LLAMA_BOS} $B",
            special_tokens=[(LLAMA_BOS, bos_id)],
        )  # fmt: skip
        wrapped = PreTrainedTokenizerFast(
            tokenizer_object=tokenizer,
            bos_token=LLAMA_BOS,
            eos_token=LLAMA_EOS,
            pad_token=LLAMA_EOS,
        )
        wrapped.chat_template = LLAMA_CHAT_TEMPLATE
        return wrapped
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=_train_bpe(QWEN_PRETOKENIZE_REGEX, list(SPECIAL_TOKENS), [*THINK_TOKENS]),
        eos_token=IM_END,
        pad_token=END_OF_TEXT,
        additional_special_tokens=[IM_START],
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def model_config(tokenizer, architecture: str, **sizes):
    """The architecture's config for ``tokenizer``'s vocabulary and special tokens.

    ``sizes`` (hidden_size, num_hidden_layers, ...) override the tiny defaults."""
    from transformers import LlamaConfig, Qwen2Config

    settings = dict(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    settings.update(sizes)
    if architecture == "llama":
        positions = settings["max_position_embeddings"]
        # the 8B's RoPE: llama3 scaling by 8 beyond an original context (16x shorter there)
        rope = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0)
        rope.update(high_freq_factor=4.0, original_max_position_embeddings=positions // 16)
        return LlamaConfig(
            **settings,
            bos_token_id=tokenizer.bos_token_id,
            tie_word_embeddings=False,
            attention_bias=False,
            mlp_bias=False,
            rope_parameters=rope,
        )
    return Qwen2Config(**settings, bos_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)


def build_model(config, seed: int):
    """A randomly initialised causal LM of ``config`` (seeded without touching the caller's
    global RNG), with the generation config the tokens need."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    return model


def _stamp(seed: int, architecture: str) -> dict:
    stamp = {"format": FORMAT_VERSION, "seed": seed}
    return stamp if architecture == "qwen2" else {**stamp, "architecture": architecture}


def _is_complete(directory: Path, seed: int, architecture: str) -> bool:
    stamp = directory / STAMP_FILE
    if not stamp.is_file():
        return False
    return json.loads(stamp.read_text()) == _stamp(seed, architecture)


def build_tiny_model(output_dir: str | Path, seed: int = 0, architecture: str = "qwen2") -> Path:
    """Writes the tiny model + tokenizer to ``output_dir`` and returns its path.

    ``architecture``: ``qwen2`` or ``llama`` (the module's docstring). Idempotent: a directory
    already holding a complete build with the same seed and architecture is returned
    untouched. The build happens in a sibling temporary directory that is renamed into place,
    so an interrupted build never leaves a half-written model behind. Refuses to overwrite a
    non-empty directory that is not such a build.
    """
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {ARCHITECTURES}, got {architecture!r}")
    output_dir = Path(output_dir)
    if _is_complete(output_dir, seed, architecture):
        return output_dir
    if output_dir.exists() and any(output_dir.iterdir()):
        raise FileExistsError(
            f"{output_dir} is not empty and holds no tiny {architecture} model with seed {seed}"
        )

    output_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.", dir=output_dir.parent))
    try:
        tokenizer = _train_tokenizer(architecture)
        model = build_model(model_config(tokenizer, architecture), seed)
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / STAMP_FILE).write_text(json.dumps(_stamp(seed, architecture)))
        if output_dir.exists():
            output_dir.rmdir()
        staging.rename(output_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return output_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--architecture", choices=ARCHITECTURES, default="qwen2")
    args = parser.parse_args(argv)
    print(build_tiny_model(args.output_dir, seed=args.seed, architecture=args.architecture))


if __name__ == "__main__":
    main()
