"""Tests of flashlib/kernels/triton/fa2_fwd_v4_tma.py (the TMA forward: tensor descriptors) on conftest's DEVICE.

On a CPU the kernel runs in Triton's interpreter, whose descriptors zero-fill out-of-bounds rows and
columns, drop out-of-bounds stores and check TMA's alignment rules, as the GPU does; on a GPU machine the
same tests run it compiled (TMA on sm_90). fp16/bf16 under FlashAttention's rule at shapes whose head
dims TMA can carry (multiples of 8: 8, 16, 40, 64, 256), lengths no block divides, Nq != Nk both ways,
GQA/MQA, causal rows that see nothing. In the interpreter the TMA forward does exactly version 1's arithmetic
on the same tiles, so there the two agree bit for bit. The warp-specialization facts the kernel's
header states are checked by cross-compiling for sm_90 (tools in the triton wheel, no GPU).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import DEVICE, need_module, require_pinned_triton, require_tool
from triton_cases import case_id, make_qkv, run_triton

need_module("hypothesis")  # skip the module, saying why, where hypothesis is missing
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import flashlib  # noqa: E402
import flashlib.kernels.triton as ft  # noqa: E402
from flashlib.backends import triton as triton_backend  # noqa: E402
from flashlib.kernels.triton import fa2_bwd_v5_tma, fa2_fwd_v1, fa2_fwd_v4_tma# noqa: E402
from flashlib.kernels.triton.configs import Config  # noqa: E402
from flashlib.testing import ROUNDING, assert_attention_right  # noqa: E402

# (B, H, Hkv, Nq, Nk, d, causal): head dims TMA can carry; lengths multiples of no block (interpreter
# blocks 32 x 16); Nq > Nk causal (rows that see nothing), Nq < Nk, N = 1, GQA and MQA.
CASES = [(1, 4, 2, 45, 70, 64, True), (1, 2, 1, 37, 20, 40, False), (1, 1, 1, 20, 33, 256, True),
         (2, 3, 1, 70, 30, 16, True), (1, 2, 2, 1, 1, 8, False), (3, 5, 1, 45, 37, 24, False)]


def tma_forward(q, k, v, causal, **kw):
    return fa2_fwd_v4_tma.forward(q, k, v, causal=causal, scale=q.shape[-1] ** -0.5, **kw)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_half_precision_within_flashattention_rule(dtype, case):
    *shape, causal = case
    q, k, v, do = make_qkv(*shape, dtype=dtype, seed=1, device=DEVICE)
    o, lse = tma_forward(q, k, v, causal)
    assert o.dtype == dtype and lse.dtype == torch.float32
    assert_attention_right(q, k, v, do, causal=causal, o=o, lse=lse)


@pytest.mark.skipif(not ft.INTERPRET, reason="bit equality of two kernels holds in the interpreter only")
@pytest.mark.parametrize("causal", [False, True])
def test_interpreter_matches_version_1_bit_for_bit(causal):
    """The same tiles and the same arithmetic: a descriptor's zero fill where version 1 masks its loads."""
    q, k, v, _ = make_qkv(2, 4, 2, 41, 53, 48, dtype=torch.float16, seed=3, device=DEVICE)
    for cfg in (Config(16, 16), Config(32, 64), Config(64, 16)):
        o1, l1 = fa2_fwd_v1.forward(q, k, v, causal=causal, scale=0.3, config=cfg)
        o2, l2 = fa2_fwd_v4_tma.forward(q, k, v, causal=causal, scale=0.3, config=cfg)
        assert torch.equal(o1, o2) and torch.equal(l1, l2), cfg


def test_rows_that_see_nothing_are_zero_with_lse_minus_inf():
    q, k, v, _ = make_qkv(1, 2, 1, 40, 9, 32, dtype=torch.float16, seed=2, device=DEVICE)
    o, lse = tma_forward(q, k, v, True)          # causal, Nq > Nk: rows 0..30 see no key
    hidden = 40 - 9
    assert torch.all(o[:, :, :hidden] == 0) and torch.all(torch.isneginf(lse[:, :, :hidden]))
    assert torch.isfinite(o).all() and torch.isfinite(lse[:, :, hidden:]).all()


def test_strided_inputs_are_read_in_place():
    """(B, N, H, d) memory viewed as (B, H, N, d): descriptors take the row stride, no copy."""
    q, k, v, do = make_qkv(1, 2, 2, 19, 23, 40, dtype=torch.float16, seed=5, device=DEVICE)
    qs, ks, vs = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    assert not qs.is_contiguous() and fa2_fwd_v4_tma.supported(qs, ks, vs) is None
    o, lse = tma_forward(qs, ks, vs, True)
    assert_attention_right(q, k, v, do, causal=True, o=o, lse=lse)


