"""flashlib's CUDA kernels (flashlib/kernels/cuda/csrc) run in the CPU emulator against the float64 oracle.

v1 (fp32) to tight tolerances; v2 (fp16/bf16, tensor cores) under FlashAttention's rule — max error at
most twice that of a plain PyTorch implementation in the same dtype; Flash-Decoding on ragged caches
with several split counts; every kernel once under AddressSanitizer and once under ThreadSanitizer.
Grids are tiny: every emulated CUDA thread is an OS thread.
"""
from __future__ import annotations

import numpy as np
import pytest
from conftest import need_module  # noqa: E402

need_module("hypothesis")  # skip the module, saying why, where hypothesis is missing
from hypothesis import given, settings, strategies as st

from conftest import require_tool
import flashlib.kernels.cuda as fc
from flashlib import testing
from flashlib.kernels.cuda import build
from flashlib.kernels.cuda.launch import EmulatorError

torch = pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def _gxx():
    require_tool("g++")                              # the CUDA emulator is built with g++ (C++20)


def make(b, h, hkv, nq, nk, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, nq, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, nk, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, nk, d, generator=g).to(dtype)
    return q, k, v


def oracle(q, k, v, causal, scale=None):
    """float64 reference on the (already rounded) inputs: flashlib.testing's oracle with GQA."""
    return testing.reference_gqa(q, k, v, causal=causal, scale=scale)


def plain_torch(q, k, v, causal):
    """Attention written plainly in q's dtype (the FlashAttention test rule's yardstick)."""
    return testing.plain_torch_attention(q, k, v, causal=causal)


# (B, H, Hkv, Nq, Nk, d): odd lengths, Nq != Nk both ways, N = 1, head dims 40/59/111/256, GQA/MQA.
SHAPES = [
    (1, 2, 1, 37, 45, 40),      # MQA, Nq < Nk
    (1, 2, 2, 45, 17, 59),      # Nq > Nk: causal rows that see nothing
    (1, 4, 2, 33, 33, 111),     # GQA
    (1, 1, 1, 20, 30, 256),
    (2, 1, 1, 1, 1, 16),        # N = 1
    (1, 1, 1, 3, 70, 8),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_v1_fp32_matches_oracle(shape, causal):
    q, k, v = make(*shape, torch.float32)
    o, lse = fc.forward(q, k, v, causal=causal)
    ro, rl = oracle(q, k, v, causal)
    assert o.dtype == torch.float32 and lse.shape == q.shape[:3]
    testing.assert_close(o, ro, atol=2e-5, rtol=1e-5, name="o")
    testing.assert_close(lse, rl, atol=2e-5, rtol=1e-5, name="lse")
    if causal and shape[3] > shape[4]:
        assert np.isneginf(lse.numpy()).any() and (o.numpy()[np.isneginf(lse.numpy())] == 0).all()


def test_v1_accepts_numpy_and_a_scale():
    q, k, v = testing.random_qkv(9, 13, 24, lead=(1, 2), dtype=np.float32, seed=3)
    o, lse = fc.forward(q, k, v, causal=True, scale=0.3)
    ro, rl = testing.reference(q, k, v, causal=True, scale=0.3)
    assert isinstance(o, np.ndarray)
    testing.assert_close(o, ro, atol=2e-5, rtol=1e-5)
    testing.assert_close(lse, rl, atol=2e-5, rtol=1e-5)


@settings(max_examples=6, deadline=None)
@given(nq=st.integers(1, 40), nk=st.integers(1, 40), d=st.integers(1, 64), causal=st.booleans(),
       seed=st.integers(0, 2 ** 16))
def test_v1_property(nq, nk, d, causal, seed):
    q, k, v = make(1, 1, 1, nq, nk, d, torch.float32, seed)
    o, lse = fc.forward(q, k, v, causal=causal)
    ro, rl = oracle(q, k, v, causal)
    testing.assert_close(o, ro, atol=2e-5, rtol=1e-5, name="o")
    testing.assert_close(lse, rl, atol=2e-5, rtol=1e-5, name="lse")


V2_SHAPES = [SHAPES[0], SHAPES[1], SHAPES[2], SHAPES[3], SHAPES[4]]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", V2_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_v2_follows_the_flashattention_rule(shape, causal, dtype):
    q, k, v = make(*shape, dtype, seed=1)
    o, lse = fc.forward(q, k, v, causal=causal, version="v2")
    ro, rl = oracle(q, k, v, causal)
    assert o.dtype == dtype
    ours = testing.max_error(o.double(), ro)
    plain = testing.max_error(plain_torch(q, k, v, causal).double(), ro)
    assert ours <= 2 * plain + 1e-6, f"v2 error {ours:.3e} > 2 x plain {dtype} error {plain:.3e}"
    testing.assert_close(lse, rl, atol=1e-4, rtol=1e-5, name="lse")   # lse is fp32 from fp32 scores


def _decode_oracle(q, k, v, lens, causal):
    b, h, nq, d = q.shape
    o, lse = np.zeros((b, h, nq, d)), np.full((b, h, nq), -np.inf)
    for i, n in enumerate(lens.tolist()):
        if n:
            oi, li = oracle(q[i:i + 1], k[i:i + 1, :, :n], v[i:i + 1, :, :n], causal)
            o[i], lse[i] = oi[0], li[0]
    return o, lse


@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["f32", "f16", "bf16"])
def test_decode_ragged_cache(dtype, num_splits):
    q, k, v = make(3, 4, 2, 1, 50, 59, dtype, seed=2)
    lens = torch.tensor([0, 37, 50], dtype=torch.int32)            # an empty sequence, a partial one, a full one
    o, lse = fc.decode(q, k, v, cache_seqlens=lens, num_splits=num_splits)
    ro, rl = _decode_oracle(q, k, v, lens, False)
    tol = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    testing.assert_close(o.double(), ro, atol=tol, rtol=0, name="o")
    testing.assert_close(lse, rl, atol=2e-5, rtol=1e-5, name="lse")


