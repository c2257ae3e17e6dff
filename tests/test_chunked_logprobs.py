"""Chunked log-probs (``update/chunked_logprobs.py``, ``update/chunked_actor.py``)
equal OpenRLHF's unchunked ones, values and gradients, against a float64 reference; with a
graph no tensor of the size of the micro-batch's logits is ever allocated.

Tolerances, measured here (fp32 model, CPU): both paths are within 3.0e-6 of fp64 in values
and 6.5e-7 (relative to the largest gradient entry) in gradients; chunked and unchunked actors
differ by at most 4.8e-7 in values and 5.7e-7 in gradients. The bounds below are 1e-5 for
both, so a wrong temperature (an error of 10 here), label shift or chunk seam fails.
"""

import pytest
import torch
from drpo_actor_harness import rollout, tiny_model
from openrlhf.models import Actor
from openrlhf.models.utils import log_probs_from_logits
from torch.utils._python_dispatch import TorchDispatchMode

from drpo_openrlhf.update import chunked_actor
from drpo_openrlhf.update.chunked_logprobs import chunked_token_log_probs

B, T, H, V, TEMP = 3, 11, 16, 50, 0.6
CHUNKS = [1, 4, 7, 32, B * T, 1000]  # 4, 7 and 32 do not divide the 33 tokens
VALUE_TOL, GRAD_TOL = 1e-5, 1e-5


def problem(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=gen))
    hidden = torch.randn(B, T, H, generator=gen, requires_grad=True)
    labels = torch.randint(0, V, (B, T), generator=gen)
    weights = torch.randn(B, T, generator=gen)  # a loss that weighs every token differently
    return head, hidden, labels, weights


def reference64(head, hidden, labels):
    """log softmax(h W^T / T)[label] in float64, and its gradients for ``problem``'s loss."""
    w = head.weight.detach().double().requires_grad_()
    h = hidden.detach().double().requires_grad_()
    logits = h @ w.T / TEMP
    return logits.log_softmax(-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1), h, w


def grads(log_probs, weights, *tensors):
    return torch.autograd.grad((log_probs * weights).sum(), tensors)


def relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.double() - expected).abs().max() / expected.abs().max()).item()


@pytest.mark.parametrize("chunk", CHUNKS)
def test_values_and_gradients_match_float64(chunk):
    head, hidden, labels, weights = problem()
    ref, h64, w64 = reference64(head, hidden, labels)
    ref_grads = grads(ref, weights.double(), h64, w64)
    unchunked = log_probs_from_logits(head(hidden).float() / TEMP, labels)
    chunked = chunked_token_log_probs(hidden, labels, head.weight, TEMP, chunk)
    assert chunked.shape == labels.shape and chunked.dtype == torch.float32
    for got in (unchunked, chunked):
        assert (got.double() - ref).abs().max().item() < VALUE_TOL
        for g, r in zip(grads(got, weights, hidden, head.weight), ref_grads, strict=True):
            assert relative(g, r) < GRAD_TOL


def test_no_grad_path_gives_the_graph_paths_values():
    head, hidden, labels, _ = problem(1)
    with_graph = chunked_token_log_probs(hidden, labels, head.weight, TEMP, 5)
    with torch.no_grad():
        without = chunked_token_log_probs(hidden, labels, head.weight, TEMP, 5)
    assert not without.requires_grad
    assert torch.equal(with_graph.detach(), without)


def test_bf16_head_matches_openrlhfs_arithmetic():
    """A bf16 projection as on GPU: chunks give OpenRLHF's values (bf16 logits, then fp32)."""
    head, hidden, labels, _ = problem(2)
    head = head.to(torch.bfloat16)
    hidden = hidden.detach().to(torch.bfloat16)
    unchunked = log_probs_from_logits(head(hidden).float() / TEMP, labels)
    chunked = chunked_token_log_probs(hidden, labels, head.weight, TEMP, 7)
    assert (chunked - unchunked).abs().max().item() < VALUE_TOL


def test_wrong_chunk_size_refused():
    head, hidden, labels, _ = problem()
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_token_log_probs(hidden, labels, head.weight, TEMP, 0)


