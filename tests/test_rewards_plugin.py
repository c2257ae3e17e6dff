"""The reward files as OpenRLHF 0.11.2 uses them: ``--reward.remote_url <file>.py``.

OpenRLHF's own ``SingleTurnAgentExecutor`` loads the file by path and calls
``reward_func`` through ``asyncio.to_thread``; only the tokenizer and the vLLM engine are
faked (character-level tokenizer, canned responses).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from time_bounds import scaled

from drpo_openrlhf.rewards import kk_reward, math_reward

openrlhf_agent = pytest.importorskip("openrlhf.utils.agent")
from openrlhf.trainer.ppo_utils.experience import Experience  # noqa: E402

MATH_FILE = Path(math_reward.__file__).resolve()
KK_FILE = Path(kk_reward.__file__).resolve()
REPO_ROOT = MATH_FILE.parents[2]

PROMPT = (
    "<｜begin▁of▁sentence｜><｜User｜>What is 1/2 + 1/4? Put the final answer in "
    "\\boxed{}. For example: <think>x</think> \\boxed{7}<｜Assistant｜><think>\n"
)
EOS = "<｜end▁of▁sentence｜>"


class CharTokenizer:
    """Character-level stand-in for an HF tokenizer (what OpenRLHF calls on it)."""

    def __call__(self, text, add_special_tokens=False, return_tensors=None):
        return {"input_ids": torch.tensor([[ord(c) for c in text]])}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


class FakeEngine:
    def __init__(self, response: str):
        self.response = response

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        out = SimpleNamespace(
            token_ids=[ord(c) for c in self.response],
            text=self.response,
            finish_reason="stop",
            logprobs=None,
        )
        return SimpleNamespace(outputs=[out])


def run_openrlhf(reward_file: Path, cases: list[tuple[str, str, object]]) -> list[dict]:
    """OpenRLHF's single-turn rollout + reward for each ``(prompt, response, label)``."""
    executor = openrlhf_agent.SingleTurnAgentExecutor(remote_rm_url=str(reward_file))
    assert executor.reward_func is not None
    params = SimpleNamespace(max_tokens=None, logprobs=None)

    async def main():
        return await asyncio.gather(
            *(
                executor.execute(prompt, label, params, 100_000, CharTokenizer(), FakeEngine(resp))
                for prompt, resp, label in cases
            )
        )

    return asyncio.run(main())


def to_experience_info(output: dict) -> dict:
    """What ``SamplesGenerator._process_response_into_experience`` does with the result."""
    info = {"reward": torch.tensor([output["reward"]]), "score": torch.tensor([output["scores"]])}
    for key, value in output["extra_logs"].items():
        if isinstance(value, torch.Tensor):
            value = value.flatten()[0].item()
        info[key] = torch.tensor([value])
    return info


def test_math_plugin_through_openrlhf_executor():
    cases = [
        (PROMPT, "1/2+1/4 = 3/4</think>\nSo $\\boxed{\\frac{3}{4}}$." + EOS, "\\frac{3}{4}"),
        (PROMPT, "hmm</think>\\boxed{0.75}" + EOS, "\\boxed{\\frac34}"),
        (PROMPT, "hmm</think>\\boxed{0.7}" + EOS, "0.75"),
        (PROMPT, "truncated reasoning that never ends \\boxed{0.75}", "0.75"),  # no </think>
        (PROMPT, "hmm</think> it is three quarters" + EOS, "0.75"),
        (PROMPT, "hmm</think>\\boxed{0.75}" + EOS, None),
        (PROMPT, "hmm</think>\\boxed{" + "(" * 990 + ")" * 990 + "}", "0.75"),
    ]
    outputs = run_openrlhf(MATH_FILE, cases)
    scores = [float(o["scores"].item()) for o in outputs]
    assert scores == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert [float(o["reward"].item()) for o in outputs] == scores
    expected_reasons = ["ok", "ok", "wrong", "no_think_end", "no_boxed", "bad_label"]
    for out, reason in zip(outputs[:6], expected_reasons, strict=True):
        assert out["extra_logs"][f"math/{reason}"].item() == 1.0
        assert out["extra_logs"]["math/prompt_not_found"].item() == 0.0
    # adversarial answer: cut off at the deadline (or, with warm sympy caches in a
    # long-lived grader, finished in time and wrong)
    last = outputs[-1]["extra_logs"]
    assert (
        last["math/timeout"].item() + last["math/wrong"].item() + last["math/unparsable"].item()
        == 1
    )

    # every sample carries the same keys, so OpenRLHF can merge and split them again
    keys = {frozenset(o["extra_logs"]) for o in outputs}
    assert len(keys) == 1
    assert {f"math/{r}" for r in math_reward.REASONS} <= next(iter(keys))
    merged = Experience._merge_item([to_experience_info(o) for o in outputs])
    assert all(v.shape == (len(outputs),) for v in merged.values())
    assert merged["math/ok"].sum().item() == 2


