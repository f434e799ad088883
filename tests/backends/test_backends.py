"""flashlib.backends: the registry (resolve, AUTO, register_backend, registered) and the adapters
"reference" and "triton" (the "cuda" one: tests/backends/test_backend_cuda.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import flashlib
from api_cases import make_qkv, run_python
from conftest import DEVICE
from flashlib import backends
from flashlib.backends import AUTO, BACKENDS, Backend, register_backend, registered, resolve
from flashlib.testing import assert_close, reference, reference_backward


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(2, 2), (4, 2), (4, 1)], ids=str)
@pytest.mark.parametrize("nq,nk", [(13, 21), (21, 13), (1, 5)])
def test_reference_backend_float64_matches_oracle_with_gqa(causal, heads, nq, nk):
    q, k, v = make_qkv(H=heads[0], HKV=heads[1], NQ=nq, NK=nk, grad=True)
    o, lse = flashlib.attention(q, k, v, causal=causal, return_lse=True, backend="reference")
    do = torch.randn_like(o)
    o.backward(do)
    G = heads[0] // heads[1]
    kk, vv = (np.repeat(x.detach().numpy(), G, 1) for x in (k, v))
    ro, rl = reference(q.detach().numpy(), kk, vv, causal=causal)
    rdq, rdk, rdv = reference_backward(q.detach().numpy(), kk, vv, do.numpy(), causal=causal)
    assert lse.dtype == torch.float64
    assert_close(o.detach().numpy(), ro, atol=1e-10, rtol=1e-10, name="o")
    assert_close(lse.numpy(), rl, atol=1e-10, rtol=1e-10, name="lse")
    assert_close(q.grad.numpy(), rdq, atol=1e-10, rtol=1e-10, name="dq")
    shape = (1, heads[1], G, nk, 24)
    assert_close(k.grad.numpy(), rdk.reshape(shape).sum(2), atol=1e-10, rtol=1e-10, name="dk")
    assert_close(v.grad.numpy(), rdv.reshape(shape).sum(2), atol=1e-10, rtol=1e-10, name="dv")


def test_gradcheck_reference_backend():
    q, k, v = make_qkv(H=2, HKV=1, NQ=5, NK=7, D=8, grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: flashlib.attention(a, b, c, causal=True,
                                                                       backend="reference"), (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_triton_and_reference_agree_and_lse_is_float32(dtype):
    q, k, v = make_qkv(NQ=19, NK=30, D=40, dtype=dtype, seed=1, device=DEVICE)
    o_t, l_t = flashlib.attention(q, k, v, causal=True, return_lse=True, backend="triton")
    o_r, l_r = flashlib.attention(q, k, v, causal=True, return_lse=True, backend="reference")
    assert o_t.dtype == o_r.dtype == dtype and l_t.dtype == l_r.dtype == torch.float32
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    assert torch.allclose(o_t.float(), o_r.float(), atol=tol)
    assert torch.allclose(l_t, l_r, atol=1e-4)


def _spy(name, calls):
    """The reference backend under another name, noting each forward call in ``calls``."""
    ref = BACKENDS["reference"]

    def spy_forward(*args, **kwargs):
        calls.append(name)
        return ref.forward(*args, **kwargs)

    return Backend(name, spy_forward, ref.backward, ref.decode, ref.check)


def test_auto_uses_the_registered_backend_for_the_device(monkeypatch):
    """The seam for new backends: register one, map a device type to it, and "auto" calls it."""
    calls = []
    with registered(_spy("spy", calls)):
        monkeypatch.setitem(AUTO, "cpu", "spy")
        q, k, v = make_qkv(dtype=torch.float32)
        flashlib.attention(q, k, v)
        assert calls == ["spy"]
        flashlib.attention(q, k, v, backend="spy")
        assert calls == ["spy", "spy"]
    assert "spy" not in BACKENDS


def test_auto_is_triton_on_cuda_and_reference_elsewhere():
    assert AUTO == {"cpu": "reference", "cuda": "triton"}
    assert sorted(BACKENDS) == ["cuda", "reference", "triton"]
    assert resolve("auto", torch.zeros(1, device="meta")) is BACKENDS["reference"]   # a device AUTO lacks
    assert resolve("auto", torch.zeros(1)) is BACKENDS["reference"]


def test_registered_is_scoped_and_restores_what_it_replaced():
    calls = []
    reference_backend = BACKENDS["reference"]
    with pytest.raises(RuntimeError, match="boom"):
        with registered(_spy("reference", calls)) as spy:
            assert resolve("reference", torch.zeros(1)) is spy
            raise RuntimeError("boom")
    assert BACKENDS["reference"] is reference_backend                 # restored, even after an error
    with pytest.raises(TypeError, match="backend must be a flashlib.backends.Backend, got str"):
        with registered("spy"):
            pass
    with pytest.raises(TypeError, match="backend must be a flashlib.backends.Backend"):
        register_backend(object())


@pytest.mark.parametrize("name,exc,match", [("fast", ValueError, r"backend must be one of \['auto', 'cuda'"),
                                            (None, TypeError, "backend must be a str, got NoneType")])
def test_resolve_refuses_unknown_names(name, exc, match):
    with pytest.raises(exc, match=match):
        resolve(name, torch.zeros(1))


def test_cuda_backward_is_the_reference_on_a_cpu():
    """The CUDA backend has no backward kernel: on CPU tensors its backward is the reference's."""
    q, k, v = make_qkv(H=2, HKV=1, NQ=6, NK=9, D=8, dtype=torch.float32)
    o, lse = backends.reference.forward(q, k, v, causal=True, scale=0.3)
    do = torch.randn_like(o)
    args = dict(causal=True, scale=0.3)
    for got, want in zip(backends.cuda.backward(q, k, v, o, lse, do, **args),
                         backends.reference.backward(q, k, v, o, lse, do, **args)):
        assert torch.equal(got, want)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only situation")
def test_triton_imported_in_compile_mode_refuses_cpu_tensors_clearly():
    r = run_python("""
        import triton, torch, flashlib
        q = torch.randn(1, 1, 4, 16)
        try:
            flashlib.attention(q, q, q, backend="triton")
        except RuntimeError as e:
            print("REFUSED:", e)
        """)
    assert r.returncode == 0, r.stderr
    assert "REFUSED:" in r.stdout and "compile mode" in r.stdout and "TRITON_INTERPRET=1" in r.stdout