def _misaligned(x):
    """x's values starting 2 bytes past a 16-byte boundary (TMA needs 16)."""
    flat = torch.empty(x.numel() + 8, dtype=x.dtype, device=x.device)
    view = flat[1:1 + x.numel()].view(x.shape)
    view.copy_(x)
    return view


@pytest.mark.parametrize("make, expect", [
    (lambda q: q.float(), "float16 or bfloat16"),
    (lambda q: q[..., :59].contiguous(), "multiples of 16 bytes"),      # d = 59: a row is 118 bytes
    (lambda q: q.transpose(-1, -2), "last dim is not contiguous"),
    (lambda q: q[:, :, :1].expand(q.shape), "row stride 0"),
    (_misaligned, "multiples of 16 bytes"),
], ids=["fp32", "d59", "transposed", "expanded-rows", "misaligned"])
def test_supported_says_why_not_and_forward_refuses(make, expect):
    q, k, v, _ = make_qkv(1, 2, 2, 64, 64, 64, dtype=torch.float16, device=DEVICE)   # N = d: q^T fits too
    bad = make(q)
    k, v = (x[..., :bad.shape[-1]].to(bad.dtype).contiguous() for x in (k, v))   # k, v as q: only q is bad
    why = fa2_fwd_v4_tma.supported(bad, k, v)
    assert why is not None and expect in why
    with pytest.raises(ValueError, match="fa2_fwd_v4_tma.forward"):
        tma_forward(bad, k, v, False)


def test_warp_specialize_must_be_a_bool():
    q, k, v, _ = make_qkv(1, 1, 1, 8, 8, 16, dtype=torch.float16, device=DEVICE)
    with pytest.raises(TypeError, match="warp_specialize must be a bool"):
        tma_forward(q, k, v, False, warp_specialize=1)


def test_bad_arguments_are_named():
    q, k, v, do = make_qkv(1, 2, 1, 8, 8, 16, dtype=torch.float16, device=DEVICE)
    with pytest.raises(TypeError, match="q must be a torch.Tensor, got list"):
        fa2_fwd_v4_tma.supported([1], k, v)
    with pytest.raises(ValueError, match="k must have the head dim of q"):
        tma_forward(q, k[..., :8], v[..., :8], False)
    with pytest.raises(TypeError, match="causal must be a bool"):
        fa2_fwd_v4_tma.forward(q, k, v, causal=1, scale=0.5)
    with pytest.raises(ValueError, match="scale must be finite"):
        fa2_fwd_v4_tma.forward(q, k, v, causal=False, scale=float("nan"))
    o, lse = tma_forward(q, k, v, False)
    with pytest.raises(ValueError, match="do must have q's shape, dtype and device"):
        fa2_bwd_v5_tma.backward(q, k, v, o, lse, do[:, :, :4], causal=False, scale=0.5)
    with pytest.raises(TypeError, match="do must be a torch.Tensor, got NoneType"):
        fa2_bwd_v5_tma.backward(q, k, v, o, lse, None, causal=False, scale=0.5)


def test_scratch_allocator_is_scoped_to_the_launch(monkeypatch):
    """Inside the launch of a spec with scratch=True Triton's allocator is the descriptors' scratch;
    afterwards (and for a spec without, and after a launch that raised) the caller's is back."""
    from triton.runtime import _allocation

    from flashlib.kernels.triton import spec as spec_module
    before = _allocation._allocator.get()
    seen = []
    kind = type(fa2_fwd_v4_tma.SPEC.fn)

    def getitem(fn, grid):
        seen.append((fn.fn.__name__, _allocation._allocator.get()))
        if fn.fn.__name__ == "_bwd_dq":
            raise RuntimeError("a launch that fails")
        return lambda *args, **kwargs: None
    monkeypatch.setattr(kind, "__getitem__", getitem)
    q, k, v, do = make_qkv(1, 2, 1, 8, 8, 16, dtype=torch.float16, device=DEVICE)
    fa2_fwd_v4_tma.forward(q, k, v, causal=False, scale=0.25)
    with pytest.raises(RuntimeError, match="a launch that fails"):
        fa2_bwd_v5_tma.backward(q, k, v, q, torch.zeros(1, 2, 8), do, causal=False, scale=0.25)
    scratch = spec_module._scratch
    assert seen == [("_fwd_tma_kernel", scratch), ("_bwd_preprocess", before), ("_bwd_dkdv_tma", scratch),
                    ("_bwd_dq", before)]
    assert _allocation._allocator.get() is before


# ------------------------------------------------------- through flashlib.attention: FLASHLIB_TRITON_FWD