class LargestAllocation(TorchDispatchMode):
    """The largest tensor any op returns while active (forward and CPU backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def test_no_allocation_holds_more_than_one_chunk_of_logits():
    """Unchunked, the fp32 logits of all B x T tokens exist (and are kept for the backward);
    chunked, nothing larger than one chunk's fp32 logits is ever allocated."""
    head, hidden, labels, weights = problem()
    chunk = 4
    sizes = {}
    for name, run in {
        "unchunked": lambda: log_probs_from_logits(head(hidden).float() / TEMP, labels),
        "chunked": lambda: chunked_token_log_probs(hidden, labels, head.weight, TEMP, chunk),
    }.items():
        with LargestAllocation() as probe:
            grads(run(), weights, hidden, head.weight)
        sizes[name] = probe.largest
    assert sizes["unchunked"] >= B * T * V * 4
    assert sizes["chunked"] <= max(chunk * V * 4, V * H * 4)  # a chunk's logits, or dW


# --- the actor: OpenRLHF's Actor with the chunked forward installed ---------------------


def actor(packing: bool, chunk: int) -> Actor:
    model = Actor(tiny_model(), temperature=TEMP)
    model.packing_samples = packing
    chunked_actor.install(model, chunk)
    return model


def actor_log_probs(model: Actor, data) -> torch.Tensor:
    return model(data["sequences"], data["action_mask"], attention_mask=data["attention_mask"])


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("chunk", [1, 7, 64, 100_000])
def test_actor_log_probs_and_gradients_equal_openrlhfs(packing, chunk):
    data = rollout()
    plain, chunked = actor(packing, 0), actor(packing, chunk)
    assert type(chunked) is chunked_actor.ChunkedLogProbActor and type(plain) is Actor
    weights = torch.randn(data["action_mask"].shape, generator=torch.Generator().manual_seed(3))
    expected, got = actor_log_probs(plain, data), actor_log_probs(chunked, data)
    assert (got - expected).abs().max().item() < VALUE_TOL
    assert expected.abs().max().item() > 1  # real log-probs, not all masked away
    plain_grads = grads(expected, weights, *plain.parameters())
    chunked_grads = grads(got, weights, *chunked.parameters())
    for g, e in zip(chunked_grads, plain_grads, strict=True):
        assert relative(g, e.double()) < GRAD_TOL


def test_actor_no_grad_scoring_matches():
    data = rollout(1)
    with torch.no_grad():
        expected = actor_log_probs(actor(True, 0), data)
        got = actor_log_probs(actor(True, 5), data)
    assert (got - expected).abs().max().item() < VALUE_TOL


def test_return_output_gives_the_same_log_probs_and_the_models_output():
    """OpenRLHF's PPO update (the baselines) asks for the output to read its MoE aux_loss."""
    data = rollout()
    model = actor(True, 6)
    expected = actor_log_probs(model, data)
    got, output = model(
        data["sequences"], data["action_mask"], data["attention_mask"], return_output=True
    )
    assert torch.equal(got, expected)
    assert output["logits"].shape[1] == 0  # no position's logits were computed


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"return_entropy": True, "return_output": True}, "return_entropy"),
        ({"ring_attn_group": object()}, "ring attention"),
        ({"pixel_values": torch.zeros(1)}, "multimodal"),
    ],
)
def test_unsupported_calls_refused(kwargs, named):
    data = rollout()
    model = actor(False, 8)
    with pytest.raises(NotImplementedError, match=f"{named}.*--drpo.logprob_chunk_tokens 0"):
        model(data["sequences"], data["action_mask"], data["attention_mask"], **kwargs)
    with pytest.raises(NotImplementedError, match="action_mask=None"):
        model(data["sequences"], attention_mask=data["attention_mask"], return_logprobs=True)


def test_install_zero_leaves_openrlhfs_forward_and_negative_is_refused():
    model = actor(False, 0)
    assert type(model) is Actor
    with pytest.raises(ValueError, match=r"--drpo\.logprob_chunk_tokens"):
        chunked_actor.install(model, -1)
