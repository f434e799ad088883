"""flashlib.kernels.cuda.fragments.mma_layout: the m16n8k16 fragment layout read off the emulator, against
the PTX ISA's tables ("Matrix Fragments for mma.m16n8k16"), written out here again from the ISA text:
groupID g = lane >> 2, threadID_in_group t = lane & 3; element e of a lane is register e // 2, half e % 2.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from conftest import require_tool
from flashlib.kernels.cuda import build, fragments
from flashlib.tools import toolchain


@pytest.fixture(scope="module")
def layout():
    require_tool("g++")
    return fragments.mma_layout()


def isa_tables():
    """{"A", "B", "C"}: (rows, cols, 2) arrays of (lane, element), from the ISA's per-register lists."""
    A, B, C = np.full((16, 16, 2), -1), np.full((16, 8, 2), -1), np.full((16, 8, 2), -1)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        # a0: (g, 2t..2t+1)  a1: (g+8, 2t..)  a2: (g, 2t+8..)  a3: (g+8, 2t+8..)
        for reg, (row, col) in enumerate([(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]):
            for h in range(2):
                A[row, col + h] = lane, 2 * reg + h
        # b0: (k = 2t..2t+1, n = g)  b1: (k = 2t+8.., n = g)
        for reg in range(2):
            for h in range(2):
                B[2 * t + 8 * reg + h, g] = lane, 2 * reg + h
        # c0, c1: (g, 2t), (g, 2t+1)  c2, c3: (g+8, 2t), (g+8, 2t+1)
        for i in range(4):
            C[g + 8 * (i // 2), 2 * t + i % 2] = lane, i
    return {"A": A, "B": B, "C": C}


@pytest.mark.parametrize("name", ["A", "B", "C"])
def test_layout_matches_the_isa(layout, name):
    assert np.array_equal(layout[name], isa_tables()[name])


def test_layout_by_hand(layout):
    # lane 13: g = 3, t = 1. A: a0 = A[3][2..3], a3 = A[11][10..11]; B: b1 = B[10..11][3]; C: c2 = C[11][2]
    assert tuple(layout["A"][3, 2]) == (13, 0) and tuple(layout["A"][11, 11]) == (13, 7)
    assert tuple(layout["B"][10, 3]) == (13, 2) and tuple(layout["C"][11, 2]) == (13, 2)
    # every lane holds 8 elements of A, 4 of B and 4 of C
    for name, per_lane in (("A", 8), ("B", 4), ("C", 4)):
        assert np.array_equal(np.bincount(layout[name][..., 0].ravel(), minlength=32), np.full(32, per_lane))


def test_layout_returns_copies(layout):
    layout["A"][0, 0] = (99, 99)
    assert tuple(fragments.mma_layout()["A"][0, 0]) == (0, 0)


def test_a_layout_that_is_not_one_to_one_is_refused():
    found = np.arange(32 * 4).reshape(32, 4)
    found[5, 1] = found[5, 0]                          # two elements of lane 5 claim the same place
    with pytest.raises(RuntimeError, match="not a one-to-one layout"):
        fragments._table(found, (16, 8))


def test_the_probe_compiles_to_tensor_core_and_ldmatrix_instructions(tmp_path):
    require_tool("nvcc")
    require_tool("cuobjdump")
    sass = toolchain.run_tool("cuobjdump", "-sass", build.nvcc_cubin(("fragment_probe", fragments.PROBE_SOURCE),
                                                                     "sm_80"), purpose="reading the SASS")
    ops = set(re.findall(r"\b(HMMA\.16816\S*|LDSM\S*)", sass))
    assert any(op.startswith("HMMA.16816") for op in ops) and any(op.startswith("LDSM") for op in ops), ops
