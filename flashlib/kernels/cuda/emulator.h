// emulator.h — the CUDA execution model on a CPU, header-only C++20, for flashlib's .cu kernels.
//
// What it emulates (just what a teaching kernel needs, checked where CUDA documents a rule):
//   * dim3, threadIdx/blockIdx (thread_local), blockDim/gridDim, warpSize;
//     __global__/__device__/__host__/__forceinline__/__launch_bounds__/__align__ (no-ops or attributes).
//   * Each CUDA thread of a block is a real OS thread (std::thread). Blocks run one after another; the
//     threads of a block run concurrently, so ThreadSanitizer sees every shared-memory race a kernel has.
//   * static __shared__ arrays become function-local statics: one copy, shared by the block's threads
//     (blocks never overlap). Dynamic `extern __shared__ T name[];` becomes a pointer to a per-launch
//     buffer of exactly the launch's byte count (heap-allocated, so AddressSanitizer catches a kernel that
//     runs past it), refilled with 0xFF bytes (a NaN in every float format) before every block, so a
//     kernel that reads shared memory it never wrote sees NaN instead of a friendly zero.
//     (C++ has no storage class for "shared by a block, sized at launch", so the build step rewrites
//     that one declaration form into a pointer on the fly; the .cu file itself is never edited.)
//   * __syncthreads(): a real barrier over the block's live threads (exited threads no longer count, as
//     on the GPU). Every arrival records its source line; threads meeting at *different* barriers
//     (divergent __syncthreads) abort with both lines; a launch in which no barrier completes for
//     FLASHLIB_EMU_TIMEOUT seconds (default 120) aborts, naming the pending barriers, instead of hanging.
//   * Warp collectives (__shfl_sync, __shfl_xor_sync, __shfl_down_sync, __shfl_up_sync, __syncwarp,
//     WMMA): per-warp exchange slots plus a warp barrier. Shuffles need all 32 lanes of a full warp.
//   * nvcuda::wmma m16n16k16 with half/bf16 inputs and float accumulators. Checked preconditions (CUDA C++
//     Programming Guide, "Warp Matrix Functions"): the pointer must be 256-bit (32-byte) aligned; ldm a
//     multiple of 8 for 16-bit elements and of 4 for float (16 bytes); every lane of the warp executes the
//     call (no lane exited or diverged) with the same pointer, ldm and layout. Fragment element layout is
//     unspecified in CUDA, so here each lane holds the whole 16x16 tile; store_matrix_sync checks that all
//     lanes hold the same tile (a kernel that writes lane-dependent values into fragment.x[] is relying on
//     a layout CUDA does not promise).
//   * The PTX wrappers of csrc/ptx.h (namespace ptx): mma.sync m16n8k16 (f16, bf16) and m16n8k8 (f16),
//     ldmatrix m8n8 .x1/.x2/.x4 (.trans), cp.async 16 bytes with commit/wait groups. Unlike WMMA, PTX
//     documents which lane holds which element, so here every lane holds exactly its ISA fragment: a
//     collective gathers all lanes' registers through the warp exchange, rebuilds the matrices with
//     the ISA's per-lane table (emu::mma_a_elem & co., the one place it is written) and returns each
//     lane its own elements (fp32 accumulation). Checked: all 32 lanes execute the call at the same
//     site; ldmatrix rows 16-byte aligned and in shared memory (the dynamic buffer or static storage);
//     cp.async dst in shared memory, src not, both 16-byte aligned, 0 <= src_bytes <= 16 (the rest of
//     the 16 bytes zero-filled). A cp.async lands only when a cp.async.wait_group covering its group
//     runs in the issuing thread: read before that, the destination still holds its old bytes (0xFF
//     fill = NaN, or the previous tile). __syncthreads does not complete copies (as on the GPU); a
//     thread that ends with copies never waited for is reported.
//   * Shared-memory bank conflicts of ldmatrix, counted where FLASHLIB_EMU_COUNTERS names a file: each
//     8x8 matrix an ldmatrix reads is one request of eight 16-byte rows; it takes as many wavefronts as
//     the most distinct 4-byte words any one of the 32 banks (word address mod 32) must serve. 1: no
//     conflict; 8: every row in the same banks. Totals per call site are written at exit (runner.cpp).
//   * __half / __nv_bfloat16 with round-to-nearest-even conversions; the float math and bit-cast
//     intrinsics the kernels use (expf, __expf, exp2f, logf, fmaxf, rsqrtf, __int_as_float, ...).
//
// Violations print "flashlib emulator: ..." on stderr and abort; flashlib runs every launch in a child
// process, so an abort becomes a Python exception carrying that message.
// Explained in: notebooks/08_cuda.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <source_location>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#define FLASHLIB_EMULATOR 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static
#ifndef __restrict__
#define __restrict__ __restrict
#endif

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
    constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
using uint3 = dim3;

inline thread_local dim3 threadIdx;
inline thread_local dim3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;
constexpr int warpSize = 32;

