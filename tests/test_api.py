"""flashlib.api: the public functions attention / decode, and bad input refused with the argument's name.

The backends behind them are tested in tests/backends/, their autograd in tests/test_ops.py, the
validator itself in tests/test_validation.py.
"""
from __future__ import annotations

import pytest
import torch

import flashlib
from api_cases import make_qkv
from conftest import DEVICE, require_tool
from flashlib import api


def test_return_types_and_lse_has_no_grad():
    q, k, v = make_qkv(dtype=torch.float32, grad=True)
    o = flashlib.attention(q, k, v, backend="reference")
    assert isinstance(o, torch.Tensor) and o.shape == q.shape and o.requires_grad
    o, lse = flashlib.attention(q, k, v, return_lse=True, backend="reference")
    assert lse.shape == q.shape[:3] and not lse.requires_grad


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


@pytest.mark.parametrize("backend", ["reference", "triton", "cuda"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_without_seqlens_is_decode_with_every_length_at_nmax(backend, num_splits):
    """cache_seqlens=None travels down to the backend (no lengths tensor is filled): the Triton kernel
    is compiled without lengths, "reference" and "cuda" (its CPU emulator) make their own; the result
    is bit for bit that of explicit lengths Nmax."""
    if backend == "cuda":
        require_tool("g++")                                        # the CUDA emulator
    device = "cpu" if backend == "cuda" else DEVICE
    q, kc, vc = make_qkv(B=2, H=4, HKV=2, NQ=2, NK=45, D=16, dtype=torch.float32, seed=9, device=device)
    full = torch.full((2,), 45, dtype=torch.int32, device=device)
    without = flashlib.decode(q, kc, vc, num_splits=num_splits, return_lse=True, backend=backend)
    given = flashlib.decode(q, kc, vc, cache_seqlens=full, num_splits=num_splits, return_lse=True,
                            backend=backend)
    for a, b in zip(without, given):
        assert torch.equal(a, b)
    torch.testing.assert_close(without[0], flashlib.attention(q, kc, vc, backend="reference"),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits,kernels", [(1, ["decode_split"]), (2, ["decode_split", "decode_combine"])])
def test_triton_decode_launches_no_combine_for_one_split(monkeypatch, num_splits, kernels):
    """With one split the split kernel writes o and lse itself (one split's partial needs no merge):
    one launch instead of two, o in q's dtype, a sequence of length 0 still 0 with lse = -inf."""
    from flashlib.kernels.triton.spec import KernelSpec
    launched, run = [], KernelSpec._run

    def record(spec, grid, args, kwargs):
        launched.append(spec.name)
        return run(spec, grid, args, kwargs)
    monkeypatch.setattr(KernelSpec, "_run", record)
    q, kc, vc = make_qkv(B=2, H=4, HKV=1, NQ=3, NK=40, D=24, dtype=torch.float16, seed=10, device=DEVICE)
    lens = torch.tensor([40, 0], device=DEVICE)
    o, lse = flashlib.decode(q, kc, vc, cache_seqlens=lens, num_splits=num_splits, return_lse=True,
                             backend="triton")
    assert launched == kernels
    assert o.dtype == q.dtype and o.is_contiguous() and lse.dtype == torch.float32
    assert (o[1] == 0).all() and torch.isneginf(lse[1]).all()              # length 0: nothing to see
    want = flashlib.attention(q[:1], kc[:1], vc[:1], backend="reference", return_lse=True)
    torch.testing.assert_close(o[:1], want[0], atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(lse[:1], want[1], atol=1e-5, rtol=1e-5)


def test_default_num_splits_rule():
    q, kc, _ = make_qkv(B=1, H=4, HKV=1, NQ=1, NK=4096, dtype=torch.float32)
    assert api.default_num_splits(q, kc) == api.CPU_SPLIT_SMS     # 1 work item, 4 "SMs" on CPU
    q, kc, _ = make_qkv(B=8, H=4, HKV=1, NQ=1, NK=4096, dtype=torch.float32)
    assert api.default_num_splits(q, kc) == 1                     # 8 work items already fill 4
    q, kc, _ = make_qkv(B=1, H=4, HKV=1, NQ=1, NK=300, dtype=torch.float32)
    assert api.default_num_splits(q, kc) == 2                     # each split keeps >= 256 keys


def test_default_num_splits_on_a_gpu_reads_its_sm_count(monkeypatch):
    """The GPU branch, with a faked H100 (132 SMs): Llama-style decode, B1, 32 query heads on 8 kv heads,
    one token, is 8 work items; ceil(132 / 8) = 17 splits fill the GPU, capped at one split per 256 keys."""
    import types

    from flashlib import hardware
    monkeypatch.setattr(hardware, "_CUDA_DEVICES", {0: hardware.CudaDevice(0, "sm_90", 132, 232448)})
    gpu = torch.device("cuda", 0)

    def shapes(nk, b=1):
        return (types.SimpleNamespace(shape=(b, 32, 1, 128), device=gpu),
                types.SimpleNamespace(shape=(b, 8, nk, 128), device=gpu))
    assert api.default_num_splits(*shapes(16384)) == 17            # ceil(132 / 8)
    assert api.default_num_splits(*shapes(4096)) == 16             # 4096 keys: 16 splits of 256
    assert api.default_num_splits(*shapes(16384, b=17)) == 1       # 136 work items fill 132 SMs


# --------------------------------------------------------------------------------------- bad input

def _bad_attention_cases():
    q, k, v = make_qkv(dtype=torch.float32)
    return [
        (dict(q=q.numpy()), TypeError, "q must be a torch.Tensor"),
        (dict(k=k[0]), ValueError, r"k must have shape \(B, H, N, d\), 4 dims"),
        (dict(v=v.int()), TypeError, "v must be float16, bfloat16, float32 or float64"),
        (dict(k=k.half()), TypeError, "k must have the dtype of q"),
        (dict(k=k[:, :, :, :8], v=v[:, :, :, :8]), ValueError, "head dim of q"),
        (dict(v=v[:, :, :3]), ValueError, "v must have the shape of k"),
        (dict(k=torch.cat([k, k[:, :1]], 1), v=torch.cat([v, v[:, :1]], 1)), ValueError,
         r"must be a multiple of kv heads Hkv=3 \(the heads of k\)"),
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
         r"multiple of kv heads Hkv=3 \(the heads of k_cache\)"),
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
