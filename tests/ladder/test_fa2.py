"""flashlib.ladder.fa2: traffic in closed form, causal block skipping, operation counts (oracle tests:
test_ladder_forward.py, test_backward.py)."""
import math

import numpy as np
import pytest

from flashlib.ladder import fa1, fa2
from flashlib.ladder.iomodel import IOCounter
from flashlib.testing import random_qkv
from ladder_cases import B, counted


@pytest.mark.parametrize("n,m,d,dv,br,bc", [(13, 29, 8, 8, 4, 5), (40, 7, 5, 9, 16, 3)])
def test_fa2_forward_closed_form(n, m, d, dv, br, bc):
    q, k, v = random_qkv(n, m, d, dv=dv)
    tr = math.ceil(n / br)
    reads = n * d + tr * (m * d + m * dv)                     # Q once; K, V once per query block
    writes = n * dv + n                                       # O and LSE
    assert counted(fa2.forward, q, k, v, block_q=br, block_k=bc) == (B * reads, B * writes)


def visible_key_blocks(n, m, br, bc):
    """Per query block, the number of key blocks the bottom-right causal mask does not hide."""
    out = []
    for i0 in range(0, n, br):
        last_visible_key = min(i0 + br, n) - 1 + m - n       # of the block's last query
        out.append(0 if last_visible_key < 0 else min(math.ceil(m / bc), last_visible_key // bc + 1))
    return out


@pytest.mark.parametrize("n,m,br,bc", [(64, 64, 8, 8), (30, 50, 7, 4), (50, 30, 6, 5)])
def test_fa2_causal_skips_hidden_blocks(n, m, br, bc):
    d = 4
    q, k, v = random_qkv(n, m, d)
    per_block = visible_key_blocks(n, m, br, bc)
    # every visited key block except possibly a partial last one is bc rows long
    key_rows = sum(min(vb * bc, m) for vb in per_block)
    reads = n * d + key_rows * 2 * d
    assert counted(fa2.forward, q, k, v, causal=True, block_q=br, block_k=bc)[0] == B * reads
    if n == m:  # square causal: about half the blocks of the non-causal pass
        full = math.ceil(n / br) * math.ceil(m / bc)
        assert sum(per_block) / full < 0.6


@pytest.mark.parametrize("n,m,d,dv,br,bc", [(13, 29, 8, 8, 4, 5), (40, 7, 5, 9, 16, 3)])
def test_fa2_backward_closed_form(n, m, d, dv, br, bc):
    q, k, v = random_qkv(n, m, d, dv=dv)
    o, lse, do = np.zeros((n, dv)), np.zeros(n), np.ones((n, dv))
    tc = math.ceil(m / bc)
    reads = 2 * n * dv + (m * d + m * dv) + tc * (n * d + n * dv + 2 * n + n * d)
    writes = n * d + n + tc * n * d + m * d + m * dv          # dQ init, D; dQ_i per (i, j); dK, dV
    assert counted(fa2.backward, q, k, v, o, lse, do, block_q=br, block_k=bc) == \
        (B * reads, B * writes)


def test_flop_counts_fa2_does_fewer_non_matmul_ops_than_fa1():
    q, k, v = random_qkv(128, 128, 32)
    io1, io2 = IOCounter(), IOCounter()
    fa1.forward(q, k, v, block_q=16, block_k=16, io=io1)
    fa2.forward(q, k, v, block_q=16, block_k=16, io=io2)
    assert io1.matmul_flops == io2.matmul_flops == 2 * 128 * 128 * (32 + 32)
    assert io2.other_flops < io1.other_flops


def test_fa2_backward_counts_two_and_a_half_times_the_forward_matmuls():
    from flashlib.ladder import fa2
    from flashlib.ladder.iomodel import IOCounter
    q, k, v = random_qkv(20, 30, 8)
    fwd, bwd = IOCounter(), IOCounter()
    o, lse = fa2.forward(q, k, v, io=fwd, block_q=7, block_k=5)
    fa2.backward(q, k, v, o, lse, np.ones_like(o), io=bwd, block_q=7, block_k=5)
    assert bwd.matmul_flops == 2.5 * fwd.matmul_flops