def test_kk_plugin_through_openrlhf_executor():
    label = "(1) Zoey is a knight\n(2) Oliver is a knave"
    prompt = "<|im_start|>user\nZoey says Oliver is a knave...<|im_end|>\n<|im_start|>assistant\n"
    cases = [
        (prompt, "...</think>\n(1) Zoey is a knight\n(2) Oliver is a knave<|im_end|>", label),
        (prompt, "...</think><answer>Zoey: knave, Oliver: knight</answer><|im_end|>", label),
        (prompt, "...</think>Zoey is a knight.<|im_end|>", label),
        (prompt, "(1) Zoey is a knight\n(2) Oliver is a knave", label),
        (prompt, "...</think>(1) Zoey is a knight\n(2) Oliver is a knave", None),
    ]
    outputs = run_openrlhf(KK_FILE, cases)
    kk_expected = ["ok", "wrong", "incomplete", "no_think_end", "bad_label"]
    assert [float(o["scores"].item()) for o in outputs] == [1.0, 0.0, 0.0, 0.0, 0.0]
    for out, reason in zip(outputs, kk_expected, strict=True):
        assert out["extra_logs"][f"kk/{reason}"].item() == 1.0
    merged = Experience._merge_item([to_experience_info(o) for o in outputs])
    assert all(v.shape == (len(outputs),) for v in merged.values())


@pytest.mark.parametrize(
    ("reward_file", "response", "label"),
    [
        (MATH_FILE, "</think>\\boxed{1.0}", "1"),  # not identical: goes through the pool
        (KK_FILE, "</think>Zoey is a knight", "Zoey is a knight"),
    ],
    ids=["math", "kk"],
)
def test_loads_by_path_without_the_package_installed(reward_file, response, label, tmp_path):
    """OpenRLHF can point at the file of a checkout that is not pip-installed."""
    script = textwrap.dedent(
        f"""
        import asyncio, importlib.util, sys
        sys.path = [p for p in sys.path if p not in ("", {str(REPO_ROOT)!r})]
        sys.meta_path = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
        assert importlib.util.find_spec("drpo_openrlhf") is None, "package still importable"
        spec = importlib.util.spec_from_file_location("reward_func", {str(reward_file)!r})
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        call = asyncio.to_thread(module.reward_func, ["p" + {response!r}], ["p"], [{label!r}])
        out = asyncio.run(call)
        assert out["scores"].tolist() == [1.0], out
        print("OK")
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(300),  # a hang guard: 3.0-3.3 s measured (2 cores at load 4-7)
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.parametrize("module", [math_reward, kk_reward], ids=["math", "kk"])
def test_reward_func_never_raises_on_garbage(module):
    calls = [
        ([], [], []),
        (None, None, None),
        ("single query string</think>", "single", "1"),
        ([None, b"\xff</think>\\boxed{1}", 3, "x" * 2_000_000], ["p"], [None, b"1", 1.5]),
        ([object()], [object()], [object()]),
        (["</think>\\boxed{1}"] * 3, None, ["1", {"a": 1}, ["x"]]),
    ]
    for queries, prompts, labels in calls:
        out = module.reward_func(queries, prompts, labels, unknown_option=True)
        n = len(out["rewards"])
        assert out["rewards"].dtype == torch.float32 and out["scores"].shape == (n,)
        assert set(out["scores"].tolist()) <= {0.0, 1.0}
        assert all(v.shape == (n,) for v in out["extra_logs"].values())


def test_math_options_from_env_and_kwargs(monkeypatch):
    query = "prompt: what?" + "no think tags here, \\boxed{2}"
    assert math_reward.reward_func([query], ["prompt: what?"], ["2"])["scores"].tolist() == [0.0]
    monkeypatch.setenv("DRPO_REWARD_REQUIRE_THINK_END", "0")
    assert math_reward.reward_func([query], ["prompt: what?"], ["2"])["scores"].tolist() == [1.0]
    assert math_reward.reward_func([query], ["prompt: what?"], ["2"], require_think_end=True)[
        "scores"
    ].tolist() == [0.0]
    monkeypatch.setenv("DRPO_REWARD_TIMEOUT_S", "not a number")
    assert math_reward.reward_func([query], ["prompt: what?"], ["2"])["scores"].tolist() == [1.0]


def test_prompt_with_think_end_does_not_count():
    """A truncated response must not borrow the ``</think>`` of a few-shot prompt."""
    out = math_reward.reward_func([PROMPT + "reasoning \\boxed{7}"], [PROMPT], ["7"])
    assert out["scores"].tolist() == [0.0]
    assert out["extra_logs"]["math/no_think_end"].tolist() == [1.0]
