"""Counted HBM traffic equals each algorithm's closed form; FA1 falls as 1/M; the SRAM budget holds."""
import math

import numpy as np
import pytest

from flashlib import decoding, fa1, fa2, naive
from flashlib.iomodel import IOCounter, SRAMOverflowError
from flashlib.testing import random_qkv

B = 2  # bytes per element used throughout (fp16 model)


def counted(fn, *args, bytes_per_element=B, **kwargs):
    io = IOCounter(bytes_per_element=bytes_per_element)
    fn(*args, io=io, **kwargs)
    return io.hbm_read_bytes, io.hbm_write_bytes


@pytest.mark.parametrize("n,m,d,dv,lead", [(13, 29, 8, 8, 1), (40, 7, 5, 9, 6), (1, 100, 64, 64, 1)])
def test_naive_forward_closed_form(n, m, d, dv, lead):
    q, k, v = random_qkv(n, m, d, dv=dv, lead=(lead,))
    reads = n * d + m * d + 2 * n * m + m * dv          # Q, K; S; P; V
    writes = 2 * n * m + n * dv                         # S, P; O
    assert counted(naive.attention, q, k, v) == (lead * B * reads, lead * B * writes)


@pytest.mark.parametrize("n,m,d,dv", [(13, 29, 8, 8), (40, 7, 5, 9)])
def test_naive_backward_closed_form(n, m, d, dv):
    q, k, v = random_qkv(n, m, d, dv=dv)
    o, do = np.zeros((n, dv)), np.ones((n, dv))
    reads = (n * d + m * d + n * m) + (n * m + n * dv) + (n * dv + m * dv) + 2 * n * m \
        + (n * m + m * d) + (n * m + n * d)
    writes = 2 * n * m + m * dv + n * m + n * m + n * d + m * d
    assert counted(naive.backward, q, k, v, o, do) == (B * reads, B * writes)


@pytest.mark.parametrize("n,m,d,dv,br,bc", [(13, 29, 8, 8, 4, 5), (40, 7, 5, 9, 16, 3),
                                            (64, 64, 16, 16, 16, 16)])
def test_fa1_closed_form(n, m, d, dv, br, bc):
    q, k, v = random_qkv(n, m, d, dv=dv)
    tc = math.ceil(m / bc)
    reads = m * d + m * dv + tc * (n * d + n * dv + 2 * n)    # K, V once; Q_i, O_i, l_i, m_i per j
    writes = (n * dv + 2 * n) + tc * (n * dv + 2 * n)         # initialisation; O_i, l_i, m_i per j
    assert counted(fa1.forward, q, k, v, block_q=br, block_k=bc) == (B * reads, B * writes)


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


@pytest.mark.parametrize("n,m,d,splits", [(1, 100, 8, 4), (3, 50, 5, 7), (2, 5, 4, 9)])
def test_decoding_closed_form(n, m, d, splits):
    q, k, v = random_qkv(n, m, d)
    reads = splits * n * d + 2 * m * d + splits * (n * d + n)   # Q per split, K/V once; combine
    writes = splits * (n * d + n) + n * d + n                   # partials; final O, LSE
    assert counted(decoding.forward, q, k, v, num_splits=splits) == (B * reads, B * writes)


def test_counts_scale_with_bytes_per_element():
    q, k, v = random_qkv(9, 9, 4)
    r2, w2 = counted(fa2.forward, q, k, v, bytes_per_element=2)
    r4, w4 = counted(fa2.forward, q, k, v, bytes_per_element=4)
    assert (r4, w4) == (2 * r2, 2 * w2)


def test_fa1_traffic_falls_as_one_over_sram():
    n, d = 1024, 16
    q, k, v = random_qkv(n, n, d)
    traffic = {}
    for kib in (4, 8, 16, 32):                  # M = kib * 512 elements; Bc = M/4d divides n
        io = IOCounter(bytes_per_element=2)
        fa1.forward(q, k, v, sram_bytes=kib * 1024, io=io)
        traffic[kib] = io.hbm_bytes
    once = (2 * n * d + n * d + 2 * n) * B      # K and V read once; O, l, m initialised once
    per_pass = [traffic[kib] - once for kib in (4, 8, 16, 32)]
    # Everything else is repeated Tc = N / Bc = 4Nd / M times.
    for small, big in zip(per_pass, per_pass[1:]):
        assert small == 2 * big
    slope = np.polyfit(np.log([4, 8, 16, 32]), np.log(list(traffic.values())), 1)[0]
    assert -1.05 < slope < -0.9


def test_fa1_paper_block_sizes_fit_and_are_used():
    d, sram = 32, 16 * 1024                     # M = 8192 elements
    assert fa1.paper_block_sizes(sram, d) == (32, 64)   # Bc = 8192 / 128 = 64, Br = min(64, 32)
    q, k, v = random_qkv(100, 130, d)
    io = IOCounter(bytes_per_element=2)
    fa1.forward(q, k, v, sram_bytes=sram, io=io)
    assert io.peak_sram_bytes == (2 * 64 * d + 2 * 32 * d) * 2 <= sram


def test_sram_budget_is_enforced():
    q, k, v = random_qkv(64, 64, 16)
    with pytest.raises(SRAMOverflowError, match="sram_bytes=1024"):
        fa1.forward(q, k, v, block_q=16, block_k=16, sram_bytes=1024)
    with pytest.raises(SRAMOverflowError):
        fa2.forward(q, k, v, block_q=64, block_k=64, io=IOCounter(sram_bytes=4096))
    with pytest.raises(ValueError, match="too small for one tile"):
        fa1.forward(q, k, v, sram_bytes=100)      # M = 50 elements < 4d = 64


def test_flop_counts_fa2_does_fewer_non_matmul_ops_than_fa1():
    q, k, v = random_qkv(128, 128, 32)
    io1, io2 = IOCounter(), IOCounter()
    fa1.forward(q, k, v, block_q=16, block_k=16, io=io1)
    fa2.forward(q, k, v, block_q=16, block_k=16, io=io2)
    assert io1.matmul_flops == io2.matmul_flops == 2 * 128 * 128 * (32 + 32)
    assert io2.other_flops < io1.other_flops


def test_counter_arguments_are_checked():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="bytes_per_element"):
            IOCounter(bytes_per_element=bad)
    with pytest.raises(ValueError, match="sram_bytes"):
        IOCounter(sram_bytes=0)
    io = IOCounter()
    io.hbm_read_bytes = 5
    io.reset()
    assert io.hbm_bytes == 0


def test_fa1_fills_in_the_paper_block_size_that_was_not_given():
    q, k, v = random_qkv(300, 300, 64)
    both, only_q = IOCounter(), IOCounter()
    fa1.forward(q, k, v, sram_bytes=100 * 1024, io=both)                 # Br = 64, Bc = 200
    fa1.forward(q, k, v, sram_bytes=100 * 1024, block_q=64, io=only_q)   # Bc still 200
    assert both.hbm_bytes == only_q.hbm_bytes
    assert only_q.peak_sram_bytes == (2 * 200 * 64 + 2 * 64 * 64) * 2