namespace emu {

[[noreturn]] inline void fail(const char* fmt, ...) {
    std::va_list ap;
    va_start(ap, fmt);
    std::fprintf(stderr, "flashlib emulator: ");
    std::vfprintf(stderr, fmt, ap);
    std::fprintf(stderr, "\n");
    va_end(ap);
    std::fflush(stderr);
    std::abort();
}

inline double timeout_seconds() {
    static const double t = [] {
        const char* s = std::getenv("FLASHLIB_EMU_TIMEOUT");
        return s ? std::atof(s) : 120.0;
    }();
    return t;
}

inline std::string where(const std::source_location& l) {
    return std::string(l.file_name()) + ":" + std::to_string(l.line());
}

// Barrier completions and thread exits; a watchdog aborts a launch whose count stops moving.
inline std::atomic<unsigned long> g_progress{0};

// A barrier over a changing set of live threads (a block, or one warp). Collectives record their source
// line so that threads meeting at different call sites are reported, not silently matched. Arrival is
// bookkept under a mutex; waiting spins briefly with sched_yield, then sleeps on the generation counter
// (C++20 atomic wait, a futex), which is much cheaper than waking every waiter through one mutex.
struct Barrier {
    std::mutex m;
    std::atomic<unsigned> gen{0};
    int expected = 0, full = 0, arrived = 0;
    const char* op = nullptr;
    std::source_location site;
    bool pending_needs_full = false;

    void reset(int n) { expected = full = n; arrived = 0; op = nullptr; pending_needs_full = false; }

    void release() {                                  // called with m held
        arrived = 0; op = nullptr; pending_needs_full = false;
        gen.fetch_add(1, std::memory_order_acq_rel);
        gen.notify_all();
        g_progress.fetch_add(1, std::memory_order_relaxed);
    }

    void arrive(const char* what, const std::source_location& loc, bool needs_full, const char* scope) {
        unsigned my_gen;
        {
            std::lock_guard<std::mutex> lk(m);
            if (needs_full && expected != 32)
                fail("%s at %s: all 32 lanes of the warp must execute it, but only %d lanes of warp %u "
                     "are live (a lane returned early or the block has a partial warp)",
                     what, where(loc).c_str(), expected, threadIdx.x / 32);
            if (arrived == 0) {
                op = what; site = loc; pending_needs_full = needs_full;
            } else if (loc.line() != site.line() || std::strcmp(loc.file_name(), site.file_name()) != 0 ||
                       std::strcmp(what, op) != 0) {
                fail("divergent %s: thread (%u,%u,%u) of block (%u,%u,%u) reached %s at %s while others "
                     "wait at %s at %s", scope, threadIdx.x, threadIdx.y, threadIdx.z, blockIdx.x,
                     blockIdx.y, blockIdx.z, what, where(loc).c_str(), op, where(site).c_str());
            }
            my_gen = gen.load(std::memory_order_relaxed);
            if (++arrived == expected) { release(); return; }
        }
        for (int spin = 0; gen.load(std::memory_order_acquire) == my_gen; ++spin) {
            if (spin < 32) std::this_thread::yield();
            else gen.wait(my_gen, std::memory_order_acquire);
        }
    }

    void exit_thread() {
        std::lock_guard<std::mutex> lk(m);
        --expected;
        g_progress.fetch_add(1, std::memory_order_relaxed);
        if (arrived > 0 && pending_needs_full)
            fail("a lane of a warp returned while the other lanes wait in %s at %s: all 32 lanes of the "
                 "warp must execute a warp-collective call", op, where(site).c_str());
        if (arrived > 0 && arrived == expected) release();
    }

