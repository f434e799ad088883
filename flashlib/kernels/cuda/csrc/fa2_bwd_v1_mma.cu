// fa2_bwd_v1_mma.cu — FlashAttention-2 backward, version 1: dK, dV and dQ with
//   mma.sync fragments.
// Changed from before: flashlib's CUDA backend had no backward of its own (its
//   gradients came from the Triton kernels on a GPU and NumPy on a CPU). This
//   is the first CUDA C++ backward, written with forward v3's building blocks
//   (fa2_fwd_v3_mma.cu, included below without its entry points: Ops, at,
//   load_tile, commit, wait_all, the swizzled tiles) and in v3's style — each
//   warp owns 16 rows, every product is an mma.sync whose fragments come from
//   ldmatrix, and what a warp computes stays in its registers:
//   * delta kernel: D_i = rowsum(dO_i * O_i) (FlashAttention-2, Algorithm 2
//     line 4), one warp per row;
//   * dK/dV kernel (Algorithm 2 lines 5-19 with the loops as FA2 orders them):
//     a block owns 64 keys, a warp 16 of them; for every query head of the kv
//     head's GQA group and every query tile Q_i it recomputes Sᵀ = K_j Q_iᵀ
//     (keys as rows, so that Pᵀ lands in the accumulator layout), Pᵀ = exp(Sᵀ -
//     LSE), dV_j += Pᵀ dO_i, dPᵀ = V_j dO_iᵀ, dSᵀ = Pᵀ ∘ (dPᵀ - D), dK_j += dSᵀ
//     Q_i — Pᵀ and dSᵀ are packed from the accumulators straight into the A
//     operand of the next mma, as v3 does with P. Summing over the GQA group
//     inside the block writes dK, dV once: no atomics, deterministic;
//   * dQ kernel: a block owns 64 query rows, as forward v3; for every key tile
//     it recomputes S = Q_i K_jᵀ, P, dP = dO_i V_jᵀ, dS = P ∘ (dP - D), dQ_i +=
//     dS K_j. A second pass instead of FA2's atomic adds to dQ: it recomputes S
//     and P once more but needs no atomics and is bit-for-bit deterministic
//     (flashlib's Triton backward makes the same trade). Tiles are copied with
//     cp.async on sm_80+ and plain 16-byte loads on sm_75, waited for at once:
//     no copy/compute pipeline yet (forward v3's two-slot pipeline is the
//     obvious next version).
// Idea: Dao 2023 (FlashAttention-2, Algorithm 2 and Section 3.2), Dao et al.
//   2022 (FlashAttention, Appendix B: dS = P ∘ (dP - rowsum(dO ∘ O))); the
//   layouts are the PTX ISA's fragment tables, as v3.
// Limits: fp16 on sm_75+, bf16 on sm_80+ (bf16 kernels trap on sm_75; flashlib
//   does not launch them). Head dim d <= 128 (buckets D in {32, 64, 128}): at D
//   = 256 a warp's dK and dV accumulators alone are 256 registers per lane;
//   flashlib's CUDA backend then takes Triton's backward on a GPU and NumPy's
//   on a CPU. Shared memory <= 48 KB at every D. The same semantics as the
//   forward: any Nq, Nk, causal bottom-right, GQA in place, rows that see no
//   key (LSE = -inf) contribute nothing and get dQ = 0.
// Launch (flashlib.kernels.cuda.launch.bwd_launch): delta over ceil(nq / 4) * H
//   * B blocks of 128 threads; dK/dV over ceil(nk / 64) * Hkv * B blocks,
//   blockIdx.x = (b * Hkv + kv head) * tiles + tile; dQ over ceil(nq / 64) * H
//   * B blocks, indexed as the forward. Kernels
//   fa2_bwd_v1_<delta|dkdv|dq>_<f16|bf16>[_d<D>].
// Run: flashlib.kernels.cuda.backward(q, k, v, o, lse, do) (CPU tensors: the
//   emulator), or the gradient of flashlib.attention(..., backend="cuda") with
//   fp16/bf16 tensors.
// Explained in: notebooks/08_cuda.
// Tested in: tests/kernels/cuda/test_cuda_bwd.py, tests/kernels/cuda/test_cuda_counts.py (skipped causal tiles).
#define FA2V3_NO_ENTRY_POINTS
#include "fa2_fwd_v3_mma.cu"

