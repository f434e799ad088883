// fa2_fwd_v2_wmma.cu — FlashAttention-2 forward, version 2: tensor cores
//   through WMMA 16x16x16.
// Changed from v1: Q·Kᵀ and P·V run on tensor cores (nvcuda::wmma, fp16 — bf16
//   on sm_80+ — inputs with fp32 accumulation); a block is BR/16 warps and each
//   warp owns 16 query rows; two lanes share a row for the online softmax and
//   combine their halves with __shfl_xor_sync. WMMA does not say which lane
//   holds which element of a fragment, so the row-wise softmax cannot run on
//   the accumulator in registers: S goes through shared memory (store S fp32,
//   read it, write P in fp16/bf16, load P as a fragment), and the O accumulator
//   lives in shared memory too (rescaled by its row's lanes, then loaded,
//   updated by mma_sync and stored back each tile). Cost: BR*(BC+4)*4 +
//   BR*(BC+8)*2 bytes for S and P (13.8 KB at BR = 64) plus BR*(d16+4)*4 for O
//   — shared memory that would otherwise hold bigger tiles, so BR shrinks to 32
//   rows at d = 128 and 16 at d = 256 — and two extra shared-memory round trips
//   per tile. FA2's CUTLASS kernels avoid both by knowing the mma.sync register
//   layout.
// Idea: Dao 2023 (FlashAttention-2), Algorithm 1; WMMA from the CUDA C++
//   Programming Guide.
// Limits: float16 everywhere, bfloat16 on sm_80+ (compiled to an empty kernel
//   for older GPUs, and refused by flashlib there); head dim d <= 256,
//   zero-padded to d16 (a multiple of 16) inside the kernel; shared memory
//   within 48 KB (no opt-in) for every d; BC = 32 keys per tile.
//   __launch_bounds__(128, 1): with a bare (128), ptxas 13.0 capped sm_80 at 64
//   registers and spilled; at 45 KB of shared memory per block only 1-4 blocks
//   fit on an SM anyway, so asking for 1 costs no occupancy.
// NaN: flashlib's rule (v1's header): a NaN a row sees makes it NaN, one it
//   does not see changes nothing. Changed for it, as in v1: P = 2^(S - 0), not
//   0, while nothing is visible (a NaN row's P stays NaN), and the end tests l
//   == 0, not l > 0. P·V runs on the whole V_j tile, so in a tile the causal
//   mask cuts (for this block) V's NaNs are loaded as 0, and each row's lanes
//   check, from global memory, whether a key they do see has a NaN value: such
//   a row ends NaN. Costs nothing on unmasked tiles.
// Launch: a 1-D grid of ceil(nq / BR) * H * B blocks, blockIdx.x = (b * H + h)
//   * tiles + tile, as v1 (any B * H that fits in memory; gridDim.y/z, which
//   held h and b before this fix, stop at 65,535).
// Run: flashlib.kernels.cuda.forward(q, k, v, version="v2") with fp16/bf16
//   tensors (forward picks v2 by itself only on a GPU before sm_75, where v3
//   cannot run); on a CPU it runs in the emulator.
// Explained in: notebooks/08_cuda.
// Tested in: tests/kernels/cuda/test_cuda_kernels.py.
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <mma.h>

namespace fa2v2 {
using namespace nvcuda;
constexpr int BC = 32;      // keys per K/V tile

template <class T> __device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<__half>(__half x) {
    return __half2float(x);
}
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) {
    return __bfloat162float(x);
}
template <class T> __device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
    return __float2half(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16(x);
}

