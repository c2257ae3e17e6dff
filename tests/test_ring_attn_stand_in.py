"""The flash-attn stand-in's attention kernels (``tests/cpu_site``), which the ring-attention
exactness tests run OpenRLHF's ring attention on, against PyTorch's own attention: outputs,
log-sum-exps and gradients, packed sequences of unequal lengths, grouped-query heads, and
query slices that end a longer key sequence (what a ring rank holds)."""

import math

import pytest
import torch
import torch.nn.functional as F
from stand_ins import flash_attn_is_stand_in

if not flash_attn_is_stand_in():
    pytest.skip("the real flash-attn is installed", allow_module_level=True)
import flash_attn.flash_attn_interface as stand_in

HEADS, KV_HEADS, DIM = 4, 2, 8
SCALE = 1 / math.sqrt(DIM)


def sdpa(q, k, v):
    """Causal attention of ``(tokens, heads, dim)`` tensors with PyTorch's own function."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
    )
    return out.transpose(0, 1)


def packed(lengths, heads, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(sum(lengths), heads, DIM, generator=gen, dtype=torch.float64)


def cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def varlen_forward(q, k, v, lengths_q, lengths_k):
    return stand_in._flash_attn_varlen_forward(
        q, k, v, cu(lengths_q), cu(lengths_k), max(lengths_q), max(lengths_k), 0.0, SCALE, True
    )


def test_varlen_forward_and_backward_match_torch_attention():
    lengths = [5, 1, 7]
    q, k, v = packed(lengths, HEADS, 0), packed(lengths, KV_HEADS, 1), packed(lengths, KV_HEADS, 2)
    out, lse, _, _ = varlen_forward(q, k, v, lengths, lengths)
    dout = packed(lengths, HEADS, 3)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    stand_in._flash_attn_varlen_backward(
        dout, q, k, v, out, lse, dq, dk, dv, cu(lengths), cu(lengths), 7, 7, 0.0, SCALE, True
    )
    start = 0
    for n in lengths:
        part = slice(start, start + n)
        leaves = [t[part].clone().requires_grad_(True) for t in (q, k, v)]
        expected = sdpa(*leaves)
        expected.backward(dout[part])
        torch.testing.assert_close(out[part], expected.detach())
        for got, leaf in zip((dq, dk, dv), leaves, strict=True):
            torch.testing.assert_close(got[part], leaf.grad)
        # the log-sum-exp of PyTorch's CPU flash kernel (per head, with repeated kv heads)
        kv = [t[part].repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1) for t in (k, v)]
        ref_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q[part].transpose(0, 1)[None], kv[0][None], kv[1][None], 0.0, True
        )[1][0]
        torch.testing.assert_close(lse[:, part], ref_lse.float())
        start += n


def test_query_slice_ending_a_longer_key_sequence_is_aligned_bottom_right():
    """A ring rank's queries are the tail of a sequence whose keys it gathered whole: they
    are the last rows of the full sequence's causal attention."""
    q, k, v = packed([9], HEADS, 4), packed([9], KV_HEADS, 5), packed([9], KV_HEADS, 6)
    out, _, _, _ = varlen_forward(q[5:], k, v, [4], [9])
    torch.testing.assert_close(out, sdpa(q, k, v)[5:])


def test_fixed_length_kernels_match_torch_attention():
    b, s = 2, 6
    gen = torch.Generator().manual_seed(7)
    q, k, v = (
        torch.randn(b, s, h, DIM, generator=gen, dtype=torch.float64)
        for h in (HEADS, KV_HEADS, KV_HEADS)
    )
    out, lse, _, _ = stand_in._flash_attn_forward(q, k, v, 0.0, SCALE, True)
    assert lse.shape == (b, HEADS, s)
    dout = torch.randn(b, s, HEADS, DIM, generator=gen, dtype=torch.float64)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    stand_in._flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, SCALE, True)
    for i in range(b):
        leaves = [t[i].clone().requires_grad_(True) for t in (q, k, v)]
        expected = sdpa(*leaves)
        expected.backward(dout[i])
        torch.testing.assert_close(out[i], expected.detach())
        for got, leaf in zip((dq, dk, dv), leaves, strict=True):
            torch.testing.assert_close(got[i], leaf.grad)


def test_unimplemented_options_are_refused():
    q = packed([3], HEADS, 8)
    k = packed([3], KV_HEADS, 9)
    with pytest.raises(NotImplementedError, match="dropout"):
        stand_in._flash_attn_varlen_forward(q, k, k, cu([3]), cu([3]), 3, 3, 0.1, SCALE, True)
    with pytest.raises(NotImplementedError, match="windows"):
        stand_in._flash_attn_varlen_forward(q, k, k, cu([3]), cu([3]), 3, 3, 0.0, SCALE, True, 2)
