// decode_v1_splitkv.cu — Flash-Decoding: split the KV cache, attend to each split
//   in parallel, combine by LSE.
// Changed from v1/v2: with one query per sequence (decoding) a Q tile per block
//   leaves the GPU nearly idle (B x H blocks). Here a block is (split, head,
//   batch): it attends one query row to the keys of its split [k0, k1) of the
//   sequence's own length cache_seqlens[b] (the chunks of
//   flashlib.ladder.decoding.split_bounds), and writes a normalised partial O_s
//   (fp32) and its LSE_s. Inside a block, 4 warps take every 4th key; a warp
//   computes q·k with its 32 lanes (8 head-dim columns each) and a
//   __shfl_xor_sync butterfly, keeps its own online softmax (m, l, O slice) in
//   registers, and the warps merge through shared memory. The combine kernel
//   merges the splits: lse = log sum_s exp(LSE_s), o = sum_s exp(LSE_s - lse)
//   O_s — the online-softmax merge again. No tensor cores: one query row
//   against K is a matrix-vector product.
// Idea: Dao, Haziza, Massa, Sizov 2023 (Flash-Decoding), PyTorch blog.
// Limits: float32, float16, bfloat16 (bf16 loads convert in software on every
//   arch); head dim d <= 256 (32 lanes x 8); keys past cache_seqlens[b] are
//   never read; a sequence of length 0, or an empty split, gives O = 0 and LSE
//   = -inf. Shared memory (5d + 8) * 4 bytes (5.1 KB at d = 256). causal =
//   bottom-right within each sequence: query i of Nq sees key j iff j <= i +
//   len_b - Nq.
// NaN: flashlib's rule (every backend): a NaN in q, or in k[j] / v[j] at a key
//   j < cache_seqlens[b] (and j visible, causal), makes the row's O NaN (and
//   its LSE, unless only v has it); keys past the length are never read, so
//   what the cache holds there changes nothing. Changed for it: "this warp /
//   split / row saw no key" is decided by l == 0 (exactly 0 only then: l >= 1
//   after any finite score), not by m or LSE == -inf or L > 0, which NaN fools
//   (fmaxf ignores NaN, so a NaN row kept m = -inf and came out O = 0, LSE =
//   -inf, and a split with a NaN key was written as empty and dropped by the
//   combine).
// Launch: 1-D grids, so any B * H that fits in memory launches (gridDim.x
//   allows 2^31 - 1; y and z, which held h and b before this fix, stop at
//   65,535): split blockIdx.x = (b * H + h) * S + s, combine blockIdx.x = (b *
//   H + h) * nq + qi — the output row itself.
// Run: flashlib.kernels.cuda.decode(q, k_cache, v_cache, cache_seqlens=...,
//   num_splits=...); on a CPU it runs in the emulator.
// Explained in: notebooks/08_cuda (the algorithm: notebooks/06_flash_decoding).
// Tested in: tests/kernels/cuda/test_cuda_kernels.py.
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace fdec {
// per block (flashlib's launch reads this line)
constexpr int THREADS = 128;
constexpr int WARPS = THREADS / 32;
// head-dim columns per lane: d <= 32 * 8
constexpr int PER_LANE = 8;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) {
    return __bfloat162float(x);
}
template <class T> __device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
    return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
    return __float2half(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16(x);
}

