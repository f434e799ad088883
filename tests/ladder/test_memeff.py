"""flashlib.ladder.memeff: the precursors' traffic (oracle tests: test_ladder_forward.py)."""
import math

import pytest

from flashlib.ladder import memeff
from flashlib.testing import random_qkv
from ladder_cases import B, counted


@pytest.mark.parametrize("n,m,d,bc", [(13, 29, 8, 5), (40, 7, 5, 3)])
def test_lse_first_reads_the_keys_twice(n, m, d, bc):
    q, k, v = random_qkv(n, m, d)
    reads = n * d + m * d + (m * d + m * d)          # Q; K in pass 1; K and V in pass 2
    assert counted(memeff.lse_first, q, k, v, block_k=bc) == (B * reads, B * n * d)


@pytest.mark.parametrize("n,m,d,qc,kc", [(13, 29, 8, 4, 5), (40, 7, 5, 16, 3)])
def test_chunked_reads_keys_once_per_query_chunk(n, m, d, qc, kc):
    q, k, v = random_qkv(n, m, d)
    reads = n * d + math.ceil(n / qc) * 2 * m * d
    assert counted(memeff.chunked, q, k, v, query_chunk=qc, key_chunk=kc) == \
        (B * reads, B * (n * d + n))
