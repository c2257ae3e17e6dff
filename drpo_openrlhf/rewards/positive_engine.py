"""The positive reward of ``--drpo.positive_reward`` scored in the vLLM engines, per group.

OpenRLHF sends each prompt to one engine, which generates its ``n`` responses together
(``RolloutRayActor.generate_responses``) and grades each with the reward function there. So
an engine holds exactly one DRPO group at a time, graded: after the correctness reward,
``PositiveRewardEngine`` calls the positive reward once with the group's correct responses
(decoded text, token count, label, prompt), under the reward functions' time limit
(``DRPO_REWARD_CALL_TIMEOUT_S``), and writes each response's score into its
``extra_logs``. OpenRLHF copies ``extra_logs`` into ``experience.info``, which travels to
the actor ranks with the response, as the prompt-group id does; incorrect responses carry
0.0 (the loss never reads it). A plugin that raises, hangs or answers wrongly stops the run
with ``PositiveRewardError`` naming it: never a silent score.

The length reward alone (``length``, the default) is not computed here: the actor computes
it from token counts, as it always has.
"""

from __future__ import annotations

import asyncio
import logging

from drpo_openrlhf.rewards.positive_reward import PositiveReward, PositiveRewardError, load
from drpo_openrlhf.rewards.reward_guard import TIMEOUT_ENV, call_timeout_s

logger = logging.getLogger(__name__)
POSITIVE_KEY = "drpo_positive_reward"  # experience.info key: each response's positive reward


def _correct(score) -> bool:
    """The correctness reward's 0/1 score (a tensor, a number or None) is 1."""
    if score is None:
        return False
    value = float(score.flatten()[0]) if hasattr(score, "flatten") else float(score)
    return value == 1.0


def response_text(output: dict, tokenizer) -> tuple[str, int]:
    """The text a response's tokens decode to (special tokens dropped) and their count."""
    tokens = [
        t for start, end in output["action_ranges"] for t in output["observation_tokens"][start:end]
    ]
    return tokenizer.decode(tokens, skip_special_tokens=True), len(tokens)


async def score_group(
    outputs: list[dict], prompt: str, label, tokenizer, reward: PositiveReward, timeout: float
) -> list[float]:
    """The positive reward of each of one prompt's responses (0.0 for the incorrect ones)."""
    scores = [0.0] * len(outputs)
    correct = [i for i, o in enumerate(outputs) if _correct(o.get("scores"))]
    if not correct:
        return scores
    texts, lengths = zip(*(response_text(outputs[i], tokenizer) for i in correct), strict=True)
    call = asyncio.to_thread(reward, list(texts), list(lengths), [label] * len(correct), prompt)
    try:
        values = await asyncio.wait_for(call, timeout)
    except (TimeoutError, asyncio.TimeoutError):  # one class from Python 3.11
        raise PositiveRewardError(
            f"--drpo.positive_reward {reward.spec}: did not return within {timeout:g} s "
            f"({TIMEOUT_ENV}) for a group of {len(correct)} correct responses"
        ) from None
    for i, value in zip(correct, values, strict=True):
        scores[i] = value
    return scores


class PositiveRewardEngine:
    """Mixin of the vLLM engine actor: ``configure_positive_reward`` loads the SPEC in the
    engine's process (the driver calls it once before the first rollout);
    ``generate_responses`` then adds each response's positive reward to its ``extra_logs``."""

    _positive_reward: PositiveReward | None = None

    async def configure_positive_reward(self, spec: str, max_len: float, shape: str) -> str:
        self._positive_reward = load(spec, max_len, shape)
        return spec

    async def generate_responses(
        self, prompt, label, sampling_params, max_length, hf_tokenizer, num_samples=1, images=None
    ):
        outputs = await super().generate_responses(
            prompt, label, sampling_params, max_length, hf_tokenizer, num_samples, images
        )
        reward = self._positive_reward
        if reward is None:
            return outputs
        timeout = call_timeout_s()
        try:
            scores = await score_group(outputs, prompt, label, hf_tokenizer, reward, timeout)
        except PositiveRewardError:
            logger.exception("positive reward failed for the prompt %r", str(prompt)[:120])
            raise
        for output, score in zip(outputs, scores, strict=True):
            output["extra_logs"] = {**(output.get("extra_logs") or {}), POSITIVE_KEY: score}
        return outputs