namespace fa2bwd {
// threads per block: 4 warps of 16 rows (keys or queries) each
constexpr int THREADS = 128;
constexpr int WARPS = THREADS / 32;
static_assert(THREADS == fa2v3::THREADS,
              "load_tile strides by forward v3's block size");
using fa2v3::Ops;
using fa2v3::at;
using fa2v3::load_tile;
using fa2v3::commit;
using fa2v3::wait_all;

// Query rows per tile of the dK/dV kernel, and keys per tile of the dQ kernel,
// for each bucket D: shared memory (dK/dV) = (2 * 64 + 2 * BQ) * D * 2 + 8 * BQ
// bytes; (dQ) = (2 * 64 + 2 * BKV) * D * 2.
constexpr int BWD_BQ_D32 = 64;
constexpr int BWD_BQ_D64 = 64;
constexpr int BWD_BQ_D128 = 16;
constexpr int BWD_BKV_D32 = 64;
constexpr int BWD_BKV_D64 = 64;
constexpr int BWD_BKV_D128 = 32;

__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) {
    return __bfloat162float(x);
}

// Line 4: delta[row] = sum_c dO[row, c] * O[row, c], one warp per row.
template <class T>
__device__ void delta(const T* __restrict__ o, const T* __restrict__ dout,
                      float* __restrict__ dlt, int nq, int d) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int tiles = (nq + WARPS - 1) / WARPS;
    const int bh = blockIdx.x / tiles,
              row = (blockIdx.x - bh * tiles) * WARPS + warp;
    if (row >= nq) return;                           // warp-uniform
    const long long base = ((long long)bh * nq + row) * d;
    float acc = 0.0f;
    for (int c = lane; c < d; c += 32)
        acc += to_float(o[base + c]) * to_float(dout[base + c]);
    for (int off = 16; off > 0; off >>= 1)
        acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (lane == 0) dlt[(long long)bh * nq + row] = acc;
}

// C[16 x 8m] += A[16 x D'] Bᵀ where A's 16 rows start at row a0 of tile `as`
// and B's rows (8m of them, from row b0) are rows of tile `bs`: both row-major
// D-wide swizzled tiles, K = `kdim` columns. (S = Q Kᵀ in the forward; here Sᵀ
// = K Qᵀ, dPᵀ = V dOᵀ, S = Q Kᵀ and dP = dO Vᵀ.)
template <class T, int D, int NB>
__device__ __forceinline__ void mma_abt(float (&c)[NB][4], T* as, int a0, T* bs,
                                        int b0) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int kk = 0; kk < D; kk += 16) {
        uint32_t a[4];
        const int ar = a0 + (lane & 7) + 8 * ((lane >> 3) & 1);
        ptx::ldmatrix_x4(a, at<T, D>(as, ar, kk + 8 * (lane >> 4)));
#pragma unroll
        for (int n = 0; n < NB; n += 2) {
            uint32_t b[4];
            const int br = b0 + 8 * n + (lane & 7) + 8 * (lane >> 4);
            const int bc = kk + 8 * ((lane >> 3) & 1);
            ptx::ldmatrix_x4(b, at<T, D>(bs, br, bc));
            Ops<T>::mma(c[n], a, b[0], b[1]);
            Ops<T>::mma(c[n + 1], a, b[2], b[3]);
        }
    }
}

