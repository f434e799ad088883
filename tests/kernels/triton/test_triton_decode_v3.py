"""Tests of flashlib/kernels/triton/decode_v3.py (Flash-Decoding: split-KV kernel, then the LSE combine) on
conftest's DEVICE, interpreted on a CPU machine and compiled on a GPU one.

Every sequence of the batch has its own valid cache length (cache_seqlens): empty, full and short
caches side by side, several split counts (splits that are empty, splits that end inside a block), GQA
groups stacked into one program's rows, and batch·head counts that are multiples of nothing. The oracle
is flashlib.testing's float64 one, run on each sequence's valid keys.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import DEVICE
from triton_cases import make_qkv

import flashlib
from flashlib.testing import assert_attention_right, assert_close, reference_gqa


def decode_oracle(q, kc, vc, lens):
    """Float64 ``(o, lse)``: sequence b attends its first lens[b] keys (none: o = 0, lse = -inf)."""
    o = np.zeros(q.shape)
    lse = np.full(q.shape[:-1], -np.inf)
    for b, n in enumerate(lens.tolist()):
        if n:
            o[b:b + 1], lse[b:b + 1] = reference_gqa(q[b:b + 1], kc[b:b + 1, :, :n], vc[b:b + 1, :, :n])
    return o, lse


def decode(q, kc, vc, lens, num_splits):
    return flashlib.decode(q, kc, vc, cache_seqlens=lens, num_splits=num_splits, return_lse=True,
                           backend="triton")


def assert_decode_matches_oracle(q, kc, vc, lens, num_splits):
    o, lse = decode(q, kc, vc, lens, num_splits)
    ro, rl = decode_oracle(q, kc, vc, lens)
    assert_close(o, ro, atol=2e-5, rtol=2e-5, name="o")
    assert_close(lse, rl, atol=2e-5, rtol=2e-5, name="lse")


@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.parametrize("shape", [(3, 4, 2, 1, 70, 40), (2, 8, 1, 2, 37, 111)], ids=str)
def test_decode_ragged_matches_oracle(shape, num_splits):
    B, H, HKV, NQ, NMAX, D = shape
    q, kc, vc, _ = make_qkv(B, H, HKV, NQ, NMAX, D, seed=7, device=DEVICE)
    lens = torch.tensor([0, NMAX, 5][:B], dtype=torch.int32, device=DEVICE)   # empty, full, short
    assert_decode_matches_oracle(q, kc, vc, lens, num_splits)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_decode_half_precision_rule(dtype):
    """FlashAttention's rule on each sequence's valid keys (lengths 90 and 33, four splits)."""
    q, kc, vc, do = make_qkv(2, 4, 1, 1, 90, 64, dtype=dtype, seed=8, device=DEVICE)
    lens = [90, 33]
    o, lse = decode(q, kc, vc, torch.tensor(lens, device=DEVICE), 4)
    for b, n in enumerate(lens):
        one = slice(b, b + 1)
        assert_attention_right(q[one], kc[one, :, :n], vc[one, :, :n], do[one], o=o[one], lse=lse[one])


@pytest.mark.parametrize("num_splits", [1, 3, 4])
def test_decode_awkward_batch_heads_match_oracle(num_splits):
    """B = 3, H = 5, Hkv = 1, Nq = 13: 65 stacked query rows, two row blocks per kv head, and splits."""
    q, kc, vc, _ = make_qkv(3, 5, 1, 13, 50, 24, seed=10, device=DEVICE)
    lens = torch.tensor([50, 0, 17], dtype=torch.int32, device=DEVICE)
    assert_decode_matches_oracle(q, kc, vc, lens, num_splits)


def test_decode_kernel_clamps_lengths_it_is_not_checked_for():
    """On a GPU flashlib.decode does not read the lengths back: the kernel itself clamps them into
    [0, Nmax], so a length past the cache reads nothing outside it and a negative one sees no key."""
    from flashlib.kernels.triton import decode_v3 as tdecode
    q, kc, vc, _ = make_qkv(3, 4, 2, 1, 20, 16, seed=11, device=DEVICE)
    bad = torch.tensor([-3, 25, 7], dtype=torch.int32, device=DEVICE)
    good = torch.tensor([0, 20, 7], dtype=torch.int32, device=DEVICE)
    o_bad, lse_bad = tdecode.decode(q, kc, vc, bad, num_splits=2, scale=0.25)
    o_good, lse_good = tdecode.decode(q, kc, vc, good, num_splits=2, scale=0.25)
    assert torch.equal(o_bad, o_good) and torch.equal(lse_bad, lse_good)
    assert torch.isneginf(lse_bad[0]).all() and (o_bad[0] == 0).all()