    std::string pending() {
        std::lock_guard<std::mutex> lk(m);
        if (arrived == 0) return "";
        return std::to_string(arrived) + " of " + std::to_string(expected) + " threads wait at " + op + " (" +
               where(site) + ")";
    }
};

struct Warp {
    Barrier bar;
    // Exchange slots, double-buffered: collective number n uses set n % 2, so one barrier per
    // collective suffices (a lane can refill set n % 2 only after everyone passed collective n + 1).
    uint64_t slot[2][32];
    const void* ptr[2][32];
    unsigned ldm[2][32];
    int layout[2][32];
    float frag[2][32][12];    // PTX mma: each lane's A and B registers, unpacked to float
    uint16_t row[2][32][8];   // PTX ldmatrix: the 16-byte row each lane's address points at
    uintptr_t row_addr[2][32];  // ... and that address (bank-conflict counting)
};

struct LaunchState {
    dim3 grid, block;
    size_t dyn_bytes = 0;
    unsigned char* dyn = nullptr;
    Barrier block_bar;
    std::vector<Warp> warps;
    int nthreads = 0;
    // control barrier between blocks (all threads, including exited ones)
    std::mutex cm;
    std::condition_variable ccv;
    int c_arrived = 0;
    unsigned long c_gen = 0;
};

inline LaunchState* g_launch = nullptr;
inline thread_local int t_lane = 0;
inline thread_local int t_warp = 0;
inline thread_local int t_linear = 0;
inline thread_local unsigned t_coll = 0;     // warp collectives this thread has executed in this block

void cp_async_thread_exit();   // PTX section below: a thread ends with copies never waited for

inline void* dynamic_smem() {
    if (!g_launch || !g_launch->dyn)
        fail("a kernel uses extern __shared__ memory but was launched with 0 dynamic shared bytes");
    return g_launch->dyn;
}

inline Warp& my_warp() { return g_launch->warps[t_warp]; }

// All threads of the launch meet here between blocks; the last one to arrive runs `between`.
template <class F>
inline void control_barrier(F&& between) {
    LaunchState& L = *g_launch;
    std::unique_lock<std::mutex> lk(L.cm);
    if (++L.c_arrived == L.nthreads) {
        between();
        L.c_arrived = 0;
        ++L.c_gen;
        L.ccv.notify_all();
        return;
    }
    const unsigned long g = L.c_gen;
    L.ccv.wait(lk, [&] { return L.c_gen != g; });
}

template <class T> constexpr char arg_kind() {
    if constexpr (std::is_pointer_v<T>) return 'p';
    else if constexpr (std::is_same_v<T, float>) return 'f';
    else if constexpr (std::is_integral_v<T> && sizeof(T) == 4) return 'i';
    else if constexpr (std::is_integral_v<T> && sizeof(T) == 8) return 'l';
    else return '?';
}

// Launch `kernel` on grid x block threads. `args` follows cuLaunchKernel's kernelParams convention:
// args[i] points at the value of the i-th parameter.
template <class... A>
inline void launch(void (*kernel)(A...), dim3 grid, dim3 block, size_t dyn_bytes, void** args) {
    const long n = long(block.x) * block.y * block.z;
    if (n < 1 || n > 1024) fail("block of %ld threads: CUDA allows 1 to 1024", n);
    if (grid.x < 1 || grid.y < 1 || grid.z < 1 || grid.x > 2147483647u || grid.y > 65535 || grid.z > 65535)
        fail("grid (%u,%u,%u) outside CUDA's limits", grid.x, grid.y, grid.z);
    if (dyn_bytes > 227 * 1024) fail("%zu bytes of dynamic shared memory: no GPU offers more than 227 KB", dyn_bytes);
    LaunchState L;
    L.grid = grid; L.block = block; L.dyn_bytes = dyn_bytes; L.nthreads = int(n);
    if (dyn_bytes) {
        void* p = nullptr;
        if (posix_memalign(&p, 256, dyn_bytes) != 0) fail("out of memory for shared memory");
        L.dyn = static_cast<unsigned char*>(p);
    }
    const int nwarps = int((n + 31) / 32);
    L.warps = std::vector<Warp>(nwarps);
    auto prepare_block = [&L, n, nwarps] {
        if (L.dyn) std::memset(L.dyn, 0xFF, L.dyn_bytes);
        L.block_bar.reset(int(n));
        for (int w = 0; w < nwarps; ++w) L.warps[w].bar.reset(int(std::min<long>(32, n - 32L * w)));
    };
    prepare_block();
    blockDim = block; gridDim = grid;
    g_launch = &L;
    // Each parameter is copied out of args once; every thread calls the kernel with these values.
    auto build = [args]<std::size_t... I>(std::index_sequence<I...>) {
        return std::tuple<A...>{*static_cast<A*>(args[I])...};
    };
    const std::tuple<A...> values = build(std::index_sequence_for<A...>{});
    const unsigned long nblocks = (unsigned long)grid.x * grid.y * grid.z;
    std::vector<std::thread> threads;
    threads.reserve(n);
    for (int t = 0; t < n; ++t) {
        threads.emplace_back([&, t] {
            t_linear = t; t_warp = t / 32; t_lane = t % 32;
            threadIdx = dim3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
            for (unsigned long b = 0; b < nblocks; ++b) {
                blockIdx = dim3(b % grid.x, (b / grid.x) % grid.y, b / ((unsigned long)grid.x * grid.y));
                t_coll = 0;
                std::apply(kernel, values);
                cp_async_thread_exit();
                L.block_bar.exit_thread();
                L.warps[t_warp].bar.exit_thread();
                control_barrier([&] { if (b + 1 < nblocks) prepare_block(); });
            }
        });
    }
    std::atomic<bool> done{false};
    std::thread watchdog([&] {
        unsigned long last = g_progress.load();
        auto since = std::chrono::steady_clock::now();
        while (!done.load()) {
            std::this_thread::sleep_for(std::chrono::milliseconds(100));
            const unsigned long now = g_progress.load();
            if (now != last) { last = now; since = std::chrono::steady_clock::now(); continue; }
            const double idle = std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
            if (idle > timeout_seconds()) {
                std::string what = L.block_bar.pending();
                for (size_t w = 0; w < L.warps.size(); ++w) {
                    std::string p = L.warps[w].bar.pending();
                    if (!p.empty()) what += (what.empty() ? "" : "; ") + ("warp " + std::to_string(w) + ": " + p);
                }
                fail("deadlock: no thread made progress for %.0f s (%s)", idle,
                     what.empty() ? "threads are stuck outside any barrier" : what.c_str());
            }
        }
    });
    for (auto& th : threads) th.join();
    done.store(true);
    watchdog.join();
    g_launch = nullptr;
    std::free(L.dyn);
}

template <class T> inline uint64_t to_bits(T v) {
    static_assert(sizeof(T) <= 8, "shuffle of a type wider than 8 bytes");
    uint64_t b = 0; std::memcpy(&b, &v, sizeof(T)); return b;
}
template <class T> inline T from_bits(uint64_t b) { T v; std::memcpy(&v, &b, sizeof(T)); return v; }

template <class T, class SrcFn>
inline T shuffle(const char* what, unsigned mask, T v, SrcFn src_of, const std::source_location& loc) {
    if (mask != 0xffffffffu)
        fail("%s at %s: mask 0x%08x — the emulator supports full-warp shuffles (mask 0xffffffff) only",
             what, where(loc).c_str(), mask);
    Warp& W = my_warp();
    const unsigned set = t_coll++ & 1u;
    W.slot[set][t_lane] = to_bits(v);
    W.bar.arrive(what, loc, true, "warp");
    return from_bits<T>(W.slot[set][src_of(t_lane)]);
}

}  // namespace emu