// acc[16 x D] += X[16 x 8NB] B where X is in accumulator layout (this warp's
// registers) and B's 8NB rows are rows of tile `bs` (row-major, D wide), read
// transposed by ldmatrix (O += P V in the forward; here dV += Pᵀ dO, dK += dSᵀ
// Q, dQ += dS K). X is packed to 16 bits as the A operand: v3's register trick.
template <class T, int D, int NB>
__device__ __forceinline__ void mma_xb(float (&acc)[D / 8][4],
                                       const float (&x)[NB][4], T* bs) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int kk = 0; kk < NB / 2; ++kk) {
        const uint32_t a[4] = {
            Ops<T>::pack(x[2 * kk][0], x[2 * kk][1]),
            Ops<T>::pack(x[2 * kk][2], x[2 * kk][3]),
            Ops<T>::pack(x[2 * kk + 1][0], x[2 * kk + 1][1]),
            Ops<T>::pack(x[2 * kk + 1][2], x[2 * kk + 1][3])};
#pragma unroll
        for (int n = 0; n < D / 8; n += 2) {
            uint32_t b[4];
            const int br = 16 * kk + (lane & 7) + 8 * ((lane >> 3) & 1);
            const int bc = 8 * n + 8 * (lane >> 4);
            ptx::ldmatrix_x4_trans(b, at<T, D>(bs, br, bc));
            Ops<T>::mma(acc[n], a, b[0], b[1]);
            Ops<T>::mma(acc[n + 1], a, b[2], b[3]);
        }
    }
}

// The warp's 16 rows of acc (accumulator layout) * mul, staged in rows r0.. of
// `tile` (this warp's own rows, read by no other warp), then written to rows
// row0.. of out (valid rows only) as 16-byte rows.
template <class T, int D>
__device__ __forceinline__ void
store_rows(T* __restrict__ out, const float (&acc)[D / 8][4], float mul,
           T* tile, int r0, int row0, int valid, int d, bool vec) {
    const int lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            T* p = at<T, D>(tile, r0 + g + 8 * r, 8 * n + 2 * t);
            p[0] = Ops<T>::from_float(acc[n][2 * r] * mul);
            p[1] = Ops<T>::from_float(acc[n][2 * r + 1] * mul);
        }
    __syncwarp();
    for (int e = lane; e < 16 * (D / 8); e += 32) {
        const int r = e / (D / 8), c = (e - r * (D / 8)) * 8;
        if (row0 + r >= valid || c >= d) continue;
        const T* src = at<T, D>(tile, r0 + r, c);
        T* dst = out + (long long)(row0 + r) * d + c;
        if (vec)
            *reinterpret_cast<fa2v3::Chunk*>(dst) =
                *reinterpret_cast<const fa2v3::Chunk*>(src);
        else for (int u = 0; u < 8 && c + u < d; ++u) dst[u] = src[u];
    }
}

