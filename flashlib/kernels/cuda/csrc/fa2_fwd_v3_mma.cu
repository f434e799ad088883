// fa2_fwd_v3_mma.cu — FlashAttention-2 forward, version 3: mma.sync fragments
//   that never leave registers.
// Changed from v2: WMMA hides which lane holds which element, so v2 had to
//   stage S, P and O through shared memory. v3 writes the tensor-core
//   instructions as inline PTX (csrc/ptx.h), whose per-lane layouts the PTX ISA
//   documents, and keeps everything a warp computes in registers:
//   * each warp owns 16 query rows (a block of WARPS warps owns BR = 64); lane
//     L holds rows g = L / 4 and g + 8 of the warp's 16, columns 2t, 2t + 1 of
//     every 8-column tile (t = L % 4);
//   * S = Q K_jᵀ with mma.sync m16n8k16 (fp16, bf16; sm_80+) or two m16n8k8
//     (fp16; sm_75), fp32 accumulators;
//   * Q, K and V fragments come from shared memory through ldmatrix (.trans for
//     V); the tiles are stored with an XOR swizzle (16-byte chunk c of row r
//     sits at chunk c ^ (r mod 8); D = 32: c ^ (r/2 mod 4)) so that the 8 rows
//     one ldmatrix phase reads fall in 8 different bank groups: conflict-free,
//     and no padding bytes;
//   * the online softmax runs on the accumulator registers: a row's 4 lanes
//     combine their maxima with two __shfl_xor_sync; the row sum stays per lane
//     until the end (the rescale factor is the row's);
//   * P is packed to fp16/bf16 straight from the S accumulators and used as the
//     A operand of P·V: the C layout of two adjacent n-tiles is exactly the A
//     layout of one k16 step (FlashAttention-2's register trick) — no
//     shared-memory round trip; O accumulates in fp32 registers (D / 2 floats
//     per lane);
//   * on sm_80+ tiles are copied with cp.async (16 bytes per thread,
//     zero-filled past N and d) in FlashAttention-2's two-slot pipeline: V_j's
//     copy is in flight while S = Q K_jᵀ is computed, and K_{j+1}'s while O +=
//     P V_j is — two barriers per key tile; sm_75 has no cp.async and uses
//     plain 16-byte loads at the same points;
//   * at the end each warp stages its O rows (in the input type) in its own
//     rows of the Q tile and writes them out as 16-byte rows, coalesced.
// Idea: Dao 2023 (FlashAttention-2, Sections 3.1-3.3: per-warp rows, no split-K
//   across warps); the fragment handling, cp.async pipeline and swizzle follow
//   the FlashAttention-2 CUDA kernels (Dao-AILab/flash-attention,
//   csrc/flash_attn/src/flash_fwd_kernel.h, built on CUTLASS/CuTe); the layouts
//   are the PTX ISA's "Matrix Fragments for mma.m16n8k16" and "ldmatrix"
//   tables.
// Limits: fp16 on sm_75+, bf16 on sm_80+ (the bf16 kernels compile to a
//   __trap() for sm_75 and flashlib refuses them there; before sm_75 flashlib
//   uses v2). Head dim d <= 256, zero-padded inside the kernel to the kernel's
//   D in {32, 64, 128, 256}; the 16-byte copies need d % 8 == 0 and 16-byte
//   aligned q, k, v, o (any other d is loaded and stored element by element).
//   Shared memory (BR + 2 BC) * D * 2 bytes <= 48 KB for every D (BC =
//   V3_BC_D<D> keys per tile), so no GPU needs an opt-in;
//   __launch_bounds__(THREADS = 128, 1): at 12-48 KB per block a few blocks
//   share an SM anyway. Semantics as every flashlib backend: any Nq, Nk; causal
//   bottom-right aligned (key tiles no row of the block sees are skipped; a
//   warp skips tiles none of its rows sees); GQA reads kv head h / (H / Hkv) in
//   place; a row that sees no key gets O = 0 and LSE = -inf; LSE (natural log)
//   is written for the backward.
// NaN: flashlib's rule (v1's header): a NaN in q[i], or in k[j] / v[j] at a key
//   j row i sees, makes row i's O NaN (and its LSE, unless only v has it); a
//   NaN row i does not see changes nothing. Changed for it: the end tests l ==
//   0 ("saw no key"), not l > 0, which NaN makes false (a NaN row was O = 0 or
//   NaN, LSE = -inf). And P·V multiplies the whole V_j tile, where P = 0 for
//   keys the causal mask hides but 0 * NaN = NaN: in a tile the mask cuts for
//   this warp, the NaN halves of the V fragments are zeroed in registers after
//   ldmatrix (a few integer ops per fragment, no extra shared-memory traffic),
//   the keys they belong to are OR-ed across the warp (5 64-bit shuffles per
//   cut tile), and a row that sees one gets acc = NaN. Unmasked tiles run as
//   before. The backward does not follow the rule (a NaN row's gradients are
//   not specified).
// Launch: a 1-D grid of ceil(nq / 64) * H * B blocks of 128 threads, blockIdx.x
//   = (b * H + h) * tiles + tile, as v1 and v2; the kernel for head dim d is
//   fa2_fwd_v3_<f16|bf16>_d<D>, D the smallest bucket >= d.
// Run: flashlib.kernels.cuda.forward(q, k, v) with fp16/bf16 tensors (picks v3;
//   version="v3" forces it); on a CPU it runs in flashlib's emulator, whose
//   ptx:: wrappers follow the ISA's lane tables exactly. FA2V3_SM80 picks the
//   path: 1 (the default on sm_80+ and in the emulator) mma.m16n8k16 +
//   cp.async, 0 (the default on sm_75) m16n8k8 + plain loads; define it to 0 to
//   run the sm_75 path in the emulator.
// Explained in: notebooks/08_cuda.
// Tested in: tests/kernels/cuda/test_cuda_v3.py, tests/kernels/cuda/test_cuda_counts.py (skipped causal tiles).
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include "ptx.h"

