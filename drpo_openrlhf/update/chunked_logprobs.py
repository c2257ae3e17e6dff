"""Token log-probs from the last hidden states, a chunk of tokens at a time.

OpenRLHF's ``Actor.forward`` materialises the whole micro-batch's logits, casts them to fp32
and takes the log-softmax: ``tokens x vocab x 4`` bytes at once (about 42 GiB for 8 responses
of ~9,216 tokens through Qwen2's 151,936-word vocabulary), and with a graph it keeps them for
the backward. Here the projection, the fp32 cast, the temperature and the log-softmax run on
``chunk_tokens`` tokens at a time, and the backward recomputes each chunk's logits from the
saved hidden states (an ``autograd.Function``: only the per-token log-sum-exp is kept), so one
chunk's logits exist at any moment.

The arithmetic per token is OpenRLHF's: logits in the weight's dtype, then fp32, then
``/ temperature``, then ``x_label - logsumexp(x)``; the gradient of the logits is cast back to
the weight's dtype before the two products, as autograd does for the unchunked graph. The
weight's gradient is summed over chunks in fp32 and cast once at the end.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _chunk_logits(hidden: Tensor, weight: Tensor, temperature: float) -> Tensor:
    logits = F.linear(hidden, weight).to(torch.float32)
    if temperature != 1.0:
        logits.div_(temperature)
    return logits


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, chunk_tokens):
        n = labels.numel()
        log_probs = hidden.new_empty(n, dtype=torch.float32)
        lse = hidden.new_empty(n, dtype=torch.float32)
        for s in range(0, n, chunk_tokens):
            e = min(s + chunk_tokens, n)
            logits = _chunk_logits(hidden[s:e], weight, temperature)
            lse[s:e] = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(-1, labels[s:e].unsqueeze(-1)).squeeze(-1)
            log_probs[s:e] = picked - lse[s:e]
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        return log_probs

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, labels, lse = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_weight else None
        n, step = labels.numel(), ctx.chunk_tokens
        for s in range(0, n, step):
            e = min(s + step, n)
            g_out = grad_out[s:e].unsqueeze(-1)
            # d log p_y / d x = onehot(y) - softmax(x), x = logits / temperature
            grad = _chunk_logits(hidden[s:e], weight, ctx.temperature)
            grad.sub_(lse[s:e].unsqueeze(-1)).exp_().mul_(-g_out)
            grad.scatter_add_(-1, labels[s:e].unsqueeze(-1), g_out)
            if ctx.temperature != 1.0:
                grad.div_(ctx.temperature)
            grad = grad.to(weight.dtype)
            if need_hidden:
                grad_hidden[s:e] = grad @ weight
            if need_weight:
                grad_weight.add_(grad.T @ hidden[s:e])
        if need_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def chunked_token_log_probs(
    hidden: Tensor, labels: Tensor, weight: Tensor, temperature: float, chunk_tokens: int
) -> Tensor:
    """``log softmax(hidden @ weight.T / temperature)[labels]``, shaped as ``labels``, fp32.

    ``hidden`` is ``[..., H]``, ``labels`` its leading shape, ``weight`` ``[V, H]`` (a bias-free
    output projection). Tokens are taken in row-major order ``chunk_tokens`` at a time (the
    last chunk may be shorter); gradients flow to ``hidden`` and ``weight``.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat = _ChunkedLogProbs.apply(
        flat_hidden, weight, labels.reshape(-1), temperature, chunk_tokens
    )
    return flat.view(labels.shape)
