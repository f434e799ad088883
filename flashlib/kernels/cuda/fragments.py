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

:func:`smem_traffic` counts what those fragments cost: the shared-memory bytes one warp moves per key tile
in v2 (WMMA, S, P and O staged through shared memory) and v3 (fragments by ``ldmatrix``, S, P and O in
registers) — chapter 8's memory-traffic table. The tests check it against the kernels as the emulator runs
them: v3's ``ldmatrix`` bytes from the emulator's counters, v2's from a copy of the kernel whose shared-memory
accesses are tallied.

Explained in: notebooks/08_cuda.
Tested in: tests/kernels/cuda/test_cuda_fragments.py, tests/kernels/cuda/test_cuda_counts.py.
"""
from __future__ import annotations

import functools

import numpy as np

from . import launch

__all__ = ["PROBE_SOURCE", "mma_layout", "smem_traffic"]

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

    Explained in: notebooks/08b_v3_registers.
    Tested in: tests/kernels/cuda/test_cuda_fragments.py.
    """
    return {name: table.copy() for name, table in _layout().items()}


def smem_traffic(version: str, d: int) -> tuple[int, int, dict]:
    """Shared-memory bytes one warp (16 query rows) reads and writes for one key tile, by what they carry.

    Returns ``(BR, BC, parts)``: the version's rows per block and keys per tile at head dim ``d``, and
    ``parts = {"Q", "K+V", "S", "P", "O"}`` in bytes, read off the kernels' loops (d16 = d rounded up to
    16; D = v3's head-dim bucket):

    * v2 (``fa2_fwd_v2_wmma.cu``): Q's A fragments, reloaded for every 16 keys of S
      (BC/16 x 16 x d16 x 2); the K_j and V_j fragments (2 x BC x d16 x 2); S stored in fp32 and read
      back by its row's lanes (2 x 16 x BC x 4); P written in 16 bits and loaded as the A fragment for
      every 16 columns of O (16 x BC x 2 + d16/16 x 16 x BC x 2); O rescaled (read and write), loaded
      and stored around its mma (4 x 16 x d16 x 4).
    * v3 (``fa2_fwd_v3_mma.cu``): Q's A fragments by ``ldmatrix`` once per tile (16 x D x 2), K_j and
      V_j by ``ldmatrix`` (2 x BC x D x 2); S, P and O never leave registers (0).

    Not counted: the copies of Q, K and V from global into shared memory (one per tile per block, not
    per warp) and the once-per-block work (zeroing O, staging the output).

    Explained in: notebooks/08b_v3_registers.
    Tested in: tests/kernels/cuda/test_cuda_counts.py.
    """
    if version not in ("v2", "v3"):
        raise ValueError(f"version must be 'v2' or 'v3' (the tensor-core kernels), got {version!r}")
    if isinstance(d, bool) or not isinstance(d, int):
        raise TypeError(f"d must be an int head dim, got {type(d).__name__}")
    if not 1 <= d <= 256:
        raise ValueError(f"d must be a head dim in 1..256 (v2 and v3 support d <= 256), got {d}")
    if version == "v2":
        br, _ = launch.v2_tile(d)
        bc, d16 = launch.V2_BC, -(-d // 16) * 16
        return br, bc, {"Q": bc // 16 * 16 * d16 * 2,
                        "K+V": 2 * bc * d16 * 2,
                        "S": 2 * 16 * bc * 4,
                        "P": 16 * bc * 2 + d16 // 16 * 16 * bc * 2,
                        "O": 4 * 16 * d16 * 4}
    dim, br, bc, _ = launch.v3_tile(d)
    return br, bc, {"Q": 16 * dim * 2, "K+V": 2 * bc * dim * 2, "S": 0, "P": 0, "O": 0}