// Lines 5-19 for one block of 64 keys: dK_j, dV_j, summed over the kv head's
// query heads.
template <class T, int D, int BQ>
__device__ void
dkdv(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
     const T* __restrict__ dout, const float* __restrict__ lse,
     const float* __restrict__ dlt, T* __restrict__ dk, T* __restrict__ dv,
     int H, int Hkv, int nq, int nk, int d, float scale, int causal, bool vec) {
    extern __shared__ __align__(128) unsigned char smem[];
    constexpr int BK = 16 * WARPS, NT = D / 8, NB = BQ / 8;
    const float NEG_INF = __int_as_float(0xff800000),
                LOG2E = 1.4426950408889634f;
    // (BK, D)  K_j, later dK_j on its way out
    T* k_s = reinterpret_cast<T*>(smem);
    T* v_s = k_s + BK * D;                           // (BK, D)  V_j, later dV_j
    T* q_s = v_s + BK * D;                           // (BQ, D)  Q_i
    T* do_s = q_s + BQ * D;                          // (BQ, D)  dO_i
    // (BQ)  LSE_i in log2 units
    float* lse_s = reinterpret_cast<float*>(do_s + BQ * D);
    float* dlt_s = lse_s + BQ;                                 // (BQ)  D_i

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2,
              t = lane & 3;
    const int tiles = (nk + BK - 1) / BK;
    const int bhk = blockIdx.x / tiles;              // b * Hkv + kv head
    const int key0 = (blockIdx.x - bhk * tiles) * BK, wkey0 = key0 + 16 * warp;
    const int group = H / Hkv, b = bhk / Hkv, hk = bhk - b * Hkv;
    // bottom-right causal: query i sees key j <= i + offset
    const int offset = nk - nq;
    const float sl2 = scale * LOG2E;

    // line 6: K_j, V_j
    load_tile<T, D>(k_s, k + ((long long)bhk * nk + key0) * d, BK, nk - key0, d,
                    vec);
    load_tile<T, D>(v_s, v + ((long long)bhk * nk + key0) * d, BK, nk - key0, d,
                    vec);
    commit();
    // line 7: dK_j = dV_j = 0 (this warp's 16 keys)
    float dk_acc[NT][4], dv_acc[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) dk_acc[n][i] = dv_acc[n][i] = 0.0f;

    // the first query that sees the block's first key (causal); earlier query
    // tiles are skipped
    const int first = causal ? max(0, min(nq, key0 - offset)) : 0;
    const int qtiles = (nq + BQ - 1) / BQ;
    // the GQA group: dK, dV sum over its query heads
    for (int hq = 0; hq < group; ++hq) {
        const long long bh = (long long)b * H + hk * group + hq;
        for (int qt = first / BQ; qt < qtiles; ++qt) {   // line 8
            const int q0 = qt * BQ;
            // every warp is done with the previous Q_i, dO_i
            __syncthreads();
            // line 9
            load_tile<T, D>(q_s, q + (bh * nq + q0) * d, BQ, nq - q0, d, vec);
            load_tile<T, D>(do_s, dout + (bh * nq + q0) * d, BQ, nq - q0, d,
                            vec);
            commit();
            for (int r = threadIdx.x; r < BQ; r += THREADS) {
                const bool in = q0 + r < nq;
                lse_s[r] = in ? lse[bh * nq + q0 + r] * LOG2E : NEG_INF;
                dlt_s[r] = in ? dlt[bh * nq + q0 + r] : 0.0f;
            }
            wait_all();
            // K_j, V_j (first time), Q_i, dO_i, LSE_i, D_i visible
            __syncthreads();
            // warp-uniform: some key of this warp is real, and (causal) seen by
            // the tile's last query
            const int qlast = min(q0 + BQ, nq) - 1;
            if (wkey0 >= nk || (causal && wkey0 > qlast + offset)) continue;
            // Sᵀ and dPᵀ: this warp's 16 keys x BQ queries
            float s[NB][4], dp[NB][4];
#pragma unroll
            for (int n = 0; n < NB; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) s[n][i] = dp[n][i] = 0.0f;
            // line 10: Sᵀ = K_j Q_iᵀ
            mma_abt<T, D, NB>(s, k_s, 16 * warp, q_s, 0);
            // line 11: Pᵀ = exp(Sᵀ - LSE). s[n][i] is key wkey0 + g + 8 (i / 2)
            // and query q0 + 8n + 2t + i % 2.
#pragma unroll
            for (int n = 0; n < NB; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int key = wkey0 + g + 8 * (i >> 1),
                              col = 8 * n + 2 * t + (i & 1), query = q0 + col;
                    const bool seen = key < nk && query < nq &&
                                      (!causal || key <= query + offset) &&
                                      lse_s[col] != NEG_INF;
                    s[n][i] = seen ? exp2f(s[n][i] * sl2 - lse_s[col]) : 0.0f;
                }
            // line 12: dV_j += Pᵀ dO_i
            mma_xb<T, D, NB>(dv_acc, s, do_s);
            // line 13: dPᵀ = V_j dO_iᵀ
            mma_abt<T, D, NB>(dp, v_s, 16 * warp, do_s, 0);
            // line 14: dSᵀ = Pᵀ ∘ (dPᵀ - D_i)
#pragma unroll
            for (int n = 0; n < NB; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i)
                    dp[n][i] =
                        s[n][i] * (dp[n][i] - dlt_s[8 * n + 2 * t + (i & 1)]);
            // line 16: dK_j += dSᵀ Q_i (scale at the end)
            mma_xb<T, D, NB>(dk_acc, dp, q_s);
        }
    }
    // line 18: write dK_j (times the softmax scale: S = scale Q Kᵀ), dV_j,
    // through the warp's own K/V rows
    // K_j, V_j landed, even had no query tile run
    wait_all();
    // no tile is loaded after this; all warps are past their reads
    __syncthreads();
    store_rows<T, D>(dk + (long long)bhk * nk * d, dk_acc, scale, k_s,
                     16 * warp, wkey0, nk, d, vec);
    store_rows<T, D>(dv + (long long)bhk * nk * d, dv_acc, 1.0f, v_s, 16 * warp,
                     wkey0, nk, d, vec);
}