#ifndef FA2V3_SM80
#define FA2V3_SM80 FLASHLIB_PTX_SM80
#endif

namespace fa2v3 {
// threads per block: 4 warps, each owning 16 query rows
constexpr int THREADS = 128;
constexpr int WARPS = THREADS / 32;
// keys per K/V tile for each head-dim bucket D: (64 + 2 BC) * D * 2 bytes of
// shared memory = 12, 24, 48 and 48 KB
constexpr int V3_BC_D32 = 64;
constexpr int V3_BC_D64 = 64;
constexpr int V3_BC_D128 = 64;
constexpr int V3_BC_D256 = 16;

// 16 bytes: one cp.async, one LDG.128/STG.128
struct __align__(16) Chunk { uint32_t w[4]; };

// The 16-bit halves of x that hold a NaN, as 0xffff masks: |h| (sign cleared)
// above INF, the bits of +inf (fp16 0x7c00, bf16 0x7f80): exponent all ones and
// a nonzero mantissa.
template <uint32_t INF>
__device__ __forceinline__ uint32_t nan_halves(uint32_t x) {
    return ((x & 0x7fffu) > INF ? 0x0000ffffu : 0u) |
           (((x >> 16) & 0x7fffu) > INF ? 0xffff0000u : 0u);
}

template <class T> struct Ops;
template <> struct Ops<__half> {
    static __device__ __forceinline__ __half from_float(float x) {
        return __float2half(x);
    }
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        return ptx::pack_half2(lo, hi);
    }
    static __device__ __forceinline__ uint32_t nans(uint32_t x) {
        return nan_halves<0x7c00u>(x);
    }
    // D += A B for one 16 x 8 x 16 step: A (4 regs, row-major 16 x 16), B = {b0
    // (k 0-7), b1 (k 8-15)}
    static __device__ __forceinline__ void
    mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if FA2V3_SM80
        ptx::mma_m16n8k16_f16(d, a, {b0, b1}, d);
#else  // sm_75: the same product as two k8 halves
        ptx::mma_m16n8k8_f16(d, {a[0], a[1]}, {b0}, d);
        ptx::mma_m16n8k8_f16(d, {a[2], a[3]}, {b1}, d);
#endif
    }
};
#if FA2V3_SM80                                     // no bf16 mma before sm_80
template <> struct Ops<__nv_bfloat16> {
    static __device__ __forceinline__ __nv_bfloat16 from_float(float x) {
        return __float2bfloat16(x);
    }
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        return ptx::pack_bf162(lo, hi);
    }
    static __device__ __forceinline__ uint32_t nans(uint32_t x) {
        return nan_halves<0x7f80u>(x);
    }
    static __device__ __forceinline__ void
    mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
        ptx::mma_m16n8k16_bf16(d, a, {b0, b1}, d);
    }
};
#endif

