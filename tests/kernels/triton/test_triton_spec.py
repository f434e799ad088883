"""Tests of flashlib/kernels/triton/spec.py: each kernel's KernelSpec against the kernel's real signature,
the launchers that read the specs (their grids at B·H far beyond CUDA's 65,535 on a second axis, with
the kernels replaced by a recorder), and the grid helpers the specs' grids call (no GPU needed).
"""
from __future__ import annotations

import dataclasses
import inspect
import types

import pytest
import torch
from conftest import DEVICE

import flashlib.kernels.triton as ft
from flashlib.hardware import CUDA_GRID_MAX
from flashlib.kernels.triton import configs, fa2_bwd_v2, fa2_bwd_v5_tma, fa2_fwd_v1, fa2_fwd_v4_tma, tables
from flashlib.kernels.triton import decode_v3 as tdecode
from flashlib.kernels.triton import tl
from flashlib.kernels.triton.configs import Config
from flashlib.kernels.triton.spec import KernelSpec
from flashlib.tools.compile_report import triton_specs

SPECS = triton_specs()


@pytest.mark.parametrize("s", SPECS, ids=lambda s: s.name)
def test_spec_matches_the_kernels_real_signature(s):
    """The jitted function's argument names, in order, and its tl.constexpr parameters are the spec's."""
    assert tuple(s.fn.arg_names) == s.arg_names
    params = inspect.signature(s.fn.fn).parameters
    assert tuple(n for n, p in params.items() if "constexpr" in str(p.annotation)) == s.constexprs
    assert set(s.signature("fp16")) == set(s.arg_names)


def _kernel(params: str):
    """A stand-in for a jitted kernel with these parameters (KernelSpec reads ``fn.fn``'s signature)."""
    namespace = {"tl": tl}
    exec(f"def kernel({params}): pass", namespace)
    return types.SimpleNamespace(fn=namespace["kernel"])


@pytest.mark.parametrize("params, match", [
    ("Q, stride_qb, stride_qh, stride_kn, N", "strides come as"),              # K's strides, no K
    ("Q, stride_qb, stride_qh, N", "strides come as"),                         # a stride missing
    ("Q, stride_qb, stride_qh, stride_qn, N, B: tl.constexpr, M", "pointers, strides, scalars"),
    ("Q, stride_qb, stride_qh, stride_qn, N, stride_x", "pointers, strides, scalars"),
])
def test_a_kernel_whose_parameters_break_the_order_is_refused(params, match):
    with pytest.raises(ValueError, match=match):
        KernelSpec("k", _kernel(params), grid=lambda a: (1,), fixed=Config(16, 16))


def test_the_spec_reads_the_kernels_signature():
    s = KernelSpec("k", _kernel("Q, LSE, stride_qb, stride_qh, stride_qn, scale, N, C: tl.constexpr"),
                   grid=lambda a: (1,), types=dict(LSE="fp32", scale="fp32"), fixed=Config(16, 16))
    assert s.pointers == {"Q": "in", "LSE": "fp32"} and s.strides == ("Q",)
    assert s.scalars == {"scale": "fp32", "N": "i32"} and s.constexprs == ("C",)
    assert s.arg_names == ("Q", "LSE", "stride_qb", "stride_qh", "stride_qn", "scale", "N", "C")


def test_a_spec_refuses_unknown_types_constants_and_config_with_fixed():
    with pytest.raises(ValueError, match="types must name pointers or scalars"):
        dataclasses.replace(fa2_fwd_v1.SPEC, types={"LSE": "fp64"})
    with pytest.raises(ValueError, match="types must name pointers or scalars"):
        dataclasses.replace(fa2_fwd_v1.SPEC, types={"LSD": "fp32"})
    with pytest.raises(ValueError, match="constants must be constexprs"):
        dataclasses.replace(fa2_fwd_v1.SPEC, constants={"WARP_SPECIALIZE": True})
    with pytest.raises(ValueError, match="exactly one of config"):
        dataclasses.replace(fa2_fwd_v1.SPEC, fixed=Config(64, 64))


def test_specs_cover_every_config_table_and_the_fixed_kernels():
    assert len({s.name for s in SPECS}) == len(SPECS)
    assert {s.config for s in SPECS if s.config} == set(configs.KERNELS)
    assert all(isinstance(s.fixed, Config) for s in SPECS if s.config is None)


def test_signature_types_follow_the_spec():
    sig = fa2_bwd_v2.DKDV_SPEC.signature("bf16")
    assert sig["Q"] == sig["DK"] == "*bf16" and sig["LSE"] == sig["DELTA"] == "*fp32"
    assert sig["stride_dvn"] == sig["NQ"] == "i32" and sig["qk_scale"] == sig["scale"] == "fp32"
    assert sig["CAUSAL"] == sig["BLOCK_D"] == "constexpr"
    assert tdecode.SPLIT_SPEC.signature("fp16")["SEQLENS"] == "*i32"


def test_launch_names_missing_and_unknown_arguments():
    q = torch.zeros(1, 1, 4, 16, device=DEVICE)
    with pytest.raises(TypeError, match=r"missing arguments \['DELTA'\], unknown arguments \['DELTAS'\]"):
        fa2_bwd_v2.PREPROCESS_SPEC.launch(O=q, DO=q, DELTAS=q, H=1, NQ=4, D=16, BLOCK_D=16)
    with pytest.raises(TypeError, match=r"missing arguments \['K', 'V', 'O', 'LSE', 'SLOPES', 'SINKS', 'CU_Q', 'CU_K', 'qk_scale'"):
        fa2_fwd_v1.SPEC.launch(Q=q)
    with pytest.raises(TypeError, match=r"unknown arguments \['WARP_SPECIALIZE'\]"):
        fa2_fwd_v4_tma.SPEC.launch(WARP_SPECIALIZE=True)   # a constant of the spec is not the caller's


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
    return {c for table in (tables.CANDIDATES, tables.SM90, tables.SM75) for c in table[kernel]} | {
        tables.INTERPRETER[kernel], Config(16, 16)}


