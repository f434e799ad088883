"""What flashlib's tensor-core kernels do, counted in the CPU emulator rather than argued.

1. Causal tiles are skipped, not visited and masked. A kernel that ran every (warp, tile) pair and masked
   the invisible scores would pass every correctness test; here the emulator counts the ``ldmatrix``
   requests of each launch (one per 8x8 matrix, ``run_emulated(counters=...)``): a warp reads fragments
   only for the tiles it computes, so the count is (pairs computed) x (requests per pair). The pairs are
   predicted from the causal rule alone (a 16-row warp needs a tile iff its last row sees the tile's first
   key), for v3's forward and the backward's dK/dV and dQ kernels, with Nq = Nk and Nq != Nk both ways
   (bottom-right). The per-pair cost is measured on the non-causal run, where every pair is computed.
   The block-level skip (the K/V tiles a block never loads) is counted in a copy of the kernel with one
   tally line in its tile loop.
2. Chapter 8's memory-traffic table (:func:`flashlib.kernels.cuda.fragments.smem_traffic`) against the
   kernels: v3's bytes are its ``ldmatrix`` requests x 128 (the emulator's counters); v2's are counted in
   a copy of v2 whose shared-memory arrays and WMMA loads/stores tally every byte they move. Per key tile:
   the difference between Nk = 2 and 3 tiles, so the once-per-block work drops out.
"""
from __future__ import annotations

import re

import pytest
from conftest import require_tool

import flashlib.kernels.cuda as fc
from flashlib.kernels.cuda import build, fragments, launch

torch = pytest.importorskip("torch")

V2 = (build.CSRC / fc.SOURCES["v2"]).read_text()
V3 = (build.CSRC / fc.SOURCES["v3"]).read_text()
BWD = (build.CSRC / fc.SOURCES["bwd"]).read_text()
REQUEST_BYTES = 8 * 16                      # one ldmatrix request: an 8x8 matrix of 16-bit elements

# Prepended to a kernel's source: tally::add(name, bytes) sums under a name (every emulated thread may
# call it), and the sums are written to $FLASHLIB_TEST_TALLY when the emulator exits. Tap<T> is a
# shared-memory array whose element reads and writes are tallied; load/store wrap WMMA's, tallied once
# per warp (lane 0) under the array's name.
TALLY = r"""
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
namespace tally {
inline std::mutex m;
inline std::map<std::string, long> sums;
inline void add(const std::string& name, long n) { std::lock_guard<std::mutex> g(m); sums[name] += n; }
struct Dump {
    ~Dump() {
        const char* path = std::getenv("FLASHLIB_TEST_TALLY");
        if (std::FILE* f = path ? std::fopen(path, "w") : nullptr) {
            for (const auto& [k, v] : sums) std::fprintf(f, "%s\t%ld\n", k.c_str(), v);
            std::fclose(f);
        }
    }
} dump;
template <class T> struct Tap {
    T* p;
    const char* name;
    struct Ref {
        T* e;
        const char* name;
        operator T() const { add(name, sizeof(T)); return *e; }
        Ref& operator=(T x) { add(name, sizeof(T)); *e = x; return *this; }
        Ref& operator*=(T x) { add(name, 2 * sizeof(T)); *e = *e * x; return *this; }
    };
    Ref operator[](int i) const { return {p + i, name}; }
    T* operator+(int i) const { return p + i; }
};
template <class F, class P, class... R> void load(const char* name, F& f, P* p, R... r) {
    if (threadIdx.x % 32 == 0) add(name, 256 * sizeof(P));
    nvcuda::wmma::load_matrix_sync(f, p, r...);
}
template <class P, class F, class... R> void store(const char* name, P* p, const F& f, R... r) {
    if (threadIdx.x % 32 == 0) add(name, 256 * sizeof(P));
    nvcuda::wmma::store_matrix_sync(p, f, r...);
}
}  // namespace tally
"""


@pytest.fixture(autouse=True)
def _gxx():
    require_tool("g++")                      # the emulator is built with g++


