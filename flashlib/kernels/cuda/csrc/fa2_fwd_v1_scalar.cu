// fa2_fwd_v1_scalar.cu — FlashAttention-2 forward, version 1: scalar fp32, one
//   thread per query row.
// Changed from the NumPy ladder (flashlib/ladder/fa2.py): the same Algorithm 1,
//   now as a CUDA block. A block owns a tile of BR query rows (one thread
//   each); K and V tiles of BC = 16 keys are staged through shared memory by
//   all threads together; each thread keeps its row's running max m, sum l and
//   the BC scores in registers (the online softmax), accumulates its O row in
//   shared memory, skips key tiles the causal mask hides entirely, and writes O
//   / l and LSE = m + log l at the end.
// Idea: Dao 2023 (FlashAttention-2), Algorithm 1; the thread-per-row layout
//   follows llm.c's first flash-attention kernel (karpathy/llm.c PR #285).
// Limits: float32 only; head dim d <= 256 (rows are stored with an odd stride,
//   d + 1 when d is even, so the threads of a warp reading their own rows hit
//   32 different banks); BR in {64, 32, 16, 8} is chosen by flashlib so that
//   shared memory (2*BR + BC) * stride * 4 bytes stays within the 48 KB every
//   GPU grants without opt-in. GQA/MQA read kv head h / (H / Hkv); Nq != Nk
//   causal is bottom-right.
// NaN: flashlib's rule (every backend): a NaN in q[i], or in k[j] / v[j] at a
//   key j row i sees, makes row i's O NaN (and its LSE, unless only v has it);
//   a NaN row i does not see changes nothing. Changed for it: the tile step
//   guarded "nothing visible yet" by zeroing P, which also erased a NaN row's P
//   (fmaxf ignores NaN, so its m stays -inf): it now subtracts 0 instead
//   (masked -inf -> 0, NaN stays NaN); P·V skips keys the causal mask hides (P
//   = 0 there, but 0 * NaN = NaN); and the end tests l == 0 ("saw no key": l >=
//   1 after any finite score) instead of l > 0, false for NaN, which made a NaN
//   row O = 0, LSE = -inf. The backward does not follow the rule (a NaN row's
//   gradients are not specified).
// Launch: a 1-D grid of ceil(nq / BR) * H * B blocks, blockIdx.x = (b * H + h)
//   * tiles + tile, so any B * H that fits in memory launches (gridDim.x allows
//   2^31 - 1; y and z, which held h and b before this fix, stop at 65,535).
//   __launch_bounds__(64, 1): with the index decoding, a bare (64) made ptxas
//   13.0 cap v1 at 72 (sm_75/80) or 64 (sm_86+) registers and spill; at d >= 64
//   the 33-41 KB of shared memory per block already limit an SM to a few
//   blocks, so asking for 1 costs no occupancy.
// Run: flashlib.kernels.cuda.forward(q, k, v, version="v1") (fp32 picks v1); on
//   a CPU it runs in the emulator.
// Explained in: notebooks/08_cuda.
// Tested in: tests/kernels/cuda/test_cuda_kernels.py, tests/kernels/cuda/test_cuda_emulator.py (the planted race).

// keys per K/V tile = scores each thread holds in registers
constexpr int V1_BC = 16;