@pytest.mark.parametrize("B,H,HKV,N", HUGE, ids=str)
def test_every_grid_helper_stays_within_cuda_limits(B, H, HKV, N):
    for cfg in all_configs("fwd") | all_configs("bwd_dq"):
        grid = fa2_fwd_v1.grid(B, H, N, cfg.block_m)
        assert within_cuda_limits(grid) and grid == (B * H * cdiv(N, cfg.block_m),)
        assert fa2_bwd_v2.grid_dq(B, H, N, cfg.block_m) == grid
    for cfg in all_configs("bwd_dkdv"):
        grid = fa2_bwd_v2.grid_dkdv(B, HKV, N, cfg.block_n)
        assert within_cuda_limits(grid) and grid == (B * HKV * cdiv(N, cfg.block_n),)
    grid = fa2_bwd_v2.grid_preprocess(B, H, N)
    assert within_cuda_limits(grid) and grid == (B * H * cdiv(N, fa2_bwd_v2.PREPROCESS_BLOCK_M),)
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


@pytest.mark.parametrize("B,H,HKV,N", HUGE, ids=str)
def test_every_launcher_passes_its_grid_helper_within_cuda_limits(monkeypatch, B, H, HKV, N):
    """The launchers themselves, at B·H up to 800,000, with KernelSpec's last step (the kernel call)
    replaced by a recorder (head dim 1, and 8 for the TMA kernels: at most a few hundred MB; nothing
    runs). Each launch passes every argument of its kernel, and its grid is its helper's for the block
    sizes the launch chose.
    """
    launches = {}

    def record(self, grid, args, kwargs):
        launches[self.name] = (tuple(grid), dict(zip(self.arg_names, [*args, *(kwargs[n] for n in
                                                                           self.constexprs)])))
        assert len(args) == len(self.runtime_args) and {"num_warps", "num_stages"} <= set(kwargs)

    monkeypatch.setattr(KernelSpec, "_run", record)
    q, k, v, do = (torch.zeros(B, h, N, 1, device=DEVICE) for h in (H, HKV, HKV, H))
    o, lse = fa2_fwd_v1.forward(q, k, v, causal=True, scale=1.0)
    q8, k8, v8 = (torch.zeros(B, h, N, 8, dtype=torch.float16, device=DEVICE) for h in (H, HKV, HKV))
    o8, lse8 = fa2_fwd_v4_tma.forward(q8, k8, v8, causal=True, scale=1.0)     # the TMA kernels: 16-byte rows
    fa2_bwd_v5_tma.backward(q8, k8, v8, o8, lse8, torch.zeros_like(q8), causal=True, scale=1.0)
    fa2_bwd_v2.backward(q, k, v, o, lse, do, causal=True, scale=1.0)
    lens = torch.full((B,), N, dtype=torch.int32, device=DEVICE)
    tdecode.decode(q[:, :, :1], k, v, lens, num_splits=3, scale=1.0)       # one new token per sequence
    assert set(launches) == {s.name for s in SPECS}
    for grid, _ in launches.values():
        assert within_cuda_limits(grid), launches
    a = {name: args for name, (_, args) in launches.items()}
    assert launches["fa2_fwd"][0] == fa2_fwd_v1.grid(B, H, N, a["fa2_fwd"]["BLOCK_M"])
    assert a["fa2_fwd"]["stride_kh"] == k.stride(1) and a["fa2_fwd"]["GROUP"] == H // HKV
    assert launches["fa2_fwd_tma"][0] == fa2_fwd_v1.grid(B, H, N, a["fa2_fwd_tma"]["BLOCK_M"])   # version 1's grid
    assert a["fa2_fwd_tma"]["stride_kh"] == k8.stride(1) and a["fa2_fwd_tma"]["GROUP"] == H // HKV
    assert launches["fa2_bwd_preprocess"][0] == fa2_bwd_v2.grid_preprocess(B, H, N)
    assert launches["fa2_bwd_dkdv"][0] == fa2_bwd_v2.grid_dkdv(B, HKV, N, a["fa2_bwd_dkdv"]["BLOCK_N"])
    assert launches["fa2_bwd_dkdv_tma"][0] == fa2_bwd_v2.grid_dkdv(B, HKV, N, a["fa2_bwd_dkdv_tma"]["BLOCK_N"])
    assert launches["fa2_bwd_dq"][0] == fa2_bwd_v2.grid_dq(B, H, N, a["fa2_bwd_dq"]["BLOCK_M"])
    assert launches["decode_split"][0] == tdecode.grid_split(B, HKV, H // HKV, 1,
                                                             a["decode_split"]["BLOCK_M"], 3)
    assert launches["decode_combine"][0] == tdecode.grid_combine(B, H, 1)


def test_staged_bytes_counts_streamed_tiles_once_per_stage():
    from flashlib.kernels.triton.spec import staged_bytes
    assert staged_bytes(Config(64, 32, 4, 3), 2, resident=10, streamed=5) == (10 + 3 * 5) * 2
    assert staged_bytes(Config(64, 32, 4, 1), 4, resident=0, streamed=7) == 7 * 4
