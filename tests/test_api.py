"""Tests of flashlib/api.py: the public attention/decode functions, the backends' dispatch, bad input."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import flashlib
from conftest import DEVICE, ROOT
from flashlib import api
from flashlib.testing import assert_close, reference, reference_backward



def make_qkv(B=1, H=4, HKV=2, NQ=13, NK=21, D=24, dtype=torch.float64, seed=0, grad=False, device="cpu"):
    """Seeded on the CPU; ``device=DEVICE`` for tensors that reach the Triton kernels."""
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(B, H, NQ, D, generator=g), torch.randn(B, HKV, NK, D, generator=g),
           torch.randn(B, HKV, NK, D, generator=g)]
    return [x.to(device, dtype).requires_grad_(grad) for x in out]


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


def test_return_types_and_lse_has_no_grad():
    q, k, v = make_qkv(dtype=torch.float32, grad=True)
    o = flashlib.attention(q, k, v, backend="reference")
    assert isinstance(o, torch.Tensor) and o.shape == q.shape and o.requires_grad
    o, lse = flashlib.attention(q, k, v, return_lse=True, backend="reference")
    assert lse.shape == q.shape[:3] and not lse.requires_grad


def test_auto_uses_the_registered_backend_for_the_device(monkeypatch):
    """The seam for new backends: register one, map a device type to it, and "auto" calls it."""
    calls = []
    ref = api.BACKENDS["reference"]

    def spy_forward(*args, **kwargs):
        calls.append("forward")
        return ref.forward(*args, **kwargs)

    spy = api.Backend("spy", spy_forward, ref.backward, ref.decode, ref.check)
    monkeypatch.setitem(api.BACKENDS, "spy", spy)
    monkeypatch.setitem(api.AUTO, "cpu", "spy")
    q, k, v = make_qkv(dtype=torch.float32)
    flashlib.attention(q, k, v)
    assert calls == ["forward"]
    flashlib.attention(q, k, v, backend="spy")
    assert calls == ["forward", "forward"]


def test_auto_on_cpu_is_reference():
    assert api.AUTO["cpu"] == "reference" and api.AUTO["cuda"] == "triton"


# ------------------------------------------------------------------------------------------ decode

@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_decode_reference_and_triton_agree_on_ragged_cache(num_splits):
    q, kc, vc = make_qkv(B=3, H=4, HKV=2, NQ=1, NK=60, D=32, dtype=torch.float32, seed=2, device=DEVICE)
    lens = torch.tensor([60, 0, 17], device=DEVICE)
    o_r, l_r = flashlib.decode(q, kc, vc, cache_seqlens=lens, num_splits=num_splits, return_lse=True,
                               backend="reference")
    o_t, l_t = flashlib.decode(q, kc, vc, cache_seqlens=lens, num_splits=num_splits, return_lse=True,
                               backend="triton")
    assert torch.allclose(o_r, o_t, atol=1e-5) and torch.equal(torch.isinf(l_r), torch.isinf(l_t))
    assert torch.all(o_t[1] == 0) and torch.all(torch.isneginf(l_t[1]))
    full = flashlib.attention(q[:1], kc[:1], vc[:1], backend="reference")    # lens[0] = Nmax
    assert torch.allclose(o_r[:1], full, atol=1e-6)


def test_decode_without_seqlens_uses_the_whole_cache():
    q, kc, vc = make_qkv(B=2, NQ=2, NK=30, dtype=torch.float32, seed=3)
    assert torch.allclose(flashlib.decode(q, kc, vc, backend="reference"),
                          flashlib.attention(q, kc, vc, backend="reference"), atol=1e-6)


def test_default_num_splits_rule():
    q, kc, _ = make_qkv(B=1, H=4, HKV=1, NQ=1, NK=4096, dtype=torch.float32)
    assert api.default_num_splits(q, kc) == api.CPU_SPLIT_SMS     # 1 work item, 4 "SMs" on CPU
    q, kc, _ = make_qkv(B=8, H=4, HKV=1, NQ=1, NK=4096, dtype=torch.float32)
    assert api.default_num_splits(q, kc) == 1                     # 8 work items already fill 4
    q, kc, _ = make_qkv(B=1, H=4, HKV=1, NQ=1, NK=300, dtype=torch.float32)
    assert api.default_num_splits(q, kc) == 2                     # each split keeps >= 256 keys


# --------------------------------------------------------------------------------------- bad input

def _bad_attention_cases():
    q, k, v = make_qkv(dtype=torch.float32)
    return [
        (dict(q=q.numpy()), TypeError, "q must be a torch.Tensor"),
        (dict(k=k[0]), ValueError, "k must have 4 dims"),
        (dict(v=v.int()), TypeError, "v must be float16, bfloat16, float32 or float64"),
        (dict(k=k.half()), TypeError, "k must have the dtype of q"),
        (dict(k=k[:, :, :, :8], v=v[:, :, :, :8]), ValueError, "head dim of q"),
        (dict(v=v[:, :, :3]), ValueError, "v must have the shape of k"),
        (dict(k=torch.cat([k, k[:, :1]], 1), v=torch.cat([v, v[:, :1]], 1)), ValueError,
         r"multiple of the heads of k"),
        (dict(k=torch.cat([k, k]), v=torch.cat([v, v])), ValueError, "batch size of q"),
        (dict(q=torch.zeros(1, 4, 2, 300), k=torch.zeros(1, 2, 2, 300), v=torch.zeros(1, 2, 2, 300)),
         ValueError, "head dim must be between 1 and 256"),
        (dict(k=k[:, :, :0], v=v[:, :, :0]), ValueError, "at least one key"),
        (dict(q=q[:, :, :0]), ValueError, "at least one query"),
        (dict(causal=1), TypeError, "causal must be a bool"),
        (dict(return_lse="yes"), TypeError, "return_lse must be a bool"),
        (dict(allow_tf32=None), TypeError, "allow_tf32 must be a bool"),
        (dict(scale=float("nan")), ValueError, "scale must be finite"),
        (dict(scale="0.1"), TypeError, "scale must be a real number"),
        (dict(backend="cudnn"), ValueError, "backend must be one of"),
        (dict(backend=None), TypeError, "backend must be a str"),
        (dict(q=q.double().to(DEVICE), k=k.double().to(DEVICE), v=v.double().to(DEVICE),
              backend="triton"), TypeError, "use backend='reference' for float64"),
    ]


@pytest.mark.parametrize("i", range(len(_bad_attention_cases())))
def test_attention_bad_input_names_the_argument(i):
    change, exc, match = _bad_attention_cases()[i]
    q, k, v = make_qkv(dtype=torch.float32)
    args = dict(q=q, k=k, v=v)
    args.update(change)
    with pytest.raises(exc, match=match):
        flashlib.attention(**args)


def _bad_decode_cases():
    q, kc, vc = make_qkv(B=2, NQ=1, NK=10, dtype=torch.float32)
    return [
        (dict(cache_seqlens=[3, 4]), TypeError, "cache_seqlens must be a torch.Tensor"),
        (dict(cache_seqlens=torch.tensor([3.0, 4.0])), TypeError, "cache_seqlens must have dtype int32"),
        (dict(cache_seqlens=torch.tensor([3])), ValueError, r"cache_seqlens must have shape \(2,\)"),
        (dict(cache_seqlens=torch.tensor([3, 11])), ValueError, r"must lie in \[0, 10\]"),
        (dict(cache_seqlens=torch.tensor([-1, 4])), ValueError, r"must lie in \[0, 10\]"),
        (dict(num_splits=0), ValueError, "num_splits must be an int >= 1"),
        (dict(num_splits=2.0), TypeError, "num_splits must be an int >= 1"),
        (dict(k_cache=kc[:, :1].repeat(1, 3, 1, 1), v_cache=vc[:, :1].repeat(1, 3, 1, 1)), ValueError,
         "multiple of the heads of k_cache"),
        (dict(v_cache=vc.half()), TypeError, "v_cache must have the dtype of q"),
        (dict(q=q.clone().requires_grad_()), ValueError, "decode is inference-only"),
        (dict(backend="fast"), ValueError, "backend must be one of"),
    ]


@pytest.mark.parametrize("i", range(len(_bad_decode_cases())))
def test_decode_bad_input_names_the_argument(i):
    change, exc, match = _bad_decode_cases()[i]
    q, kc, vc = make_qkv(B=2, NQ=1, NK=10, dtype=torch.float32)
    args = dict(q=q, k_cache=kc, v_cache=vc)
    args.update(change)
    with pytest.raises(exc, match=match):
        flashlib.decode(**args)


def _run(code: str, **env):
    full_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          cwd=ROOT, env=full_env, timeout=300)


def test_importing_flashlib_imports_neither_torch_nor_triton():
    r = _run("import sys, flashlib; print('torch' in sys.modules, 'triton' in sys.modules)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "False"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only situation")
def test_triton_imported_in_compile_mode_refuses_cpu_tensors_clearly():
    r = _run("""
        import triton, torch, flashlib
        q = torch.randn(1, 1, 4, 16)
        try:
            flashlib.attention(q, q, q, backend="triton")
        except RuntimeError as e:
            print("REFUSED:", e)
        """)
    assert r.returncode == 0, r.stderr
    assert "REFUSED:" in r.stdout and "compile mode" in r.stdout and "TRITON_INTERPRET=1" in r.stdout


def test_custom_op_passes_torch_opcheck():
    q, k, v = make_qkv(dtype=torch.float32, grad=True)
    flashlib.attention(q, k, v, backend="reference")             # registers the ops on first use
    torch.library.opcheck(torch.ops.flashlib.attention_fwd.default,
                          (q, k, v, True, 0.25, False, "reference", 0, 0))
    torch.library.opcheck(torch.ops.flashlib.attention_fwd.default,
                          (q, k, v, False, 0.25, False, "reference", 5, 3))      # user blocks


def test_attention_compiles_without_graph_breaks():
    """torch.compile(fullgraph=True) fails on any graph break: the custom op keeps attention whole."""
    q, k, v = make_qkv(NQ=9, NK=12, D=16, dtype=torch.float32, grad=True)

    def loss(q, k, v):
        return flashlib.attention(q, k, v, causal=True, backend="reference").square().sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    out = compiled(q, k, v)
    out.backward()
    grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    expected = loss(q, k, v)
    expected.backward()
    assert torch.allclose(out, expected, atol=1e-5)
    assert all(torch.allclose(a, x.grad, atol=1e-5) for a, x in zip(grads, (q, k, v)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only situation")
def test_reference_first_then_triton_on_cpu_in_one_process():
    """Calling a torch custom op imports triton; flashlib must have chosen Triton's mode before that."""
    r = _run("""
        import torch, flashlib
        q = torch.randn(1, 2, 5, 16)
        a = flashlib.attention(q, q, q, backend="reference")
        b = flashlib.attention(q, q, q, backend="triton")
        print("SAME", bool(torch.allclose(a, b, atol=1e-5)))
        """)
    assert r.returncode == 0, r.stderr
    assert "SAME True" in r.stdout
