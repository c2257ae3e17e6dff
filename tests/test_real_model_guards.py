"""The weight probe and the rollout log-prob gap on the real model, SmolLM2-135M-Instruct (the
session's ``smollm2`` fixture), through Hugging Face alone: no pipeline run, no vLLM.

Stand-in engines are Hugging Face instances of the model (sdpa) in the dtype a CPU run takes on
this machine (``runtime/cpu_dtype.py``: bf16 with native bf16, else fp32), as the actor runs it;
the faults below are far larger than either dtype's rounding. What they score is what the guards
compare (``sync/weight_probe.py``, ``sync/logprob_gap.py``). The probe is the real-model run's
(``tests/test_e2e_real_model.py``, ``--data.max_len 256``: 255 tokens). Measured here (mean
|difference| per token, the largest token in brackets): two instances agree bit for bit; a
rotary base x4 gives 0.199 (2.49) at 255 tokens, 0.163 (4.52) at the default 1024; responses
sampled at temperature 1.0 and scored at 0.6 give 0.17-0.37 (5-8) over about 200 tokens (three
seeds). The honest gaps a real engine adds (vLLM CPU against the actor, docs/reliability.md: the
probe 0.027 at 1024 tokens, the run's rollouts 0.0069-0.009) are smaller than either margin.
fp16 compute is measured by hand only (bf16 against fp16 here: 0.029 (0.28) at 255 tokens; CPU
fp16 is slow): the engines' comparison names it, the actor's limit cannot (the honest range).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_e2e_real_model import PAIRS, chat
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from drpo_openrlhf.runtime import cpu_dtype
from drpo_openrlhf.sync.logprob_gap import HONEST_CAP, GapLimit, LogprobGapError, logprob_gap
from drpo_openrlhf.sync.weight_probe import ActorLimits, compare_probe, probe_token_ids

PROBE = 255  # the real-model run's probe: --data.max_len 256 - 1
ROPE_FACTOR = 4.0
# The real-model run's honest rollout gap (largest of 6 runs; test_e2e_real_model.py)
HONEST_ROLLOUT_GAP = 0.009
RUN_TEMPERATURE, ENGINE_TEMPERATURE = 0.6, 1.0
RUN_DTYPE = {"bf16": torch.bfloat16, "fp32": torch.float32}[
    cpu_dtype.choose("auto", cpu_dtype.read_kernels())[0]
]


def load(model_dir: Path, rope_factor: float = 1.0) -> torch.nn.Module:
    config = AutoConfig.from_pretrained(model_dir)
    config.rope_parameters["rope_theta"] *= rope_factor
    return AutoModelForCausalLM.from_pretrained(
        model_dir, config=config, dtype=RUN_DTYPE, attn_implementation="sdpa"
    ).eval()


@torch.no_grad()
def probe_scores(model: torch.nn.Module, ids: list[int]) -> list[float]:
    """Each probe token's log-prob given the ones before, as the actor and the engines score it."""
    tokens = torch.tensor([ids])
    logprobs = model(tokens).logits.float().log_softmax(-1)[0, :-1]
    return logprobs.gather(-1, tokens[0, 1:, None])[:, 0].tolist()


@pytest.fixture(scope="module")
def healthy(smollm2):
    return load(smollm2)


def test_a_rotary_base_x4_on_the_real_model_is_named_by_both_probe_comparisons(smollm2, healthy):
    ids = probe_token_ids(AutoTokenizer.from_pretrained(smollm2), PROBE + 1)
    engines = [
        probe_scores(healthy, ids),
        probe_scores(load(smollm2), ids),  # a second instance: the same bits
        probe_scores(load(smollm2, ROPE_FACTOR), ids),
    ]
    actor = engines[0]
    result = compare_probe(actor, engines, ActorLimits())
    print("probe gaps (mean, max):", result.gaps, "spread:", result.engine_spread)
    assert engines[0] == engines[1]  # identical engines, the probe alone: bit for bit
    assert result.problems[0].startswith(
        "engine 2 scores the probe differently from engines 0, 1: up to"
    ), result.problems
    rope_gap = result.gaps[2][0]
    assert rope_gap > HONEST_CAP + 0.05, rope_gap  # over the cap with the honest gap's room
    assert result.problems[1].startswith("engine 2 is"), result.problems
    assert "(limit 0.1: the cap, first probe)" in result.problems[1]
    assert len(result.problems) == 2  # the healthy engines are named nowhere


@torch.no_grad()
def sampled_at(model, tokenizer, temperature: float, seed: int = 0):
    """The real-model run's prompts, two responses each of up to 32 tokens sampled at
    ``temperature`` (no top-k, top-p); returns the sampled tokens, their mask (up to the
    first end of turn) and the logits they were sampled from."""
    prompts = [
        tokenizer.apply_chat_template(chat(a, b), tokenize=False, add_generation_prompt=True)
        for a, b in PAIRS
    ]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    torch.manual_seed(seed)
    out = model.generate(
        **batch,
        do_sample=True,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        max_new_tokens=32,
        num_return_sequences=2,
        pad_token_id=tokenizer.pad_token_id,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[:, batch["input_ids"].shape[1] :]
    end = (tokens == tokenizer.eos_token_id).long()
    mask = (end.cumsum(1) - end) == 0
    return tokens, mask, torch.stack(out.logits, 1).float()


def test_an_engine_sampling_at_temperature_1_where_the_actor_scores_at_0_6_is_over_the_cap(
    smollm2, healthy
):
    """The engine samples at 1.0 and reports its tokens' log-probs at 1.0 (vLLM's processed
    log-probs); the actor scores the same tokens at 0.6. The model's own logits serve both, so
    the gap is the temperature's alone (an engine's honest gap, 0.0069-0.009, comes on top)."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2, padding_side="left")
    tokens, mask, logits = sampled_at(healthy, tokenizer, ENGINE_TEMPERATURE)

    def logprobs(temperature: float) -> torch.Tensor:
        return (logits / temperature).log_softmax(-1).gather(-1, tokens[..., None])[..., 0]

    engine, actor = logprobs(ENGINE_TEMPERATURE), logprobs(RUN_TEMPERATURE)
    mean, largest, count = logprob_gap(engine, actor, mask)
    print(f"temperature {ENGINE_TEMPERATURE} vs {RUN_TEMPERATURE}: {mean:.4f} (max {largest:.3f})")
    assert count > 100 and mean > HONEST_CAP, (mean, count)
    # one such engine beside a healthy one, at the run's first (exactly checked) rollout
    healthy_engine = (HONEST_ROLLOUT_GAP, 0.5, count)
    with pytest.raises(LogprobGapError, match="more than an honest gap can") as stop:
        GapLimit(None, exact_start=True).check({0: healthy_engine, 1: (mean, largest, count)}, 1)
    assert f"engine 1 {mean:.3g}" in str(stop.value) and "engine 0" not in str(stop.value)
    # every engine at temperature 1.0: still over the cap, whatever the engines agree on
    with pytest.raises(LogprobGapError, match="more than an honest gap can"):
        GapLimit(None, exact_start=True).check({0: (mean, largest, count)}, 1)
