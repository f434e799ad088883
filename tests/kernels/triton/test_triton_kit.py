"""Tests of flashlib/kernels/triton/kit.py, the helpers every Triton kernel shares, run in small kernels on
conftest's DEVICE: the key and query ranges of a block against the causal mask's definition (query i sees
key j iff j <= i + Nk - Nq) computed by brute force, the flat-grid decode, and the named constants.
"""
from __future__ import annotations

import math
import pathlib
import warnings

import numpy as np
import pytest
import torch
from conftest import DEVICE

from flashlib.kernels.triton import flat_grid, kit, tl, triton
from flashlib.testing import _visible


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


# ---------------------------------------------------------------- issue 24: the band and the variants

@triton.jit
def _band_ranges(OUT, NQ, NK, WIN_L, WIN_R, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    i = tl.program_id(0)                 # query block i for the key range, key block i for the query one
    a, b, c, d = kit.band_key_range(i * BLOCK_M, NQ, NK, WIN_L, WIN_R, BLOCK_M, BLOCK_N)
    e, f, g, h = kit.band_query_range(i * BLOCK_N, NQ, NK, WIN_L, WIN_R, BLOCK_M, BLOCK_N)
    for n, x in enumerate((a, b, c, d, e, f, g, h)):
        tl.store(OUT + i * 8 + n, x)


def band_sees(nq, nk, window, causal):
    """The brute-force mask: query i sees key j (the float64 oracle's, flash-attn's window)."""
    return _visible(nq, nk, causal, window)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [(3, 2), (0, 0), (20, -1), (-1, 5), (7, 0), (100, 100), (-1, -1)], ids=str)
@pytest.mark.parametrize("blocks", [(16, 16), (32, 16), (16, 32)], ids=str)
@pytest.mark.parametrize("nq,nk", [(1, 1), (5, 40), (40, 9), (33, 33), (70, 30), (17, 45)], ids=str)
def test_band_ranges_split_tiles_into_empty_partial_and_full(nq, nk, blocks, window, causal):
    """band_key_range of each query block and band_query_range of each key block, against the brute-force
    mask: no block a row sees is skipped, no block no row sees is visited, the full ones are exactly the
    blocks every row sees entirely (below Nk), and every other visited block is masked."""
    bm, bn = blocks
    win_l, win_r = kit.band(window, causal, nq, nk)
    n = max(cdiv(nq, bm), cdiv(nk, bn))
    out = torch.full((n, 8), -1, dtype=torch.int32, device=DEVICE)
    _band_ranges[(n,)](out, nq, nk, win_l, win_r, BLOCK_M=bm, BLOCK_N=bn)
    got = out.cpu().numpy()
    sees = band_sees(nq, nk, window, causal)
    for m in range(cdiv(nq, bm)):                   # key blocks of query block m
        lo, lo_full, hi_full, hi = got[m, :4]
        rows = sees[m * bm:(m + 1) * bm]
        assert lo % bn == lo_full % bn == hi_full % bn == 0 and lo <= lo_full <= hi_full
        visited = set(range(lo, max(hi, lo_full), bn))
        full = set(range(lo_full, hi_full, bn))
        for start in range(0, nk, bn):
            tile = rows[:, start:start + bn]
            seen_all = tile.all() and start + bn <= nk
            assert (start in visited) == tile.any(), ("visited iff some row sees a key", m, start)
            assert (start in full) == seen_all, ("full iff every row sees every key", m, start)
    for j in range(cdiv(nk, bn)):                   # query blocks of key block j
        lo, lo_full, hi_full, hi = got[j, 4:]
        cols = sees[:, j * bn:(j + 1) * bn]
        assert lo % bm == lo_full % bm == hi_full % bm == 0 and lo <= lo_full <= hi_full
        visited = set(range(lo, max(hi, lo_full), bm))
        full = set(range(lo_full, hi_full, bm))
        for start in range(0, nq, bm):
            tile = cols[start:start + bm]
            assert (start in visited) == tile.any(), ("visited iff a row sees the block", j, start)
            assert (start in full) == tile.all(), ("full iff every row sees every key < Nk", j, start)


def test_band_folds_causal_and_clamps_unbounded_sides():
    assert kit.band((-1, -1), True, 10, 25) == (25, 0)        # causal: right 0; left unbounded: Nk
    assert kit.band((3, 5), True, 10, 25) == (3, 0)
    assert kit.band((3, -1), False, 10, 25) == (3, 10)        # right unbounded: Nq
    assert kit.band((1000, 1000), False, 10, 25) == (25, 10)  # past the sequence: clamped
    assert kit.band((0, 0), False, 7, 3) == (0, 0)


@triton.jit
def _join64(OUT, LO, HI):
    tl.store(OUT, kit.join64(LO, HI))


@pytest.mark.parametrize("x", [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32 + 1, 2**40 + 12345, 2**63 - 1])
def test_split32_and_join64_round_trip(x):
    lo, hi = kit.split32(x)
    assert -2**31 <= lo < 2**31 and -2**31 <= hi < 2**31
    out = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    _join64[(1,)](out, lo, hi)
    assert out.item() == x


