"""A tiny, offline-built causal LM directory for tests and CPU demos.

No model hub is reachable on the development machines, so tests cannot download even a small
model. This module trains a byte-level BPE tokenizer on a built-in corpus of arithmetic
reasoning text and pairs it with a randomly initialised two-layer Qwen2 model (~100K
parameters). The directory it writes loads with ``AutoTokenizer`` / ``AutoModelForCausalLM``
like any Hugging Face checkpoint, has a ChatML chat template, and generates (random text).

Token choices mirror the DeepSeek-R1-Distill-Qwen models the paper fine-tunes:
``<|im_start|>``, ``<|im_end|>`` and ``<|endoftext|>`` are special tokens (``<|im_end|>`` is
EOS, ``<|endoftext|>`` is padding); ``<think>`` and ``</think>`` are single added tokens but
*not* special, so decoding with ``skip_special_tokens=True`` keeps them, as the math reward
needs ``</think>`` in the response text. Pre-tokenisation is Qwen2's (digits split one by one).

Usage: ``python -m drpo_openrlhf.tiny_model OUTPUT_DIR [--seed N]``.
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


def _train_tokenizer():
    """Trains the byte-level BPE and wraps it for transformers."""
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
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(THINK_TOKENS),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=IM_END,
        pad_token=END_OF_TEXT,
        additional_special_tokens=[IM_START],
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def _build_model(tokenizer, seed: int):
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    pad_id = tokenizer.convert_tokens_to_ids(END_OF_TEXT)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    # Seed only a private generator state: callers' global RNG stays untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=pad_id, eos_token_id=eos_id, pad_token_id=pad_id
    )
    return model


def _is_complete(directory: Path, seed: int) -> bool:
    stamp = directory / STAMP_FILE
    if not stamp.is_file():
        return False
    recorded = json.loads(stamp.read_text())
    return recorded == {"format": FORMAT_VERSION, "seed": seed}


def build_tiny_model(output_dir: str | Path, seed: int = 0) -> Path:
    """Writes the tiny model + tokenizer to ``output_dir`` and returns its path.

    Idempotent: a directory already holding a complete build with the same seed is returned
    untouched. The build happens in a sibling temporary directory that is renamed into place,
    so an interrupted build never leaves a half-written model behind. Refuses to overwrite a
    non-empty directory that is not such a build.
    """
    output_dir = Path(output_dir)
    if _is_complete(output_dir, seed):
        return output_dir
    if output_dir.exists() and any(output_dir.iterdir()):
        raise FileExistsError(f"{output_dir} is not empty and holds no tiny model with seed {seed}")

    output_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.", dir=output_dir.parent))
    try:
        tokenizer = _train_tokenizer()
        model = _build_model(tokenizer, seed)
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / STAMP_FILE).write_text(json.dumps({"format": FORMAT_VERSION, "seed": seed}))
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
    args = parser.parse_args(argv)
    print(build_tiny_model(args.output_dir, seed=args.seed))


if __name__ == "__main__":
    main()
