"""Supervised fine-tuning of the demo's base policy on toy reasoning traces.

The RL methods need a starting policy that already solves the task verbosely and
imperfectly; a couple of minutes of next-token training on ``toy_task`` traces gives one.
Only response tokens (and the closing EOS) are trained, the prompt goes through the chat
template exactly as rollouts and evaluation encode it.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from drpo_openrlhf.eval.runner import encode_prompt


@dataclass(frozen=True)
class SFTConfig:
    steps: int = 600
    batch_size: int = 64
    lr: float = 3e-3
    warmup_steps: int = 30
    weight_decay: float = 0.01
    seed: int = 0


def encode_pair(tokenizer, prompt: str, response: str) -> tuple[list[int], int]:
    """Token ids of prompt + response + EOS, and where the response starts."""
    prompt_ids = encode_prompt(tokenizer, prompt)
    response_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
    return prompt_ids + response_ids + [tokenizer.eos_token_id], len(prompt_ids)


def _batches(
    pairs: Iterator[tuple[str, str]], tokenizer, batch_size: int, rng: random.Random
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Right-padded ``(input_ids, attention_mask, labels)``; each chunk of 8 batches is sorted
    by length first so that little compute goes to padding."""
    pad = tokenizer.pad_token_id
    while True:
        chunk = [encode_pair(tokenizer, *next(pairs)) for _ in range(8 * batch_size)]
        chunk.sort(key=lambda item: len(item[0]))
        groups = [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
        rng.shuffle(groups)
        for group in groups:
            width = max(len(ids) for ids, _ in group)
            input_ids = torch.full((len(group), width), pad, dtype=torch.long)
            attention_mask = torch.zeros_like(input_ids)
            labels = torch.full_like(input_ids, -100)
            for row, (ids, start) in enumerate(group):
                input_ids[row, : len(ids)] = torch.tensor(ids)
                attention_mask[row, : len(ids)] = 1
                labels[row, start : len(ids)] = input_ids[row, start : len(ids)]
            yield input_ids, attention_mask, labels


def train_sft(
    model_dir: str | Path,
    output_dir: str | Path,
    pairs: Iterator[tuple[str, str]],
    config: SFTConfig,
    *,
    progress: bool = True,
) -> Path:
    """Fine-tunes ``model_dir`` on ``(prompt, response)`` pairs; saves to ``output_dir``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    torch.manual_seed(config.seed)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.lr, weight_decay=config.weight_decay
    )

    def schedule(step: int) -> float:  # linear warm-up, then linear decay to 10%
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        rest = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
        return 1.0 - 0.9 * rest

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    batches = _batches(pairs, tokenizer, config.batch_size, random.Random(config.seed))
    bar = tqdm(range(config.steps), desc="sft", unit="step", disable=not progress)
    for _ in bar:
        input_ids, attention_mask, labels = next(batches)
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
        # Sum over tokens, mean over examples: batches are sorted by length, and a per-batch
        # token mean would give the decisions of short traces (e.g. skipping the steps) more
        # weight than random batching does.
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), reduction="sum"
        ) / len(labels)
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.3f}")
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return Path(output_dir)