template <class T>
__device__ void split(const T* __restrict__ q, const T* __restrict__ k,
                      const T* __restrict__ v, const int* __restrict__ seqlens,
                      float* __restrict__ o_parts,
                      float* __restrict__ lse_parts, int B, int H, int Hkv,
                      int nq, int nmax, int d, int S, float scale, int causal) {
    extern __shared__ __align__(16) float smem[];
    const float NEG_INF = __int_as_float(0xff800000);
    // (d)           this query row, fp32
    float* q_s = smem;
    // (WARPS, d+2)  each warp's (m, l, O[0..d))
    float* st = q_s + d;
    // blockIdx.x = (b * H + h) * S + s
    const int bh = blockIdx.x / S, s = blockIdx.x - bh * S;
    const int b = bh / H, h = bh - b * H, hk = h / (H / Hkv);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    // clamped: the host does not read lengths back
    const int len = min(max(seqlens[b], 0), nmax);
    // split_bounds
    const int k0 = int((long long)s * len / S),
              k1 = int((long long)(s + 1) * len / S);
    const T* kh = k + ((long long)(b) * Hkv + hk) * nmax * d;
    const T* vh = v + ((long long)(b) * Hkv + hk) * nmax * d;

    for (int qi = 0; qi < nq; ++qi) {
        const T* qrow = q + (((long long)(b) * H + h) * nq + qi) * d;
        for (int c = threadIdx.x; c < d; c += THREADS)
            q_s[c] = to_float(qrow[c]);
        __syncthreads();                             // q row visible

        const int jmax = causal ? min(k1, qi + len - nq + 1) : k1;
        float m = NEG_INF, l = 0.0f, acc[PER_LANE];
#pragma unroll
        for (int t = 0; t < PER_LANE; ++t) acc[t] = 0.0f;
        // this warp's keys of the split
        for (int j = k0 + warp; j < jmax; j += WARPS) {
            const T* kr = kh + (long long)(j) * d;
            float part = 0.0f;
#pragma unroll
            for (int t = 0; t < PER_LANE; ++t) {
                const int c = lane + 32 * t;
                if (c < d) part += q_s[c] * to_float(kr[c]);
            }
#pragma unroll
            for (int off = 16; off > 0; off >>= 1)
                part += __shfl_xor_sync(0xffffffffu, part, off);
            // every lane holds q·k_j
            const float sj = part * scale;
            const float m_new = fmaxf(m, sj);
            // m = -inf the first time: exp(-inf) = 0
            const float alpha = expf(m - m_new);
            const float p = expf(sj - m_new);
            l = l * alpha + p;
            const T* vr = vh + (long long)(j) * d;
#pragma unroll
            for (int t = 0; t < PER_LANE; ++t) {
                const int c = lane + 32 * t;
                if (c < d) acc[t] = acc[t] * alpha + p * to_float(vr[c]);
            }
            m = m_new;
        }

        // merge the 4 warps' states
        float* mine = st + warp * (d + 2);
        if (lane == 0) { mine[0] = m; mine[1] = l; }
#pragma unroll
        for (int t = 0; t < PER_LANE; ++t) {
            const int c = lane + 32 * t;
            if (c < d) mine[2 + c] = acc[t];
        }
        // every warp's state visible
        __syncthreads();

        // A warp that saw no key has l == 0 exactly (skipped: its weight would
        // be exp(-inf - -inf)); a warp that saw a NaN has l = NaN and is kept,
        // so the NaN reaches L, O_s and LSE_s.
        float M = NEG_INF, L = 0.0f;
        for (int w = 0; w < WARPS; ++w) M = fmaxf(M, st[w * (d + 2)]);
        for (int w = 0; w < WARPS; ++w) {
            const float mw = st[w * (d + 2)], lw = st[w * (d + 2) + 1];
            if (lw != 0.0f) L += expf(mw - M) * lw;
        }
        // no key in this split (NaN L is not empty)
        const bool empty = L == 0.0f;
        // (S, B, H, nq)
        const long long row = (((long long)(s) * B + b) * H + h) * nq + qi;
        for (int c = threadIdx.x; c < d; c += THREADS) {
            float ov = 0.0f;
            for (int w = 0; w < WARPS; ++w) {
                const float mw = st[w * (d + 2)];
                if (st[w * (d + 2) + 1] != 0.0f)
                    ov += expf(mw - M) * st[w * (d + 2) + 2 + c];
            }
            // normalised O_s
            o_parts[row * d + c] = empty ? 0.0f : ov / L;
        }
        if (threadIdx.x == 0) lse_parts[row] = empty ? NEG_INF : M + logf(L);
        // q_s and st are rewritten for the next row
        __syncthreads();
    }
}