template <class T>
__device__ void forward(const T* __restrict__ q, const T* __restrict__ k,
                        const T* __restrict__ v, T* __restrict__ o,
                        float* __restrict__ lse, int H, int Hkv, int nq, int nk,
                        int d, float scale, int causal) {
    extern __shared__ __align__(128) unsigned char smem[];
    const float NEG_INF = __int_as_float(0xff800000);
    const int d16 = (d + 15) & ~15;                  // head dim padded to 16
    // row strides (elements): +16 bytes against bank conflicts, keeping every
    // 16-row block 32-byte aligned and ldm a multiple of 16 bytes
    const int qs = d16 + 8;
    const int os = d16 + 4;
    const int ss = BC + 4;
    const int ps = BC + 8;
    const int br = blockDim.x / 2;                   // 16 rows per warp
    T* q_s = reinterpret_cast<T*>(smem);             // (br, qs)   Q_i
    T* kv_s = q_s + br * qs;                         // (BC, qs)   K_j, then V_j
    // (br, ss)   S_ij fp32
    float* s_s = reinterpret_cast<float*>(kv_s + BC * qs);
    // (br, ps)   P~_ij in the input type
    T* p_s = reinterpret_cast<T*>(s_s + br * ss);
    // (br, os)   O_i fp32, unnormalised
    float* o_s = reinterpret_cast<float*>(p_s + br * ps);

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    // this warp's first row in the tile
    const int wr = warp * 16;
    // the row this lane and its neighbour own
    const int my_row = wr + lane / 2;
    // which 16 of the BC scores, which half of O
    const int half_ = lane & 1;
    const int c_lo = half_ * (d16 / 2), c_hi = c_lo + d16 / 2;
    // 1-D grid: blockIdx.x = (b * H + h) * tiles + tile
    const int tiles = (nq + br - 1) / br;
    // b * H + h: this block's (batch, query head)
    const int bh = blockIdx.x / tiles;
    // b * Hkv + kv head (GQA)
    const int bhk = (bh / H) * Hkv + (bh % H) / (H / Hkv);
    const int row0 = (blockIdx.x - bh * tiles) * br, i = row0 + my_row;
    const T* qh = q + (long long)(bh) * nq * d;
    const T* kh = k + (long long)(bhk) * nk * d;
    const T* vh = v + (long long)(bhk) * nk * d;
    // bottom-right causal: i sees j <= i + offset
    const int offset = nk - nq;
    const T zero = from_float<T>(0.0f);

    // line 4: Q_i, zero-padded
    for (int e = threadIdx.x; e < br * d16; e += blockDim.x) {
        const int rr = e / d16, c = e - rr * d16;
        q_s[rr * qs + c] = (row0 + rr < nq && c < d)
                               ? qh[(long long)(row0 + rr) * d + c]
                               : zero;
    }
    for (int c = c_lo; c < c_hi; ++c) o_s[my_row * os + c] = 0.0f;   // line 5
    float m = NEG_INF, l = 0.0f;
    // this row saw a NaN value that was loaded as 0
    bool v_nan = false;
    __syncthreads();

    int kend = nk;
    if (causal) kend = min(nk, min(row0 + br, nq) - 1 + offset + 1);
    for (int j0 = 0; j0 < kend; j0 += BC) {          // line 6
        // line 7: K_j, zero-padded
        for (int e = threadIdx.x; e < BC * d16; e += blockDim.x) {
            const int jj = e / d16, c = e - jj * d16;
            kv_s[jj * qs + c] = (j0 + jj < nk && c < d)
                                    ? kh[(long long)(j0 + jj) * d + c]
                                    : zero;
        }
        __syncthreads();

        // line 8: S = Q_i K_jᵀ, this warp's 16 x BC
#pragma unroll
        for (int n = 0; n < BC / 16; ++n) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
            wmma::fill_fragment(acc, 0.0f);
            for (int kk = 0; kk < d16; kk += 16) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, T,
                               wmma::row_major> a;
                // Kᵀ: K read column-major
                wmma::fragment<wmma::matrix_b, 16, 16, 16, T,
                               wmma::col_major> bt;
                wmma::load_matrix_sync(a, q_s + wr * qs + kk, qs);
                wmma::load_matrix_sync(bt, kv_s + 16 * n * qs + kk, qs);
                wmma::mma_sync(acc, a, bt, acc);
            }
            wmma::store_matrix_sync(s_s + wr * ss + 16 * n, acc, ss,
                                    wmma::mem_row_major);
        }
        // S rows visible to the lanes that own them
        __syncwarp();

        // line 9: online softmax, 16 scores per lane
        float sv[16];
        float m_tile = NEG_INF;
#pragma unroll
        for (int t = 0; t < 16; ++t) {
            const int jj = half_ * 16 + t, j = j0 + jj;
            const bool visible = j < nk && (!causal || j <= i + offset);
            sv[t] = visible ? s_s[my_row * ss + jj] * scale : NEG_INF;
            m_tile = fmaxf(m_tile, sv[t]);
        }
        // the row's other half
        m_tile = fmaxf(m_tile, __shfl_xor_sync(0xffffffffu, m_tile, 1));
        const float m_new = fmaxf(m, m_tile);
        // nothing visible yet: avoid -inf - -inf
        const bool none = m_new == NEG_INF;
        const float alpha = none ? 1.0f : expf(m - m_new);
        // none: masked -inf -> 0, a NaN score stays NaN
        const float base = none ? 0.0f : m_new;
        float p_sum = 0.0f;
