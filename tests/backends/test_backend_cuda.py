"""The "cuda" backend (flashlib.backends.cuda) through flashlib.attention and decode: CPU tensors
run in the CUDA emulator; the backward is the reference backend's."""
import shutil

import pytest
import torch

import flashlib
from conftest import require
from flashlib.testing import assert_close, assert_fa_rule, plain_torch_attention, reference_gqa


@pytest.fixture(autouse=True)
def _needs_gpp():
    require(shutil.which("g++") is not None, "g++ is needed to build the CUDA emulator")


def _qkv(dtype, b=1, h=4, hkv=2, nq=19, nk=33, d=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).to(dtype).requires_grad_()
            for s in ((b, h, nq, d), (b, hkv, nk, d), (b, hkv, nk, d))]


@pytest.mark.parametrize("causal", [False, True])
def test_fp32_kernel_v1_with_reference_backward(causal):
    q, k, v = _qkv(torch.float32, nq=33, nk=19)        # causal: rows 0..13 see nothing
    o, lse = flashlib.attention(q, k, v, causal=causal, return_lse=True, backend="cuda")
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), do)
    o_ref, lse_ref, g_ref = reference_gqa(q, k, v, causal=causal, do=do)
    assert_close(o.detach(), o_ref, atol=2e-6, rtol=1e-5, name="o")
    assert_close(lse, lse_ref, atol=2e-6, rtol=1e-5, name="lse")
    for got, want in zip(grads, g_ref):
        assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_fp16_kernel_v2_within_flashattention_rule():
    q, k, v = _qkv(torch.float16, d=59)
    o = flashlib.attention(q, k, v, causal=True, backend="cuda")
    o_ref, _ = reference_gqa(q, k, v, causal=True)
    assert_fa_rule(o, plain_torch_attention(q, k, v, causal=True), o_ref)


def test_decode_ragged():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 1, 64, generator=g)
    kc, vc = torch.randn(2, 1, 50, 64, generator=g), torch.randn(2, 1, 50, 64, generator=g)
    lens = torch.tensor([50, 7])
    o, lse = flashlib.decode(q, kc, vc, cache_seqlens=lens, num_splits=3, return_lse=True,
                             backend="cuda")
    for b, n in enumerate(lens.tolist()):
        o_ref, lse_ref = reference_gqa(q[b:b + 1], kc[b:b + 1, :, :n], vc[b:b + 1, :, :n])
        assert_close(o[b:b + 1], o_ref, atol=2e-6, rtol=1e-5)
        assert_close(lse[b:b + 1], lse_ref, atol=2e-6, rtol=1e-5)


def test_float64_is_refused_with_the_kernel_versions():
    q, k, v = _qkv(torch.float64)
    with pytest.raises(TypeError, match="backend='cuda' takes float32 .* or float16/bfloat16"):
        flashlib.attention(q, k, v, backend="cuda")


def test_compile_report_has_cuda_rows():
    from flashlib.tools.compile_report import ROW_PRODUCERS, cuda_rows
    assert cuda_rows in ROW_PRODUCERS
    require(shutil.which("nvcc") is not None, "nvcc is needed for the CUDA compile report")
    rows = cuda_rows(("sm_75",))
    assert rows and all(r["backend"] == "cuda" and r["ok"] for r in rows)
    v2 = [r for r in rows if r["kernel"].startswith("fa2_fwd_v2")]
    assert v2 and all(r["mma_instructions"] > 0 and r["tensor_cores"] for r in v2)