inline void __syncthreads(std::source_location loc = std::source_location::current()) {
    emu::g_launch->block_bar.arrive("__syncthreads()", loc, false, "block");
}
inline void __syncwarp(unsigned mask = 0xffffffffu, std::source_location loc = std::source_location::current()) {
    (void)mask;
    emu::my_warp().bar.arrive("__syncwarp()", loc, false, "warp");
}
template <class T>
inline T __shfl_sync(unsigned mask, T v, int src, int width = 32,
                     std::source_location loc = std::source_location::current()) {
    return emu::shuffle("__shfl_sync", mask, v, [&](int lane) { return (lane & ~(width - 1)) + (src & (width - 1)); }, loc);
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32,
                         std::source_location loc = std::source_location::current()) {
    return emu::shuffle("__shfl_xor_sync", mask, v, [&](int lane) {
        int s = lane ^ lane_mask;
        return ((s & ~(width - 1)) == (lane & ~(width - 1))) ? s : lane; }, loc);
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32,
                          std::source_location loc = std::source_location::current()) {
    return emu::shuffle("__shfl_down_sync", mask, v, [&](int lane) {
        int s = lane + int(delta);
        return (s & ~(width - 1)) == (lane & ~(width - 1)) ? s : lane; }, loc);
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32,
                        std::source_location loc = std::source_location::current()) {
    return emu::shuffle("__shfl_up_sync", mask, v, [&](int lane) {
        int s = lane - int(delta);
        return (s >= 0 && (s & ~(width - 1)) == (lane & ~(width - 1))) ? s : lane; }, loc);
}

// ---- math and bit-cast intrinsics ------------------------------------------------------------------
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline float __uint_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned i; std::memcpy(&i, &f, 4); return i; }
template <class T> inline T __ldg(const T* p) { return *p; }
[[noreturn]] inline void __trap() { emu::fail("__trap() called by thread %u of block %u", threadIdx.x, blockIdx.x); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }

// ---- 16-bit floating-point types -------------------------------------------------------------------
namespace emu {
inline uint16_t float_to_half_bits(float f) {
    uint32_t x; std::memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u, e = (x >> 23) & 0xffu;
    uint32_t m = x & 0x7fffffu;
    if (e == 0xff) return uint16_t(sign | 0x7c00u | (m ? 0x200u : 0u));
    const int exp = int(e) - 127 + 15;
    if (exp >= 31) return uint16_t(sign | 0x7c00u);
    if (exp <= 0) {                                   // subnormal half (or zero)
        if (exp < -10) return uint16_t(sign);
        m |= 0x800000u;
        const int shift = 14 - exp;
        uint32_t hm = m >> shift;
        const uint32_t rem = m & ((1u << shift) - 1), halfway = 1u << (shift - 1);
        if (rem > halfway || (rem == halfway && (hm & 1u))) ++hm;
        return uint16_t(sign | hm);
    }
    uint32_t out = sign | (uint32_t(exp) << 10) | (m >> 13);
    const uint32_t rem = m & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (out & 1u))) ++out;   // carries into the exponent: correct
    return uint16_t(out);
}
inline float half_bits_to_float(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu, x;
    if (e == 0x1f) x = sign | 0x7f800000u | (m << 13);
    else if (e == 0) {
        if (m == 0) x = sign;
        else {                                         // normalise the subnormal
            int shift = 0;
            while (!(m & 0x400u)) { m <<= 1; ++shift; }
            m &= 0x3ffu;
            x = sign | (uint32_t(127 - 15 + 1 - shift) << 23) | (m << 13);
        }
    } else x = sign | ((e + 127 - 15) << 23) | (m << 13);
    float f; std::memcpy(&f, &x, 4); return f;
}
inline uint16_t float_to_bf16_bits(float f) {
    uint32_t x; std::memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t((x >> 16) | 0x40u);   // quiet NaN
    x += 0x7fffu + ((x >> 16) & 1u);
    return uint16_t(x >> 16);
}
inline float bf16_bits_to_float(uint16_t b) { uint32_t x = uint32_t(b) << 16; float f; std::memcpy(&f, &x, 4); return f; }
}  // namespace emu

struct __half {
    uint16_t __x;
    __half() = default;
    __half(float f) : __x(emu::float_to_half_bits(f)) {}
    operator float() const { return emu::half_bits_to_float(__x); }
};
using half = __half;
struct __nv_bfloat16 {
    uint16_t __x;
    __nv_bfloat16() = default;
    __nv_bfloat16(float f) : __x(emu::float_to_bf16_bits(f)) {}
    operator float() const { return emu::bf16_bits_to_float(__x); }
};
using nv_bfloat16 = __nv_bfloat16;
inline __half __float2half(float f) { return __half(f); }
inline __half __float2half_rn(float f) { return __half(f); }
inline float __half2float(__half h) { return float(h); }
inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline float __bfloat162float(__nv_bfloat16 b) { return float(b); }