def instrumented(name, text, *edits):
    """``(name, TALLY + text)`` with each ``(old, new)`` of ``edits`` made exactly once."""
    for old, new in edits:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return name, TALLY + text


def tile_tally(line):
    """An edit that tallies one tile per block (thread 0) after ``line``, a line of a tile loop."""
    return line, line + '        if (threadIdx.x == 0) tally::add("tiles", 1);\n'


def run(specs, bufs, outs, monkeypatch, tmp_path, source=None):
    """Run in the emulator; ``(ldmatrix requests, tallies)``: total requests (all call sites) and the
    instrumented source's sums (empty for an unmodified kernel)."""
    counters, path = {}, tmp_path / "tally.tsv"
    monkeypatch.setenv("FLASHLIB_TEST_TALLY", str(path))
    path.unlink(missing_ok=True)
    launch.run_emulated(specs, bufs, outs, source=source, counters=counters)
    tallies = dict((k, int(v)) for k, v in (ln.split("\t") for ln in path.read_text().splitlines())) \
        if path.exists() else {}
    return sum(c["requests"] for c in counters.values()), tallies


def rand(*shape, seed=0):
    """A seeded fp16 tensor of ``shape``."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).half()


# ---- 1. causal tiles are skipped -------------------------------------------------------------------------
def pairs(rows, cols, row_tile, col_tile, needs):
    """How many (row tile, column tile) pairs satisfy ``needs(first row, last row, first column, last
    column)``; tiles start at 0 and the last one of each axis may be partial."""
    return sum(needs(r0, min(r0 + row_tile, rows) - 1, c0, min(c0 + col_tile, cols) - 1)
               for r0 in range(0, rows, row_tile) for c0 in range(0, cols, col_tile))


def query_rows(nq, nk, causal):
    """Rows are queries, columns keys (forward, dQ): needed iff the last query sees the first key,
    ``j <= i + Nk - Nq`` (bottom-right)."""
    return lambda r0, r1, c0, c1: (not causal) or c0 <= r1 + nk - nq


def key_rows(nq, nk, causal):
    """Rows are keys, columns queries (dK/dV): needed iff the first key is seen by the last query."""
    return lambda r0, r1, c0, c1: (not causal) or r0 <= c1 + nk - nq


# (Nq, Nk): equal, Nq < Nk and Nq > Nk (causal rows that see no key), each over several tiles both ways
SKIP_SHAPES = [(200, 200), (150, 200), (200, 70)]


def assert_skips(count, nq, nk, d):
    """``count(causal) -> (requests, tallies, pairs, block pairs)`` for one kernel: the non-causal run fixes
    the requests per pair; the causal run must need strictly fewer pairs and read exactly that many."""
    full, full_tiles, full_pairs, full_blocks = count(False)
    per_pair, rest = divmod(full, full_pairs)
    assert rest == 0 and per_pair > 0, (full, full_pairs)
    part, part_tiles, needed, blocks = count(True)
    assert needed < full_pairs, "this shape must let causal skip tiles"
    assert part == per_pair * needed, (f"causal read fragments for {part / per_pair:.1f} (warp, tile) pairs; "
                                       f"{needed} need it (non-causal: {full_pairs}) at Nq={nq}, Nk={nk}, d={d}")
    assert (full_tiles, part_tiles) == (full_blocks, blocks), "K/V tiles loaded per block"


@pytest.mark.parametrize("nq, nk", SKIP_SHAPES, ids=lambda x: str(x))
def test_v3_skips_causal_tiles(nq, nk, monkeypatch, tmp_path):
    d = 32
    _, br, bc, _ = launch.v3_tile(d)
    source = instrumented("v3_tile_tally", V3, tile_tally("        const int j0 = j * BC;\n"))
    q, k, v = rand(1, 1, nq, d), rand(1, 1, nk, d, seed=1), rand(1, 1, nk, d, seed=2)

    def count(causal):
        bufs = {"q": q, "k": k, "v": v, "o": torch.empty_like(q), "lse": torch.empty(1, 1, nq)}
        specs = launch.v3_launch(1, 1, 1, nq, nk, d, d ** -0.5, causal, "f16")
        plain, _ = run(specs, dict(bufs), ["o", "lse"], monkeypatch, tmp_path)
        _, tallies = run(specs, bufs, ["o", "lse"], monkeypatch, tmp_path, source)
        needs = query_rows(nq, nk, causal)
        return plain, tallies["tiles"], pairs(nq, nk, 16, bc, needs), pairs(nq, nk, br, bc, needs)
    assert_skips(count, nq, nk, d)


def bwd_buffers(h, hkv, nq, nk, d):
    """The backward's buffers; lse and delta are zeros (the counts do not depend on values)."""
    q, do = rand(1, h, nq, d), rand(1, h, nq, d, seed=3)
    k, v = rand(1, hkv, nk, d, seed=1), rand(1, hkv, nk, d, seed=2)
    return {"q": q, "k": k, "v": v, "o": torch.zeros_like(q), "do": do, "lse": torch.zeros(1, h, nq),
            "delta": torch.zeros(1, h, nq), "dq": torch.empty_like(q), "dk": torch.empty_like(k),
            "dv": torch.empty_like(v)}


