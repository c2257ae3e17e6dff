"""Rollouts with HF ``generate``: layout, masks, seeding, and log-probs under left padding."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from drpo_openrlhf.eval.runner import encode_prompt
from drpo_openrlhf.local.rollout import Rollout, generate_rollout, token_log_probs
from drpo_openrlhf.tiny_model import build_tiny_model

PROMPTS = ["Compute 1+2.", "Compute 23+5+41+7+9.", "What is 3 * 4?"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    path = build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    return model, tokenizer


def _rollout(tiny, seed: int = 0, max_new_tokens: int = 12):
    model, tokenizer = tiny
    ids = [encode_prompt(tokenizer, p) for p in PROMPTS]
    return generate_rollout(
        model,
        tokenizer,
        ids,
        n=3,
        max_new_tokens=max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        seed=seed,
    )


def test_layout_masks_and_texts(tiny) -> None:
    _, tokenizer = tiny
    r = _rollout(tiny)
    assert r.group_ids.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    width = max(len(encode_prompt(tokenizer, p)) for p in PROMPTS)
    assert r.prompt_width == width
    responses = r.sequences[:, width:]
    eos = tokenizer.eos_token_id
    for row in range(len(r.texts)):
        length = int(r.num_tokens[row])
        mask = r.response_mask[row]
        assert mask[:length].all() and not mask[length:].any()
        tokens = responses[row, :length].tolist()
        if r.truncated[row]:
            assert eos not in tokens and length == responses.shape[1]
        else:
            assert tokens[-1] == eos and eos not in tokens[:-1]
            tokens = tokens[:-1]
        assert r.texts[row] == tokenizer.decode(tokens, skip_special_tokens=True)
    # the random tiny model rarely stops within 12 tokens: both kinds must be covered
    assert r.truncated.any()


def test_rollouts_are_seeded(tiny) -> None:
    a, b, c = _rollout(tiny, seed=1), _rollout(tiny, seed=1), _rollout(tiny, seed=2)
    assert torch.equal(a.sequences, b.sequences)
    assert not torch.equal(a.sequences, c.sequences)


def test_select_keeps_rows_aligned(tiny) -> None:
    r = _rollout(tiny)
    part = r.select([7, 2])
    assert torch.equal(part.sequences, r.sequences[[7, 2]])
    assert part.group_ids.tolist() == [2, 0]
    assert part.texts == (r.texts[7], r.texts[2])


def test_log_probs_do_not_depend_on_left_padding(tiny) -> None:
    """Each row scored alone (no padding) must give the batched, left-padded values."""
    model, _ = tiny
    r = _rollout(tiny)
    with torch.no_grad():
        batched = token_log_probs(model, r, temperature=0.7)
    width = r.prompt_width
    for row in range(len(r.texts)):
        start = int((r.attention_mask[row, :width] == 0).sum())
        length = int(r.num_tokens[row])
        ids = r.sequences[row : row + 1, start : width + length]
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, width - start - 1 : -1] / 0.7
        alone = torch.log_softmax(logits, -1).gather(-1, ids[0, width - start :, None])[:, 0]
        torch.testing.assert_close(batched[row, :length], alone, rtol=0, atol=1e-9)


def test_log_probs_match_generation_probabilities(tiny) -> None:
    """The log-probs we train on are those of the distribution the rollout sampled from."""
    model, tokenizer = tiny
    ids = [encode_prompt(tokenizer, p) for p in PROMPTS]
    width = max(len(i) for i in ids)
    input_ids = torch.full((len(ids), width), tokenizer.pad_token_id)
    mask = torch.zeros_like(input_ids)
    for row, i in enumerate(ids):
        input_ids[row, width - len(i) :] = torch.tensor(i)
        mask[row, width - len(i) :] = 1
    out = model.generate(
        input_ids=input_ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=6,
        output_logits=True,
        return_dict_in_generate=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    # generate hands back float32 logits, hence the float32-level tolerance below
    expected = torch.stack([torch.log_softmax(s.double(), -1) for s in out.logits], dim=1)
    expected = expected.gather(-1, out.sequences[:, width:, None])[..., 0]
    steps = out.sequences.shape[1] - width
    r = Rollout(
        sequences=out.sequences,
        attention_mask=torch.cat([mask, torch.ones(len(ids), steps, dtype=torch.long)], 1),
        response_mask=torch.ones(len(ids), steps, dtype=torch.long),
        group_ids=torch.arange(len(ids)),
        truncated=torch.ones(len(ids), dtype=torch.bool),
        texts=("",) * len(ids),
        prompt_width=width,
    )
    with torch.no_grad():
        torch.testing.assert_close(token_log_probs(model, r, 1.0), expected, rtol=0, atol=1e-5)