template <class T>
__device__ void combine(const float* __restrict__ o_parts,
                        const float* __restrict__ lse_parts, T* __restrict__ o,
                        float* __restrict__ lse, int B, int H, int nq, int d,
                        int S) {
    const float NEG_INF = __int_as_float(0xff800000);
    // ((b * H + h) * nq + qi): the block is the row
    const long long row = blockIdx.x;
    // from one split to the next
    const long long stride = (long long)(B) * H * nq;
    // An empty split has LSE_s = -inf exactly (skipped); a NaN split (LSE_s
    // NaN, or O_s NaN) is kept: its weight exp(NaN - M), or its O_s, makes the
    // row NaN. L == 0: every split empty.
    float M = NEG_INF, L = 0.0f;
    for (int s = 0; s < S; ++s) M = fmaxf(M, lse_parts[s * stride + row]);
    for (int s = 0; s < S; ++s) {
        const float ls = lse_parts[s * stride + row];
        if (ls != NEG_INF) L += expf(ls - M);
    }
    const bool empty = L == 0.0f;                    // NaN L is not empty
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float acc = 0.0f;
        for (int s = 0; s < S; ++s) {
            const float ls = lse_parts[s * stride + row];
            if (ls != NEG_INF)
                acc += expf(ls - M) * o_parts[(s * stride + row) * d + c];
        }
        o[row * d + c] = from_float<T>(empty ? 0.0f : acc / L);
    }
    if (threadIdx.x == 0) lse[row] = empty ? NEG_INF : M + logf(L);
}
}  // namespace fdec

// One split kernel and one combine kernel per dtype (kernels are extern "C":
// one name for NVRTC, nvcc and the emulator).
extern "C" __global__ void __launch_bounds__(fdec::THREADS)
    decode_split_f32(const float* __restrict__ q, const float* __restrict__ k,
                     const float* __restrict__ v,
                     const int* __restrict__ seqlens,
                     float* __restrict__ o_parts, float* __restrict__ lse_parts,
                     int B, int H, int Hkv, int nq, int nmax, int d, int S,
                     float scale, int causal) {
    fdec::split<float>(q, k, v, seqlens, o_parts, lse_parts, B, H, Hkv, nq,
                       nmax, d, S, scale, causal);
}
extern "C" __global__ void __launch_bounds__(fdec::THREADS)
    decode_combine_f32(const float* __restrict__ o_parts,
                       const float* __restrict__ lse_parts,
                       float* __restrict__ o, float* __restrict__ lse, int B,
                       int H, int nq, int d, int S) {
    fdec::combine<float>(o_parts, lse_parts, o, lse, B, H, nq, d, S);
}
extern "C" __global__ void __launch_bounds__(fdec::THREADS)
    decode_split_f16(const __half* __restrict__ q, const __half* __restrict__ k,
                     const __half* __restrict__ v,
                     const int* __restrict__ seqlens,
                     float* __restrict__ o_parts, float* __restrict__ lse_parts,
                     int B, int H, int Hkv, int nq, int nmax, int d, int S,
                     float scale, int causal) {
    fdec::split<__half>(q, k, v, seqlens, o_parts, lse_parts, B, H, Hkv, nq,
                        nmax, d, S, scale, causal);
}
extern "C" __global__ void __launch_bounds__(fdec::THREADS)
    decode_combine_f16(const float* __restrict__ o_parts,
                       const float* __restrict__ lse_parts,
                       __half* __restrict__ o, float* __restrict__ lse, int B,
                       int H, int nq, int d, int S) {
    fdec::combine<__half>(o_parts, lse_parts, o, lse, B, H, nq, d, S);
}
extern "C" __global__ void __launch_bounds__(fdec::THREADS) decode_split_bf16(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
    const __nv_bfloat16* __restrict__ v, const int* __restrict__ seqlens,
    float* __restrict__ o_parts, float* __restrict__ lse_parts, int B, int H,
    int Hkv, int nq, int nmax, int d, int S, float scale, int causal) {
    fdec::split<__nv_bfloat16>(q, k, v, seqlens, o_parts, lse_parts, B, H, Hkv,
                               nq, nmax, d, S, scale, causal);
}
extern "C" __global__ void __launch_bounds__(fdec::THREADS)
    decode_combine_bf16(const float* __restrict__ o_parts,
                        const float* __restrict__ lse_parts,
                        __nv_bfloat16* __restrict__ o, float* __restrict__ lse,
                        int B, int H, int nq, int d, int S) {
    fdec::combine<__nv_bfloat16>(o_parts, lse_parts, o, lse, B, H, nq, d, S);
}