def test_env_selects_the_tma_forward_where_it_applies(monkeypatch):
    monkeypatch.delenv("FLASHLIB_TRITON_FWD", raising=False)       # the default, whatever the caller's
    calls = []
    real = fa2_fwd_v1.forward
    monkeypatch.setattr(fa2_fwd_v1, "forward", lambda *a, spec, **kw: (
        spec is fa2_fwd_v4_tma.SPEC and calls.append(a[0].shape)) or real(*a, spec=spec, **kw))
    q, k, v, do = make_qkv(1, 4, 2, 33, 47, 40, dtype=torch.float16, seed=4, device=DEVICE)
    flashlib.attention(q, k, v, backend="triton")
    assert calls == []                                        # default: version 1
    monkeypatch.setenv("FLASHLIB_TRITON_FWD", "tma")
    o, lse, grads = run_triton(q, k, v, do, True)             # the TMA forward, Triton's backward
    assert calls == [q.shape]
    assert_attention_right(q, k, v, do, causal=True, o=o, lse=lse, grads=grads)
    q59, k59, v59, _ = make_qkv(1, 2, 2, 9, 9, 59, dtype=torch.float16, device=DEVICE)
    assert triton_backend.forward_version(q59, k59, v59) == "v1"   # d = 59: TMA cannot, version 1 runs
    flashlib.attention(q59, k59, v59, backend="triton")
    assert calls == [q.shape]


def test_env_with_an_unknown_version_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("FLASHLIB_TRITON_FWD", "v9")
    q, k, v, _ = make_qkv(1, 1, 1, 8, 8, 16, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match=r"FLASHLIB_TRITON_FWD must be one of \('v1', 'v4'\) or an alias "
                                         r"\('tma',\) \(triton forward\), got 'v9'"):
        flashlib.attention(q, k, v, backend="triton")


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nq=st.integers(1, 50), nk=st.integers(1, 50), d=st.sampled_from([8, 16, 24, 40, 64, 72]),
       causal=st.booleans(), heads=st.sampled_from([(1, 1), (2, 1), (4, 2)]), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([torch.float16, torch.bfloat16]))
def test_property_within_flashattention_rule(nq, nk, d, causal, heads, seed, dtype):
    q, k, v, do = make_qkv(1, heads[0], heads[1], nq, nk, d, dtype=dtype, seed=seed, device=DEVICE)
    o, lse = tma_forward(q, k, v, causal)
    # floor: flash-attn's own slack (testing.rounding_floor: twice the rounding error of values of the
    # output's magnitude): at a handful of keys plain fp16/bf16 torch can be exact, or luckier than the
    # one final rounding here.
    assert_attention_right(q, k, v, do, causal=causal, o=o, lse=lse, floor=ROUNDING)


# ------------------------------------------------- the header's warp-specialization facts, on sm_90

_WS_PROBE = r"""
import contextlib, hashlib, io, json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from flashlib.kernels.triton import fa2_fwd_v4_tma
from flashlib.tools.compile_report import REPORT_CONSTEXPRS
spec, out = fa2_fwd_v4_tma.SPEC, {}
sig = spec.signature("fp16")
for warps, ws in ((4, True), (8, True), (8, False)):
    values = {**spec.defaults, **REPORT_CONSTEXPRS, "BLOCK_M": 128, "BLOCK_N": 64, "WARP_SPECIALIZE": ws}
    const = {n: values[n] for n in spec.constexprs}
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            k = triton.compile(ASTSource(spec.fn, sig, const), target=GPUTarget("cuda", 90, 32),
                               options=dict(num_warps=warps, num_stages=2))
        ptx = re.sub(r"(?m)^//.*$", "", k.asm["ptx"])              # comments name the compile, not the code
        out[f"w{warps}-ws{int(ws)}"] = {"ptx_setmaxnreg": len(re.findall(r"setmaxnreg", ptx)),
                                        "ptx_sha256": hashlib.sha256(ptx.encode()).hexdigest()}
    except Exception as exc:
        out[f"w{warps}-ws{int(ws)}"] = {"error": type(exc).__name__}
print("PROBE:" + json.dumps(out))
"""


def test_warp_specialization_is_not_yet_possible_for_this_loop_in_this_triton():
    """Why WARP_SPECIALIZE is off by default (fa2_fwd_v4_tma.py's header): cross-compiled for sm_90 by the
    pinned triton, 4 warps make its Hopper warp-specialization pass fail, 8 warps leave the loop whole
    (the same PTX as without it, no setmaxnreg). When a Triton upgrade changes either, this test fails:
    then measure warp specialization on a GPU and update the header, the chapter and this test."""
    require_pinned_triton()
    require_tool("ptxas")
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([sys.executable, "-c", _WS_PROBE], capture_output=True, text=True, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE:")), None)
    assert line is not None, proc.stderr[-2000:]
    got = json.loads(line.removeprefix("PROBE:"))
    assert got["w4-ws1"] == {"error": "RuntimeError"}, got
    assert got["w8-ws1"]["ptx_setmaxnreg"] == 0 and got["w8-ws1"] == got["w8-ws0"], got
