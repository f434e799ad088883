// ptx_kernels.cu — small kernels that exercise each wrapper of flashlib/kernels/cuda/csrc/ptx.h, for
// tests/kernels/cuda/test_cuda_ptx.py. They run in the CPU emulator and compile with nvcc (sm_75: the
// m16n8k8 and ldmatrix kernels only; the sm_80 bodies are guarded by FLASHLIB_PTX_SM80).
// 16-bit matrix elements travel as raw bits (uint16_t); registers as uint32_t.
// The `planted_bug` argument of ptx_tile_mma switches on one bug at a time (0: none), as chapter 8's
// planted-bug tests do.
#include "ptx.h"

// ldmatrix: `rows` (32 rows of 8 16-bit values) is copied to shared memory with plain loads; lane L passes
// the address of shared row perm[L] (a permutation), so lanes 8i..8i+7 choose the rows of matrix i.
// which: 1, 2, 4 (.x1/.x2/.x4), 12, 14 (.x2.trans/.x4.trans). out[lane * 4 + i] = r[i], 0 where unused.
extern "C" __global__ void ptx_ldmatrix(const uint16_t* rows, const int* perm, uint32_t* out, int which) {
    extern __shared__ __align__(16) unsigned char smem[];
    uint16_t* s = reinterpret_cast<uint16_t*>(smem);   // (32, 8)
    const int lane = threadIdx.x;
    for (int j = 0; j < 8; ++j) s[lane * 8 + j] = rows[lane * 8 + j];
    __syncwarp();
    const uint16_t* row = s + perm[lane] * 8;
    uint32_t r[4] = {0, 0, 0, 0};
    if (which == 1) { uint32_t x[1]; ptx::ldmatrix_x1(x, row); r[0] = x[0]; }
    if (which == 2) { uint32_t x[2]; ptx::ldmatrix_x2(x, row); r[0] = x[0]; r[1] = x[1]; }
    if (which == 4) ptx::ldmatrix_x4(r, row);
    if (which == 12) { uint32_t x[2]; ptx::ldmatrix_x2_trans(x, row); r[0] = x[0]; r[1] = x[1]; }
    if (which == 14) ptx::ldmatrix_x4_trans(r, row);
    for (int i = 0; i < 4; ++i) out[lane * 4 + i] = r[i];
}

// mma.sync on registers given per lane: a[lane * 4 + i], b[lane * 2 + i], c[lane * 4 + i]; d likewise.
// kind: 0 m16n8k16 f16, 1 m16n8k16 bf16, 2 m16n8k8 f16 (a[lane * 4 + 0..1], b[lane * 2 + 0]).
extern "C" __global__ void ptx_mma(const uint32_t* a, const uint32_t* b, const float* c, float* d, int kind) {
    const int lane = threadIdx.x;
    const uint32_t a4[4] = {a[lane * 4], a[lane * 4 + 1], a[lane * 4 + 2], a[lane * 4 + 3]};
    const uint32_t b2[2] = {b[lane * 2], b[lane * 2 + 1]};
    const float c4[4] = {c[lane * 4], c[lane * 4 + 1], c[lane * 4 + 2], c[lane * 4 + 3]};
    float d4[4] = {0, 0, 0, 0};
#if FLASHLIB_PTX_SM80
    if (kind == 0) ptx::mma_m16n8k16_f16(d4, a4, b2, c4);
    if (kind == 1) ptx::mma_m16n8k16_bf16(d4, a4, b2, c4);
#endif
    if (kind == 2) {
        const uint32_t a2[2] = {a4[0], a4[1]}, b1[1] = {b2[0]};
        ptx::mma_m16n8k8_f16(d4, a2, b1, c4);
    }
    for (int i = 0; i < 4; ++i) d[lane * 4 + i] = d4[i];
}

// pack_half2 / pack_bf162 of (x[2i], x[2i+1]): out[2i] and out[2i+1].
extern "C" __global__ void ptx_pack(const float* x, uint32_t* out) {
    const int i = threadIdx.x;
    out[2 * i] = ptx::pack_half2(x[2 * i], x[2 * i + 1]);
    out[2 * i + 1] = ptx::pack_bf162(x[2 * i], x[2 * i + 1]);
}

// cp.async: lane L copies 16-byte chunk L of src (src_bytes of it, the rest zero-filled) into dynamic
// shared memory and writes shared memory back to out. read_early: also copy shared to early_out right
// after the commit, before the wait (the stale bytes a missing wait would read).
extern "C" __global__ void ptx_cp_async(const uint16_t* src, uint16_t* out, uint16_t* early_out, int src_bytes,
                                        int read_early) {
    extern __shared__ __align__(16) unsigned char smem[];
    uint16_t* s = reinterpret_cast<uint16_t*>(smem);   // (32, 8)
    const int lane = threadIdx.x;
#if FLASHLIB_PTX_SM80
    ptx::cp_async_16(s + lane * 8, src + lane * 8, src_bytes);
    ptx::cp_async_commit();
    if (read_early)
        for (int j = 0; j < 8; ++j) early_out[lane * 8 + j] = s[lane * 8 + j];
    ptx::cp_async_wait<0>();
#endif
    for (int j = 0; j < 8; ++j) out[lane * 8 + j] = s[lane * 8 + j];
}

