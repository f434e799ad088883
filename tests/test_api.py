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
    """The GPU branch, with a faked H100 (132 SMs) as the device's facts: Llama-style decode, B1, 32
    query heads on 8 kv heads, one token, is 8 work items; ceil(132 / 8) = 17 splits fill the GPU,
    capped at one split per 256 keys. (Meta tensors: the shapes, no memory.)"""
    from flashlib import hardware
    h100 = hardware.CudaDevice(0, "sm_90", 132, 232448)
    monkeypatch.setattr(hardware, "device_facts", lambda device: h100)

    def shapes(nk, b=1):
        return (torch.empty(b, 32, 1, 128, device="meta"), torch.empty(b, 8, nk, 128, device="meta"))
    assert api.default_num_splits(*shapes(16384)) == 17            # ceil(132 / 8)
    assert api.default_num_splits(*shapes(4096)) == 16             # 4096 keys: 16 splits of 256
    assert api.default_num_splits(*shapes(16384, b=17)) == 1       # 136 work items fill 132 SMs


def test_default_num_splits_is_exported_and_answers_an_empty_batch():
    assert flashlib.default_num_splits is api.default_num_splits
    assert "default_num_splits" in flashlib.__all__
    q, kc, _ = make_qkv(B=1, H=4, HKV=1, NQ=1, NK=4096, dtype=torch.float32)
    assert flashlib.default_num_splits(q[:0], kc[:0]) == 1          # B = 0: nothing to split
    assert flashlib.default_num_splits(q[:, :0], kc) == 1           # H = 0


@pytest.mark.parametrize("q_change,k_change,exc,match", [
    (lambda q: q.numpy(), None, TypeError, "q must be a torch.Tensor"),
    (None, lambda k: [1, 2], TypeError, "k_cache must be a torch.Tensor"),
    (lambda q: q[:, :3], lambda k: k[:, :2], ValueError,                  # silently 1 before
     r"H=3 must be a multiple of kv heads Hkv=2 \(the heads of k_cache\)"),
    (None, lambda k: k[:, :0], ValueError, "multiple of kv heads Hkv=0"),   # ZeroDivisionError
    (None, lambda k: k[0], ValueError, r"k_cache must have shape \(B, H, N, d\)"),   # unpack error
    (None, lambda k: k.half(), TypeError, "k_cache must have the dtype of q"),
    (None, lambda k: k[:, :, :, :8], ValueError, "k_cache must have the head dim of q"),
])
def test_default_num_splits_checks_its_arguments_as_decode_does(q_change, k_change, exc, match):
    q, kc, _ = make_qkv(B=1, H=4, HKV=2, NQ=1, NK=64, D=16, dtype=torch.float32)
    q = q_change(q) if q_change else q
    kc = k_change(kc) if k_change else kc
    with pytest.raises(exc, match=match):
        flashlib.default_num_splits(q, kc)


# ------------------------------------------------------------------------------------- num_splits

def test_decode_clamps_num_splits_to_nmax_before_any_backend():
    """A split holds at least one key: num_splits > Nmax reaches the backend as Nmax (10**9 used to
    reach it as is: numpy's MemoryError, torch's allocator, the CUDA grid limit)."""
    from flashlib.backends import BACKENDS, Backend, registered
    seen = []

    def spy_decode(q, k_cache, v_cache, cache_seqlens, *, num_splits, scale):
        seen.append(num_splits)
        return BACKENDS["reference"].decode(q, k_cache, v_cache, cache_seqlens,
                                            num_splits=num_splits, scale=scale)
    ref = BACKENDS["reference"]
    q, kc, vc = make_qkv(B=2, H=2, HKV=1, NQ=1, NK=37, D=8, dtype=torch.float32, seed=4)
    with registered(Backend("spy", ref.forward, ref.backward, spy_decode, ref.check)):
        for n in (1, 36, 37, 38, 10**9):
            flashlib.decode(q, kc, vc, num_splits=n, backend="spy")
    assert seen == [1, 36, 37, 37, 37]


