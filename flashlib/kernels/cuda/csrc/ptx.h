// ptx.h — one device function per PTX instruction the tensor-core kernels use: mma.sync, ldmatrix and
// cp.async with its commit/wait groups, plus the two packing helpers that build their 16-bit pairs.
//
// On the GPU (nvcc, NVRTC) each wrapper is the instruction itself, as inline PTX. In flashlib's CPU
// emulator (FLASHLIB_EMULATOR, defined by emulator.h, which the emulator build includes first) the same
// names are implemented in emulator.h ("PTX wrappers" section) following the PTX ISA's per-lane fragment
// tables exactly, so a kernel that puts an element in the wrong register or lane computes a wrong result
// on a CPU too; this file then only checks that emulator.h came first.
//
// Fragment layouts (PTX ISA, "Warp-level matrix fragments for mma.m16n8k16 / mma.m16n8k8" and
// "ldmatrix"); groupID g = lane >> 2, threadID_in_group t = lane & 3; the low 16 bits of a 32-bit
// register hold the element with the lower column (A, C) or row (B) index:
//   m16n8k16 (f16, bf16): A 16x16 row-major, 4 regs/lane   B 16x8 (K x N) "col", 2 regs   C, D 16x8 fp32
//     a[0] = {A[g][2t],   A[g][2t+1]},   a[1] = {A[g+8][2t],   A[g+8][2t+1]},
//     a[2] = {A[g][2t+8], A[g][2t+9]},   a[3] = {A[g+8][2t+8], A[g+8][2t+9]}
//     b[0] = {B[2t][g], B[2t+1][g]},     b[1] = {B[2t+8][g], B[2t+9][g]}
//     c[0], c[1] = C[g][2t], C[g][2t+1]; c[2], c[3] = C[g+8][2t], C[g+8][2t+1]
//   m16n8k8 (f16): a[0], a[1] as above (K = 8), b[0] = {B[2t][g], B[2t+1][g]}, C and D as above.
//   ldmatrix m8n8 .x1/.x2/.x4: lanes 8i..8i+7 pass the addresses of rows 0..7 of matrix i (each row 16
//     bytes, 16-byte aligned, in shared memory; .x1 reads lanes 0-7's addresses, .x2 lanes 0-15's).
//     r[i] of lane L = {M_i[L>>2][2(L&3)], M_i[L>>2][2(L&3)+1]};  with .trans the same of M_iᵀ, i.e.
//     {M_i[2(L&3)][L>>2], M_i[2(L&3)+1][L>>2]}.
//   Loading A of m16n8k16 with one ldmatrix_x4: matrices 0..3 = A's quadrants (rows 0-7, cols 0-7),
//     (rows 8-15, cols 0-7), (rows 0-7, cols 8-15), (rows 8-15, cols 8-15): lane L passes
//     &A[(L & 7) + 8 * ((L >> 3) & 1)][8 * (L >> 4)].
//
// Architectures: ldmatrix and mma.m16n8k8 need sm_75; mma.m16n8k16 (f16, bf16) and cp.async need sm_80.
// In device code for an older GPU the sm_80 wrappers are deleted functions, so a kernel for sm_75 that
// uses only m16n8k8 and ldmatrix compiles and one that calls an sm_80 wrapper fails at compile time
// (guard such calls with `#if FLASHLIB_PTX_SM80`, which this file defines: 1 on sm_80+, in the host
// pass and in the emulator, 0 in device code for older GPUs). On sm_75 kernels load tiles with plain loads.
//
// cp.async semantics the kernels rely on (and the emulator enforces): a copy lands only when a
// cp.async.wait_group covering its group runs in the *issuing* thread; other threads may read it only
// after a __syncthreads that follows that wait. __syncthreads itself does not complete copies.
//
// Explained in: notebooks/08_cuda.
// Tested in: tests/kernels/cuda/test_cuda_ptx.py.
#pragma once

#ifdef FLASHLIB_EMULATOR
// The emulator's implementations live in emulator.h (namespace ptx), included before the kernel source.
#ifndef FLASHLIB_EMULATOR_PTX
#error "ptx.h in the emulator needs emulator.h's PTX section (FLASHLIB_EMULATOR_PTX)"
#endif
#define FLASHLIB_PTX_SM80 1            // the sm_80 wrappers exist (the emulator has them all)
#else

#if defined(__CUDACC_RTC__)
typedef unsigned int uint32_t;     // NVRTC has no <stdint.h>
#else
#include <stdint.h>
#endif
#include <cuda_fp16.h>
#include <cuda_bf16.h>

