"""Tests of flashlib/tools/bench.py and flashlib/__main__.py (the command line)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from conftest import DEVICE, ROOT
from flashlib.tools import bench
from flashlib.__main__ import COMMANDS, build_parser
from flashlib.tools.measure import best_time



def test_flop_and_byte_formulas():
    # FA2 paper: 4 N^2 d H per batch element forward; x2.5 backward; causal halves.
    assert bench.attention_flops(1, 1, 1024, 1024, 64) == 4 * 1024 * 1024 * 64
    assert bench.attention_flops(2, 16, 512, 512, 128, causal=True) == 4 * 512 * 512 * 128 * 16
    assert bench.attention_flops(1, 2, 8, 8, 4, backward=True) == 2.5 * 4 * 8 * 8 * 4 * 2
    assert bench.decode_bytes(2, 4, 1000, 128, 2) == 2 * 2 * 4 * 1000 * 128 * 2


def test_naive_and_sdpa_agree_with_bottom_right_causal():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, n, 16, generator=g) for n in (5, 9, 9))
    k, v = k[:, :2], v[:, :2]                                      # GQA 4 -> 2
    import flashlib
    ref = flashlib.attention(q, k, v, causal=True, backend="reference")
    assert torch.allclose(bench._naive(q, k, v, True), ref, atol=1e-5)
    assert torch.allclose(bench._sdpa(q, k, v, True), ref, atol=1e-5)


def test_run_and_plot_plumbing(tmp_path):
    """The whole pipeline at toy sizes on DEVICE (interpreted kernels on a CPU, compiled on a GPU) with a
    wall-clock timer. These numbers are never shown: by default run() uses triton.testing.do_bench."""
    res = bench.run((16, 24), batch=1, heads=2, kv_heads=1, head_dim=16, dtype="float32", device=DEVICE,
                    timer=lambda fn: best_time(fn, repeat=1) * 1e3, progress=False)
    assert {r["impl"] for r in res["rows"]} == {"flashlib", "sdpa", "naive"} and len(res["rows"]) == 6
    for r in res["rows"]:
        assert r["fwd_tflops"] > 0 and r["bwd_tflops"] > 0 and r["decode_gbs"] > 0
    path = tmp_path / "bench.png"
    bench.plot(res, path)
    assert path.stat().st_size > 1000
    assert len(bench.format_results(res).splitlines()) == 7


def _cli(*args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-m", "flashlib", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=900)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a CPU-only machine prints")
def test_bench_without_gpu_says_so_and_prints_the_compile_summary():
    from conftest import require_tool
    require_tool("ptxas")
    r = _cli("bench")
    assert r.returncode == 0, r.stderr
    assert "No CUDA GPU" in r.stdout and "TFLOP" not in r.stdout
    assert "sm_80 (smem limit 163 KB)" in r.stdout and "fa2_fwd" in r.stdout


@pytest.mark.parametrize("args", [("bogus",), ("bench", "--frob"), ()])
def test_unknown_arguments_print_usage(args):
    r = _cli(*args)
    assert r.returncode == 2 and "usage: python -m flashlib" in r.stderr


def test_commands_are_a_registry():
    assert {"bench", "compile-report"} <= set(COMMANDS)
    args = build_parser().parse_args(["compile-report", "--arch", "sm_80", "--arch", "sm_90"])
    assert args.arch == ["sm_80", "sm_90"] and args.run is COMMANDS["compile-report"][2]
