"""flashlib.ladder.fa1: traffic in closed form, falling as 1/M; the paper's block sizes (oracle tests:
test_ladder_forward.py)."""
import math

import numpy as np
import pytest

from flashlib.ladder import fa1
from flashlib.ladder.iomodel import IOCounter
from flashlib.testing import random_qkv
from ladder_cases import B, counted


@pytest.mark.parametrize("n,m,d,dv,br,bc", [(13, 29, 8, 8, 4, 5), (40, 7, 5, 9, 16, 3),
                                            (64, 64, 16, 16, 16, 16)])
def test_fa1_closed_form(n, m, d, dv, br, bc):
    q, k, v = random_qkv(n, m, d, dv=dv)
    tc = math.ceil(m / bc)
    reads = m * d + m * dv + tc * (n * d + n * dv + 2 * n)    # K, V once; Q_i, O_i, l_i, m_i per j
    writes = (n * dv + 2 * n) + tc * (n * dv + 2 * n)         # initialisation; O_i, l_i, m_i per j
    assert counted(fa1.forward, q, k, v, block_q=br, block_k=bc) == (B * reads, B * writes)


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


def test_fa1_fills_in_the_paper_block_size_that_was_not_given():
    q, k, v = random_qkv(300, 300, 64)
    both, only_q = IOCounter(), IOCounter()
    fa1.forward(q, k, v, sram_bytes=100 * 1024, io=both)                 # Br = 64, Bc = 200
    fa1.forward(q, k, v, sram_bytes=100 * 1024, block_q=64, io=only_q)   # Bc still 200
    assert both.hbm_bytes == only_q.hbm_bytes
    assert only_q.peak_sram_bytes == (2 * 200 * 64 + 2 * 64 * 64) * 2
