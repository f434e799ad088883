"""Which lane holds which element of an ``mma.sync.m16n8k16`` fragment, read off the CPU emulator.

:func:`mma_layout` runs one warp of a probe kernel (:data:`PROBE_SOURCE`) in flashlib's emulator. The
kernel takes the path v3 takes (``fa2_fwd_v3_mma.cu``): it loads A (16 x 16) with ``ldmatrix.x4`` and B
(16 x 8, stored K x N) with ``ldmatrix.x2.trans`` from shared memory, as the csrc/ptx.h wrappers do, and

* writes, for every register half it now holds, which element of A or B it found (A holds
  ``16 r + c``, B holds ``8 k + n``: small integers, exact in fp16);
* runs ``mma.sync`` with A = the identity and that B, so D = B, and writes, for each accumulator
  ``d[i]``, the element of B it came out with: that is where C/D element (r, n) lives.

Nothing in Python knows the PTX ISA's tables: the answer is whatever the emulator's ``ldmatrix`` and
``mma`` do, which the tests compare with the ISA's formulas written out independently.

Explained in: notebooks/08_cuda.
Tested in: tests/kernels/cuda/test_cuda_fragments.py.
"""
from __future__ import annotations

import functools

import numpy as np

from . import launch

__all__ = ["PROBE_SOURCE", "mma_layout"]

PROBE_SOURCE = r"""
// fragment_probe.cu — one warp: where each element of A, B and C/D of mma.sync.m16n8k16 lives.
#include "ptx.h"
extern "C" __global__ void fragment_probe(const uint16_t* a, const uint16_t* eye, const uint16_t* b,
                                          uint16_t* a_of, uint16_t* b_of, float* c_of) {
    extern __shared__ __align__(16) unsigned char smem[];
    uint16_t* as = reinterpret_cast<uint16_t*>(smem);   // (16, 16) A: element (r, c) holds 16 r + c
    uint16_t* is = as + 256;                            // (16, 16) the identity
    uint16_t* bs = is + 256;                            // (16, 8)  B, K x N: element (k, n) holds 8 k + n
    const int lane = threadIdx.x;
    for (int j = 0; j < 8; ++j) {
        as[lane * 8 + j] = a[lane * 8 + j];
        is[lane * 8 + j] = eye[lane * 8 + j];
        if (lane < 16) bs[lane * 8 + j] = b[lane * 8 + j];
    }
    __syncwarp();
    uint32_t fa[4], fi[4], fb[2];                       // the addresses v3 passes: A's four 8 x 8 quadrants
    const int arow = (lane & 7) + 8 * ((lane >> 3) & 1), acol = 8 * (lane >> 4);
    ptx::ldmatrix_x4(fa, as + arow * 16 + acol);
    ptx::ldmatrix_x4(fi, is + arow * 16 + acol);
    ptx::ldmatrix_x2_trans(fb, bs + (lane & 15) * 8);   // B's rows k = 0..15
    for (int e = 0; e < 8; ++e) {                       // element e = register e / 2, half e % 2 (low first)
        a_of[lane * 8 + e] = uint16_t(fa[e / 2] >> (16 * (e % 2)));            // fp16 bits
        if (e < 4) b_of[lane * 4 + e] = uint16_t(fb[e / 2] >> (16 * (e % 2)));
    }
    const float zero[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    float d[4];
    ptx::mma_m16n8k16_f16(d, fi, fb, zero);             // D = I B = B
    for (int i = 0; i < 4; ++i) c_of[lane * 4 + i] = d[i];
}
"""


def _table(found, shape):
    """(rows, cols, 2) int array: [..., 0] the lane and [..., 1] the lane's element number that holds
    matrix element (r, c), from ``found[lane, e]`` = the flat index of the element lane/e holds."""
    out = np.full(shape + (2,), -1, dtype=np.int64)
    for lane, row in enumerate(found):
        for e, flat in enumerate(row):
            r, c = divmod(int(flat), shape[1])
            if not (0 <= r < shape[0]) or out[r, c, 0] != -1:
                raise RuntimeError(f"the emulator put element {flat} of a {shape} fragment in lane {lane}, "
                                   f"element {e}: not a one-to-one layout")
            out[r, c] = lane, e
    return out


@functools.lru_cache(maxsize=1)
def _layout():
    import torch

    half = lambda x: torch.as_tensor(np.asarray(x, np.float32)).to(torch.float16).contiguous()   # noqa: E731
    bufs = {"a": half(np.arange(256).reshape(16, 16)), "eye": half(np.eye(16)), "b": half(np.arange(128).reshape(16, 8)),
            "a_of": torch.empty(32 * 8, dtype=torch.float16), "b_of": torch.empty(32 * 4, dtype=torch.float16),
            "c_of": torch.empty(32 * 4)}
    args = tuple(("buf", name) for name in ("a", "eye", "b", "a_of", "b_of", "c_of"))
    spec = launch.LaunchSpec("fragment_probe.cu", "fragment_probe", (1, 1, 1), (32, 1, 1), (256 + 256 + 128) * 2,
                             args, "one warp")
    launch.run_emulated([spec], bufs, ["a_of", "b_of", "c_of"], source=("fragment_probe", PROBE_SOURCE))
    found = {name: bufs[f"{name.lower()}_of"].float().numpy().reshape(32, -1) for name in ("A", "B", "C")}
    return {"A": _table(found["A"], (16, 16)), "B": _table(found["B"], (16, 8)), "C": _table(found["C"], (16, 8))}


def mma_layout() -> dict:
    """The per-lane fragment layout of ``mma.sync.m16n8k16`` (fp16), as flashlib's CPU emulator runs it.

    Runs :data:`PROBE_SOURCE` (one warp, g++ builds it once and caches it) and returns
    ``{"A": (16, 16, 2), "B": (16, 8, 2), "C": (16, 8, 2)}`` int arrays: ``[r, c, 0]`` is the lane that
    holds element (r, c) of the matrix (A: rows x k, B: k x n, C and D: rows x n) and ``[r, c, 1]``
    which of that lane's elements it is (A: 0..7, B and C: 0..3; element ``e`` of a 16-bit fragment is
    register ``e // 2``, low half first). Needs g++; raises EmulatorError if the probe fails and
    RuntimeError if the emulator's layout is not one-to-one. The arrays are copies: safe to modify.

    Explained in: notebooks/08_cuda.
    Tested in: tests/kernels/cuda/test_cuda_fragments.py.
    """
    return {name: table.copy() for name, table in _layout().items()}