def test_decode_several_queries_causal_and_d256():
    q, k, v = make(2, 2, 1, 3, 40, 256, torch.float32, seed=4)
    lens = torch.tensor([2, 40], dtype=torch.int32)                # 3 queries, 2 keys: a row sees nothing
    o, lse = fc.decode(q, k, v, cache_seqlens=lens, num_splits=5, causal=True)
    ro, rl = _decode_oracle(q, k, v, lens, True)
    testing.assert_close(o.double(), ro, atol=2e-5, rtol=0, name="o")
    testing.assert_close(lse, rl, atol=2e-5, rtol=1e-5, name="lse")
    assert np.isneginf(lse.numpy()).any()


# ---- the 1-D grid: blockIdx.x = (b * H + h) * blocks_per_head + block, decoded in every kernel ----
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["v1", "v2"])
def test_forward_with_awkward_batch_times_heads(dtype):
    """B = 3, H = 5 (prime, MQA onto one kv head) and two Q tiles per head: a mix-up of tile, head or
    batch in the decoded block index shows up against the oracle."""
    q, k, v = make(3, 5, 1, 70, 45, 16, dtype, seed=5)
    spec, = (fc.launch.v1_launch(3, 5, 1, 70, 45, 16, 0.25, True) if dtype == torch.float32 else
             fc.launch.v2_launch(3, 5, 1, 70, 45, 16, 0.25, True, "f16"))
    assert spec.grid == (2 * 5 * 3, 1, 1)                # 2 tiles of 64 rows x H x B
    o, lse = fc.forward(q, k, v, causal=True, version="v1" if dtype == torch.float32 else "v2")   # Nq > Nk
    ro, rl = oracle(q, k, v, True)
    if dtype == torch.float32:
        testing.assert_close(o, ro, atol=2e-5, rtol=1e-5, name="o")
    else:
        testing.assert_fa_rule(o, plain_torch(q, k, v, True), ro, name="o")
    testing.assert_close(lse, rl, atol=1e-4, rtol=1e-5, name="lse")


def test_decode_with_awkward_batch_times_heads():
    q, k, v = make(3, 5, 1, 2, 40, 24, torch.float32, seed=6)
    lens = torch.tensor([40, 0, 13], dtype=torch.int32)
    o, lse = fc.decode(q, k, v, cache_seqlens=lens, num_splits=3, causal=True)
    ro, rl = _decode_oracle(q, k, v, lens, True)
    testing.assert_close(o.double(), ro, atol=2e-5, rtol=0, name="o")
    testing.assert_close(lse, rl, atol=2e-5, rtol=1e-5, name="lse")


