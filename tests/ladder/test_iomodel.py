"""Counted HBM traffic equals each algorithm's closed form; FA1 falls as 1/M; the SRAM budget holds."""
import pytest

from flashlib.ladder import fa1, fa2
from flashlib.ladder.iomodel import IOCounter, SRAMOverflowError
from flashlib.testing import random_qkv
from ladder_cases import counted


def test_counts_scale_with_bytes_per_element():
    q, k, v = random_qkv(9, 9, 4)
    r2, w2 = counted(fa2.forward, q, k, v, bytes_per_element=2)
    r4, w4 = counted(fa2.forward, q, k, v, bytes_per_element=4)
    assert (r4, w4) == (2 * r2, 2 * w2)


def test_sram_budget_is_enforced():
    q, k, v = random_qkv(64, 64, 16)
    with pytest.raises(SRAMOverflowError, match="sram_bytes=1024"):
        fa1.forward(q, k, v, block_q=16, block_k=16, sram_bytes=1024)
    with pytest.raises(SRAMOverflowError):
        fa2.forward(q, k, v, block_q=64, block_k=64, io=IOCounter(sram_bytes=4096))
    with pytest.raises(ValueError, match="too small for one tile"):
        fa1.forward(q, k, v, sram_bytes=100)      # M = 50 elements < 4d = 64


def test_counter_arguments_are_checked():
    for bad, exc in ((0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError),
                     ("2", TypeError)):
        with pytest.raises(exc, match="bytes_per_element must be a positive int"):
            IOCounter(bytes_per_element=bad)
    with pytest.raises(ValueError, match="sram_bytes"):
        IOCounter(sram_bytes=0)
    io = IOCounter()
    io.hbm_read_bytes = 5
    io.reset()
    assert io.hbm_bytes == 0