// ---- WMMA ------------------------------------------------------------------------------------------
namespace nvcuda {
namespace wmma {
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <class Use, int M, int N, int K, class T, class Layout = void>
struct fragment {
    static_assert(M == 16 && N == 16 && K == 16, "the emulator implements the m16n16k16 WMMA shape only");
    static constexpr int num_rows = std::is_same_v<Use, matrix_b> ? K : M;
    static constexpr int num_cols = std::is_same_v<Use, matrix_a> ? K : N;
    // CUDA spreads a fragment over the warp's lanes in an unspecified layout; here every lane holds the
    // whole tile, row-major. num_elements therefore differs from CUDA's per-lane count.
    static constexpr int num_elements = num_rows * num_cols;
    using element_type = T;
    T x[num_elements];
};

namespace detail {
template <class T> constexpr unsigned ldm_multiple() { return sizeof(T) == 2 ? 8u : 4u; }

// The collective checks shared by load/store: full warp, same pointer/ldm/layout on every lane,
// 256-bit alignment, ldm multiple of 16 bytes.
template <class T>
inline void check_collective(const char* what, const void* p, unsigned ldm, int layout, unsigned min_ldm,
                             const std::source_location& loc) {
    using emu::fail;
    if (reinterpret_cast<uintptr_t>(p) % 32 != 0)
        fail("%s at %s: pointer %p is not 256-bit (32-byte) aligned, as WMMA requires (thread %u, "
             "block %u)", what, emu::where(loc).c_str(), p, threadIdx.x, blockIdx.x);
    if (ldm % ldm_multiple<T>() != 0)
        fail("%s at %s: ldm = %u is not a multiple of %u (%zu-byte elements need a 16-byte stride)",
             what, emu::where(loc).c_str(), ldm, ldm_multiple<T>(), sizeof(T));
    if (ldm < min_ldm)
        fail("%s at %s: ldm = %u is smaller than the tile's %u elements per row/column", what,
             emu::where(loc).c_str(), ldm, min_ldm);
    emu::Warp& W = emu::my_warp();
    const int lane = emu::t_lane;
    const unsigned set = emu::t_coll++ & 1u;
    W.ptr[set][lane] = p; W.ldm[set][lane] = ldm; W.layout[set][lane] = layout;
    W.bar.arrive(what, loc, true, "warp");
    if (W.ptr[set][0] != p || W.ldm[set][0] != ldm || W.layout[set][0] != layout)
        fail("%s at %s: lane %d passed (ptr %p, ldm %u, layout %d) but lane 0 passed (ptr %p, ldm %u, "
             "layout %d); every lane must pass the same values", what, emu::where(loc).c_str(), lane, p,
             ldm, layout, W.ptr[set][0], W.ldm[set][0], W.layout[set][0]);
}
template <class Layout> constexpr int layout_code() { return std::is_same_v<Layout, col_major> ? 1 : 0; }
}  // namespace detail

template <class Use, int M, int N, int K, class T, class L, class V>
inline void fill_fragment(fragment<Use, M, N, K, T, L>& f, const V& v) {
    for (auto& e : f.x) e = T(v);
}

template <class Use, int M, int N, int K, class T, class L>
inline void load_matrix_sync(fragment<Use, M, N, K, T, L>& f, const T* p, unsigned ldm,
                             std::source_location loc = std::source_location::current()) {
    static_assert(!std::is_same_v<Use, accumulator>, "load_matrix_sync of an accumulator needs a layout_t");
    using F = fragment<Use, M, N, K, T, L>;
    constexpr bool col = std::is_same_v<L, col_major>;
    detail::check_collective<T>("wmma::load_matrix_sync", p, ldm, detail::layout_code<L>(),
                                col ? F::num_rows : F::num_cols, loc);
    for (int r = 0; r < F::num_rows; ++r)
        for (int c = 0; c < F::num_cols; ++c)
            f.x[r * F::num_cols + c] = col ? p[c * ldm + r] : p[r * ldm + c];
}

template <int M, int N, int K, class T>
inline void load_matrix_sync(fragment<accumulator, M, N, K, T, void>& f, const T* p, unsigned ldm, layout_t layout,
                             std::source_location loc = std::source_location::current()) {
    const bool col = layout == mem_col_major;
    detail::check_collective<T>("wmma::load_matrix_sync", p, ldm, int(layout), 16, loc);
    for (int r = 0; r < M; ++r)
        for (int c = 0; c < N; ++c) f.x[r * N + c] = col ? p[c * ldm + r] : p[r * ldm + c];
}

// Lane 0 writes the tile (each lane holds all of it); no barrier after the write, so a kernel that lets
// other lanes read the tile without __syncwarp() is still reported by ThreadSanitizer.
template <int M, int N, int K, class T>
inline void store_matrix_sync(T* p, const fragment<accumulator, M, N, K, T, void>& f, unsigned ldm, layout_t layout,
                              std::source_location loc = std::source_location::current()) {
    emu::Warp& W = emu::my_warp();
    detail::check_collective<T>("wmma::store_matrix_sync", p, ldm, int(layout), 16, loc);
    const unsigned set = emu::t_coll++ & 1u;
    W.ptr[set][emu::t_lane] = f.x;
    W.bar.arrive("wmma::store_matrix_sync", loc, true, "warp");
    if (emu::t_lane == 0) {
        for (int l = 1; l < 32; ++l)
            if (std::memcmp(W.ptr[set][l], f.x, sizeof(f.x)) != 0)
                emu::fail("wmma::store_matrix_sync at %s: lane %d holds a different tile than lane 0 — "
                          "the kernel wrote lane-dependent values into fragment.x[], whose layout CUDA "
                          "leaves unspecified", emu::where(loc).c_str(), l);
    }
    W.bar.arrive("wmma::store_matrix_sync", loc, true, "warp");   // lane 0 is done reading fragments
    if (emu::t_lane == 0) {
        const bool col = layout == mem_col_major;
        for (int r = 0; r < M; ++r)
            for (int c = 0; c < N; ++c) (col ? p[c * ldm + r] : p[r * ldm + c]) = f.x[r * N + c];
    }
}

template <int M, int N, int K, class TA, class LA, class LB, class TC>
inline void mma_sync(fragment<accumulator, M, N, K, TC, void>& d, const fragment<matrix_a, M, N, K, TA, LA>& a,
                     const fragment<matrix_b, M, N, K, TA, LB>& b, const fragment<accumulator, M, N, K, TC, void>& c,
                     std::source_location loc = std::source_location::current()) {
    static_assert(std::is_same_v<TC, float>, "the emulator implements float accumulators only");
    emu::my_warp().bar.arrive("wmma::mma_sync", loc, true, "warp");
    float out[M * N];
    for (int i = 0; i < M; ++i)
        for (int j = 0; j < N; ++j) {
            float acc = float(c.x[i * N + j]);
            for (int k = 0; k < K; ++k) acc += float(a.x[i * K + k]) * float(b.x[k * N + j]);
            out[i * N + j] = acc;
        }
    for (int i = 0; i < M * N; ++i) d.x[i] = out[i];
}
}  // namespace wmma
}  // namespace nvcuda