// FLASHLIB_PTX_SM80: 1 where mma.m16n8k16 and cp.async exist (sm_80+, the host pass, the emulator);
// kernels guard their sm_80 paths with `#if FLASHLIB_PTX_SM80` (not `__CUDA_ARCH__ >= 800`, which is
// false in the emulator).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define FLASHLIB_PTX_SM80 0
#define FLASHLIB_PTX_DELETED_BELOW_SM80(decl) decl = delete;
#else
#define FLASHLIB_PTX_SM80 1
#define FLASHLIB_PTX_DELETED_BELOW_SM80(decl)
#endif

namespace ptx {

namespace detail {
__device__ __forceinline__ uint32_t smem_u32(const void* p) {     // a generic pointer as a .shared address
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
}  // namespace detail

// Below sm_80 the sm_80 wrappers are declared deleted: calling one there is a compile error.
FLASHLIB_PTX_DELETED_BELOW_SM80(__device__ void mma_m16n8k16_f16(float (&)[4], const uint32_t (&)[4], const uint32_t (&)[2], const float (&)[4]))
FLASHLIB_PTX_DELETED_BELOW_SM80(__device__ void mma_m16n8k16_bf16(float (&)[4], const uint32_t (&)[4], const uint32_t (&)[2], const float (&)[4]))
FLASHLIB_PTX_DELETED_BELOW_SM80(__device__ void cp_async_16(void*, const void*, int))
FLASHLIB_PTX_DELETED_BELOW_SM80(__device__ void cp_async_commit())

// ---- mma.sync and ldmatrix -----------------------------------------------------------------------
// The instruction strings must be literals, so variants that differ only in a type or qualifier (f16 /
// bf16, plain / .trans) share one macro and paste it in.
#define FLASHLIB_PTX_MMA_M16N8K16(AB)                                                                  \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." AB "." AB ".f32 "                            \
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"               \
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])                                      \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),                   \
                   "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]))
#define FLASHLIB_PTX_LDMATRIX_X2(QUAL)                                                                 \
    asm volatile("ldmatrix.sync.aligned.m8n8.x2" QUAL ".shared.b16 {%0, %1}, [%2];\n"                  \
                 : "=r"(r[0]), "=r"(r[1]) : "r"(detail::smem_u32(row)) : "memory")
#define FLASHLIB_PTX_LDMATRIX_X4(QUAL)                                                                 \
    asm volatile("ldmatrix.sync.aligned.m8n8.x4" QUAL ".shared.b16 {%0, %1, %2, %3}, [%4];\n"          \
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(detail::smem_u32(row)) : "memory")

#if FLASHLIB_PTX_SM80
__device__ __forceinline__ void mma_m16n8k16_f16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                                 const float (&c)[4]) {
    FLASHLIB_PTX_MMA_M16N8K16("f16");
}
__device__ __forceinline__ void mma_m16n8k16_bf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                                  const float (&c)[4]) {
    FLASHLIB_PTX_MMA_M16N8K16("bf16");
}
#endif

__device__ __forceinline__ void mma_m16n8k8_f16(float (&d)[4], const uint32_t (&a)[2], const uint32_t (&b)[1],
                                                const float (&c)[4]) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5}, {%6}, {%7, %8, %9, %10};\n"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(b[0]), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

__device__ __forceinline__ void ldmatrix_x1(uint32_t (&r)[1], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n"
                 : "=r"(r[0]) : "r"(detail::smem_u32(row)) : "memory");
}
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], const void* row) { FLASHLIB_PTX_LDMATRIX_X2(""); }
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) { FLASHLIB_PTX_LDMATRIX_X4(""); }
__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&r)[2], const void* row) { FLASHLIB_PTX_LDMATRIX_X2(".trans"); }
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) { FLASHLIB_PTX_LDMATRIX_X4(".trans"); }

// ---- cp.async ------------------------------------------------------------------------------------
#if FLASHLIB_PTX_SM80
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(detail::smem_u32(smem_dst)), "l"(gmem_src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
}
#else
template <int N> __device__ void cp_async_wait() = delete;
#endif

// ---- packing -------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
    return uint32_t(__half_as_ushort(__float2half_rn(lo))) | (uint32_t(__half_as_ushort(__float2half_rn(hi))) << 16);
}
__device__ __forceinline__ uint32_t pack_bf162(float lo, float hi) {
    return uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(lo))) |
           (uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(hi))) << 16);
}

}  // namespace ptx
#undef FLASHLIB_PTX_DELETED_BELOW_SM80
#undef FLASHLIB_PTX_MMA_M16N8K16
#undef FLASHLIB_PTX_LDMATRIX_X2
#undef FLASHLIB_PTX_LDMATRIX_X4
#endif  // FLASHLIB_EMULATOR