__device__ __forceinline__ void commit() {
#if FA2V3_SM80
    ptx::cp_async_commit();
#endif
}
// this thread's copies landed (then a barrier shares them)
__device__ __forceinline__ void wait_all() {
#if FA2V3_SM80
    ptx::cp_async_wait<0>();
#endif
}

// Element (r, c) of a tile of rows of D elements, stored swizzled: 16-byte
// chunk c / 8 of row r sits at chunk (c / 8) ^ (r mod 8) (D >= 64), or ^ ((r /
// 2) mod 4) for D = 32 (two rows per 128 bytes).
template <class T, int D>
__device__ __forceinline__ T* at(T* tile, int r, int c) {
    const int x = D >= 64 ? (r & 7) : ((r >> 1) & 3);
    return tile + r * D + ((((c >> 3) ^ x) << 3) | (c & 7));
}

// rows x D tile <- rows of a (., d) matrix in global memory; rows >= valid and
// columns >= d are zeros.
template <class T, int D>
__device__ __forceinline__ void load_tile(T* tile, const T* __restrict__ src,
                                          int rows, int valid, int d,
                                          bool vec) {
    constexpr int CH = D / 8;                      // 16-byte chunks per row
    for (int e = threadIdx.x; e < rows * CH; e += THREADS) {
        const int r = e / CH, c = (e - r * CH) * 8;
        T* dst = at<T, D>(tile, r, c);
        const bool in = r < valid && c < d;
        // d % 8 == 0: a chunk is all in or all out
        if (vec) {
#if FA2V3_SM80
            ptx::cp_async_16(dst, in ? src + (long long)r * d + c : src,
                             in ? 16 : 0);
#else
            Chunk x = {{0u, 0u, 0u, 0u}};
            if (in)
                x = *reinterpret_cast<const Chunk*>(src + (long long)r * d + c);
            *reinterpret_cast<Chunk*>(dst) = x;
#endif
        } else {
            for (int t = 0; t < 8; ++t)
                dst[t] = (r < valid && c + t < d)
                             ? src[(long long)r * d + c + t]
                             : Ops<T>::from_float(0.0f);
        }
    }
}