// dQ_i for one block of 64 query rows: dQ_i = scale * sum_j dS_ij K_j.
template <class T, int D, int BKV>
__device__ void dq(const T* __restrict__ q, const T* __restrict__ k,
                   const T* __restrict__ v, const T* __restrict__ dout,
                   const float* __restrict__ lse, const float* __restrict__ dlt,
                   T* __restrict__ dqo, int H, int Hkv, int nq, int nk, int d,
                   float scale, int causal, bool vec) {
    extern __shared__ __align__(128) unsigned char smem[];
    constexpr int BR = 16 * WARPS, NT = D / 8, NB = BKV / 8;
    const float NEG_INF = __int_as_float(0xff800000),
                LOG2E = 1.4426950408889634f;
    // (BR, D)   Q_i, later dQ_i on its way out
    T* q_s = reinterpret_cast<T*>(smem);
    T* do_s = q_s + BR * D;                          // (BR, D)   dO_i
    T* k_s = do_s + BR * D;                          // (BKV, D)  K_j
    T* v_s = k_s + BKV * D;                          // (BKV, D)  V_j

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2,
              t = lane & 3;
    const int tiles = (nq + BR - 1) / BR;
    const int bh = blockIdx.x / tiles;
    const int bhk = (bh / H) * Hkv + (bh % H) / (H / Hkv);
    const int row0 = (blockIdx.x - bh * tiles) * BR, wrow0 = row0 + 16 * warp;
    const int offset = nk - nq;
    const float sl2 = scale * LOG2E;
    const T* kh = k + (long long)bhk * nk * d;
    const T* vh = v + (long long)bhk * nk * d;

    // rows g, g + 8 of this warp: LSE (log2 units), D_i
    float lse2[2], dl[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = wrow0 + g + 8 * r;
        lse2[r] = row < nq ? lse[(long long)bh * nq + row] * LOG2E : NEG_INF;
        dl[r] = row < nq ? dlt[(long long)bh * nq + row] : 0.0f;
    }
    // keys the block's last row sees
    const int kend = causal ? min(nk, min(row0 + BR, nq) + offset) : nk;
    const int ntiles = kend > 0 ? (kend + BKV - 1) / BKV : 0;
    const int wend = wrow0 >= nq ? 0
                     : causal    ? min(nk, min(wrow0 + 16, nq) + offset)
                                 : nk;
    float acc[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n)
        acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;

    if (ntiles > 0) {
        load_tile<T, D>(q_s, q + ((long long)bh * nq + row0) * d, BR, nq - row0,
                        d, vec);
        load_tile<T, D>(do_s, dout + ((long long)bh * nq + row0) * d, BR,
                        nq - row0, d, vec);
    }
    for (int j = 0; j < ntiles; ++j) {
        const int j0 = j * BKV;
        // every warp is done with K_{j-1}, V_{j-1}
        __syncthreads();
        load_tile<T, D>(k_s, kh + (long long)j0 * d, BKV, nk - j0, d, vec);
        load_tile<T, D>(v_s, vh + (long long)j0 * d, BKV, nk - j0, d, vec);
        commit();
        wait_all();
        // K_j, V_j (and Q_i, dO_i) visible
        __syncthreads();
        // warp-uniform: none of this warp's rows sees a key here
        if (j0 >= wend) continue;
        float s[NB][4], dp[NB][4];
#pragma unroll
        for (int n = 0; n < NB; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) s[n][i] = dp[n][i] = 0.0f;
        mma_abt<T, D, NB>(s, q_s, 16 * warp, k_s, 0);     // S = Q_i K_jᵀ
        mma_abt<T, D, NB>(dp, do_s, 16 * warp, v_s, 0);   // dP = dO_i V_jᵀ
#pragma unroll
        for (int n = 0; n < NB; ++n)
            // P = exp(S - LSE); dS = P ∘ (dP - D_i)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int key = j0 + 8 * n + 2 * t + (i & 1), r = i >> 1,
                          row = wrow0 + g + 8 * r;
                const bool seen = key < nk && row < nq &&
                                  (!causal || key <= row + offset) &&
                                  lse2[r] != NEG_INF;
                const float p = seen ? exp2f(s[n][i] * sl2 - lse2[r]) : 0.0f;
                s[n][i] = p * (dp[n][i] - dl[r]);
            }
        // dQ_i += dS K_j (scale at the end)
        mma_xb<T, D, NB>(acc, s, k_s);
    }
    // every warp is done reading Q_i before rows are reused
    __syncthreads();
    store_rows<T, D>(dqo + (long long)bh * nq * d, acc, scale, q_s, 16 * warp,
                     wrow0, nq, d, vec);
}

