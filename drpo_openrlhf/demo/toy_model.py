"""The demo's policy before fine-tuning: a small random Qwen2 (or Llama) with the tiny test
tokenizer.

``drpo_openrlhf.models.tiny`` already builds, offline, a tokenizer whose corpus covers the toy
task's text (digits, ``<think>``, ``\\boxed``, "Wait, let me check"); its 100K-parameter model
is too small to learn multi-step addition in minutes, so this module keeps that tokenizer and
architecture and only changes the network's size. ``architecture="llama"`` gives the 8B
recipe's architecture and chat format (``models.tiny``'s docstring) at the same size.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from drpo_openrlhf.models.tiny import build_model, build_tiny_model, model_config

HEAD_DIM = 32


def build_toy_model(
    output_dir: str | Path,
    *,
    hidden_size: int = 128,
    num_layers: int = 3,
    seed: int = 0,
    architecture: str = "qwen2",
) -> Path:
    """Writes a randomly initialised model + tokenizer to ``output_dir`` (an HF directory).

    Heads are ``HEAD_DIM`` wide: the smallest head size vLLM's CPU attention supports. The
    Llama variant groups two query heads per key/value head where it can, as the 8B does."""
    if hidden_size % HEAD_DIM:
        raise ValueError(f"hidden_size must be a multiple of {HEAD_DIM}, got {hidden_size}")
    num_heads = hidden_size // HEAD_DIM
    from transformers import AutoTokenizer, GenerationConfig

    output_dir = Path(output_dir)
    with tempfile.TemporaryDirectory() as scratch:  # only its tokenizer and generation config
        tiny = build_tiny_model(Path(scratch) / "tiny", seed=seed, architecture=architecture)
        tokenizer = AutoTokenizer.from_pretrained(tiny)
        generation_config = GenerationConfig.from_pretrained(tiny)
    grouped = architecture == "llama" and num_heads % 2 == 0
    config = model_config(
        tokenizer,
        architecture,
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads // 2 if grouped else num_heads,
        max_position_embeddings=512,
    )
    model = build_model(config, seed)
    model.generation_config = generation_config
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return output_dir