// The backward (fa2_bwd_v1_mma.cu) includes this file for the pieces above,
// with FA2V3_NO_ENTRY_POINTS defined: the forward itself and its kernels are
// left out.
#ifndef FA2V3_NO_ENTRY_POINTS
template <class T, int D, int BC>
__device__ void forward(const T* __restrict__ q, const T* __restrict__ k,
                        const T* __restrict__ v, T* __restrict__ o,
                        float* __restrict__ lse, int H, int Hkv, int nq, int nk,
                        int d, float scale, int causal) {
    extern __shared__ __align__(128) unsigned char smem[];
    // query rows per block; 8-column tiles of O
    constexpr int BR = 16 * WARPS, NT = D / 8;
    const float NEG_INF = __int_as_float(0xff800000);
    // (BR, D)  Q_i, later O_i on its way out
    T* q_s = reinterpret_cast<T*>(smem);
    T* k_s = q_s + BR * D;                           // (BC, D)  K_j
    T* v_s = k_s + BC * D;                           // (BC, D)  V_j

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    // the ISA's groupID and threadID_in_group
    const int g = lane >> 2, t = lane & 3;
    // 1-D grid: blockIdx.x = (b * H + h) * tiles + tile
    const int tiles = (nq + BR - 1) / BR;
    const int bh = blockIdx.x / tiles;               // b * H + h
    // b * Hkv + kv head (GQA)
    const int bhk = (bh / H) * Hkv + (bh % H) / (H / Hkv);
    const int row0 = (blockIdx.x - bh * tiles) * BR, wrow0 = row0 + 16 * warp;
    const T* qh = q + (long long)(bh) * nq * d;
    const T* kh = k + (long long)(bhk) * nk * d;
    const T* vh = v + (long long)(bhk) * nk * d;
    // bottom-right causal: i sees j <= i + offset
    const int offset = nk - nq;
    // scores in log2 units: e^x = 2^(x log2 e)
    const float sl2 = scale * 1.4426950408889634f;
    const bool vec = d % 8 == 0 && ((reinterpret_cast<unsigned long long>(q) |
                                     reinterpret_cast<unsigned long long>(k) |
                                     reinterpret_cast<unsigned long long>(v) |
                                     reinterpret_cast<unsigned long long>(o)) &
                                    15) == 0;

    // keys the block's last row sees (causal), the tiles that hold them, and
    // the keys this warp's rows see
    const int kend = causal ? min(nk, min(row0 + BR, nq) + offset) : nk;
    const int ntiles = kend > 0 ? (kend + BC - 1) / BC : 0;
    const int wend = wrow0 >= nq ? 0
                     : causal    ? min(nk, min(wrow0 + 16, nq) + offset)
                                 : nk;

    // O rows g, g+8: acc[n] = C fragment of columns 8n..8n+7
    float acc[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n)
        acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    // rows g, g+8: running max (log2 units), sum
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};

    if (ntiles > 0) {                                // line 4: Q_i; and K_0
        load_tile<T, D>(q_s, qh + (long long)row0 * d, BR, nq - row0, d, vec);
        load_tile<T, D>(k_s, kh, BC, nk, d, vec);
        commit();
    }
    for (int j = 0; j < ntiles; ++j) {               // line 6
        const int j0 = j * BC;
        wait_all();
        // K_j (and Q_i) visible; every warp is done with V_{j-1}
        __syncthreads();
        // V_j flies during S = Q K_jᵀ
        load_tile<T, D>(v_s, vh + (long long)j0 * d, BC, nk - j0, d, vec);
        commit();
        // warp-uniform: some row of this warp sees a key here
        const bool active = j0 < wend;
        // warp-uniform: the mask hides a key here
        const bool cut = causal && j0 + BC - 1 > wrow0 + offset;
        // S_ij, this warp's 16 x BC, as C fragments
        float s[BC / 8][4];
        if (active) {
#pragma unroll
            for (int n = 0; n < BC / 8; ++n)
                s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
            // line 8: S = Q_i K_jᵀ, 16 dims at a time
#pragma unroll
            for (int kk = 0; kk < D; kk += 16) {
                // A = Q rows (16 x 16): quadrants (0-7|8-15 rows, 0-7|8-15
                // cols)
                uint32_t a[4];
                const int qr = 16 * warp + (lane & 7) + 8 * ((lane >> 3) & 1);
                ptx::ldmatrix_x4(a, at<T, D>(q_s, qr, kk + 8 * (lane >> 4)));
                // B = K_jᵀ: K rows are B's columns, no transpose
#pragma unroll
                for (int n = 0; n < BC / 8; n += 2) {
                    // (keys 8n.., dims kk..), (8n.., kk+8..), (8n+8.., kk..),
                    // (8n+8.., kk+8..)
                    uint32_t b[4];
                    const int kr = 8 * n + (lane & 7) + 8 * (lane >> 4);
                    const int kc = kk + 8 * ((lane >> 3) & 1);
                    ptx::ldmatrix_x4(b, at<T, D>(k_s, kr, kc));
                    Ops<T>::mma(s[n], a, b[0], b[1]);
                    Ops<T>::mma(s[n + 1], a, b[2], b[3]);
                }
            }
            // line 9: the online softmax. s[n][i] is row g + 8 (i / 2),
            // key j0 + 8n + 2t + i % 2.
            const bool masked =
                j0 + BC > nk || (causal && j0 + BC - 1 > wrow0 + offset);
            float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
            for (int n = 0; n < BC / 8; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int key = j0 + 8 * n + 2 * t + (i & 1),
                              row = wrow0 + g + 8 * (i >> 1);
                    float x = s[n][i] * sl2;
                    if (masked &&
                        !(key < nk && (!causal || key <= row + offset)))
                        x = NEG_INF;
                    s[n][i] = x;
                    mx[i >> 1] = fmaxf(mx[i >> 1], x);
                }
            float alpha[2], base[2];
            // a row lives in 4 lanes: lanes 4g..4g+3
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
                const float m_new = fmaxf(m[r], mx[r]);
                // nothing visible yet: avoid -inf - -inf
                const bool none = m_new == NEG_INF;
                alpha[r] = none ? 1.0f : exp2f(m[r] - m_new);
                // then every score is -inf and 2^(-inf - 0) = 0
                base[r] = none ? 0.0f : m_new;
                m[r] = m_new;
                l[r] *= alpha[r];
            }
#pragma unroll
            for (int n = 0; n < BC / 8; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    s[n][i] = exp2f(s[n][i] - base[i >> 1]);   // P~_ij, fp32
                    // this lane's part of the row sum
                    l[i >> 1] += s[n][i];
                }
#pragma unroll
            for (int n = 0; n < NT; ++n) {           // diag(alpha) O_i
                acc[n][0] *= alpha[0]; acc[n][1] *= alpha[0];
                acc[n][2] *= alpha[1]; acc[n][3] *= alpha[1];
            }
        }
        wait_all();
        // V_j visible; every warp is done with K_j
        __syncthreads();
        // K_{j+1} flies during O += P V_j
        if (j + 1 < ntiles) {
            load_tile<T, D>(k_s, kh + (long long)(j0 + BC) * d, BC,
                            nk - j0 - BC, d, vec);
            commit();
        }
        if (active) {
            // cut tiles: bit jj = V_j's key jj has a NaN (zeroed)
            unsigned long long nan_keys = 0;
            // line 10: O_i += P~ V_j, 16 keys at a time
#pragma unroll
            for (int kk = 0; kk < BC / 16; ++kk) {
                // P as the A operand: C fragments of n-tiles 2kk, 2kk+1 = A
                // fragment of k-step kk
                const uint32_t a[4] = {
                    Ops<T>::pack(s[2 * kk][0], s[2 * kk][1]),
                    Ops<T>::pack(s[2 * kk][2], s[2 * kk][3]),
                    Ops<T>::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                    Ops<T>::pack(s[2 * kk + 1][2], s[2 * kk + 1][3])};
                // B = V_j (keys x dims), read transposed by ldmatrix
#pragma unroll
                for (int n = 0; n < NT; n += 2) {
                    // (keys 16kk.., dims 8n..), (16kk+8.., 8n..), (16kk..,
                    // 8n+8..), (16kk+8.., 8n+8..)
                    uint32_t b[4];
                    const int vr = 16 * kk + (lane & 7) + 8 * ((lane >> 3) & 1);
                    const int vc = 8 * n + 8 * (lane >> 4);
                    ptx::ldmatrix_x4_trans(b, at<T, D>(v_s, vr, vc));
                    // NaN rule: b[x] holds keys 16kk + 8 (x & 1) + 2t (its low
                    // half) and that + 1 (high)
                    if (cut) {
#pragma unroll
                        for (int x = 0; x < 4; ++x) {
                            const uint32_t bad = Ops<T>::nans(b[x]);
                            // (lo, hi)
                            const unsigned long long pair =
                                (bad & 1u) | ((bad >> 15) & 2u);
                            // a hidden key's NaN must not meet its P = 0
                            b[x] &= ~bad;
                            nan_keys |= pair << (16 * kk + 8 * (x & 1) + 2 * t);
                        }
                    }
                    Ops<T>::mma(acc[n], a, b[0], b[1]);
                    Ops<T>::mma(acc[n + 1], a, b[2], b[3]);
                }
            }
            // the rows that see a key with a NaN value: acc = NaN
            if (cut) {
#pragma unroll
                for (int off = 1; off < 32; off <<= 1)
                    nan_keys |= __shfl_xor_sync(0xffffffffu, nan_keys, off);
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    // keys j0 .. j0+seen-1
                    const int seen =
                        min(nk, wrow0 + g + 8 * r + offset + 1) - j0;
                    const unsigned long long mine = seen <= 0 ? 0ull
                                                    : seen >= 64
                                                        ? ~0ull
                                                        : (1ull << seen) - 1;
                    if (nan_keys & mine)
#pragma unroll
                        for (int n = 0; n < NT; ++n)
                            acc[n][2 * r] = acc[n][2 * r + 1] =
                                __int_as_float(0x7fc00000);
                }
            }
        }
    }

    // lines 12-15: O_i / l, LSE = m + log l. The row sums are completed across
    // the row's 4 lanes.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        // saw no key: O = 0, LSE = -inf (NaN l is not empty)
        const bool empty = l[r] == 0.0f;
        const float inv = empty ? 0.0f : 1.0f / l[r];
        const int row = wrow0 + g + 8 * r;
        // this warp's own Q rows: no other warp reads them
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            T* p = at<T, D>(q_s, 16 * warp + g + 8 * r, 8 * n + 2 * t);
            p[0] = Ops<T>::from_float(acc[n][2 * r] * inv);
            p[1] = Ops<T>::from_float(acc[n][2 * r + 1] * inv);
        }
        if (t == 0 && row < nq)
            lse[(long long)(bh) * nq + row] =
                empty ? NEG_INF : (m[r] + log2f(l[r])) * 0.6931471805599453f;
    }
    __syncwarp();                                    // the warp's O rows staged
    // 16-byte chunks of the warp's 16 rows
    for (int e = lane; e < 16 * (D / 8); e += 32) {
        const int r = e / (D / 8), c = (e - r * (D / 8)) * 8, row = wrow0 + r;
        if (row >= nq || c >= d) continue;
        const T* src = at<T, D>(q_s, 16 * warp + r, c);
        T* dst = o + ((long long)(bh) * nq + row) * d + c;
        if (vec)
            *reinterpret_cast<Chunk*>(dst) =
                *reinterpret_cast<const Chunk*>(src);
        else for (int u = 0; u < 8 && c + u < d; ++u) dst[u] = src[u];
    }
}
#endif  // FA2V3_NO_ENTRY_POINTS
}  // namespace fa2v3