__device__ __forceinline__ bool aligned16(const void* a, const void* b,
                                          const void* c, const void* e,
                                          const void* f, const void* h) {
    const unsigned long long x = reinterpret_cast<unsigned long long>(a) |
                                 reinterpret_cast<unsigned long long>(b) |
                                 reinterpret_cast<unsigned long long>(c) |
                                 reinterpret_cast<unsigned long long>(e) |
                                 reinterpret_cast<unsigned long long>(f) |
                                 reinterpret_cast<unsigned long long>(h);
    return (x & 15) == 0;
}
}  // namespace fa2bwd

// Entry points, one per (dtype, head-dim bucket D), written out so that each
// name is greppable (and found by flashlib's build, which reads them). Under
// FA2V3_SM80 = 0 (sm_75) the bf16 ones trap.
#define FA2BWD_ARGS(T) const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, \
    const T* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ dlt
#define FA2BWD_DKDV_ARGS(T) FA2BWD_ARGS(T), T* __restrict__ dk, T* __restrict__ dv, int H, int Hkv, int nq, int nk, \
    int d, float scale, int causal
#define FA2BWD_DQ_ARGS(T) FA2BWD_ARGS(T), T* __restrict__ dq, int H, int Hkv, int nq, int nk, int d, float scale, int causal
#define FA2BWD_DKDV(T, D) fa2bwd::dkdv<T, D, fa2bwd::BWD_BQ_D##D>(q, k, v, dout, lse, dlt, dk, dv, H, Hkv, nq, nk, d, \
    scale, causal, d % 8 == 0 && fa2bwd::aligned16(q, k, v, dout, dk, dv))
#define FA2BWD_DQ(T, D) fa2bwd::dq<T, D, fa2bwd::BWD_BKV_D##D>(q, k, v, dout, lse, dlt, dq, H, Hkv, nq, nk, d, scale, \
    causal, d % 8 == 0 && fa2bwd::aligned16(q, k, v, dout, dq, dq))
