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




def test_tiles_are_recorded_and_reset():
    import numpy as np
    io = IOCounter()
    q, k, v = random_qkv(5, 7, 2)
    fa2.forward(q, k, v, block_q=2, block_k=4, io=io)
    assert io.tiles == [(0, 0), (0, 4), (2, 0), (2, 4), (4, 0), (4, 4)]
    io.tile(np.int64(3), 1)
    assert io.tiles[-1] == (3, 1)
    with pytest.raises(ValueError, match="i must be an int >= 0"):
        io.tile(-1, 0)
    io.reset()
    assert io.tiles == []


def test_traffic_slope_is_one_for_a_window_and_two_for_dense_attention():
    from flashlib.ladder.iomodel import traffic_slope
    ns, blocks = [256, 512, 1024, 2048], dict(block_q=32, block_k=32)
    slope, traffic = traffic_slope(fa2.forward, ns, window_size=(64, 0), causal=True, **blocks)
    assert 0.95 < slope < 1.1 and len(traffic) == 4 and traffic == sorted(traffic)
    assert 0.95 < traffic_slope(fa2.forward, ns, window_size=(32, 32), **blocks)[0] < 1.1
    assert 1.8 < traffic_slope(fa2.forward, ns, causal=True, **blocks)[0] < 2.0
    assert 1.9 < traffic_slope(fa2.forward, ns, **blocks)[0] < 2.0
    # the bytes are fa2.forward's own count
    io = IOCounter()
    x = random_qkv(256, 256, 16)[0].astype("float32")
    fa2.forward(x, x, x, window_size=(64, 0), causal=True, io=io, **blocks)
    assert traffic[0] == io.hbm_bytes


@pytest.mark.parametrize("kw,exc,match", [
    (dict(ns=[8]), ValueError, "two distinct"), (dict(ns=[8, 8]), ValueError, "two distinct"),
    (dict(ns=8), TypeError, "ns"), (dict(ns=[8, 0]), ValueError, "ns"),
    (dict(ns=[8, 16], d=0), ValueError, "d must"),
    (dict(ns=[8, 16], window_size=(-2, 0)), ValueError, "window_size"),
    (dict(ns=[8, 16], algorithm="fa2"), TypeError, "algorithm"),
])
def test_traffic_slope_arguments_are_checked(kw, exc, match):
    from flashlib.ladder.iomodel import traffic_slope
    kw = dict(dict(algorithm=fa2.forward), **kw)
    with pytest.raises(exc, match=match):
        traffic_slope(**kw)