// Bad calls the emulator must report. what: 1 ldmatrix on a misaligned row, 2 ldmatrix on global memory,
// 3 cp.async with src_bytes 17, 4 cp.async to a misaligned destination, 5 cp.async into global memory.
extern "C" __global__ void ptx_misuse(const uint16_t* g, uint16_t* gout, int what) {
    extern __shared__ __align__(16) unsigned char smem[];
    uint16_t* s = reinterpret_cast<uint16_t*>(smem);
    const int lane = threadIdx.x;
    uint32_t r[1] = {0};
    if (what == 1) ptx::ldmatrix_x1(r, s + lane * 8 + 1);
    if (what == 2) ptx::ldmatrix_x1(r, g + lane * 8);
#if FLASHLIB_PTX_SM80
    if (what == 3) ptx::cp_async_16(s + lane * 8, g + lane * 8, 17);
    if (what == 4) ptx::cp_async_16(s + lane * 8 + 4, g + lane * 8, 16);
    if (what == 5) ptx::cp_async_16(gout + lane * 8, g + lane * 8, 16);
    ptx::cp_async_commit();
    ptx::cp_async_wait<0>();
#endif
    gout[lane] = uint16_t(r[0] * (what == 0));
}

// The whole path a tensor-core kernel takes, on one tile: D (16 x 8, fp32) = A (16 x 16) · B (16 x 8).
// Warp 0 copies A and B into shared memory with cp.async (A in one group, B in the next); warp 1 loads
// fragments with ldmatrix (A: .x4; B stored K x N: .x2.trans, stored N x K: .x2) and runs one mma.sync,
// writing D from the accumulator's fragment layout. a: A row-major; b: B as (16, 8) if b_kn else Bᵀ (8, 16).
// planted_bug: 1 wrong fragment index (a[1] and a[2] swapped), 2 no cp.async.wait_group at all,
// 3 wait_group 1 instead of 0 (B still in flight when read), 4 no __syncthreads between warp 0's wait and
// warp 1's reads, 5 lane 31 of warp 1 returns before ldmatrix.
extern "C" __global__ void ptx_tile_mma(const uint16_t* a, const uint16_t* b, float* d, int bf16, int b_kn,
                                        int planted_bug) {
#if FLASHLIB_PTX_SM80
    extern __shared__ __align__(16) unsigned char smem[];
    uint16_t* as = reinterpret_cast<uint16_t*>(smem);  // (16, 16): 32 chunks of 16 bytes
    uint16_t* bs = as + 16 * 16;                       // (16, 8) or (8, 16): 16 chunks
    const int t = threadIdx.x;
    if (t < 32) {
        ptx::cp_async_16(as + t * 8, a + t * 8, 16);
        ptx::cp_async_commit();
        if (t < 16) ptx::cp_async_16(bs + t * 8, b + t * 8, 16);
        ptx::cp_async_commit();
        if (planted_bug == 3) ptx::cp_async_wait<1>();
        else if (planted_bug != 2) ptx::cp_async_wait<0>();
    }
    if (planted_bug != 4) __syncthreads();
    if (t >= 32) {
        const int lane = t - 32;
        if (planted_bug == 5 && lane == 31) return;
        uint32_t fa[4], fb[2];
        // matrices 0..3 = A's quadrants (rows 0-7 | 8-15) x (cols 0-7 | 8-15), in a[0..3]'s order
        ptx::ldmatrix_x4(fa, as + ((lane & 7) + 8 * ((lane >> 3) & 1)) * 16 + 8 * (lane >> 4));
        if (b_kn) ptx::ldmatrix_x2_trans(fb, bs + (lane & 15) * 8);          // rows k = 0..15 of B
        else ptx::ldmatrix_x2(fb, bs + (lane & 7) * 16 + 8 * ((lane >> 3) & 1));   // Bᵀ's (n, k 0-7 | 8-15)
        if (planted_bug == 1) { const uint32_t x = fa[1]; fa[1] = fa[2]; fa[2] = x; }
        const float zero[4] = {0, 0, 0, 0};
        float acc[4];
        if (bf16) ptx::mma_m16n8k16_bf16(acc, fa, fb, zero);
        else ptx::mma_m16n8k16_f16(acc, fa, fb, zero);
        const int g = lane >> 2, tg = lane & 3;
        for (int i = 0; i < 4; ++i) d[(g + 8 * (i >> 1)) * 8 + 2 * tg + (i & 1)] = acc[i];
    }
    __syncthreads();                                   // warp 1 is done reading the tile
    if (planted_bug == 3 && t < 32) ptx::cp_async_wait<0>();   // B lands only now: too late
#endif
}
