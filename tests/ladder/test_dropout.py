"""flashlib.ladder.dropout: philox_uniform is Triton's tl.rand bit for bit (run in a tiny kernel, in
the interpreter on a CPU, compiled on a GPU), keep_mask follows the counter layout, and the arguments
are checked."""
from __future__ import annotations

import numpy as np
import pytest

from flashlib.ladder.dropout import check_seed, keep_mask, philox_uniform

# Philox4x32-10 of counter (0, 0, 0, 0) with key (0, 0): the Random123 known-answer test's first word
# (Salmon et al. 2011, kat_vectors: philox4x32 10 ... -> 6627e8d5 e169c58d bc57ac4c 9b00dbd8).
KAT_ZERO = 0x6627E8D5


def _uniform_of(word: int) -> np.float32:
    x = np.array([word], dtype=np.uint32).view(np.int32)
    x = np.where(x < 0, ~x, x)
    return (x.astype(np.float32) * np.float32(4.6566127342e-10))[0]


def test_philox_matches_the_random123_known_answer():
    assert philox_uniform(0, np.array([0])) == _uniform_of(KAT_ZERO)


def test_philox_uniform_is_float32_in_zero_one_and_looks_uniform():
    u = philox_uniform(1234, np.arange(200_000))
    assert u.dtype == np.float32 and u.shape == (200_000,)
    assert 0.0 <= u.min() and u.max() < 1.0
    assert abs(u.mean() - 0.5) < 0.005 and abs(u.var() - 1 / 12) < 0.002
    assert len(np.unique(u)) > 199_000
    # the seed's two halves and the counter's two halves all matter
    c = np.array([5, 5 + 2 ** 32, 5 + 2 ** 40])
    assert len(set(philox_uniform(7, c))) == 3
    assert philox_uniform(7, c[:1]) != philox_uniform(7 + 2 ** 32, c[:1])


def test_keep_mask_uses_the_flat_index_plus_offset_as_counter():
    seed, offset, shape, p = 42, 1000, (2, 3, 5, 7), 0.3
    z = keep_mask(seed, offset, shape, p)
    assert z.shape == shape and z.dtype == bool
    u = philox_uniform(seed, offset + np.arange(2 * 3 * 5 * 7)).reshape(shape)
    assert np.array_equal(z, u >= np.float32(p))
    b, h, i, j = 1, 2, 3, 4                  # c = offset + ((b * H + h) * Nq + i) * Nk + j
    c = offset + ((b * 3 + h) * 5 + i) * 7 + j
    assert z[b, h, i, j] == (philox_uniform(seed, np.array([c]))[0] >= np.float32(p))
    # a tile is the same bits as the whole
    assert np.array_equal(keep_mask(seed, offset, shape, p, rows=(1, 4), cols=(2, 7)), z[..., 1:4, 2:7])
    assert keep_mask(seed, offset, shape, p, rows=(2, 2)).shape == (2, 3, 0, 7)
    assert keep_mask(seed, offset, (5, 7), 0.0).all()


def test_keep_mask_keeps_one_minus_p_and_differs_per_seed_and_offset():
    shape = (4, 64, 64)
    for p in (0.1, 0.5, 0.9):
        kept = keep_mask(3, 0, shape, p).mean()
        assert abs(kept - (1 - p)) < 4 * np.sqrt(p * (1 - p) / np.prod(shape))
    a = keep_mask(3, 0, shape, 0.5)
    assert (a != keep_mask(4, 0, shape, 0.5)).mean() > 0.4
    assert (a != keep_mask(3, 1, shape, 0.5)).mean() > 0.4
    assert np.array_equal(a, keep_mask(3, 0, shape, 0.5))       # deterministic


@pytest.mark.parametrize("call,exc,match", [
    (lambda: philox_uniform(-1, np.arange(3)), ValueError, "seed"),
    (lambda: philox_uniform(2 ** 63, np.arange(3)), ValueError, "seed"),
    (lambda: philox_uniform(1.5, np.arange(3)), TypeError, "seed"),
    (lambda: philox_uniform(True, np.arange(3)), TypeError, "seed"),
    (lambda: philox_uniform(1, np.arange(3.0)), TypeError, "counters"),
    (lambda: philox_uniform(1, np.array([-1])), ValueError, "counters"),
    (lambda: keep_mask(1, -1, (2, 2), 0.5), ValueError, "offset"),
    (lambda: keep_mask(1, 2 ** 62, (2, 2), 0.5), ValueError, "offset"),
    (lambda: keep_mask(1, 0, (2,), 0.5), ValueError, "shape"),
    (lambda: keep_mask(1, 0, 5, 0.5), TypeError, "shape"),
    (lambda: keep_mask(1, 0, (2, -2), 0.5), ValueError, "shape"),
    (lambda: keep_mask(1, 0, (2, 2), 1.0), ValueError, "p must"),
    (lambda: keep_mask(1, 0, (2, 2), -0.1), ValueError, "p must"),
    (lambda: keep_mask(1, 0, (2, 2), "0.1"), TypeError, "p must"),
    (lambda: keep_mask(1, 0, (2, 2), 0.1, rows=(0, 3)), ValueError, "rows"),
    (lambda: keep_mask(1, 0, (2, 2), 0.1, cols=(2, 1)), ValueError, "cols"),
    (lambda: keep_mask(1, 0, (2, 2), 0.1, cols=3), TypeError, "cols"),
    (lambda: check_seed("1", "dropout_seed"), TypeError, "dropout_seed"),
])
def test_bad_arguments_are_refused_naming_them(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_philox_uniform_is_tritons_tl_rand_bit_for_bit():
    """A tiny kernel stores tl.rand(seed, offs) for int64 offsets (some >= 2**32); its float32 bits
    equal philox_uniform's, for 32-bit and 64-bit seeds."""
    from conftest import need_module
    need_module("triton")
    need_module("torch")
    import torch
    from conftest import DEVICE

    from flashlib.kernels.triton import tl, triton    # selects the interpreter on a CPU

    @triton.jit
    def _rand(OUT, OFFS, seed, N: tl.constexpr):
        idx = tl.arange(0, N)
        offs = tl.load(OFFS + idx)                      # int64
        tl.store(OUT + idx, tl.rand(seed, offs))

    rng = np.random.default_rng(0)
    offsets = np.concatenate([np.arange(40), 2 ** 32 - 4 + np.arange(8),
                              rng.integers(0, 2 ** 40 + 2 ** 36, 16)]).astype(np.int64)
    n = len(offsets)
    offs = torch.from_numpy(offsets).to(DEVICE)
    for seed in (0, 1, 12345, 2 ** 31 + 7, 2 ** 40 + 3, 2 ** 63 - 1):
        out = torch.empty(n, dtype=torch.float32, device=DEVICE)
        _rand[(1,)](out, offs, seed, N=n)
        got = out.cpu().numpy()
        want = philox_uniform(seed, offsets)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), seed