// ---- PTX wrappers (csrc/ptx.h): mma.sync, ldmatrix, cp.async --------------------------------------
// The GPU side of these names is inline PTX in csrc/ptx.h; here each follows the PTX ISA's per-lane
// fragment tables ("Matrix Fragments for mma.m16n8k16 / mma.m16n8k8", "ldmatrix"), written once below as
// "which element of the matrix does register `reg`, half `h` of lane `lane` hold". A collective call
// gathers every lane's registers through the warp exchange, rebuilds the matrices from that table and
// hands each lane exactly its own fragment, so a kernel with a wrong lane mapping computes a wrong result.
#define FLASHLIB_EMULATOR_PTX 1
extern "C" char __data_start[] __attribute__((weak)), _end[] __attribute__((weak));   // GNU ld's symbols
namespace emu {
struct RC { int r, c; };
// groupID g = lane >> 2, threadID_in_group t = lane & 3; half h = 0 is the low 16 bits of the register.
inline RC mma_a_elem(int lane, int reg, int h) {          // A (16 x K), row-major; K = 16: regs 0-3, K = 8: 0-1
    return {(lane >> 2) + 8 * (reg & 1), 2 * (lane & 3) + h + 8 * (reg >> 1)};
}
inline RC mma_b_elem(int lane, int reg, int h) {          // B (K x 8), "col": {k, n}
    return {2 * (lane & 3) + h + 8 * reg, lane >> 2};
}
inline RC mma_c_elem(int lane, int i) {                   // C, D (16 x 8) fp32: c[0..3]
    return {(lane >> 2) + 8 * (i >> 1), 2 * (lane & 3) + (i & 1)};
}
inline RC ldmatrix_elem(int lane, int h) {                // matrix i's element in r[i] (no .trans): {row, col}
    return {lane >> 2, 2 * (lane & 3) + h};
}

// Where shared memory lives in the emulator: the launch's dynamic buffer, or static storage (a
// `__shared__` array is a function-local static). Global buffers (heap) and locals (stack) are neither.
inline bool is_shared(const void* p, size_t n) {
    const auto a = reinterpret_cast<uintptr_t>(p);
    const auto in = [&](const void* lo, size_t len) {
        const auto l = reinterpret_cast<uintptr_t>(lo);
        return lo != nullptr && a >= l && a + n <= l + len;
    };
    if (g_launch && g_launch->dyn && in(g_launch->dyn, g_launch->dyn_bytes)) return true;
    if (__data_start == nullptr || _end == nullptr) return true;          // unknown layout: cannot tell
    return in(__data_start, size_t(_end - __data_start));
}

template <int KA, int KB>   // KA registers of A (4: m16n8k16, 2: m16n8k8), KB of B
inline void mma(const char* what, float (&d)[4], const uint32_t* a, const uint32_t* b, const float (&c)[4],
                float (*to_float)(uint16_t), const std::source_location& loc) {
    constexpr int K = 4 * KA;
    Warp& W = my_warp();
    const int lane = t_lane;
    const unsigned set = t_coll++ & 1u;
    float* mine = W.frag[set][lane];
    for (int r = 0; r < KA; ++r)
        for (int h = 0; h < 2; ++h) mine[2 * r + h] = to_float(uint16_t(a[r] >> (16 * h)));
    for (int r = 0; r < KB; ++r)
        for (int h = 0; h < 2; ++h) mine[2 * KA + 2 * r + h] = to_float(uint16_t(b[r] >> (16 * h)));
    W.bar.arrive(what, loc, true, "warp");
    float A[16][K], B[K][8];                 // rebuilt from all 32 lanes' registers by the ISA table
    for (int l = 0; l < 32; ++l)
        for (int h = 0; h < 2; ++h) {
            for (int r = 0; r < KA; ++r) { const RC e = mma_a_elem(l, r, h); A[e.r][e.c] = W.frag[set][l][2 * r + h]; }
            for (int r = 0; r < KB; ++r) { const RC e = mma_b_elem(l, r, h); B[e.r][e.c] = W.frag[set][l][2 * KA + 2 * r + h]; }
        }
    float out[4];
    for (int i = 0; i < 4; ++i) {            // fp32 accumulation (each 16-bit product is exact in fp32)
        const RC e = mma_c_elem(lane, i);
        float acc = c[i];
        for (int k = 0; k < K; ++k) acc += A[e.r][k] * B[k][e.c];
        out[i] = acc;
    }
    for (int i = 0; i < 4; ++i) d[i] = out[i];    // d may alias c
}

// Bank-conflict counters (FLASHLIB_EMU_COUNTERS): per (instruction, call site), requests and wavefronts.
struct SmemCount { unsigned long requests = 0, wavefronts = 0; };
inline std::mutex g_count_m;
inline std::map<std::pair<std::string, std::string>, SmemCount> g_counts;
inline bool counting() {
    static const bool on = std::getenv("FLASHLIB_EMU_COUNTERS") != nullptr;
    return on;
}

// Wavefronts one request of eight 16-byte rows (one ldmatrix matrix) needs: the most distinct 4-byte
// words that fall in any one of the 32 banks (CUDA C++ Programming Guide, "Shared Memory": successive
// 32-bit words go to successive banks; distinct words in one bank are served one after another).
inline int wavefronts_of_rows(const uintptr_t* rows) {
    uintptr_t words[32];
    int n = 0;
    for (int l = 0; l < 8; ++l)
        for (int j = 0; j < 4; ++j) {
            const uintptr_t w = rows[l] / 4 + j;
            if (std::find(words, words + n, w) == words + n) words[n++] = w;
        }
    int per_bank[32] = {}, most = 0;
    for (int i = 0; i < n; ++i) most = std::max(most, ++per_bank[words[i] % 32]);
    return most;
}

inline void write_counts() {
    const char* path = std::getenv("FLASHLIB_EMU_COUNTERS");
    if (path == nullptr) return;
    std::FILE* f = std::fopen(path, "w");
    if (f == nullptr) fail("could not write the counters to %s", path);
    for (const auto& [key, c] : g_counts)
        std::fprintf(f, "%s\t%s\t%lu\t%lu\n", key.first.c_str(), key.second.c_str(), c.requests, c.wavefronts);
    std::fclose(f);
}

template <int X, bool TRANS>
inline void ldmatrix(const char* what, uint32_t* r, const void* row, const std::source_location& loc) {
    Warp& W = my_warp();
    const int lane = t_lane;
    if (lane < 8 * X) {                      // .x1 reads lanes 0-7's addresses, .x2 0-15's, .x4 all
        if (reinterpret_cast<uintptr_t>(row) % 16 != 0)
            fail("%s at %s: lane %d's row address %p is not 16-byte aligned, as ldmatrix requires (thread "
                 "%u, block %u)", what, where(loc).c_str(), lane, row, threadIdx.x, blockIdx.x);
        if (!is_shared(row, 16))
            fail("%s at %s: lane %d's row address %p is not in shared memory (ldmatrix reads .shared only; "
                 "thread %u, block %u)", what, where(loc).c_str(), lane, row, threadIdx.x, blockIdx.x);
    }
    // Each lane reads the row it points at before the warp meets, so that no lane touches shared
    // memory after the collective returns (as on the GPU, where the warp's loads are done by then).
    const unsigned set = t_coll++ & 1u;
    if (lane < 8 * X) {
        std::memcpy(W.row[set][lane], row, 16);
        W.row_addr[set][lane] = reinterpret_cast<uintptr_t>(row);
    }
    W.bar.arrive(what, loc, true, "warp");
    if (lane == 0 && counting()) {
        unsigned long waves = 0;
        for (int i = 0; i < X; ++i) waves += wavefronts_of_rows(&W.row_addr[set][8 * i]);
        std::lock_guard<std::mutex> g(g_count_m);
        SmemCount& c = g_counts[{what, where(loc)}];
        c.requests += X;
        c.wavefronts += waves;
    }
    for (int i = 0; i < X; ++i) {
        uint32_t v = 0;
        for (int h = 0; h < 2; ++h) {
            RC e = ldmatrix_elem(lane, h);
            if (TRANS) std::swap(e.r, e.c);  // .trans: the same position of the transposed matrix
            v |= uint32_t(W.row[set][8 * i + e.r][e.c]) << (16 * h);   // row e.r of matrix i
        }
        r[i] = v;
    }
}

// cp.async: a copy is captured at issue and lands in shared memory only when a cp.async.wait_group
// covering its group runs in the issuing thread (wait_group N completes all committed groups but the N
// newest; copies not yet committed are not waited for, as in PTX). Until then the destination keeps its
// old bytes: the 0xFF fill (NaN) or the previous tile. __syncthreads does not complete copies (a
// pipeline keeps the next tile in flight across it); a thread that ends with copies never waited for is
// reported, because their data never reached shared memory.
struct AsyncCopy {
    unsigned char* dst;
    unsigned char data[16];
    std::source_location loc;
};
inline thread_local std::vector<AsyncCopy> t_cp_open;                  // issued, not committed
inline thread_local std::vector<std::vector<AsyncCopy>> t_cp_groups;   // committed, oldest first

inline void cp_async(void* dst, const void* src, int src_bytes, const std::source_location& loc) {
    if (src_bytes < 0 || src_bytes > 16)
        fail("cp.async at %s: src_bytes = %d, but it must be 0..16 (thread %u, block %u)", where(loc).c_str(),
             src_bytes, threadIdx.x, blockIdx.x);
    if (reinterpret_cast<uintptr_t>(dst) % 16 != 0 || reinterpret_cast<uintptr_t>(src) % 16 != 0)
        fail("cp.async at %s: dst %p and src %p must both be 16-byte aligned for a 16-byte copy (thread %u, "
             "block %u)", where(loc).c_str(), dst, src, threadIdx.x, blockIdx.x);
    if (!is_shared(dst, 16))
        fail("cp.async at %s: dst %p..+16 is not in shared memory (outside the launch's shared buffer?) "
             "(thread %u, block %u)", where(loc).c_str(), dst, threadIdx.x, blockIdx.x);
    if (src_bytes > 0 && is_shared(src, size_t(src_bytes)))
        fail("cp.async at %s: src %p is in shared memory; cp.async.shared.global copies from global memory "
             "(thread %u, block %u)", where(loc).c_str(), src, threadIdx.x, blockIdx.x);
    AsyncCopy c{static_cast<unsigned char*>(dst), {}, loc};
    if (src_bytes > 0) std::memcpy(c.data, src, size_t(src_bytes));   // the rest stays zero: zero-fill
    t_cp_open.push_back(c);
}
inline void cp_async_commit() {
    t_cp_groups.push_back(std::move(t_cp_open));
    t_cp_open.clear();
}
inline void cp_async_wait(int n) {
    while (int(t_cp_groups.size()) > n) {
        for (const AsyncCopy& c : t_cp_groups.front()) std::memcpy(c.dst, c.data, 16);
        t_cp_groups.erase(t_cp_groups.begin());
    }
}
inline void cp_async_thread_exit() {
    size_t n = t_cp_open.size();
    const AsyncCopy* first = t_cp_open.empty() ? nullptr : &t_cp_open.front();
    for (const auto& g : t_cp_groups) {
        n += g.size();
        if (!first && !g.empty()) first = &g.front();
    }
    if (n > 0)
        fail("thread (%u,%u,%u) of block (%u,%u,%u) ended with %zu cp.async copies (the first issued at %s) "
             "that no cp.async.wait_group completed: their data never landed in shared memory (a missing "
             "cp_async_wait<0>(), or a commit after the last wait)", threadIdx.x, threadIdx.y, threadIdx.z,
             blockIdx.x, blockIdx.y, blockIdx.z, n, where(first->loc).c_str());
    t_cp_open.clear();
    t_cp_groups.clear();
}
}  // namespace emu