# ---- sanitizers: each kernel once under ASan and once under TSan (one small launch each) ----------
SANITIZED = {
    "v1": lambda san: fc.forward(*make(1, 2, 1, 19, 23, 24, torch.float32), causal=True, sanitizer=san),
    "v2-f16": lambda san: fc.forward(*make(1, 1, 1, 17, 40, 40, torch.float16), causal=True, sanitizer=san,
                                     version="v2"),
    "v2-bf16": lambda san: fc.forward(*make(1, 1, 1, 17, 20, 24, torch.bfloat16), causal=False, sanitizer=san,
                                      version="v2"),
    "decode": lambda san: fc.decode(*make(2, 2, 1, 1, 30, 40, torch.float16), num_splits=3, sanitizer=san,
                                    cache_seqlens=torch.tensor([11, 30], dtype=torch.int32)),
}


@pytest.mark.parametrize("sanitizer", ["address", "thread"])
@pytest.mark.parametrize("kernel", list(SANITIZED))
def test_kernels_are_clean_under_sanitizers(kernel, sanitizer):
    o, lse = SANITIZED[kernel](sanitizer)             # EmulatorError (with the report) if anything is found
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()


def test_tsan_catches_a_race_planted_in_v1():
    src = (build.CSRC / fc.SOURCES["v1"]).read_text()
    line = "        __syncthreads();                             // K_j visible\n"
    assert src.count(line) == 1
    q, k, v = make(1, 1, 1, 8, 16, 8, torch.float32)
    from flashlib.kernels.cuda import launch
    specs = launch.v1_launch(1, 1, 1, 8, 16, 8, 8 ** -0.5, False)
    bufs = {"q": q, "k": k, "v": v, "o": torch.empty_like(q), "lse": torch.empty(1, 1, 8)}
    with pytest.raises(EmulatorError) as err:
        launch.run_emulated(specs, bufs, ["o", "lse"], sanitizer="thread",
                            source=("v1_planted_race", src.replace(line, "")))
    assert "ThreadSanitizer: data race" in err.value.report


# ---- bad input ------------------------------------------------------------------------------------
def test_version_and_dtype_errors_name_the_version():
    q, k, v = make(1, 1, 1, 4, 4, 8, torch.float16)
    with pytest.raises(TypeError, match="v1 supports dtypes float32"):
        fc.forward(q, k, v, version="v1")
    q, k, v = make(1, 1, 1, 4, 4, 8, torch.float32)
    with pytest.raises(TypeError, match="v2 supports dtypes float16, bfloat16"):
        fc.forward(q, k, v, version="v2")
    with pytest.raises(TypeError, match="float32 \\(v1\\), float16 or bfloat16"):
        fc.forward(q.double(), k.double(), v.double())
    with pytest.raises(ValueError, match="head dim must be between 1 and 256, got 300"):
        fc.forward(*make(1, 1, 1, 2, 2, 300, torch.float32))
    with pytest.raises(ValueError, match="version must be"):
        fc.forward(q, k, v, version="v9")


def test_shape_and_argument_errors():
    q, k, v = make(1, 3, 2, 4, 4, 8, torch.float32)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        fc.forward(q, k, v)
    q, k, v = make(1, 2, 1, 4, 4, 8, torch.float32)
    with pytest.raises(ValueError, match="q must have shape \\(B, H, N, d\\)"):
        fc.forward(q[0], k, v)
    with pytest.raises(ValueError, match="sanitizer must be"):
        fc.forward(q, k, v, sanitizer="memory")
    with pytest.raises(TypeError, match="scale must be a real number"):
        fc.forward(q, k, v, scale="1")
    with pytest.raises(ValueError, match="cache_seqlens must lie in"):
        fc.decode(q, k, v, cache_seqlens=torch.tensor([5]), num_splits=2)
    with pytest.raises(ValueError, match="num_splits must be an int >= 1"):
        fc.decode(q, k, v, cache_seqlens=torch.tensor([3]), num_splits=0)
    with pytest.raises(ValueError, match="version must be one of"):
        fc.source("v9")


def test_prebuild_returns_each_built_emulator():
    require_tool("g++")
    paths = fc.prebuild(("v1", "decode"))
    assert len(paths) == 2 and all(p.is_file() for p in paths)
    assert fc.prebuild(("v1",)) == paths[:1]                  # the second call finds it in the cache