@pytest.mark.parametrize("nq, nk", SKIP_SHAPES, ids=lambda x: str(x))
@pytest.mark.parametrize("kernel", ["dkdv", "dq"])
def test_backward_skips_causal_tiles(kernel, nq, nk, monkeypatch, tmp_path):
    d, h, hkv = 32, 2, 1                     # GQA 2:1: dK/dV loops over both query heads of its group
    _, bq, bkv, _, _ = launch.bwd_tile(d)
    rows = 16 * launch.BWD_WARPS
    loop_line = {"dkdv": "            const int q0 = qt * BQ;\n", "dq": "        const int j0 = j * BKV;\n"}[kernel]
    source = instrumented(f"bwd_{kernel}_tile_tally", BWD, tile_tally(loop_line))
    bufs = bwd_buffers(h, hkv, nq, nk, d)

    def count(causal):
        spec, = [s for s in launch.bwd_launch(1, h, hkv, nq, nk, d, d ** -0.5, causal, "f16")
                 if f"_{kernel}_" in s.kernel]
        out = ["dk", "dv"] if kernel == "dkdv" else ["dq"]
        plain, _ = run([spec], dict(bufs), out, monkeypatch, tmp_path)
        _, tallies = run([spec], dict(bufs), out, monkeypatch, tmp_path, source)
        if kernel == "dq":                   # rows are queries (64 a block), tiles BKV keys, per head
            needs = query_rows(nq, nk, causal)
            warp, block = pairs(nq, nk, 16, bkv, needs), pairs(nq, nk, rows, bkv, needs)
        else:                                # rows are keys (64 a block), tiles BQ queries, per group head
            needs = key_rows(nq, nk, causal)
            warp, block = pairs(nk, nq, 16, bq, needs), pairs(nk, nq, rows, bq, needs)
        heads = h // hkv if kernel == "dkdv" else h      # dK/dV: a block sums its group's query heads
        return plain, tallies["tiles"], heads * warp, heads * block
    assert_skips(count, nq, nk, d)


# ---- 2. the memory-traffic table --------------------------------------------------------------------------
@pytest.mark.parametrize("d", [32, 64, 128])
def test_v3_traffic_is_what_ldmatrix_reads(d):
    """Per warp and key tile, the bytes v3 reads by ldmatrix, by tile (the call site's line names q_s,
    k_s or v_s), equal smem_traffic's Q and K+V; S, P and O have no shared-memory traffic to count."""
    br, bc, parts = fragments.smem_traffic("v3", d)
    lines = V3.splitlines()
    per_tile = {}
    for tiles in (2, 3):
        nk = tiles * bc
        q, k, v = rand(1, 1, br, d), rand(1, 1, nk, d, seed=1), rand(1, 1, nk, d, seed=2)
        counters = {}
        launch.run_emulated(launch.v3_launch(1, 1, 1, br, nk, d, d ** -0.5, False, "f16"),
                            {"q": q, "k": k, "v": v, "o": torch.empty_like(q), "lse": torch.empty(1, 1, br)},
                            ["o", "lse"], counters=counters)
        for (_, site), c in counters.items():
            tile = re.search(r"\b([qkv])_s\b", lines[int(site.rsplit(":", 1)[1]) - 1]).group(1)
            per_tile[tile] = c["requests"] * REQUEST_BYTES - per_tile.get(tile, 0)
    warps = br // 16
    assert {t: b / warps for t, b in per_tile.items()} == {"q": parts["Q"], "k": parts["K+V"] / 2,
                                                          "v": parts["K+V"] / 2}
    assert parts["S"] == parts["P"] == parts["O"] == 0