namespace ptx {
using SL = std::source_location;
inline void mma_m16n8k16_f16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], const float (&c)[4],
                             SL loc = SL::current()) {
    emu::mma<4, 2>("mma.sync.m16n8k16.f16", d, a, b, c, emu::half_bits_to_float, loc);
}
inline void mma_m16n8k16_bf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], const float (&c)[4],
                              SL loc = SL::current()) {
    emu::mma<4, 2>("mma.sync.m16n8k16.bf16", d, a, b, c, emu::bf16_bits_to_float, loc);
}
inline void mma_m16n8k8_f16(float (&d)[4], const uint32_t (&a)[2], const uint32_t (&b)[1], const float (&c)[4],
                            SL loc = SL::current()) {
    emu::mma<2, 1>("mma.sync.m16n8k8.f16", d, a, b, c, emu::half_bits_to_float, loc);
}
inline void ldmatrix_x1(uint32_t (&r)[1], const void* row, SL loc = SL::current()) {
    emu::ldmatrix<1, false>("ldmatrix.x1", r, row, loc);
}
inline void ldmatrix_x2(uint32_t (&r)[2], const void* row, SL loc = SL::current()) {
    emu::ldmatrix<2, false>("ldmatrix.x2", r, row, loc);
}
inline void ldmatrix_x4(uint32_t (&r)[4], const void* row, SL loc = SL::current()) {
    emu::ldmatrix<4, false>("ldmatrix.x4", r, row, loc);
}
inline void ldmatrix_x2_trans(uint32_t (&r)[2], const void* row, SL loc = SL::current()) {
    emu::ldmatrix<2, true>("ldmatrix.x2.trans", r, row, loc);
}
inline void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row, SL loc = SL::current()) {
    emu::ldmatrix<4, true>("ldmatrix.x4.trans", r, row, loc);
}
inline void cp_async_16(void* smem_dst, const void* gmem_src, int src_bytes, SL loc = SL::current()) {
    emu::cp_async(smem_dst, gmem_src, src_bytes, loc);
}
inline void cp_async_commit() { emu::cp_async_commit(); }
template <int N> inline void cp_async_wait() {
    static_assert(N >= 0, "cp.async.wait_group takes a non-negative group count");
    emu::cp_async_wait(N);
}
inline uint32_t pack_half2(float lo, float hi) {
    return uint32_t(emu::float_to_half_bits(lo)) | (uint32_t(emu::float_to_half_bits(hi)) << 16);
}
inline uint32_t pack_bf162(float lo, float hi) {
    return uint32_t(emu::float_to_bf16_bits(lo)) | (uint32_t(emu::float_to_bf16_bits(hi)) << 16);
}
}  // namespace ptx

// ---- the child-process runner's registry -----------------------------------------------------------
namespace emu {
struct KernelEntry {
    std::string signature;   // one char per parameter: p pointer, i int32, l int64, f float
    std::function<void(dim3, dim3, size_t, void**)> run;
};
inline std::map<std::string, KernelEntry>& registry() { static std::map<std::string, KernelEntry> r; return r; }
template <class... A>
struct Register {
    Register(const char* name, void (*k)(A...)) {
        registry()[name] = KernelEntry{std::string{arg_kind<A>()...},
                                       [k](dim3 g, dim3 b, size_t s, void** a) { launch(k, g, b, s, a); }};
    }
};
}  // namespace emu
#define FLASHLIB_EMU_KERNEL(name) static ::emu::Register flashlib_emu_register_##name(#name, &name);