@pytest.mark.parametrize("backend", ["reference", "triton", "cuda"])
def test_a_billion_splits_give_the_answer_of_the_splits_that_can_hold_keys(backend):
    if backend == "cuda":
        require_tool("g++")                                            # the CUDA emulator
    device = DEVICE if backend == "triton" else "cpu"
    q, kc, vc = make_qkv(B=2, H=2, HKV=1, NQ=1, NK=37, D=8, dtype=torch.float32, seed=4,
                         device=device)
    lens = torch.tensor([37, 5], device=device)
    many = flashlib.decode(q, kc, vc, cache_seqlens=lens, num_splits=10**9, return_lse=True,
                           backend=backend)
    every = flashlib.decode(q, kc, vc, cache_seqlens=lens, num_splits=37, return_lse=True,
                            backend=backend)
    for a, b in zip(many, every):
        assert torch.equal(a, b)
    want = flashlib.attention(q[:1], kc[:1], vc[:1], backend="reference")
    torch.testing.assert_close(many[0][:1], want, atol=1e-5, rtol=1e-5)


def test_triton_decode_runs_only_the_splits_its_key_blocks_can_fill(monkeypatch):
    """The Triton kernel's splits are whole key blocks (every decode config's block_n >= 16), so the
    backend runs at most ceil(Nmax / 16) splits; the answer is that of more splits, which were empty
    (to the last bit in the interpreter; a GPU's combine may sum the splits in another order)."""
    from flashlib.backends import triton as backend
    from flashlib.kernels.triton import decode_v3 as kernel
    from flashlib.kernels.triton import tables
    every = (tables.CANDIDATES, tables.SM75, tables.SM90, tables.FP32, tables.SM75_FP32, tables.SM90_FP32)
    assert all(c.block_n >= backend.MIN_DECODE_BLOCK_N for t in every for c in t["decode"])
    assert tables.INTERPRETER["decode"].block_n >= backend.MIN_DECODE_BLOCK_N
    seen, run = [], kernel.decode

    def spy(*args, num_splits, **kwargs):
        seen.append(num_splits)
        return run(*args, num_splits=num_splits, **kwargs)
    monkeypatch.setattr(kernel, "decode", spy)
    q, kc, vc = make_qkv(B=2, H=2, HKV=1, NQ=1, NK=37, D=8, dtype=torch.float32, seed=4,
                         device=DEVICE)
    lens = torch.tensor([37, 20], device=DEVICE)
    o, lse = backend.decode(q, kc, vc, lens, num_splits=37, scale=0.3)
    assert seen == [3]                                                 # ceil(37 / 16)
    o_all, lse_all = run(q, kc, vc, lens.to(torch.int32), num_splits=37, scale=0.3)   # 34 empty
    tol = 0 if DEVICE == "cpu" else 1e-6
    torch.testing.assert_close(o, o_all, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, lse_all, atol=tol, rtol=tol)


# --------------------------------------------------------------------------------- cache_seqlens

BIG_LENGTHS = [2**32 + 3, -2**40, 2**31 + 5]            # int64 lengths that int32 would wrap
CLAMPED = [37, 0, 37]                                   # what they mean: clamped into [0, Nmax]


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_backends_clamp_int64_lengths_before_narrowing_them(backend):
    """The path that never reads lengths back (every GPU call; torch.compile on a CPU) reaches the
    backend with unchecked lengths: 2**32 + 3 must mean Nmax, not 3 (int32 wraps it)."""
    from flashlib.backends import BACKENDS
    device = DEVICE if backend == "triton" else "cpu"
    q, kc, vc = make_qkv(B=3, H=2, HKV=1, NQ=1, NK=37, D=8, dtype=torch.float32, seed=6,
                         device=device)
    big = torch.tensor(BIG_LENGTHS, dtype=torch.int64, device=device)
    clamped = torch.tensor(CLAMPED, dtype=torch.int64, device=device)
    run = BACKENDS[backend].decode
    got, want = (run(q, kc, vc, lens, num_splits=2, scale=0.3) for lens in (big, clamped))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_cuda_kernels_clamp_int64_lengths_before_narrowing_them(monkeypatch):
    """flashlib.kernels.cuda.decode on a GPU does not read the lengths (check_cache_seqlens returns
    them unread): stood in for here by letting the check pass them, on the CPU emulator."""
    require_tool("g++")
    from flashlib.kernels import cuda
    monkeypatch.setattr(cuda, "check_cache_seqlens", lambda lens, q, nmax: lens)
    q, kc, vc = make_qkv(B=3, H=2, HKV=1, NQ=1, NK=37, D=8, dtype=torch.float32, seed=6)
    big = torch.tensor(BIG_LENGTHS, dtype=torch.int64)
    clamped = torch.tensor(CLAMPED, dtype=torch.int64)
    got, want = (cuda.decode(q, kc, vc, cache_seqlens=lens, num_splits=2) for lens in (big, clamped))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


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
