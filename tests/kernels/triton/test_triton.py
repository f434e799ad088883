"""Tests of flashlib/kernels/triton/ (fa2_fwd, fa2_bwd, decode, the flat grids) on conftest's DEVICE.

On a CPU machine the kernels run in Triton's interpreter on CPU tensors; on a GPU machine the same tests
run the compiled kernels on CUDA tensors (flashlib.kernels.triton fixes the mode; conftest.DEVICE follows it).
Every kernel is checked against the float64 oracle (flashlib.testing): fp32 tightly (true fp32 on a GPU
too: input_precision="ieee"); fp16/bf16 under FlashAttention's rule — max error <= 2x that of a plain
PyTorch implementation in the same dtype (3x for gradients). Shapes are small (the interpreter is slow)
but adversarial: lengths that are multiples of no block, Nq != Nk both ways, odd head dims up to 256,
GQA/MQA, rows that see nothing, and batch·head counts that are multiples of nothing (the flat grid).
Determinism of the backward is tested on a GPU (tests/gpu): the interpreter runs one program at a time.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import need_module  # noqa: E402

need_module("hypothesis")  # skip the module, saying why, where hypothesis is missing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flashlib
from flashlib.testing import assert_close, max_error, plain_torch_attention, reference, reference_gqa

import flashlib.kernels.triton as ft  # noqa: E402  (sets TRITON_INTERPRET=1 here when there is no GPU)
from flashlib.hardware import CUDA_GRID_MAX  # noqa: E402
from conftest import DEVICE  # noqa: E402
from flashlib.kernels.triton import decode as tdecode  # noqa: E402
from flashlib.kernels.triton import configs, fa2_bwd, fa2_fwd  # noqa: E402
from flashlib.kernels.triton.configs import Config  # noqa: E402


def make_qkv(B, H, HKV, NQ, NK, D, dtype=torch.float32, seed=0):
    """Seeded on the CPU (the same values on every machine), then moved to DEVICE."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, NQ, D, generator=g).to(DEVICE, dtype)
    k = torch.randn(B, HKV, NK, D, generator=g).to(DEVICE, dtype)
    v = torch.randn(B, HKV, NK, D, generator=g).to(DEVICE, dtype)
    do = torch.randn(B, H, NQ, D, generator=g).to(DEVICE, dtype)
    return q, k, v, do


def f64(x):
    return x.detach().cpu().to(torch.float64).numpy()


def oracle(q, k, v, do, causal):
    """Float64 (o, lse, dq, dk, dv) from flashlib.testing's oracle (GQA groups summed)."""
    o, lse, (dq, dk, dv) = reference_gqa(q, k, v, causal=causal, do=do)
    return o, lse, dq, dk, dv


