"""Tests of flashlib/kernels/triton/kit.py, the helpers every Triton kernel shares, run in small kernels on
conftest's DEVICE: the key and query ranges of a block against the causal mask's definition (query i sees
key j iff j <= i + Nk - Nq) computed by brute force, the flat-grid decode, and the named constants.
"""
from __future__ import annotations

import math
import pathlib

import numpy as np
import pytest
import torch
from conftest import DEVICE

from flashlib.kernels.triton import flat_grid, kit, tl, triton


@triton.jit
def _ranges(OUT, NQ, NK, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    i = tl.program_id(0)                 # query block i for key_range, key block i for query_range
    lo_masked, hi = kit.key_range(i * BLOCK_M, NQ, NK, BLOCK_M, BLOCK_N, CAUSAL)
    lo, hi_masked = kit.query_range(i * BLOCK_N, NQ, NK, BLOCK_M, BLOCK_N, CAUSAL)
    tl.store(OUT + i * 4 + 0, lo_masked)
    tl.store(OUT + i * 4 + 1, hi)
    tl.store(OUT + i * 4 + 2, lo)
    tl.store(OUT + i * 4 + 3, hi_masked)


@triton.jit
def _unflatten(OUT, N0, N1):
    pid = tl.program_id(0)
    a, rest = kit.unflatten(pid, N0)
    b, c = kit.unflatten(rest, N1)
    tl.store(OUT + pid * 3 + 0, a)
    tl.store(OUT + pid * 3 + 1, b)
    tl.store(OUT + pid * 3 + 2, c)


def cdiv(a, b):
    return -(-a // b)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("blocks", [(16, 16), (32, 16), (16, 32)], ids=str)
@pytest.mark.parametrize("nq,nk", [(1, 1), (5, 40), (40, 9), (33, 33), (70, 30), (17, 45), (18, 32), (20, 50)],
                         ids=str)  # (18, 32), (20, 50): a query block starts one row before the first full row
def test_ranges_skip_only_hidden_blocks_and_mask_only_partial_ones(nq, nk, blocks, causal):
    """key_range of each query block and query_range of each key block, against the brute-force mask:
    nothing seen is skipped, nothing unseen is loaded, the partial blocks (and only those but in a
    ragged last key block) are masked."""
    bm, bn = blocks
    n = max(cdiv(nq, bm), cdiv(nk, bn))
    out = torch.full((n, 4), -1, dtype=torch.int32, device=DEVICE)
    _ranges[(n,)](out, nq, nk, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal)
    got = out.cpu().numpy()
    rows, keys = np.arange(nq)[:, None], np.arange(nk)[None, :]
    sees = keys <= rows + nk - nq if causal else np.ones((nq, nk), bool)   # query i sees key j
    for m in range(cdiv(nq, bm)):                    # key_range of query block m
        lo_masked, hi = got[m, :2]
        block = sees[m * bm:(m + 1) * bm]
        seen_by_all = np.cumprod(block.all(0)).sum()             # leading keys every row sees
        assert not block[:, hi:].any(), "a key the range skips is seen"
        assert hi == 0 or block[:, hi - 1].any(), "the range loads a key no row sees"
        assert lo_masked == seen_by_all // bn * bn, "the unmasked key blocks are not all the whole ones"
    for j in range(cdiv(nk, bn)):                    # query_range of key block j
        lo, hi_masked = got[j, 2:]
        block = sees[:, j * bn:(j + 1) * bn]
        seeing = np.flatnonzero(block.any(1))
        assert lo % bm == 0 and not block[:lo].any(), "a query row the range skips sees the key block"
        if len(seeing):
            assert lo == seeing[0] // bm * bm, "the range visits a query block that sees nothing"
        if not causal:
            assert (lo, hi_masked) == (0, 0)        # no diagonal (a ragged key block: the key mask)
            continue
        ragged = (j + 1) * bn > nk                   # hi_masked counts its keys up to (j + 1)·bn - 1
        for start in range(lo, nq, bm):              # every partial block masked; no other, but ragged
            partial = not block[start:start + bm].all()
            assert start < hi_masked if partial else (start >= hi_masked or ragged), (j, start)


def test_unflatten_is_the_flat_grids_decode():
    """flat_grid(c2, c1, c0) numbers its programs c0 fastest: unflatten twice gives them back."""
    n0, n1, n2 = 3, 5, 7
    grid = flat_grid(n2, n1, n0)
    out = torch.full((grid[0], 3), -1, dtype=torch.int32, device=DEVICE)
    _unflatten[grid](out, n0, n1)
    want = [[p % n0, (p // n0) % n1, p // (n0 * n1)] for p in range(n0 * n1 * n2)]
    assert grid == (n0 * n1 * n2,) and out.cpu().tolist() == want


def test_named_constants_and_no_bare_literals_in_the_kernels():
    assert kit.LOG2E.value == math.log2(math.e) and kit.LN2.value == math.log(2.0)
    assert kit.qk_scale(0.125) == 0.125 * math.log2(math.e)
    for path in pathlib.Path(kit.__file__).parent.glob("*.py"):
        text = path.read_text()
        for literal in ("1.4426950408", "0.6931471805", "1.442695", "0.693147"):
            assert literal not in text, f"{path.name}: {literal} — use kit.LOG2E / kit.LN2"


@triton.jit
def _to_bfloat16(X, Y, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Y + offs, tl.load(X + offs).to(tl.bfloat16))


def test_float32_to_bfloat16_rounds_to_nearest_even_as_on_a_gpu():
    """A kernel's x.to(tl.bfloat16) gives torch's bits (round to nearest even, as cvt.rn.bf16.f32): ties
    both ways, values just above and below a half ulp, negatives, subnormals, inf and nan. In the
    interpreter this is flashlib's replacement of Triton's conversion, which truncates (checked below)."""
    ulp = 2.0 ** -7                                     # bfloat16's spacing in [1, 2)
    special = [1 + ulp / 2, 1 + 3 * ulp / 2, 1 + ulp / 2 + 2 ** -20, 1 + ulp / 2 - 2 ** -20, 2.124258,
               -2.124258, 1e-40, -3e-39, float("inf"), float("-inf"), 3.3e38, 0.0, -0.0]
    x = torch.cat([torch.tensor(special), torch.randn(256 - len(special), generator=torch.Generator().manual_seed(0))])
    x = x.to(DEVICE, torch.float32)
    y = torch.empty(256, dtype=torch.bfloat16, device=DEVICE)
    _to_bfloat16[(1,)](x, y, N=256)
    want = x.to(torch.bfloat16)
    assert torch.equal(y.view(torch.int16), want.view(torch.int16))
    assert y[4].item() == 2.125                         # the FlashAttention-rule case: not 2.109375
    nan = torch.tensor([float("nan")] * 16, device=DEVICE)
    ynan = torch.empty(16, dtype=torch.bfloat16, device=DEVICE)
    _to_bfloat16[(1,)](nan, ynan, N=16)
    assert ynan.isnan().all()
    if DEVICE == "cpu":                                 # why the replacement: Triton's own truncates
        from triton.runtime import interpreter
        original = interpreter._convert_float.triton_original
        bits = original(np.array([2.124258], dtype=np.float32), tl.float32, tl.bfloat16, None)
        assert torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).item() == 2.109375