extern "C" __global__ void __launch_bounds__(64, 1)
fa2_fwd_v1_f32(const float* __restrict__ q,    // (B, H, nq, d)
               const float* __restrict__ k,    // (B, Hkv, nk, d)
               const float* __restrict__ v,    // (B, Hkv, nk, d)
               float* __restrict__ o,          // (B, H, nq, d)
               float* __restrict__ lse,        // (B, H, nq)
               int H, int Hkv, int nq, int nk, int d, float scale, int causal)
{
    extern __shared__ __align__(16) float smem[];
    const float NEG_INF = __int_as_float(0xff800000);
    // rows in this block's Q tile
    const int br = blockDim.x;
    // odd row stride: conflict-free row-per-thread access
    const int ds = d + 1 - (d & 1);
    float* q_s = smem;                               // (br, ds)  Q_i
    // (br, ds)  O_i, unnormalised
    float* o_s = q_s + br * ds;
    float* kv_s = o_s + br * ds;                     // (BC, ds)  K_j, then V_j

    // 1-D grid: blockIdx.x = (b * H + h) * tiles + tile
    const int tiles = (nq + br - 1) / br;
    // b * H + h: this block's (batch, query head)
    const int bh = blockIdx.x / tiles;
    // b * Hkv + kv head (GQA)
    const int bhk = (bh / H) * Hkv + (bh % H) / (H / Hkv);
    const int row0 = (blockIdx.x - bh * tiles) * br, r = threadIdx.x,
              i = row0 + r;
    const float* qh = q + (long long)(bh) * nq * d;
    const float* kh = k + (long long)(bhk) * nk * d;
    const float* vh = v + (long long)(bhk) * nk * d;
    // bottom-right causal: i sees j <= i + offset
    const int offset = nk - nq;

    // line 4: load Q_i (coalesced over the tile)
    for (int e = threadIdx.x; e < br * d; e += br) {
        const int rr = e / d, c = e - rr * d;
        q_s[rr * ds + c] =
            row0 + rr < nq ? qh[(long long)(row0 + rr) * d + c] : 0.0f;
    }
    // line 5: O_i = 0, l = 0, m = -inf
    for (int c = 0; c < d; ++c) o_s[r * ds + c] = 0.0f;
    float m = NEG_INF, l = 0.0f;
    // Q_i visible to every thread
    __syncthreads();

    // causal: tiles past the block's last row's last visible key are skipped
    int kend = nk;
    if (causal) kend = min(nk, min(row0 + br, nq) - 1 + offset + 1);
    // line 6: loop over key tiles
    for (int j0 = 0; j0 < kend; j0 += V1_BC) {
        // line 7: load K_j
        for (int e = threadIdx.x; e < V1_BC * d; e += br) {
            const int jj = e / d, c = e - jj * d;
            kv_s[jj * ds + c] =
                j0 + jj < nk ? kh[(long long)(j0 + jj) * d + c] : 0.0f;
        }
        __syncthreads();                             // K_j visible

        // line 8: S_ij, this thread's row
        float s[V1_BC];
        float m_tile = NEG_INF;
#pragma unroll
        for (int jj = 0; jj < V1_BC; ++jj) {
            float acc = 0.0f;
            for (int c = 0; c < d; ++c)
                acc += q_s[r * ds + c] * kv_s[jj * ds + c];
            const int j = j0 + jj;
            const bool visible = j < nk && (!causal || j <= i + offset);
            s[jj] = visible ? acc * scale : NEG_INF;
            m_tile = fmaxf(m_tile, s[jj]);
        }
        // line 9: m^(j); -inf while nothing is visible
        const float m_new = fmaxf(m, m_tile);
        // guard: exp(-inf - -inf) would be NaN
        const bool none = m_new == NEG_INF;
        const float alpha = none ? 1.0f : expf(m - m_new);
        // none: masked -inf -> 0, but a NaN score stays NaN
        const float base = none ? 0.0f : m_new;
        float p_sum = 0.0f;
#pragma unroll
        for (int jj = 0; jj < V1_BC; ++jj) {
            // P~_ij (masked entries: exp(-inf) = 0)
            s[jj] = expf(s[jj] - base);
            p_sum += s[jj];
        }
        l = alpha * l + p_sum;                       // l^(j)
        m = m_new;
        // everyone is done reading K_j
        __syncthreads();

        // load V_j into the same buffer
        for (int e = threadIdx.x; e < V1_BC * d; e += br) {
            const int jj = e / d, c = e - jj * d;
            kv_s[jj * ds + c] =
                j0 + jj < nk ? vh[(long long)(j0 + jj) * d + c] : 0.0f;
        }
        __syncthreads();                             // V_j visible

        // keys jj > jvis are hidden from row i
        const int jvis = causal ? i + offset - j0 : V1_BC;
        // line 10: O_i = diag(alpha) O_i + P~ V_j
        for (int c = 0; c < d; ++c) {
            float acc = o_s[r * ds + c] * alpha;
            // hidden keys skipped: 0 * NaN would be NaN
#pragma unroll
            for (int jj = 0; jj < V1_BC; ++jj)
                acc += jj <= jvis ? s[jj] * kv_s[jj * ds + c] : 0.0f;
            o_s[r * ds + c] = acc;
        }
        // everyone is done reading V_j
        __syncthreads();
    }

    // lines 12-15: O_i / l, LSE = m + log l
    if (i < nq) {
        // saw no key: O = 0, LSE = -inf (NaN l is not empty)
        const bool empty = l == 0.0f;
        const float inv_l = empty ? 0.0f : 1.0f / l;
        float* oh = o + ((long long)(bh) * nq + i) * d;
        for (int c = 0; c < d; ++c) oh[c] = o_s[r * ds + c] * inv_l;
        lse[(long long)(bh) * nq + i] = empty ? NEG_INF : m + logf(l);
    }
}