def plain_torch(q, k, v, do, causal):
    """flashlib.testing's plain same-dtype attention, with its gradients: the fp16 rule's baseline."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    o = plain_torch_attention(q, k, v, causal=causal)
    o.backward(do)
    return o.detach(), q.grad, k.grad, v.grad


def run_triton(q, k, v, do, causal):
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    o, lse = flashlib.attention(qq, kk, vv, causal=causal, return_lse=True, backend="triton")
    o.backward(do)
    return o.detach(), lse, qq.grad, kk.grad, vv.grad


def test_interpreter_mode_on_this_machine():
    assert ft.INTERPRET == (not torch.cuda.is_available())
    assert torch.device(DEVICE).type == ("cpu" if ft.INTERPRET else "cuda")


# (B, H, Hkv, Nq, Nk, d, causal): multiples of no block (interpreter blocks: 32 x 16), both ways
# of Nq != Nk, head dims 1, 40, 59, 111, 256, GQA and MQA, causal rows that see nothing (Nq > Nk).
FP32_CASES = [
    (1, 1, 1, 1, 1, 1, False), (1, 2, 2, 1, 37, 40, True), (2, 4, 2, 17, 45, 40, False),
    (1, 4, 1, 45, 17, 59, True), (1, 2, 1, 33, 33, 111, True), (1, 1, 1, 5, 40, 256, True),
    (1, 4, 2, 70, 30, 16, True), (1, 2, 2, 30, 70, 24, False), (1, 3, 1, 50, 50, 64, True),
]


@pytest.mark.parametrize("case", FP32_CASES, ids=lambda c: "B{}H{}kv{}-{}x{}-d{}-{}".format(
    *c[:6], "causal" if c[6] else "full"))
def test_fp32_forward_backward_match_oracle(case):
    *shape, causal = case
    q, k, v, do = make_qkv(*shape)
    o, lse, dq, dk, dv = run_triton(q, k, v, do, causal)
    r = oracle(q, k, v, do, causal)
    for name, got, want in zip(("o", "lse", "dq", "dk", "dv"), (o, lse, dq, dk, dv), r):
        assert_close(f64(got), want, atol=2e-5, rtol=2e-5, name=name)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", [(1, 4, 2, 45, 70, 59, True), (1, 2, 1, 37, 20, 40, False),
                                  (1, 1, 1, 20, 33, 111, True)], ids=str)
def test_half_precision_within_flashattention_rule(dtype, case):
    *shape, causal = case
    q, k, v, do = make_qkv(*shape, dtype=dtype, seed=1)
    got = run_triton(q, k, v, do, causal)
    base = plain_torch(q, k, v, do, causal)
    r = oracle(q, k, v, do, causal)
    got = (got[0], *got[2:])
    r = (r[0], *r[2:])
    for i, name in enumerate(("o", "dq", "dk", "dv")):
        factor = 2 if name == "o" else 3
        err, base_err = max_error(f64(got[i]), r[i]), max_error(f64(base[i]), r[i])
        assert np.isfinite(err), name
        assert err <= factor * base_err, f"{name}: {err:.3e} > {factor} x plain {dtype} {base_err:.3e}"


def test_rows_that_see_nothing_are_zero_with_lse_minus_inf_and_zero_grads():
    q, k, v, do = make_qkv(1, 2, 1, 40, 9, 32, seed=2)       # causal, Nq > Nk: rows 0..30 see nothing
    o, lse, dq, dk, dv = run_triton(q, k, v, do, True)
    hidden = 40 - 9
    assert torch.all(o[:, :, :hidden] == 0) and torch.all(torch.isneginf(lse[:, :, :hidden]))
    assert torch.isfinite(lse[:, :, hidden:]).all()
    for g in (dq, dk, dv):
        assert torch.isfinite(g).all()
    assert torch.all(dq[:, :, :hidden] == 0)


def test_block_sizes_do_not_change_the_result():
    q, k, v, do = make_qkv(1, 2, 1, 41, 53, 48, seed=3)
    outs = [fa2_fwd.forward(q, k, v, causal=True, scale=0.3, config=Config(bm, bn))
            for bm, bn in ((16, 16), (32, 64), (64, 16))]
    o0, l0 = outs[0]
    grads = [fa2_bwd.backward(q, k, v, o0, l0, do, causal=True, scale=0.3, config_dkdv=Config(bm, bn),
                              config_dq=Config(bn, bm)) for bm, bn in ((16, 16), (32, 64), (16, 32))]
    for o, lse in outs[1:]:
        assert_close(o, o0, atol=1e-5, rtol=1e-5, name="o")
        assert_close(lse, l0, atol=1e-5, rtol=1e-5, name="lse")
    for g in grads[1:]:
        for a, b in zip(g, grads[0]):
            assert_close(a, b, atol=1e-5, rtol=1e-5, name="grad")


def test_strided_inputs_are_read_in_place():
    """(B, N, H, d) memory viewed as (B, H, N, d): the kernels take strides, no layout copy needed."""
    q, k, v, do = make_qkv(1, 2, 2, 19, 23, 40, seed=5)
    qs, ks, vs = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    assert not qs.is_contiguous()
    o1 = flashlib.attention(qs, ks, vs, causal=True, backend="triton")
    o2 = flashlib.attention(q, k, v, causal=True, backend="triton")
    assert torch.allclose(o1, o2, atol=1e-6)


def test_allow_tf32_runs_and_stays_close():
    q, k, v, _ = make_qkv(1, 1, 1, 20, 20, 32, seed=6)
    o = flashlib.attention(q, k, v, allow_tf32=True, backend="triton")
    assert_close(f64(o), oracle(q, k, v, torch.zeros_like(q), False)[0], atol=2e-2, rtol=2e-2)


# ---------------------------------------------------------------------------------------------- decode

def decode_oracle(q, kc, vc, lens):
    G = q.shape[1] // kc.shape[1]
    o = np.zeros(q.shape)
    lse = np.full(q.shape[:-1], -np.inf)
    for b, n in enumerate(lens.tolist()):
        if n:
            o[b], lse[b] = reference(f64(q[b]), np.repeat(f64(kc[b, :, :n]), G, 0),
                                     np.repeat(f64(vc[b, :, :n]), G, 0))
    return o, lse


@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.parametrize("shape", [(3, 4, 2, 1, 70, 40), (2, 8, 1, 2, 37, 111)], ids=str)
def test_decode_ragged_matches_oracle(shape, num_splits):
    B, H, HKV, NQ, NMAX, D = shape
    q, kc, vc, _ = make_qkv(B, H, HKV, NQ, NMAX, D, seed=7)
    lens = torch.tensor([0, NMAX, 5][:B], dtype=torch.int32, device=DEVICE)   # empty, full, short
    o, lse = flashlib.decode(q, kc, vc, cache_seqlens=lens, num_splits=num_splits, return_lse=True,
                             backend="triton")
    ro, rl = decode_oracle(q, kc, vc, lens)
    assert_close(f64(o), ro, atol=2e-5, rtol=2e-5, name="o")
    assert_close(f64(lse), rl, atol=2e-5, rtol=2e-5, name="lse")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_decode_half_precision_rule(dtype):
    q, kc, vc, _ = make_qkv(2, 4, 1, 1, 90, 64, dtype=dtype, seed=8)
    lens = torch.tensor([90, 33], device=DEVICE)
    o = flashlib.decode(q, kc, vc, cache_seqlens=lens, num_splits=4, backend="triton")
    ro, _ = decode_oracle(q, kc, vc, lens)
    base = torch.cat([plain_torch(q[b:b + 1], kc[b:b + 1, :, :n], vc[b:b + 1, :, :n],
                                  torch.zeros_like(q[b:b + 1]), False)[0] for b, n in enumerate([90, 33])])
    assert max_error(f64(o), ro) <= 2 * max_error(f64(base), ro)


# ------------------------------------------------------------------------------ flat grids (CUDA limits)

def within_cuda_limits(grid) -> bool:
    """CUDA allows 2^31 - 1 programs on grid axis 0 and 65,535 on axes 1 and 2."""
    return 1 <= len(grid) <= 3 and all(1 <= n <= limit for n, limit in zip(grid, CUDA_GRID_MAX))


def cdiv(a, b):
    return -(-a // b)


# (B, H, Hkv, N): B·H = 131,072 (the shape that failed on an H100), with GQA, and B = 100,000.
HUGE = [(1024, 128, 128, 16), (1024, 128, 8, 16), (100_000, 1, 1, 16), (100_000, 8, 2, 1)]


def all_configs(kernel):
    """Every block size a launcher can be given: each architecture's table and the interpreter's."""
    return {c for table in (configs.CANDIDATES, configs.SM90, configs.SM75) for c in table[kernel]} | {
        configs.INTERPRETER[kernel], Config(16, 16)}


@pytest.mark.parametrize("B,H,HKV,N", HUGE, ids=str)
def test_every_grid_helper_stays_within_cuda_limits(B, H, HKV, N):
    for cfg in all_configs("fwd") | all_configs("bwd_dq"):
        grid = fa2_fwd.grid(B, H, N, cfg.block_m)
        assert within_cuda_limits(grid) and grid == (B * H * cdiv(N, cfg.block_m),)
        assert fa2_bwd.grid_dq(B, H, N, cfg.block_m) == grid
    for cfg in all_configs("bwd_dkdv"):
        grid = fa2_bwd.grid_dkdv(B, HKV, N, cfg.block_n)
        assert within_cuda_limits(grid) and grid == (B * HKV * cdiv(N, cfg.block_n),)
    grid = fa2_bwd.grid_preprocess(B, H, N)
    assert within_cuda_limits(grid) and grid == (B * H * cdiv(N, fa2_bwd.PREPROCESS_BLOCK_M),)
    group = H // HKV
    for cfg in all_configs("decode"):
        block_m = tdecode.split_block_m(cfg.block_m, group, N)
        for splits in (1, 7, 128):
            grid = tdecode.grid_split(B, HKV, group, N, block_m, splits)
            assert within_cuda_limits(grid) and grid == (B * HKV * cdiv(group * N, block_m) * splits,)
    assert within_cuda_limits(tdecode.grid_combine(B, H, N))


def test_flat_grid_refuses_more_programs_than_cuda_allows():
    assert ft.flat_grid(65_536, 32_767) == (65_536 * 32_767,)
    with pytest.raises(ValueError, match="outside CUDA's grid limit"):
        ft.flat_grid(65_536, 32_768)


class _Recorder:
    """Stands in for a @triton.jit kernel: records the grid and the constexprs of each launch."""

    def __init__(self, name, launches):
        self.name, self.launches = name, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches[self.name] = (tuple(grid), kwargs)
        return launch


@pytest.mark.parametrize("B,H,HKV,N", HUGE, ids=str)
def test_every_launcher_passes_its_grid_helper_within_cuda_limits(monkeypatch, B, H, HKV, N):
    """The launchers themselves, at B·H up to 800,000, with the kernels replaced by recorders (head dim
    1: a few MB; nothing runs). Each grid is its helper's, for the block sizes the launch chose."""
    launches = {}
    for module, name in ((fa2_fwd, "_fwd_kernel"), (fa2_bwd, "_bwd_preprocess"), (fa2_bwd, "_bwd_dkdv"),
                         (fa2_bwd, "_bwd_dq"), (tdecode, "_split_kernel"), (tdecode, "_combine_kernel")):
        monkeypatch.setattr(module, name, _Recorder(name, launches))
    q, k, v, do = (torch.zeros(B, h, N, 1, device=DEVICE) for h in (H, HKV, HKV, H))
    o, lse = fa2_fwd.forward(q, k, v, causal=True, scale=1.0)
    fa2_bwd.backward(q, k, v, o, lse, do, causal=True, scale=1.0)
    lens = torch.full((B,), N, dtype=torch.int32, device=DEVICE)
    tdecode.decode(q[:, :, :1], k, v, lens, num_splits=3, scale=1.0)       # one new token per sequence
    assert len(launches) == 6
    for grid, _ in launches.values():
        assert within_cuda_limits(grid), launches
    kw = {name: kwargs for name, (_, kwargs) in launches.items()}
    assert launches["_fwd_kernel"][0] == fa2_fwd.grid(B, H, N, kw["_fwd_kernel"]["BLOCK_M"])
    assert launches["_bwd_preprocess"][0] == fa2_bwd.grid_preprocess(B, H, N)
    assert launches["_bwd_dkdv"][0] == fa2_bwd.grid_dkdv(B, HKV, N, kw["_bwd_dkdv"]["BLOCK_N"])
    assert launches["_bwd_dq"][0] == fa2_bwd.grid_dq(B, H, N, kw["_bwd_dq"]["BLOCK_M"])
    assert launches["_split_kernel"][0] == tdecode.grid_split(B, HKV, H // HKV, 1,
                                                              kw["_split_kernel"]["BLOCK_M"], 3)
    assert launches["_combine_kernel"][0] == tdecode.grid_combine(B, H, 1)