@triton.jit
def _elementwise(X, Y, OUT, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(X + offs)
    y = tl.load(Y + offs)
    tl.store(OUT + offs, kit.tanh(x))
    tl.store(OUT + N + offs, kit.logaddexp(x, y))
    o, lse = kit.add_sink(tl.full([N, 16], 1.0, tl.float32), x, y)
    tl.store(OUT + 2 * N + offs, tl.sum(o, 1) / 16)
    tl.store(OUT + 3 * N + offs, lse)


def test_tanh_logaddexp_and_add_sink_elementwise():
    """tanh to fp32 accuracy from 1e-6 to far past saturation, both signs; logaddexp and add_sink on
    -inf (a row that saw no key, a sink of -inf) and NaN."""
    inf, nan = float("inf"), float("nan")
    mags = np.concatenate([[0.0, 1e-6, 1e-3, 0.1, 0.124, 0.126, 0.5, 1.0, 3.0, 9.0, 20.0, 88.0, 1e4], [inf]])
    x = np.concatenate([mags, -mags[1:], [nan, -inf, -inf, 2.0]]).astype(np.float32)
    y = np.concatenate([np.linspace(-3, 3, len(mags) * 2 - 1), [0.0, -inf, 1.0, -inf]]).astype(np.float32)
    n = 32
    x = np.pad(x, (0, n - len(x)), constant_values=0.5)
    y = np.pad(y, (0, n - len(y)), constant_values=-0.5)
    out = torch.zeros(4 * n, device=DEVICE)
    with warnings.catch_warnings():      # the interpreter's NumPy warns on inf - inf in a discarded branch
        warnings.simplefilter("ignore", RuntimeWarning)
        _elementwise[(1,)](torch.tensor(x, device=DEVICE), torch.tensor(y, device=DEVICE), out, N=n)
    t, lae, o, lse = out.cpu().double().numpy().reshape(4, n)
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    with np.errstate(invalid="ignore"):
        np.testing.assert_allclose(t, np.tanh(x64), rtol=2e-6, atol=1e-7)
        want = np.logaddexp(x64, y64)
        np.testing.assert_allclose(lae, want, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(lse, want, rtol=1e-6, atol=1e-6)
        w = np.where(np.isneginf(x64), 0.0, np.exp(x64 - want))   # o = 1 scaled by exp(lse - lse')
        np.testing.assert_allclose(o, w, rtol=1e-5, atol=1e-7)
    assert np.isnan(t[x != x]).all() and np.isnan(o[x != x]).all()


@triton.jit
def _keep(OUT, SEED_LO, SEED_HI, OFF_LO, OFF_HI, NQ, NK, P, BM: tl.constexpr, BN: tl.constexpr):
    bh = tl.program_id(0)
    seed = kit.join64(SEED_LO, SEED_HI)
    base = kit.join64(OFF_LO, OFF_HI) + bh.to(tl.int64) * NQ * NK
    qpos = tl.arange(0, BM)
    keys = tl.arange(0, BN)
    keep = kit.dropout_keep(seed, base, qpos, keys, NK, P)
    tl.store(OUT + bh * BM * BN + qpos[:, None] * BN + keys[None, :], keep.to(tl.int32))


# (seed, offset): 64-bit seeds, and offsets whose counters cross 2^32 inside a row (the carry)
DROPOUT_SEEDS = [(2**40 + 12345, 2**32 - 45), (7, 0), (2**62 + 3, 2**39 + 2**32 - 100)]


def keep_matches_ladder(keep_kernel, device) -> list[bool]:
    """Run ``keep_kernel`` (_keep) for DROPOUT_SEEDS; whether each mask is keep_mask's, bit for bit."""
    from flashlib.ladder.dropout import keep_mask
    H, NQ, NK, p = 3, 16, 32, 0.3
    same = []
    for seed, off in DROPOUT_SEEDS:
        out = torch.zeros(H, NQ, NK, dtype=torch.int32, device=device)
        keep_kernel[(H,)](out, *kit.split32(seed), *kit.split32(off), NQ, NK, p, BM=NQ, BN=NK)
        same.append(bool(np.array_equal(out.cpu().numpy().astype(bool), keep_mask(seed, off, (1, H, NQ, NK), p)[0])))
    return same


def test_dropout_keep_is_the_ladders_keep_mask_bit_for_bit():
    assert keep_matches_ladder(_keep, DEVICE) == [True] * len(DROPOUT_SEEDS)


_KEEP_CHILD = '''
import sys, torch, triton
sys.path.insert(0, {tests!r})
from test_triton_kit import _keep, keep_matches_ladder
print("RESULT", triton.__version__, keep_matches_ladder(_keep, "cpu"))
'''


@pytest.mark.parametrize("version", ["3.2.0", "3.3.1", "3.6.0"])
def test_dropout_keep_is_the_same_on_older_tritons(version, tmp_path):
    """triton 3.2 and 3.3 run a 64-bit Philox when tl.rand gets an int64 counter (other bits than 3.6 and 3.9):
    kit.dropout_keep builds the two 32-bit words itself, so every Triton flashlib supports draws
    keep_mask's bits (each version's interpreter, in a child process)."""
    import os
    import subprocess
    import sys
    from conftest import ROOT
    from flashlib.tools import triton_versions
    folder = triton_versions.ensure(version)
    tests = str(pathlib.Path(__file__).parent)
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(folder or ""), str(ROOT), tests,
                                                        str(pathlib.Path(tests).parent.parent)])))
    proc = subprocess.run([sys.executable, "-c", _KEEP_CHILD.format(tests=tests)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = proc.stdout.split("RESULT", 1)[1].split()
    assert line[0] == version and " ".join(line[1:]) == str([True] * len(DROPOUT_SEEDS)), proc.stdout