#if FA2V3_SM80
#define FA2BWD_BF16(CALL) CALL
#else
#define FA2BWD_BF16(CALL) __trap()                   // sm_75: no bf16 mma; never launched there
#endif
extern "C" __global__ void __launch_bounds__(fa2bwd::THREADS, 1) fa2_bwd_v1_dkdv_f16_d32(FA2BWD_DKDV_ARGS(__half)) { FA2BWD_DKDV(__half, 32); }
extern "C" __global__ void __launch_bounds__(fa2bwd::THREADS, 1) fa2_bwd_v1_dq_f16_d32(FA2BWD_DQ_ARGS(__half)) { FA2BWD_DQ(__half, 32); }
extern "C" __global__ void __launch_bounds__(fa2bwd::THREADS, 1) fa2_bwd_v1_dkdv_f16_d64(FA2BWD_DKDV_ARGS(__half)) { FA2BWD_DKDV(__half, 64); }
extern "C" __global__ void __launch_bounds__(fa2bwd::THREADS, 1) fa2_bwd_v1_dq_f16_d64(FA2BWD_DQ_ARGS(__half)) { FA2BWD_DQ(__half, 64); }
extern "C" __global__ void __launch_bounds__(fa2bwd::THREADS, 1) fa2_bwd_v1_dkdv_f16_d128(FA2BWD_DKDV_ARGS(__half)) { FA2BWD_DKDV(__half, 128); }
extern "C" __global__ void __launch_bounds__(fa2bwd::THREADS, 1) fa2_bwd_v1_dq_f16_d128(FA2BWD_DQ_ARGS(__half)) { FA2BWD_DQ(__half, 128); }
extern "C" __global__ void __launch_bounds__(fa2bwd::THREADS, 1) fa2_bwd_v1_dkdv_bf16_d32(FA2BWD_DKDV_ARGS(__nv_bfloat16)) { FA2BWD_BF16(FA2BWD_DKDV(__nv_bfloat16, 32)); }
extern "C" __global__ void __launch_bounds__(fa2bwd::THREADS, 1) fa2_bwd_v1_dq_bf16_d32(FA2BWD_DQ_ARGS(__nv_bfloat16)) { FA2BWD_BF16(FA2BWD_DQ(__nv_bfloat16, 32)); }
extern "C" __global__ void __launch_bounds__(fa2bwd::THREADS, 1) fa2_bwd_v1_dkdv_bf16_d64(FA2BWD_DKDV_ARGS(__nv_bfloat16)) { FA2BWD_BF16(FA2BWD_DKDV(__nv_bfloat16, 64)); }
extern "C" __global__ void __launch_bounds__(fa2bwd::THREADS, 1) fa2_bwd_v1_dq_bf16_d64(FA2BWD_DQ_ARGS(__nv_bfloat16)) { FA2BWD_BF16(FA2BWD_DQ(__nv_bfloat16, 64)); }
extern "C" __global__ void __launch_bounds__(fa2bwd::THREADS, 1) fa2_bwd_v1_dkdv_bf16_d128(FA2BWD_DKDV_ARGS(__nv_bfloat16)) { FA2BWD_BF16(FA2BWD_DKDV(__nv_bfloat16, 128)); }
extern "C" __global__ void __launch_bounds__(fa2bwd::THREADS, 1) fa2_bwd_v1_dq_bf16_d128(FA2BWD_DQ_ARGS(__nv_bfloat16)) { FA2BWD_BF16(FA2BWD_DQ(__nv_bfloat16, 128)); }
extern "C" __global__ void __launch_bounds__(fa2bwd::THREADS)
    fa2_bwd_v1_delta_f16(const __half* __restrict__ o,
                         const __half* __restrict__ dout,
                         float* __restrict__ dlt, int nq, int d) {
    fa2bwd::delta(o, dout, dlt, nq, d);
}
extern "C" __global__ void __launch_bounds__(fa2bwd::THREADS)
    fa2_bwd_v1_delta_bf16(const __nv_bfloat16* __restrict__ o,
                          const __nv_bfloat16* __restrict__ dout,
                          float* __restrict__ dlt, int nq, int d) {
    fa2bwd::delta(o, dout, dlt, nq, d);
}