@pytest.mark.parametrize("causal", [False, True])
def test_awkward_batch_heads_match_oracle(causal):
    """B·H = 15 (B = 3, H = 5, Hkv = 1) with several query and key blocks per head: every program must
    decode its own (block, batch, head) from the flat grid."""
    q, k, v, do = make_qkv(3, 5, 1, 45, 37, 24, seed=9)
    got = run_triton(q, k, v, do, causal)
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), got, oracle(q, k, v, do, causal)):
        assert_close(f64(a), b, atol=2e-5, rtol=2e-5, name=name)


@pytest.mark.parametrize("num_splits", [1, 3, 4])
def test_decode_awkward_batch_heads_match_oracle(num_splits):
    """B = 3, H = 5, Hkv = 1, Nq = 13: 65 stacked query rows, two row blocks per kv head, and splits."""
    q, kc, vc, _ = make_qkv(3, 5, 1, 13, 50, 24, seed=10)
    lens = torch.tensor([50, 0, 17], dtype=torch.int32, device=DEVICE)
    o, lse = flashlib.decode(q, kc, vc, cache_seqlens=lens, num_splits=num_splits, return_lse=True,
                             backend="triton")
    ro, rl = decode_oracle(q, kc, vc, lens)
    assert_close(f64(o), ro, atol=2e-5, rtol=2e-5, name="o")
    assert_close(f64(lse), rl, atol=2e-5, rtol=2e-5, name="lse")


# ------------------------------------------------------------------------------------------ property

@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nq=st.integers(1, 40), nk=st.integers(1, 40), d=st.integers(1, 72), causal=st.booleans(),
       heads=st.sampled_from([(1, 1), (2, 1), (4, 2)]), seed=st.integers(0, 2**16))
def test_property_forward_backward_match_oracle(nq, nk, d, causal, heads, seed):
    q, k, v, do = make_qkv(1, heads[0], heads[1], nq, nk, d, seed=seed)
    got = run_triton(q, k, v, do, causal)
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), got, oracle(q, k, v, do, causal)):
        assert_close(f64(a), b, atol=5e-5, rtol=5e-5, name=name)
