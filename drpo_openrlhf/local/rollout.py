"""Rollouts with Hugging Face ``generate`` and the token log-probs the updates need.

Single-process counterpart of OpenRLHF's vLLM rollouts: ``n`` samples per prompt, kept
together as consecutive rows (a prompt's group), with the response masks and lengths
counted the way the rest of the project counts them (EOS included, as in
``eval.generation.HFBackend``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
from torch import Tensor


@dataclass(frozen=True)
class Rollout:
    """Sampled responses, one row each; the ``n`` rows of a prompt are consecutive.

    ``sequences`` holds the left-padded prompt (``prompt_width`` columns) followed by the
    response; ``response_mask`` marks response tokens up to and including EOS.
    """

    sequences: Tensor
    attention_mask: Tensor
    response_mask: Tensor
    group_ids: Tensor
    truncated: Tensor
    texts: tuple[str, ...]
    prompt_width: int

    @property
    def num_tokens(self) -> Tensor:
        return self.response_mask.sum(dim=-1)

    def select(self, rows: Sequence[int]) -> Rollout:
        """The rows ``rows`` (a micro-batch), in that order."""
        index = torch.as_tensor(list(rows), dtype=torch.long)
        values = {
            f.name: getattr(self, f.name)[index]
            for f in fields(self)
            if isinstance(getattr(self, f.name), Tensor)
        }
        return Rollout(
            **values, texts=tuple(self.texts[i] for i in index), prompt_width=self.prompt_width
        )


@torch.no_grad()
def generate_rollout(
    model,
    tokenizer,
    prompt_ids: Sequence[Sequence[int]],
    *,
    n: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    seed: int,
) -> Rollout:
    """``n`` samples for each prompt in one ``generate`` call, seeded in a forked RNG state.

    The rollout's tensors live on the model's device."""
    from transformers import GenerationConfig

    pad_id = tokenizer.pad_token_id
    eos_id = tokenizer.eos_token_id
    device = model.device
    width = max(len(ids) for ids in prompt_ids)
    input_ids = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, ids in enumerate(prompt_ids):
        input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, width - len(ids) :] = 1
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    config = GenerationConfig(
        do_sample=True,
        temperature=temperature,
        top_p=top_p,
        top_k=0,
        repetition_penalty=1.0,
        max_new_tokens=max_new_tokens,
        num_return_sequences=n,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    was_training = model.training
    model.eval()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        output = model.generate(
            input_ids=input_ids, attention_mask=attention_mask, generation_config=config
        )
    model.train(was_training)
    responses = output[:, width:]
    is_eos = responses == eos_id
    has_eos = is_eos.any(dim=-1)
    # Tokens up to and including the first EOS; all of them when there is none (truncated).
    first_eos = torch.where(has_eos, is_eos.int().argmax(dim=-1), responses.shape[1] - 1)
    positions = torch.arange(responses.shape[1], device=device)
    response_mask = (positions[None, :] <= first_eos[:, None]).long()
    texts = tuple(
        tokenizer.decode(tokens[: int(length)], skip_special_tokens=True)
        for tokens, length in zip(responses, response_mask.sum(-1) - has_eos.long(), strict=True)
    )
    return Rollout(
        sequences=output,
        attention_mask=torch.cat([attention_mask.repeat_interleave(n, dim=0), response_mask], 1),
        response_mask=response_mask,
        group_ids=torch.arange(len(prompt_ids), device=device).repeat_interleave(n),
        truncated=~has_eos,
        texts=texts,
        prompt_width=width,
    )


def token_log_probs(model, rollout: Rollout, temperature: float) -> Tensor:
    """``log pi(o_t | q, o_<t)`` of every response position, shape ``(B, T)``.

    Logits are divided by the sampling temperature, as OpenRLHF and the authors' code do.
    Position ids follow the attention mask, as ``generate`` computed them for left-padded
    prompts; positions after EOS are garbage and masked out by ``response_mask``.
    """
    position_ids = (rollout.attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(
        input_ids=rollout.sequences,
        attention_mask=rollout.attention_mask,
        position_ids=position_ids,
    ).logits
    width = rollout.prompt_width
    logits = logits[:, width - 1 : -1]
    # at least float32 (half-precision log-softmax is too coarse), float64 stays float64
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    targets = rollout.sequences[:, width:]
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
