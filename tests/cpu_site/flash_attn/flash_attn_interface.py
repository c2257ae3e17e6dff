"""Plain-torch stand-ins for flash-attn's attention kernels, as ``ring_flash_attn``
(OpenRLHF's ring attention) imports and calls them: the variable-length ones, which its
``llama3`` variant (the one OpenRLHF installs) calls, and the fixed-length ones, which its
package imports, computed by the variable-length ones.

Packed sequences are ``(total_tokens, heads, head_dim)`` cut by ``cu_seqlens``; a query
sequence may be shorter than its key sequence (a ring rank holds the tail of a sequence whose
head lies on earlier ranks), and the causal mask is then aligned bottom-right, as flash-attn
2.1+ does: query ``i`` of ``Lq`` sees keys ``j <= i + Lk - Lq``. Grouped-query attention
(fewer key heads) is supported; dropout, windows, soft-capping and ALiBi are refused. Tested
against torch's own attention in ``tests/test_ring_attn_stand_in.py``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _refuse_options(dropout_p, window_size_left, window_size_right, softcap, alibi_slopes):
    if dropout_p or (window_size_left, window_size_right) != (-1, -1) or softcap:
        raise NotImplementedError("the stand-in has no dropout, windows or soft-capping")
    if alibi_slopes is not None:
        raise NotImplementedError("the stand-in has no ALiBi")


def _varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal):
    """Output ``(total_q, heads, dim)`` in ``q``'s dtype and log-sum-exp ``(heads,
    total_q)`` in fp32, one sequence at a time, the scores in fp32 (or fp64 inputs' dtype)."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    repeat = q.shape[1] // k.shape[1]
    outs, lses = [], []
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for s in range(len(bounds_q) - 1):
        qs = q[bounds_q[s] : bounds_q[s + 1]].to(dtype)
        ks = k[bounds_k[s] : bounds_k[s + 1]].to(dtype).repeat_interleave(repeat, dim=1)
        vs = v[bounds_k[s] : bounds_k[s + 1]].to(dtype).repeat_interleave(repeat, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * softmax_scale
        if causal:
            lq, lk = qs.shape[0], ks.shape[0]
            rows = torch.arange(lq, device=q.device)[:, None] + (lk - lq)
            visible = torch.arange(lk, device=q.device)[None, :] <= rows
            scores = scores.masked_fill(~visible, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse[..., None])
        outs.append(torch.einsum("hqk,khd->qhd", probs, vs).to(q.dtype))
        lses.append(lse.float())
    return torch.cat(outs), torch.cat(lses, dim=-1)


def _flash_attn_varlen_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    return_softmax: bool = False,
    block_table: Tensor | None = None,
    leftpad_k: Tensor | None = None,
    seqused_k: Tensor | None = None,
    zero_tensors: bool = False,
) -> tuple[Tensor, Tensor, None, None]:
    """``(out, softmax_lse, S_dmask, rng_state)`` as flash-attn 2.8 returns them."""
    _refuse_options(dropout_p, window_size_left, window_size_right, softcap, alibi_slopes)
    with torch.no_grad():
        out, lse = _varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)
    return out, lse, None, None


def _flash_attn_varlen_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    softmax_lse: Tensor,
    dq: Tensor,
    dk: Tensor,
    dv: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    rng_state: Tensor | None = None,
    zero_tensors: bool = False,
) -> Tensor:
    """Writes the gradients into ``dq``, ``dk``, ``dv`` (recomputing the forward, as
    flash-attn does) and returns ``rowsum(dout * out)`` per head, as flash-attn does."""
    _refuse_options(dropout_p, window_size_left, window_size_right, softcap, alibi_slopes)
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    with torch.enable_grad():
        again, _ = _varlen_attention(*leaves, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)
        grads = torch.autograd.grad(again, leaves, dout)
    for buffer, grad in zip((dq, dk, dv), grads, strict=True):
        buffer.copy_(grad)
    return (dout.float() * out.float()).sum(-1).T


def _uniform_cu_seqlens(batch: int, seqlen: int, device: torch.device) -> Tensor:
    return torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device=device)


def _flash_attn_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    return_softmax: bool = False,
) -> tuple[Tensor, Tensor, None, None]:
    """``(batch, seqlen, heads, dim)`` inputs; log-sum-exp ``(batch, heads, seqlen_q)``."""
    (b, sq), sk = q.shape[:2], k.shape[1]
    out, lse, _, _ = _flash_attn_varlen_forward(
        q.flatten(0, 1),
        k.flatten(0, 1),
        v.flatten(0, 1),
        _uniform_cu_seqlens(b, sq, q.device),
        _uniform_cu_seqlens(b, sk, q.device),
        sq,
        sk,
        dropout_p,
        softmax_scale,
        causal,
        window_size_left,
        window_size_right,
        softcap,
        alibi_slopes,
    )
    return out.unflatten(0, (b, sq)), lse.unflatten(1, (b, sq)).transpose(0, 1), None, None


def _flash_attn_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    softmax_lse: Tensor,
    dq: Tensor,
    dk: Tensor,
    dv: Tensor,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    rng_state: Tensor | None = None,
) -> Tensor:
    """Writes ``dq``, ``dk``, ``dv``; returns ``rowsum(dout * out)`` ``(batch, heads, seqlen)``."""
    (b, sq), sk = q.shape[:2], k.shape[1]
    flat = [t.flatten(0, 1) for t in (dq, dk, dv)]
    d = _flash_attn_varlen_backward(
        dout.flatten(0, 1),
        q.flatten(0, 1),
        k.flatten(0, 1),
        v.flatten(0, 1),
        out.flatten(0, 1),
        softmax_lse.transpose(0, 1).flatten(1),
        *flat,
        _uniform_cu_seqlens(b, sq, q.device),
        _uniform_cu_seqlens(b, sk, q.device),
        sq,
        sk,
        dropout_p,
        softmax_scale,
        causal,
        window_size_left,
        window_size_right,
        softcap,
        alibi_slopes,
        deterministic,
    )
    for buffer, grad in zip((dq, dk, dv), flat, strict=True):
        if grad.data_ptr() != buffer.data_ptr():  # flatten copied a non-contiguous buffer
            buffer.copy_(grad.unflatten(0, (b, -1)))
    return d.unflatten(1, (b, sq)).transpose(0, 1)