V2_TAPS = [
    ("    float* s_s = reinterpret_cast<float*>(kv_s + BC * qs);",
     '    tally::Tap<float> s_s{reinterpret_cast<float*>(kv_s + BC * qs), "S"};'),
    ("    T* p_s = reinterpret_cast<T*>(s_s + br * ss);", '    tally::Tap<T> p_s{reinterpret_cast<T*>(s_s + br * ss), "P"};'),
    ("    float* o_s = reinterpret_cast<float*>(p_s + br * ps);",
     '    tally::Tap<float> o_s{reinterpret_cast<float*>(p_s + br * ps), "O"};'),
]
V2_FRAGMENT_ARRAYS = {"q_s": "Q", "kv_s": "K+V", "s_s": "S", "p_s": "P", "o_s": "O"}


def v2_tallied():
    """v2 with S, P and O as tallied arrays and every WMMA load/store tallied under its array's part."""
    text = re.sub(r"wmma::load_matrix_sync\((\w+), (\w+)",
                  lambda m: f'tally::load("{V2_FRAGMENT_ARRAYS[m[2]]}", {m[1]}, {m[2]}', V2)
    text = re.sub(r"wmma::store_matrix_sync\((\w+)",
                  lambda m: f'tally::store("{V2_FRAGMENT_ARRAYS[m[1]]}", {m[1]}', text)
    assert "wmma::load_matrix_sync" not in text and "wmma::store_matrix_sync" not in text
    return instrumented("v2_traffic_tally", text, *V2_TAPS)


@pytest.mark.parametrize("d", [40, 64, 128])
def test_v2_traffic_is_what_the_kernel_moves(d, monkeypatch, tmp_path):
    """Per warp and key tile, v2's fragment loads/stores and its softmax's scalar reads and writes of S,
    P and O, tallied in the running kernel, equal smem_traffic's parts (d = 40: padded to d16 = 48)."""
    br, bc, parts = fragments.smem_traffic("v2", d)
    source = v2_tallied()
    per_tile = {}
    for tiles in (2, 3):
        nk = tiles * bc
        q, k, v = rand(1, 1, br, d), rand(1, 1, nk, d, seed=1), rand(1, 1, nk, d, seed=2)
        bufs = {"q": q, "k": k, "v": v, "o": torch.empty_like(q), "lse": torch.empty(1, 1, br)}
        _, tallies = run(launch.v2_launch(1, 1, 1, br, nk, d, d ** -0.5, False, "f16"), bufs, ["o", "lse"],
                         monkeypatch, tmp_path, source)
        assert torch.isfinite(bufs["o"]).all()           # the tallied kernel still computes
        per_tile = {part: b - per_tile.get(part, 0) for part, b in tallies.items()}
    warps = br // 16
    assert {part: b / warps for part, b in per_tile.items()} == parts


def test_smem_traffic_refuses_bad_arguments():
    with pytest.raises(ValueError, match="version must be 'v2' or 'v3'.*'v1'"):
        fragments.smem_traffic("v1", 64)
    with pytest.raises(TypeError, match="d must be an int head dim, got float"):
        fragments.smem_traffic("v3", 64.0)
    with pytest.raises(ValueError, match="d must be a head dim in 1..256.*got 0"):
        fragments.smem_traffic("v2", 0)