#pragma unroll
        for (int t = 0; t < 16; ++t) {
            const float p = expf(sv[t] - base);
            p_s[my_row * ps + half_ * 16 + t] = from_float<T>(p);
            p_sum += p;
        }
        p_sum += __shfl_xor_sync(0xffffffffu, p_sum, 1);
        l = alpha * l + p_sum;
        m = m_new;
        // diag(alpha) O_i
        for (int c = c_lo; c < c_hi; ++c) o_s[my_row * os + c] *= alpha;
        // NaN rule: in a tile the causal mask cuts, P = 0 for hidden keys but 0
        // * NaN = NaN in P·V, so V's NaNs are loaded as 0 below; a row that
        // sees a key with a NaN value is made NaN at the end.
        // block-uniform: some row misses a key
        const bool cut = causal && j0 + BC - 1 > row0 + offset;
        if (cut && i < nq) {
            // this row sees keys jj <= jvis
            const int jvis = min(nk - 1, i + offset) - j0;
            // this lane: the row's keys half_ * 16 + t
            for (int t = 0; t < 16; ++t) {
                const int jj = half_ * 16 + t;
                if (jj > jvis) break;
                for (int c = 0; c < d; ++c) {
                    const float x = to_float(vh[(long long)(j0 + jj) * d + c]);
                    if (x != x) v_nan = true;
                }
            }
        }
        // all warps done with K_j; P and O rows written
        __syncthreads();

        // V_j into the same buffer
        for (int e = threadIdx.x; e < BC * d16; e += blockDim.x) {
            const int jj = e / d16, c = e - jj * d16;
            T x = (j0 + jj < nk && c < d) ? vh[(long long)(j0 + jj) * d + c]
                                          : zero;
            // hidden or not: seen ones set v_nan
            if (cut && to_float(x) != to_float(x)) x = zero;
            kv_s[jj * qs + c] = x;
        }
        __syncthreads();

        // line 10: O_i += P~ V_j, 16 columns at a time
        for (int c0 = 0; c0 < d16; c0 += 16) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
            wmma::load_matrix_sync(acc, o_s + wr * os + c0, os,
                                   wmma::mem_row_major);
#pragma unroll
            for (int kk = 0; kk < BC; kk += 16) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, T,
                               wmma::row_major> a;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, T,
                               wmma::row_major> bv;
                wmma::load_matrix_sync(a, p_s + wr * ps + kk, ps);
                wmma::load_matrix_sync(bv, kv_s + kk * qs + c0, qs);
                wmma::mma_sync(acc, a, bv, acc);
            }
            wmma::store_matrix_sync(o_s + wr * os + c0, acc, os,
                                    wmma::mem_row_major);
        }
        // V_j consumed; O rows visible to their lanes
        __syncthreads();
    }

    // every lane: the row's two lanes agree
    const int other = __shfl_xor_sync(0xffffffffu, v_nan ? 1 : 0, 1);
    v_nan = v_nan || other != 0;
    if (i < nq) {                                    // lines 12-15
        // saw no key: O = 0, LSE = -inf (NaN l is not empty)
        const bool empty = l == 0.0f;
        const float inv_l = v_nan   ? __int_as_float(0x7fc00000)
                            : empty ? 0.0f
                                    : 1.0f / l;
        T* oh = o + ((long long)(bh) * nq + i) * d;
        for (int c = c_lo; c < min(c_hi, d); ++c)
            oh[c] = from_float<T>(o_s[my_row * os + c] * inv_l);
        if (half_ == 0)
            lse[(long long)(bh) * nq + i] = empty ? NEG_INF : m + logf(l);
    }
}
}  // namespace fa2v2

extern "C" __global__ void __launch_bounds__(128, 1)
    fa2_fwd_v2_f16(const __half* __restrict__ q, const __half* __restrict__ k,
                   const __half* __restrict__ v, __half* __restrict__ o,
                   float* __restrict__ lse, int H, int Hkv, int nq, int nk,
                   int d, float scale, int causal) {
    fa2v2::forward<__half>(q, k, v, o, lse, H, Hkv, nq, nk, d, scale, causal);
}

extern "C" __global__ void __launch_bounds__(128, 1)
    fa2_fwd_v2_bf16(const __nv_bfloat16* __restrict__ q,
                    const __nv_bfloat16* __restrict__ k,
                    const __nv_bfloat16* __restrict__ v,
                    __nv_bfloat16* __restrict__ o, float* __restrict__ lse,
                    int H, int Hkv, int nq, int nk, int d, float scale,
                    int causal) {
// WMMA has no bf16 before Ampere
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    fa2v2::forward<__nv_bfloat16>(q, k, v, o, lse, H, Hkv, nq, nk, d, scale,
                                  causal);
#endif
}
