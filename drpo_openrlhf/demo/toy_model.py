"""The demo's policy before fine-tuning: a small random Qwen2 with the tiny test tokenizer.

``drpo_openrlhf.tiny_model`` already builds, offline, a tokenizer whose corpus covers the toy
task's text (digits one per token, ``<think>``, ``\\boxed``, "Wait, let me check"); its
100K-parameter model is too small to learn multi-step addition in minutes, so this module
keeps that tokenizer and configuration and only changes the network's size.
"""

from __future__ import annotations

from pathlib import Path

from drpo_openrlhf.tiny_model import build_tiny_model

HEAD_DIM = 32


def build_toy_model(
    output_dir: str | Path,
    *,
    hidden_size: int = 128,
    num_layers: int = 3,
    seed: int = 0,
) -> Path:
    """Writes a randomly initialised model + tokenizer to ``output_dir`` (an HF directory).

    Heads are ``HEAD_DIM`` wide: the smallest head size vLLM's CPU attention supports."""
    if hidden_size % HEAD_DIM:
        raise ValueError(f"hidden_size must be a multiple of {HEAD_DIM}, got {hidden_size}")
    num_heads = hidden_size // HEAD_DIM
    import torch
    from transformers import (
        AutoConfig,
        AutoTokenizer,
        GenerationConfig,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    output_dir = Path(output_dir)
    tiny = build_tiny_model(output_dir.parent / f".{output_dir.name}-tokenizer", seed=seed)
    settings = AutoConfig.from_pretrained(tiny).to_dict()
    settings.pop("layer_types", None)  # derived from the number of layers
    settings.update(
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=512,
    )
    config = Qwen2Config(**settings)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig.from_pretrained(tiny)
    model.save_pretrained(output_dir)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(output_dir)
    return output_dir
