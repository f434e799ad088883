"""flashlib.ladder.naive: counted HBM traffic equals Algorithms 0 and 3 in closed form (the oracle tests are in
test_ladder_forward.py and test_backward.py)."""
import numpy as np
import pytest

from flashlib.ladder import naive
from flashlib.testing import random_qkv
from ladder_cases import B, counted


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
