"""Sampling settings, the backend interface and the Hugging Face ``generate`` backend.

A backend turns chat-templated prompt token ids into ``n`` sampled responses each. Two
exist: vLLM for GPU evaluation at the paper's scale (``vllm_backend.py``), and plain
``transformers`` generation here, for CPU, tiny models and tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class SamplingSettings:
    """What defines the distribution sampled from; defaults are the paper's protocol."""

    n: int = 16
    temperature: float = 0.6
    top_p: float = 0.95
    max_new_tokens: int = 8192
    seed: int = 0

    def __post_init__(self) -> None:
        if self.n < 1 or self.max_new_tokens < 1:
            raise ValueError("n and max_new_tokens must be positive")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError("need temperature >= 0 and 0 < top_p <= 1")


@dataclass(frozen=True)
class Sample:
    """One response. ``num_tokens`` counts the EOS token when the response stopped on it;
    ``truncated`` means it hit ``max_new_tokens`` instead."""

    text: str
    num_tokens: int
    truncated: bool


class GenerationBackend(Protocol):
    """Generates ``sampling.n`` responses for each prompt, in prompt order."""

    def generate(
        self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingSettings, seed: int
    ) -> list[list[Sample]]: ...

    def close(self) -> None: ...


class HFBackend:
    """``transformers`` generation, batched over prompts with left padding.

    Sampling is set explicitly (top-k off, no repetition penalty) so a checkpoint's own
    ``generation_config.json`` cannot change the protocol, as with vLLM. Each call is seeded
    with ``seed`` in a forked RNG state, so results do not depend on earlier calls.
    """

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "auto",
        device: str | None = None,
        batch_size: int = 8,
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.batch_size = batch_size
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
        self.model.to(self.device).eval()
        eos = self.model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos]) | {self.tokenizer.eos_token_id}
        self.eos_ids = sorted(i for i in eos_ids if i is not None)
        if not self.eos_ids:
            raise ValueError(f"{model_path} defines no EOS token")
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.eos_ids[0]

    def generate(
        self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingSettings, seed: int
    ) -> list[list[Sample]]:
        import torch

        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.inference_mode():
            torch.manual_seed(seed)
            results: list[list[Sample]] = []
            for start in range(0, len(prompt_ids), self.batch_size):
                results.extend(
                    self._generate_batch(prompt_ids[start : start + self.batch_size], sampling)
                )
        return results

    def _generate_batch(
        self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingSettings
    ) -> list[list[Sample]]:
        import torch
        from transformers import GenerationConfig

        width = max(len(ids) for ids in prompt_ids)
        input_ids = torch.full((len(prompt_ids), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, ids in enumerate(prompt_ids):
            input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, width - len(ids) :] = 1

        do_sample = sampling.temperature > 0
        config = GenerationConfig(
            do_sample=do_sample,
            temperature=sampling.temperature if do_sample else None,
            top_p=sampling.top_p if do_sample else None,
            top_k=0 if do_sample else None,
            repetition_penalty=1.0,
            max_new_tokens=sampling.max_new_tokens,
            # Greedy decoding gives one answer; it is replicated below instead.
            num_return_sequences=sampling.n if do_sample else 1,
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id,
            # a checkpoint OpenRLHF's trainer saved says use_cache false (its packed training
            # needs it off), which would recompute every prefix: 10x the time on the demo's
            use_cache=True,
        )
        output = self.model.generate(
            input_ids=input_ids.to(self.device),
            attention_mask=attention_mask.to(self.device),
            generation_config=config,
        )
        responses = output[:, width:].tolist()
        samples = [self._to_sample(tokens, sampling.max_new_tokens) for tokens in responses]
        per_prompt = len(samples) // len(prompt_ids)
        grouped = [samples[i * per_prompt : (i + 1) * per_prompt] for i in range(len(prompt_ids))]
        return grouped if do_sample else [group * sampling.n for group in grouped]

    def _to_sample(self, tokens: list[int], max_new_tokens: int) -> Sample:
        # Rows that finished early are padded to the batch's length after their EOS.
        stop = next((i for i, t in enumerate(tokens) if t in self.eos_ids), None)
        if stop is None:
            kept, num_tokens = tokens[:max_new_tokens], min(len(tokens), max_new_tokens)
        else:
            kept, num_tokens = tokens[:stop], stop + 1
        text = self.tokenizer.decode(kept, skip_special_tokens=True)
        return Sample(text=text, num_tokens=num_tokens, truncated=stop is None)

    def close(self) -> None:
        del self.model