// One kernel per (dtype, head-dim bucket D): D and the tile sizes are
// compile-time, so every fragment array is unrolled into registers.
#ifndef FA2V3_NO_ENTRY_POINTS
#define FA2V3_ARGS(T) const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ o, \
                      float* __restrict__ lse, int H, int Hkv, int nq, int nk, int d, float scale, int causal
#define FA2V3_CALL(T, D) fa2v3::forward<T, D, fa2v3::V3_BC_D##D>(q, k, v, o, lse, H, Hkv, nq, nk, d, scale, causal)
extern "C" __global__ void __launch_bounds__(fa2v3::THREADS, 1) fa2_fwd_v3_f16_d32(FA2V3_ARGS(__half)) { FA2V3_CALL(__half, 32); }
extern "C" __global__ void __launch_bounds__(fa2v3::THREADS, 1) fa2_fwd_v3_f16_d64(FA2V3_ARGS(__half)) { FA2V3_CALL(__half, 64); }
extern "C" __global__ void __launch_bounds__(fa2v3::THREADS, 1) fa2_fwd_v3_f16_d128(FA2V3_ARGS(__half)) { FA2V3_CALL(__half, 128); }
extern "C" __global__ void __launch_bounds__(fa2v3::THREADS, 1) fa2_fwd_v3_f16_d256(FA2V3_ARGS(__half)) { FA2V3_CALL(__half, 256); }
#if FA2V3_SM80
#define FA2V3_BF16(D) FA2V3_CALL(__nv_bfloat16, D)
#else
#define FA2V3_BF16(D) __trap();                      // sm_75: no bf16 mma; pick_version never launches these
                                                     // there, and a launch that did would fail, not return garbage
#endif
extern "C" __global__ void __launch_bounds__(fa2v3::THREADS, 1) fa2_fwd_v3_bf16_d32(FA2V3_ARGS(__nv_bfloat16)) { FA2V3_BF16(32); }
extern "C" __global__ void __launch_bounds__(fa2v3::THREADS, 1) fa2_fwd_v3_bf16_d64(FA2V3_ARGS(__nv_bfloat16)) { FA2V3_BF16(64); }
extern "C" __global__ void __launch_bounds__(fa2v3::THREADS, 1) fa2_fwd_v3_bf16_d128(FA2V3_ARGS(__nv_bfloat16)) { FA2V3_BF16(128); }
extern "C" __global__ void __launch_bounds__(fa2v3::THREADS, 1) fa2_fwd_v3_bf16_d256(FA2V3_ARGS(__nv_bfloat16)) { FA2V3_BF16(256); }
#endif  // FA2V3_NO_ENTRY_POINTS
