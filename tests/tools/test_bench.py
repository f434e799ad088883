"""Tests of flashlib/tools/bench.py and its command (the parser itself: tests/test_main.py).

No GPU number is made here. The result files these tests write are synthetic (their device is called
SYNTHETIC, their times are round numbers) and live only in pytest's tmp_path, never under benchmarks/;
the only timings are toy-size CPU runs of the plumbing, which are never saved or shown.
"""
from __future__ import annotations

import json
import os
import re
import subprocess

import numpy as np
import pytest
import torch

import flashlib
from conftest import DEVICE, ROOT, require_module, run_cli
from flashlib.tools import bench
from flashlib.__main__ import COMMANDS, build_parser, main as cli_main
from flashlib.tools.measure import best_time

SYNTHETIC_DEVICE = "SYNTHETIC GPU (made up by tests/tools/test_bench.py; not a measurement)"
# impl -> (fwd_ms, bwd_ms, decode_ms); None: refused, with a reason
SYNTHETIC_TIMES = {"flashlib": (2.0, 5.0, 0.5), "sdpa-flash": (3.0, 5.0, None),
                   "sdpa-cudnn": (1.0, 10.0, 0.25), "sdpa-efficient": (None, None, 1.0), "naive": (8.0, 20.0, 2.0)}


def synthetic_results(ns=(512, 1024)) -> dict:
    """Results shaped as run() returns them on a GPU, made up for these tests and labelled so."""
    env = {"device": SYNTHETIC_DEVICE, "compute_capability": "sm_80", "sm_count": 108, "driver": "synthetic",
           "cuda": "synthetic", "torch": torch.__version__, "triton": "synthetic", "flashlib": flashlib.__version__,
           "commit": "0123456789abcdef0123456789abcdef01234567", "dirty": False, "date": "2000-01-01T00:00:00Z"}
    config = dict(ns=list(ns), batch=2, heads=8, kv_heads=2, head_dim=64, dtype="float16", causal=True,
                  timer="synthetic")
    rows = []
    for n in ns:
        for impl, times in SYNTHETIC_TIMES.items():
            row = {"n": n, "impl": impl, **dict(zip(bench.TIMES, times)), "why": {}}
            row["why"] = {key: "synthetic refusal" for key in bench.TIMES if row[key] is None}
            rows.append(row)
    return {"environment": env, "config": config, "rows": rows}


def fake_gpu(monkeypatch, arch="sm_90"):
    """torch sees a CUDA GPU of architecture ``arch``, and flashlib's device facts say so (nothing runs on
    it: the tests that use this replace bench.run)."""
    from flashlib import hardware
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(hardware, "cuda_device", lambda device=None: hardware.CudaDevice(0, arch, 40, 65536))


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
    require_module("matplotlib")  # bench.plot
    res = bench.run((16, 24), batch=1, heads=2, kv_heads=1, head_dim=16, dtype="float32", device=DEVICE,
                    timer=lambda fn: best_time(fn, repeat=1) * 1e3, progress=False)
    impls = ["flashlib", "flashlib-tma", "flashlib-cuda", *bench.SDPA_BACKENDS, "naive"]
    assert [(r["n"], r["impl"]) for r in res["rows"]] == [(n, i) for n in (16, 24) for i in impls]
    for r in res["rows"]:
        for key, derived in zip(bench.TIMES, ("fwd_tflops", "bwd_tflops", "decode_gbs")):
            if r["impl"] == "flashlib-cuda" and key == "bwd_ms":     # float32: Triton's backward, not timed twice
                assert r[key] is None and r["why"][key].startswith(bench.CUDA_NO_BACKWARD)
                assert "takes float16 and bfloat16, not float32" in r["why"][key]
            elif r["impl"] == "flashlib-tma":      # float32: the TMA kernels refuse; decode is row flashlib's
                assert r[key] is None and r[derived] is None
                assert r["why"] == {"fwd_ms": r["why"]["fwd_ms"], "bwd_ms": "not timed: the forward has no time",
                                    "decode_ms": bench.TMA_NO_DECODE}
                assert r["why"]["fwd_ms"].startswith(bench.TMA_REFUSED) and "got torch.float32" in r["why"]["fwd_ms"]
            elif r["impl"] in ("flashlib", "flashlib-cuda", "naive"):
                assert r[key] > 0 and r[derived] > 0, (r, key)
            else:                   # an SDPA backend: timed, or refused with the reason kept
                assert (r[key] > 0 and r[derived] > 0) if r[key] is not None else r["why"][key], (r, key)
    if DEVICE == "cpu":             # torch's memory-efficient and cuDNN kernels are CUDA-only: refused here
        for r in res["rows"]:
            if r["impl"] in ("sdpa-efficient", "sdpa-cudnn"):
                assert r["fwd_ms"] is None and "RuntimeError" in r["why"]["fwd_ms"]
                assert r["why"]["bwd_ms"] == "not timed: the forward has no time"
    kv = res["config"].pop("sdpa_kv")                  # GQA (2 heads on 1): how each SDPA row got K and V
    assert set(kv) == set(bench.SDPA_BACKENDS) and set(kv.values()) <= {"enable_gqa", "expanded"}
    assert res["config"] == dict(ns=[16, 24], batch=1, heads=2, kv_heads=1, head_dim=16, dtype="float32",
                                 causal=False, timer="test_run_and_plot_plumbing.<locals>.<lambda>")
    res["config"]["sdpa_kv"] = kv
    assert res["environment"]["device"] == ("cpu" if DEVICE == "cpu" else torch.cuda.get_device_name(0))
    path = tmp_path / "bench.png"
    bench.plot(res, path)
    assert path.stat().st_size > 1000
    text = bench.format_results(res)
    assert len(text.split("\n\n")[0].splitlines()) == 1 + len(res["rows"])
    assert ("refused" in text) == any(not why.startswith("not timed")
                                      for r in res["rows"] for why in r["why"].values())
    assert "flashlib-cuda's speed against SDPA" in text and "flashlib-cuda bwd: " + bench.CUDA_NO_BACKWARD in text
    assert re.search(r"\n\s*16 flashlib-tma\s+refused\s+-\s+-\n", text), text
    half = bench.run([16], batch=1, heads=2, head_dim=16, dtype="float16", device=DEVICE, timer=lambda fn: 1.0,
                     progress=False)                         # fp16: the CUDA backward is timed
    # fp16, d = 16: the CUDA backward and the TMA kernels (forward and dK/dV) are timed
    assert all(r["fwd_ms"] == r["bwd_ms"] == 1.0 for r in half["rows"]
               if r["impl"] in ("flashlib", "flashlib-cuda", "flashlib-tma")), half
    half_tma = next(r for r in half["rows"] if r["impl"] == "flashlib-tma")
    assert half_tma["decode_ms"] is None and half_tma["why"] == {"decode_ms": bench.TMA_NO_DECODE}, half_tma
    without = bench.run([16], batch=1, heads=2, head_dim=16, dtype="float32", device=DEVICE, cuda=False,
                        timer=lambda fn: 1.0, progress=False)
    assert "flashlib-cuda" not in {r["impl"] for r in without["rows"]}
    assert "flashlib-tma" in {r["impl"] for r in without["rows"]}
    no_tma = bench.run([16], batch=1, heads=2, head_dim=16, dtype="float16", device=DEVICE, cuda=False, tma=False,
                       timer=lambda fn: 1.0, progress=False)
    assert [r["impl"] for r in no_tma["rows"]] == ["flashlib", *bench.SDPA_BACKENDS, "naive"]
    with pytest.raises(TypeError, match="run: cuda must be a bool .* got 'no'"):
        bench.run([16], device=DEVICE, cuda="no", timer=lambda fn: 1.0, progress=False)
    with pytest.raises(TypeError, match="run: tma must be a bool .* got 1"):
        bench.run([16], device=DEVICE, tma=1, timer=lambda fn: 1.0, progress=False)
    saved = tmp_path / "cpu.json"
    if DEVICE == "cpu":             # a CPU's times are never saved as a result file
        with pytest.raises(ValueError, match="environment.device must be a CUDA GPU's name"):
            bench.save(res, saved)
        assert not saved.exists()
        # what run() returns is what load() gives back (here under a synthetic GPU's label, in tmp_path)
        relabelled = {**res, "environment": synthetic_results()["environment"]}
        assert bench.load(bench.save(relabelled, saved))["rows"] == res["rows"]
    else:
        assert bench.load(bench.save(res, saved))["rows"] == res["rows"]


# ------------------------------------------- "flashlib-tma": the TMA forward and the TMA dK/dV, timed

V2_DKDV, TMA_DKDV = "fa2_bwd_dkdv", "fa2_bwd_dkdv_tma"      # the dK/dV kernels' KernelSpec names
VARIABLES = ("FLASHLIB_TRITON_FWD", "FLASHLIB_TRITON_BWD")


def _spy_on_kernels(monkeypatch):
    """Replace the Triton backend's forward launcher (fa2_fwd_v1.forward, which runs version 1 or, with
    spec=fa2_fwd_v4_tma.SPEC, the TMA forward, version 4) and its backward (fa2_bwd_v2.backward, which runs
    version 2 or, with dkdv_spec=fa2_bwd_v5_tma.DKDV_SPEC, version 5's dK/dV) by spies that run the real
    kernels and record ``(kernel, (FLASHLIB_TRITON_FWD, FLASHLIB_TRITON_BWD) at the call)``: kernel "v1"
    or "tma" for a forward (by the spec launched), the dK/dV kernel's name for a backward. Returns the
    record."""
    from flashlib.kernels.triton import fa2_bwd_v2, fa2_fwd_v1, fa2_fwd_v4_tma
    calls = []

    def env():
        return tuple(os.environ.get(variable) for variable in VARIABLES)

    def forward(*args, _real=fa2_fwd_v1.forward, **kwargs):
        calls.append(("tma" if kwargs.get("spec") is fa2_fwd_v4_tma.SPEC else "v1", env()))
        return _real(*args, **kwargs)
    monkeypatch.setattr(fa2_fwd_v1, "forward", forward)

    def backward(*args, _real=fa2_bwd_v2.backward, **kwargs):
        calls.append((kwargs.get("dkdv_spec", fa2_bwd_v2.DKDV_SPEC).name, env()))
        return _real(*args, **kwargs)
    monkeypatch.setattr(fa2_bwd_v2, "backward", backward)
    return calls


# what the timer reports for the kernels that ran inside the call it timed: each row's time is shown to
# be its own kernel's and no other's (a set not listed here, e.g. a forward inside a timed backward,
# is a KeyError: the test fails)
SPY_MS = {frozenset(): 1.0, frozenset({"v1"}): 3.0, frozenset({"tma"}): 7.0, frozenset({V2_DKDV}): 5.0,
          frozenset({TMA_DKDV}): 11.0}


@pytest.mark.parametrize("outside", [None, ("tma", "tma"), ("v1", "v2")],
                         ids=["unset", "tma-outside", "default-outside"])
def test_the_tma_row_times_the_tma_kernels_and_the_flashlib_row_versions_1_and_2(monkeypatch, outside):
    """The timer reports which kernels ran inside the function it timed, so the tma row's forward time
    is shown to be the TMA forward's alone and its backward time the TMA dK/dV's (in version 2's
    backward), row "flashlib"'s version 1's and version 2's with its own dK/dV, whatever the reader's
    own FLASHLIB_TRITON_FWD and FLASHLIB_TRITON_BWD, which are as they were afterwards."""
    for variable, value in zip(VARIABLES, outside or (None, None)):
        if value is None:
            monkeypatch.delenv(variable, raising=False)
        else:
            monkeypatch.setenv(variable, value)
    calls = _spy_on_kernels(monkeypatch)

    def timer(fn):
        start = len(calls)
        fn()
        return SPY_MS[frozenset(kernel for kernel, _ in calls[start:])]
    res = bench.run((16, 40), batch=1, heads=2, kv_heads=1, head_dim=16, dtype="float16", device=DEVICE,
                    timer=timer, progress=False, cuda=False)
    assert tuple(os.environ.get(variable) for variable in VARIABLES) == (outside or (None, None))
    rows = {(r["n"], r["impl"]): r for r in res["rows"]}
    for n in (16, 40):
        tma, v12 = rows[(n, "flashlib-tma")], rows[(n, "flashlib")]
        # the forward the backward needs (its graph) runs outside the timed call: a backward time is the
        # backward's alone (the tma row's: version 2's backward launching the TMA dK/dV)
        assert (tma["fwd_ms"], tma["bwd_ms"]) == (7.0, 11.0) and tma["fwd_tflops"] > 0 and tma["bwd_tflops"] > 0
        assert tma["decode_ms"] is None and tma["decode_gbs"] is None
        assert tma["why"] == {"decode_ms": bench.TMA_NO_DECODE}, tma
        assert (v12["fwd_ms"], v12["bwd_ms"], v12["decode_ms"]) == (3.0, 5.0, 1.0) and v12["why"] == {}, v12
    # every TMA kernel ran under FLASHLIB_TRITON_FWD/BWD=v4/v5 and every version 1/2 kernel under v1/v2;
    # per N and row, two forwards (the timed one, the one the backward needs) and a backward
    assert sorted(calls) == sorted([("tma", ("v4", "v5"))] * 4 + [(TMA_DKDV, ("v4", "v5"))] * 2
                                   + [("v1", ("v1", "v2"))] * 4 + [(V2_DKDV, ("v1", "v2"))] * 2), calls


@pytest.mark.parametrize("dtype,head_dim,reason", [
    ("float32", 16, "the TMA kernels take float16 or bfloat16, got torch.float32"),
    ("bfloat16", 12, "multiples of 16 bytes (TMA needs them; d = 12: a multiple of 8"),
], ids=["float32", "bf16-d12"])
def test_the_tma_row_records_the_refusal_instead_of_timing_versions_1_and_2(monkeypatch, dtype, head_dim, reason):
    """Where the TMA kernels do not take the tensors, the tma row has no time, with the reason, and
    versions 1 and 2 (which FLASHLIB_TRITON_FWD/BWD=v4/v5 would run instead) never run under its name."""
    calls = _spy_on_kernels(monkeypatch)
    res = bench.run([16], batch=1, heads=2, head_dim=head_dim, dtype=dtype, device=DEVICE, cuda=False,
                    timer=lambda fn: (fn(), 1.0)[1], progress=False)
    tma = next(r for r in res["rows"] if r["impl"] == "flashlib-tma")
    assert (tma["fwd_ms"], tma["bwd_ms"], tma["decode_ms"]) == (None,) * 3
    assert (tma["fwd_tflops"], tma["bwd_tflops"], tma["decode_gbs"]) == (None,) * 3
    assert set(tma["why"]) == set(bench.TIMES), tma["why"]
    assert tma["why"]["fwd_ms"].startswith(f"{bench.TMA_REFUSED}: ") and reason in tma["why"]["fwd_ms"], tma["why"]
    assert tma["why"]["bwd_ms"] == "not timed: the forward has no time"
    assert tma["why"]["decode_ms"] == bench.TMA_NO_DECODE
    # versions 1 and 2 ran for row "flashlib" only (its forward, the backward's forward, its backward)
    assert sorted(calls) == sorted([("v1", ("v1", "v2"))] * 2 + [(V2_DKDV, ("v1", "v2"))]), calls
    v12 = next(r for r in res["rows"] if r["impl"] == "flashlib")
    assert (v12["fwd_ms"], v12["bwd_ms"], v12["decode_ms"]) == (1.0, 1.0, 1.0), v12
    assert re.search(r"\n\s*16 flashlib-tma\s+refused\s+-\s+-\n", bench.format_results(res))


def test_triton_kernels_sets_both_variables_and_restores_them_also_when_the_body_raises(monkeypatch):
    monkeypatch.delenv("FLASHLIB_TRITON_FWD", raising=False)
    monkeypatch.delenv("FLASHLIB_TRITON_BWD", raising=False)
    with bench.triton_kernels("v4", "v5"):
        assert (os.environ["FLASHLIB_TRITON_FWD"], os.environ["FLASHLIB_TRITON_BWD"]) == ("v4", "v5")
    assert not set(VARIABLES) & set(os.environ)                          # unset before: unset after
    monkeypatch.setenv("FLASHLIB_TRITON_FWD", "tma")                     # one set (an alias), the other unset
    with bench.triton_kernels("v1", "v2"):
        assert (os.environ["FLASHLIB_TRITON_FWD"], os.environ["FLASHLIB_TRITON_BWD"]) == ("v1", "v2")
    assert os.environ["FLASHLIB_TRITON_FWD"] == "tma" and "FLASHLIB_TRITON_BWD" not in os.environ
    monkeypatch.setenv("FLASHLIB_TRITON_FWD", "v1")
    monkeypatch.setenv("FLASHLIB_TRITON_BWD", "v2")
    with pytest.raises(ZeroDivisionError):
        with bench.triton_kernels("v4", "v5"):
            assert (os.environ["FLASHLIB_TRITON_FWD"], os.environ["FLASHLIB_TRITON_BWD"]) == ("v4", "v5")
            1 / 0
    assert (os.environ["FLASHLIB_TRITON_FWD"], os.environ["FLASHLIB_TRITON_BWD"]) == ("v1", "v2")
    # a version the backend does not have: refused naming the variable, before anything is set
    for forward, backward, message in (
            ("v2", "v5", r"triton_kernels: FLASHLIB_TRITON_FWD must be one of \('v1', 'v4'\), got 'v2'"),
            ("v4", "v1", r"triton_kernels: FLASHLIB_TRITON_BWD must be one of \('v2', 'v5'\), got 'v1'")):
        with pytest.raises(ValueError, match=message):
            with bench.triton_kernels(forward, backward):
                pytest.fail("the body ran")
        assert (os.environ["FLASHLIB_TRITON_FWD"], os.environ["FLASHLIB_TRITON_BWD"]) == ("v1", "v2")


@pytest.mark.parametrize("broken", ["fa2_fwd_tma", "fa2_bwd_dkdv_tma"])
def test_run_restores_the_variables_when_a_tma_kernel_raises(monkeypatch, broken):
    """A failure inside the tma row's timed forward or backward (the launch of the TMA forward's or the
    TMA dK/dV's KernelSpec, by its name) propagates (it is not a refusal) and leaves the reader's
    FLASHLIB_TRITON_FWD and FLASHLIB_TRITON_BWD as they were."""
    from flashlib.kernels.triton.spec import KernelSpec
    monkeypatch.delenv("FLASHLIB_TRITON_FWD", raising=False)
    monkeypatch.setenv("FLASHLIB_TRITON_BWD", "v2")
    seen = []

    def run(self, grid, args, kwargs, _real=KernelSpec._run):
        if self.name == broken:
            seen.append(tuple(os.environ.get(variable) for variable in VARIABLES))
            raise RuntimeError("a TMA-kernel failure made up by the test")
        return _real(self, grid, args, kwargs)
    monkeypatch.setattr(KernelSpec, "_run", run)
    with pytest.raises(RuntimeError, match="made up by the test"):
        bench.run([16], batch=1, heads=2, head_dim=16, dtype="float16", device=DEVICE, cuda=False,
                  timer=lambda fn: (fn(), 1.0)[1], progress=False)
    assert seen == [("v4", "v5")]
    assert "FLASHLIB_TRITON_FWD" not in os.environ and os.environ["FLASHLIB_TRITON_BWD"] == "v2"


def test_a_flashlib_tma_row_loads_and_gets_its_own_ratios_table_and_dash_dot_lines(tmp_path):
    """A file with the tma row keeps schema 1 (load accepts any impl name; files without it still load);
    its ratios have a forward and a backward, the table says why decode is missing, the plot draws both."""
    require_module("matplotlib")  # bench.plot
    results = synthetic_results(ns=(256,))
    results["rows"].insert(1, {"n": 256, "impl": "flashlib-tma", "fwd_ms": 1.5, "bwd_ms": 2.5, "decode_ms": None,
                               "why": {"decode_ms": bench.TMA_NO_DECODE}})
    loaded = bench.load(bench.save(results, tmp_path / "tma.json"))
    assert [r["impl"] for r in loaded["rows"]][:2] == ["flashlib", "flashlib-tma"]
    assert bench._flashlib_impls(loaded) == ["flashlib", "flashlib-tma"]
    assert loaded["rows"][1]["bwd_tflops"] == pytest.approx(2 * loaded["rows"][0]["bwd_tflops"])   # 5 ms / 2.5 ms
    tma = {r["baseline"]: r for r in bench.ratios(loaded, "flashlib-tma")}
    assert tma["sdpa-flash"] == {"n": 256, "baseline": "sdpa-flash", "fwd": 2.0, "bwd": 2.0, "decode": None}
    assert tma["sdpa-cudnn"]["fwd"] == pytest.approx(2 / 3) and tma["sdpa-cudnn"]["bwd"] == 4.0
    assert tma["sdpa-efficient"]["fwd"] is None and tma["sdpa-efficient"]["bwd"] is None
    text = bench.format_results(loaded)
    assert "flashlib's speed against SDPA" in text and "flashlib-tma's speed against SDPA" in text
    assert re.search(r"\n\s*256 flashlib-tma\s+\d+\.\d\s+\d+\.\d\s+-\n", text), text
    assert re.search(r"\n\s*256 sdpa-flash\s+2\.00x\s+2\.00x\s+-\n", text.split("flashlib-tma's speed")[1])
    assert re.search(r"\n\s*256 sdpa-cudnn\s+0\.67x\s+4\.00x\s+-\n", text.split("flashlib-tma's speed")[1])
    lines = text.splitlines()
    assert f"  flashlib-tma decode: {bench.TMA_NO_DECODE}" in lines
    assert not any(line.startswith("  flashlib-tma bwd") or line.startswith("  flashlib-tma fwd") for line in lines)
    fig = bench.plot(loaded)
    styles = {line.get_label(): line.get_linestyle() for ax in fig.axes for line in ax.get_lines()}
    assert styles["flashlib-tma vs sdpa-flash"] == "-." and styles["flashlib vs sdpa-flash"] == "-"
    assert "flashlib-tma" in fig.axes[1].get_legend_handles_labels()[1]          # backward TFLOP/s panel
    fwd_ratios, bwd_ratios, decode_ratios = fig.axes[3:]
    for ax, want in ((fwd_ratios, {"flashlib-tma vs sdpa-flash": 2.0, "flashlib-tma vs sdpa-cudnn": 2 / 3}),
                     (bwd_ratios, {"flashlib-tma vs sdpa-flash": 2.0, "flashlib-tma vs sdpa-cudnn": 4.0})):
        drawn = {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()
                 if line.get_label().startswith("flashlib-tma vs")}
        assert drawn == {label: [pytest.approx(y)] for label, y in want.items()}, drawn
        assert set(want) <= {t.get_text() for t in ax.get_legend().get_texts()}
    assert not any(label.startswith("flashlib-tma vs") for label in
                   decode_ratios.get_legend_handles_labels()[1])               # no decode ratio drawn
    results["rows"].pop(1)                                           # the row is optional: --no-tma
    assert bench.load(bench.save(results, tmp_path / "no-tma.json"))["rows"][1]["impl"] == "sdpa-flash"


def test_bench_no_tma_flag_skips_the_row(monkeypatch, capsys):
    """--no-tma reaches run() as tma=False (the run itself is replaced: the CLI's plumbing only)."""
    got, made_up = [], synthetic_results()
    made_up["rows"] = [bench._with_throughput(r, made_up["config"]) for r in made_up["rows"]]
    fake_gpu(monkeypatch)
    monkeypatch.setattr(bench, "run", lambda *a, **kw: got.append(kw) or made_up)
    for flags, tma in (([], True), (["--no-tma"], False), (["--no-tma", "--no-cuda"], False)):
        assert cli_main(["bench", "--n", "64", "--out", "", *flags]) == 0
        assert got[-1]["tma"] is tma and got[-1]["cuda"] is ("--no-cuda" not in flags)
    assert "flashlib's speed against SDPA" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a CPU-only machine prints")
def test_bench_without_gpu_says_so_and_prints_the_compile_summary():
    from conftest import require_tool
    require_tool("ptxas")
    r = run_cli("bench")
    assert r.returncode == 0, r.stderr
    assert "No CUDA GPU" in r.stdout and "TFLOP" not in r.stdout
    assert "sm_80 (smem limit 163 KB)" in r.stdout and "fa2_fwd" in r.stdout


def test_commands_are_a_registry():
    assert {"bench", "compile-report"} <= set(COMMANDS)
    args = build_parser().parse_args(["compile-report", "--arch", "sm_80", "--arch", "sm_90"])
    assert args.arch == ["sm_80", "sm_90"] and args.run is COMMANDS["compile-report"][2]


def test_run_refuses_bad_arguments_before_timing():
    for kwargs, field in ((dict(dtype="float8"), "config.dtype"), (dict(heads=6, kv_heads=4), "config.kv_heads"),
                          (dict(ns=[]), "config.ns"), (dict(head_dim=0), "config.head_dim")):
        with pytest.raises(ValueError, match=rf"run: {re.escape(field)} must be"):
            bench.run(**{"ns": [16], **kwargs}, device=DEVICE, timer=lambda fn: 1.0, progress=False)


def test_environment_names_versions_commit_and_utc_date(monkeypatch, tmp_path):
    env = bench.environment("cpu")
    assert set(env) == set(bench._ENV_FIELDS)
    assert env["device"] == "cpu" and env["compute_capability"] is None and env["sm_count"] is None
    assert env["torch"] == torch.__version__ and env["flashlib"] == flashlib.__version__
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", env["date"])
    if (ROOT / ".git").exists():
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
        assert env["commit"] == head and isinstance(env["dirty"], bool)
    # Installed outside a git checkout (a wheel in site-packages): "unknown", no crash.
    monkeypatch.setattr(bench, "__file__", str(tmp_path / "site-packages" / "flashlib" / "tools" / "bench.py"))
    assert bench._git_commit() == ("unknown", None)


def test_save_and_load_round_trip(tmp_path):
    results = synthetic_results()
    path = bench.save(results, tmp_path / "synthetic.json")
    data = json.loads(path.read_text())
    assert data["schema"] == bench.SCHEMA and data["config"] == results["config"]
    assert data["environment"] == results["environment"] and data["rows"] == results["rows"]
    loaded = bench.load(path)
    assert loaded["environment"] == results["environment"] and loaded["config"] == results["config"]
    c = results["config"]
    for got, want in zip(loaded["rows"], results["rows"], strict=True):
        assert {k: got[k] for k in want} == want
        n, fwd, bwd, dec = want["n"], want["fwd_ms"], want["bwd_ms"], want["decode_ms"]
        flops = bench.attention_flops(c["batch"], c["heads"], n, n, c["head_dim"], causal=True)
        assert got["fwd_tflops"] == (pytest.approx(flops / (fwd * 1e-3) / 1e12) if fwd else None)
        assert got["bwd_tflops"] == (pytest.approx(2.5 * flops / (bwd * 1e-3) / 1e12) if bwd else None)
        nbytes = bench.decode_bytes(c["batch"], c["kv_heads"], n, c["head_dim"], 2)
        assert got["decode_gbs"] == (pytest.approx(nbytes / (dec * 1e-3) / 1e9) if dec else None)
    again = bench.save(loaded, tmp_path / "again.json")            # what load returns saves to the same file
    assert again.read_text() == path.read_text()


def _spoil(data, where, value):
    """Set (or, with value=KeyError, delete) the field at the path ``where`` of a saved file's data."""
    *parents, last = where
    for key in parents:
        data = data[key]
    if value is KeyError:
        del data[last]
    else:
        data[last] = value


@pytest.mark.parametrize("where,value,message", [
    (("schema",), "flashlib-bench/0", re.escape(f"schema must be one of {bench.SCHEMAS}")),
    (("environment", "commit"), KeyError, "environment.commit must be a non-empty string"),
    (("environment", "device"), "cpu", "environment.device must be a CUDA GPU's name"),
    (("environment", "compute_capability"), None, "environment.compute_capability must be a CUDA GPU's"),
    (("environment", "sm_count"), 0, "environment.sm_count must be a positive int"),
    (("environment", "date"), "yesterday", "environment.date must be a UTC time"),
    (("config", "dtype"), "float8", "config.dtype must be one of"),
    (("config", "ns"), [], "config.ns must be a non-empty list"),
    (("config", "causal"), "yes", "config.causal must be a bool"),
    (("rows", 0, "fwd_ms"), -1.0, r"rows\[0\].fwd_ms must be a positive number"),
    (("rows", 0, "decode_ms"), KeyError, r"rows\[0\].decode_ms must be a positive number"),
    (("rows", 1, "why"), {}, r"rows\[1\].why.decode_ms must be the reason decode_ms is null"),
    (("rows", 2, "n"), 777, r"rows\[2\].n must be one of config.ns"),
    (("rows",), [], "rows must be a non-empty list"),
], ids=lambda x: "-".join(map(str, x)) if isinstance(x, tuple) else None)
def test_load_refuses_a_bad_file_naming_it_and_the_field(tmp_path, where, value, message):
    data = json.loads(bench.save(synthetic_results(), tmp_path / "good.json").read_text())
    _spoil(data, where, value)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=re.escape(str(bad)) + ": " + message):
        bench.load(bad)


def test_load_refuses_a_file_without_sdpa_from_the_same_run_or_not_json(tmp_path):
    results = synthetic_results()
    results["rows"] = [r for r in results["rows"] if not (r["impl"] == "sdpa-cudnn" and r["n"] == 1024)]
    with pytest.raises(ValueError, match="results: rows must be a row for impl='sdpa-cudnn' at n=1024"):
        bench.save(results, tmp_path / "never.json")
    assert not (tmp_path / "never.json").exists()
    bad = tmp_path / "truncated.json"
    bad.write_text('{"schema": "flashlib-bench/1", "environment": {')
    with pytest.raises(ValueError, match=re.escape(str(bad)) + ": not a JSON file"):
        bench.load(bad)


def test_ratios_are_sdpa_time_over_flashlib_time():
    results = synthetic_results(ns=(256,))
    got = {r["baseline"]: r for r in bench.ratios(results)}
    assert list(got) == list(bench.SDPA_BACKENDS)
    assert got["sdpa-flash"] == {"n": 256, "baseline": "sdpa-flash", "fwd": 1.5, "bwd": 1.0, "decode": None}
    assert got["sdpa-cudnn"] == {"n": 256, "baseline": "sdpa-cudnn", "fwd": 0.5, "bwd": 2.0, "decode": 0.5}
    assert got["sdpa-efficient"] == {"n": 256, "baseline": "sdpa-efficient", "fwd": None, "bwd": None,
                                     "decode": 2.0}
    naive = {r["baseline"]: r["fwd"] for r in bench.ratios(results, impl="naive")}
    assert naive == {"sdpa-flash": 3 / 8, "sdpa-cudnn": 1 / 8, "sdpa-efficient": None}
    with pytest.raises(ValueError, match="impl must be one of the results' implementations .* got 'fa3'"):
        bench.ratios(results, impl="fa3")


def test_format_results_shows_ratios_and_why_times_are_missing(tmp_path):
    text = bench.format_results(bench.load(bench.save(synthetic_results(ns=(256,)), tmp_path / "s.json")))
    lines = text.splitlines()
    assert re.fullmatch(r"\s*256 sdpa-efficient\s+refused\s+refused\s+\S+", lines[4])
    assert re.fullmatch(r"\s*256 sdpa-flash\s+1\.50x\s+1\.00x\s+-", lines[9])
    assert lines[-2:] == ["  sdpa-flash decode: synthetic refusal", "  sdpa-efficient fwd, bwd: synthetic refusal"]


def test_a_flashlib_cuda_row_gets_its_own_ratios_table_and_dashed_lines(tmp_path):
    """Files from before the CUDA row existed still load (above); one with it shows both of flashlib's
    rows against SDPA, the CUDA one with no backward time and the reason."""
    require_module("matplotlib")  # bench.plot
    results = synthetic_results(ns=(256,))
    results["rows"].insert(1, {"n": 256, "impl": "flashlib-cuda", "fwd_ms": 4.0, "bwd_ms": None,
                               "decode_ms": 1.0, "why": {"bwd_ms": bench.CUDA_NO_BACKWARD}})
    loaded = bench.load(bench.save(results, tmp_path / "cuda.json"))
    cuda = {r["baseline"]: r for r in bench.ratios(loaded, "flashlib-cuda")}
    assert cuda["sdpa-flash"] == {"n": 256, "baseline": "sdpa-flash", "fwd": 0.75, "bwd": None, "decode": None}
    assert cuda["sdpa-cudnn"]["decode"] == 0.25
    text = bench.format_results(loaded)
    assert "flashlib's speed against SDPA" in text and "flashlib-cuda's speed against SDPA" in text
    assert re.search(r"\n\s*256 flashlib-cuda\s+\S+\s+-\s+\S+\n", text)
    assert f"  flashlib-cuda bwd: {bench.CUDA_NO_BACKWARD}" in text.splitlines()
    fig = bench.plot(loaded)
    styles = {line.get_label(): line.get_linestyle() for ax in fig.axes for line in ax.get_lines()}
    assert styles["flashlib-cuda vs sdpa-flash"] == "--" and styles["flashlib vs sdpa-flash"] == "-"


def test_plot_file_draws_a_labelled_figure_of_a_synthetic_file(tmp_path):
    require_module("matplotlib")  # bench.plot
    path = bench.save(synthetic_results(), tmp_path / "synthetic.json")
    out = tmp_path / "synthetic.png"
    fig = bench.plot_file(path, out)
    assert out.stat().st_size > 10_000
    title = fig._suptitle.get_text()
    assert title.startswith(f"measured on {SYNTHETIC_DEVICE} (sm_80, 108 SMs, driver synthetic")
    assert "commit 0123456789;" in title and "2000-01-01T00:00:00Z" in title and "causal" in title
    ratio_axes = fig.axes[3:]
    assert [ax.get_legend_handles_labels()[1] for ax in ratio_axes] == [
        ["flashlib vs sdpa-flash", "flashlib vs sdpa-cudnn"], ["flashlib vs sdpa-flash", "flashlib vs sdpa-cudnn"],
        ["flashlib vs sdpa-cudnn", "flashlib vs sdpa-efficient"]]      # a backend with no time at all is not drawn


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a CPU-only machine does")
def test_bench_save_without_gpu_is_refused_and_writes_nothing(tmp_path, capsys):
    path = tmp_path / "never.json"
    assert cli_main(["bench", "--save", str(path), "--n", "64"]) == 1
    assert not path.exists() and not list(tmp_path.iterdir())
    err = capsys.readouterr().err
    assert "no CUDA GPU on this machine" in err and "nothing was written" in err


def check_result_file(path):
    results = bench.load(path)
    env = results["environment"]
    assert env["device"] != "cpu" and "SYNTHETIC" not in env["device"].upper(), path
    assert re.fullmatch(r"sm_\d+", env["compute_capability"]) and env["sm_count"] > 0, path
    assert any(r["impl"] == "flashlib" and r["fwd_ms"] for r in results["rows"]), path


def test_every_committed_result_file_loads_and_names_a_cuda_gpu():
    """One test over benchmarks/*.json (none yet is fine: no skip in CI); a CPU or synthetic file fails."""
    for path in sorted((ROOT / "benchmarks").glob("*.json")):
        check_result_file(path)


def test_the_committed_file_check_refuses_a_synthetic_file(tmp_path):
    path = tmp_path / "synthetic.json"
    bench.save(synthetic_results(), path)
    with pytest.raises(AssertionError):
        check_result_file(path)


def test_result_name_says_gpu_dtype_head_dim_causal_and_date():
    results = synthetic_results()
    results["environment"]["device"] = "NVIDIA H100 80GB HBM3"
    assert bench.result_name(results) == "nvidia-h100-80gb-hbm3-fp16-d64-causal-20000101T0000Z.json"
    results["config"].update(dtype="bfloat16", head_dim=128, causal=False)
    results["environment"]["date"] = "2026-11-23T20:45:59Z"
    assert bench.result_name(results) == "nvidia-h100-80gb-hbm3-bf16-d128-20261123T2045Z.json"


def test_save_into_a_folder_names_the_file(monkeypatch, tmp_path, capsys):
    """--save DIR (an existing folder) writes DIR/result_name(results); the file loads back."""
    made_up = synthetic_results()
    made_up["rows"] = [bench._with_throughput(r, made_up["config"]) for r in made_up["rows"]]
    fake_gpu(monkeypatch)
    monkeypatch.setattr(bench, "run", lambda *a, **kw: made_up)
    monkeypatch.setattr(bench, "environment", lambda *a, **kw: made_up["environment"])
    assert cli_main(["bench", "--n", "64", "--out", "", "--save", str(tmp_path)]) == 0
    want = tmp_path / bench.result_name(made_up)
    assert want.is_file() and f"results saved to {want}" in capsys.readouterr().out
    assert bench.load(want)["config"] == made_up["config"]
    with pytest.raises(SystemExit) as exited:                        # argparse's usage error
        cli_main(["bench", "--n", "64", "--out", "", "--save", str(tmp_path / "nowhere" / "x.json")])
    assert exited.value.code == 2 and "argument --save: its folder does not exist" in capsys.readouterr().err
    for not_json in (tmp_path / "results.txt", f"{tmp_path / 'missing-folder'}/"):     # refused before running
        with pytest.raises(SystemExit) as exited:
            cli_main(["bench", "--n", "64", "--out", "", "--save", str(not_json)])
        assert exited.value.code == 2
        assert "argument --save: expected FILE.json or an existing folder" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == [want.name]


def test_run_times_only_what_it_is_asked_for():
    """--only decode (a sweep to long caches) leaves forward and backward null with NOT_ASKED; --only bwd
    times the backward although no forward time was asked for (a refused forward still stops it)."""
    decode_only = bench.run([16], batch=1, heads=2, head_dim=16, dtype="float16", device=DEVICE, cuda=False,
                            timer=lambda fn: 1.0, progress=False, only=("decode_ms",))
    for r in decode_only["rows"]:
        assert r["fwd_ms"] is None and r["why"]["fwd_ms"] == bench.NOT_ASKED, r
        assert r["bwd_ms"] is None and r["why"]["bwd_ms"] == bench.NOT_ASKED, r
        if r["impl"] != "flashlib-tma":                     # its decode is row flashlib's
            assert r["decode_ms"] == 1.0, r                 # (the fake timer runs nothing: none refuses)
    bwd_only = bench.run([16], batch=1, heads=2, head_dim=16, dtype="float32", device=DEVICE, cuda=False,
                         timer=lambda fn: 1.0, progress=False, only=["bwd_ms"])
    rows = {r["impl"]: r for r in bwd_only["rows"]}
    assert rows["flashlib"]["bwd_ms"] == 1.0 and rows["flashlib"]["why"] == {
        "fwd_ms": bench.NOT_ASKED, "decode_ms": bench.NOT_ASKED}
    tma = rows["flashlib-tma"]                              # float32: refused, so its backward is not timed
    assert tma["why"]["fwd_ms"].startswith(bench.TMA_REFUSED) and tma["bwd_ms"] is None
    assert "- " in bench.format_results(bwd_only)
    for bad in ((), ("fwd",), "everything", ("fwd_ms", 3)):
        with pytest.raises(ValueError, match=r"run: only must be a non-empty subset of \('fwd_ms'"):
            bench.run([16], device=DEVICE, only=bad, timer=lambda fn: 1.0, progress=False)


def test_the_command_passes_only(monkeypatch):
    got, made_up = [], synthetic_results()
    made_up["rows"] = [bench._with_throughput(r, made_up["config"]) for r in made_up["rows"]]
    fake_gpu(monkeypatch)
    monkeypatch.setattr(bench, "run", lambda *a, **kw: got.append(kw) or made_up)
    assert cli_main(["bench", "--n", "64", "--out", "", "--only", "decode"]) == 0
    assert got[-1]["only"] == ("decode_ms",)
    assert cli_main(["bench", "--n", "64", "--out", ""]) == 0
    assert got[-1]["only"] == bench.TIMES


# ---- capability: a dtype this GPU lacks is refused before anything runs ------------------------------
@pytest.mark.parametrize("arch, dtype, refused", [("sm_75", "bfloat16", True), ("sm_75", "float16", False),
                                                  ("sm_75", "float32", False), ("sm_80", "bfloat16", False),
                                                  ("sm_90", "bfloat16", False)])
def test_the_command_refuses_a_dtype_this_gpu_lacks_with_its_own_exit_code(monkeypatch, capsys, arch, dtype,
                                                                           refused):
    """On a T4 (sm_75) `bench --dtype bfloat16` runs nothing and exits EXIT_NOT_SUPPORTED, which make
    bench-gpu reports as skipped (tests/test_make_targets.py); before, the run itself failed and the sweep
    stopped at its first bfloat16 run."""
    got, made_up = [], synthetic_results()
    made_up["rows"] = [bench._with_throughput(r, made_up["config"]) for r in made_up["rows"]]
    fake_gpu(monkeypatch, arch)
    monkeypatch.setattr(bench, "run", lambda *a, **kw: got.append(kw) or made_up)
    rc = cli_main(["bench", "--dtype", dtype, "--n", "64", "--out", ""])
    err = capsys.readouterr().err
    if refused:
        assert rc == bench.EXIT_NOT_SUPPORTED == 4 and got == []
        assert f"--dtype {dtype}: flashlib's kernels do not take {dtype} on this GPU ({arch}" in err
        assert "they take float16, float32 here" in err and "Nothing was run" in err
    else:
        assert rc == 0 and got[-1]["dtype"] == dtype and err == ""


def test_dtype_refusal_follows_kernel_dtypes_and_rejects_unknown_dtypes(monkeypatch):
    from flashlib import hardware
    assert bench.dtype_refusal("bfloat16", "cpu") is None            # the interpreter takes every dtype
    fake_gpu(monkeypatch, "sm_75")
    assert set(hardware.kernel_dtypes("cuda")) == {"float16", "float32"}
    assert "sm_75" in bench.dtype_refusal("bfloat16", "cuda") and bench.dtype_refusal("float16", "cuda") is None
    with pytest.raises(ValueError, match=r"dtype must be one of \['bfloat16', 'float16', 'float32'\], got 'float64'"):
        bench.dtype_refusal("float64")


# ---- speed goals: reported, never asserted -----------------------------------------------------------
def test_goal_line_says_met_or_missed():
    assert bench.goal_line("generate", 1.04) == ("goal met: flashlib.auto's time per generated token / plain "
                                                 "SDPA's (issue 10): 1.04 (at most 1.1)")
    assert bench.goal_line("generate", 1.25).startswith("goal MISSED: ")
    assert bench.goal_line("small", 0.5).startswith("goal met: ") and bench.goal_line("small", 0.49).startswith(
        "goal MISSED: ")
    with pytest.raises(ValueError, match="goal must be one of \\['generate', 'small'\\], got 'speed'"):
        bench.goal_line("speed", 1.0)
    for bad in (None, float("nan"), True):
        with pytest.raises(TypeError, match="value must be a finite number"):
            bench.goal_line("generate", bad)


def _fake_generation(costs):
    """A stand-in for a model's greedy generation on a CPU: each new token after the first is one
    decode-shaped SDPA call (one query per head, 8 heads on 2, against the growing cache), so
    flashlib.auto routes it to flashlib.decode; a fake clock advances ``costs[auto on?]`` per token."""
    import flashlib.auto as auto
    now = [0.0]

    def generate(model, ids, new):
        b, t = ids.shape
        g = torch.Generator().manual_seed(t)
        for step in range(1, new):
            q = torch.randn(b, 8, 1, 16, generator=g)
            kv = torch.randn(b, 2, t + step, 16, generator=g)
            torch.nn.functional.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
        now[0] += new * costs[auto.is_enabled()]
        return ids

    return generate, (lambda: now[0])


@pytest.mark.parametrize("auto_cost, met", [(1.0, True), (1.05, True), (2.0, False)])
def test_generate_per_token_times_auto_against_sdpa_and_reports_the_goal(auto_cost, met):
    """The speed check that tests/gpu/test_auto_gpu.py used to assert, moved here: the plumbing on a
    CPU with a fake clock (a token costs 1 s with plain SDPA, ``auto_cost`` s through flashlib.auto)."""
    generate, clock = _fake_generation({False: 1.0, True: auto_cost})
    got = bench.generate_per_token(batch=1, prompt=8, new=4, repeats=2, device="cpu", model=object(),
                                   generate=generate, clock=clock)
    assert got["sdpa_ms"] == pytest.approx(1000.0) and got["auto_ms"] == pytest.approx(1000.0 * auto_cost)
    assert got["ratio"] == pytest.approx(auto_cost)
    assert got["decode_calls"] == 2 * 4             # repeats x (new + 1 - 1) + repeats x (1 - 1) timed steps
    assert got["goal"].startswith("goal met: " if met else "goal MISSED: "), got["goal"]
    with pytest.raises(ValueError, match="generate_per_token: new must be a positive int, got 0"):
        bench.generate_per_token(new=0, model=object(), generate=generate, clock=clock)


def test_generate_per_token_without_calls_to_decode_measures_no_goal():
    """A model whose steps never reach flashlib.decode (here: no SDPA call at all) gives no goal verdict."""
    now = [0.0]

    def generate(model, ids, new):
        now[0] += new
        return ids

    got = bench.generate_per_token(batch=1, prompt=8, new=4, repeats=1, device="cpu", model=object(),
                                   generate=generate, clock=lambda: now[0])
    assert got["decode_calls"] == 0 and got["ratio"] == pytest.approx(1.0)
    assert got["goal"].startswith("goal not measured: ") and "no timed call went to flashlib.decode" in got["goal"]


def test_the_command_prints_the_generate_goal_or_says_what_is_missing(monkeypatch, capsys):
    import importlib.util
    fake_gpu(monkeypatch)
    monkeypatch.setattr(bench, "generate_per_token", lambda **kw: {
        "sdpa_ms": 1.0, "auto_ms": 1.3, "ratio": 1.3, "decode_calls": 64, "goal": bench.goal_line("generate", 1.3)})
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "transformers"
                        else real(name, *a))
    assert cli_main(["bench", "--generate"]) == 0
    out = capsys.readouterr().out
    assert "plain SDPA 1.000, flashlib.auto 1.300 (64 calls to flashlib.decode timed)" in out
    assert "goal MISSED: flashlib.auto's time per generated token" in out
    with pytest.raises(SystemExit) as exited:                        # argparse's usage error
        cli_main(["bench", "--generate", "--save", "x.json"])
    assert exited.value.code == 2 and "argument --save: --generate prints" in capsys.readouterr().err
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers"
                        else real(name, *a))
    assert cli_main(["bench", "--generate"]) == bench.EXIT_NOT_SUPPORTED
    assert "'transformers' is not installed" in capsys.readouterr().err


@pytest.mark.parametrize("call, error, message", [
    (lambda: bench.attention_flops(1, 1, 8, 8, 4, causal="False"), TypeError, r"causal must be a bool, got str"),
    (lambda: bench.attention_flops(1, 1, 8, 8, 4, backward=1), TypeError, r"backward must be a bool, got int 1"),
    (lambda: bench.attention_flops(-1, 1, 8, 8, 4), ValueError, r"attention_flops: batch must be an int >= 0, got -1"),
    (lambda: bench.attention_flops(1, 1, 8.5, 8, 4), TypeError, r"attention_flops: n_q must be an int >= 0, got float"),
    (lambda: bench.decode_bytes(1, 1, 8, 4, "2"), TypeError, r"decode_bytes: elem_bytes must be an int >= 0, got str"),
    (lambda: bench.decode_bytes(1, -2, 8, 4, 2), ValueError, r"decode_bytes: kv_heads must be an int >= 0, got -2"),
])
def test_the_throughput_counts_refuse_bad_arguments_naming_them(call, error, message):
    """Before: causal="False" halved the count (any truthy value was taken as causal) and a negative
    size gave a negative count."""
    with pytest.raises(error, match=message):
        call()
    assert bench.attention_flops(np.int64(1), 1, 8, 8, 4, causal=np.bool_(True)) == 4 * 8 * 8 * 4 / 2


# ---- the serving rows (issue 25): plumbing on a CPU, with a made-up clock ---------------------------
def _counting_timer():
    """A stand-in for do_bench: runs the call once, returns 1, 2, 3... ms (the rows' order), no timing."""
    seen = []

    def timer(fn):
        fn()
        seen.append(len(seen) + 1.0)
        return seen[-1]
    return timer


SMALL_SERVING = dict(batch=3, heads=4, kv_heads=2, head_dim=16, dtype="float32", max_len=40, page_size=3,
                     suffix=5, device="cpu", backend="reference")


def test_serving_times_every_row_checks_the_outputs_and_counts_the_work():
    got = bench.serving(**SMALL_SERVING, timer=_counting_timer())
    assert [r["impl"] for r in got["rows"]] == list(bench.SERVING_ROWS)
    assert got["config"] == {"batch": 3, "heads": 4, "kv_heads": 2, "head_dim": 16, "dtype": "float32",
                             "max_len": 40, "page_size": 3, "suffix": 5, "timer": "_counting_timer.<locals>.timer"}
    assert got["environment"]["device"] == "cpu"
    rows = {r["impl"]: r for r in got["rows"]}
    # timed in order: each prefill row's call then its forward + backward, then each decode call
    assert [(rows[n]["ms"], rows[n]["train_ms"]) for n in ("varlen", "padded-flashlib", "padded-sdpa")] == [
        (1.0, 2.0), (3.0, 4.0), (5.0, 6.0)]
    decode = ("paged-decode", "dense-decode", "cascade", "plain-decode")
    assert [rows[n]["ms"] for n in decode] == [7.0, 8.0, 9.0, 10.0]
    assert all(rows[n]["train_ms"] is None and rows[n]["why"] == {"train_ms": bench.SERVING_INFERENCE}
               for n in decode)
    # the same answers before timing: paged decode bit for bit the dense one
    assert set(got["checks"]) == {"varlen vs padded-sdpa", "varlen vs padded-flashlib",
                                  "paged-decode vs dense-decode", "cascade vs plain-decode"}
    assert got["checks"]["paged-decode vs dense-decode"] == 0.0
    assert max(got["checks"].values()) < 1e-5, got["checks"]
    # work: causal FLOPs over the real tokens (13, 26, 40) or the padded ones; K/V bytes read
    lens = [13, 26, 40]
    flops = sum(bench.attention_flops(1, 4, n, n, 16, causal=True) for n in lens)
    assert rows["varlen"]["work"] == flops and rows["varlen"]["unit"] == "FLOP"
    assert rows["padded-sdpa"]["work"] == rows["padded-flashlib"]["work"] == bench.attention_flops(
        3, 4, 40, 40, 16, causal=True)
    assert rows["paged-decode"]["work"] == rows["dense-decode"]["work"] == 2 * 2 * sum(lens) * 16 * 4
    assert rows["cascade"]["work"] == 2 * 2 * (40 + 3 * 5) * 16 * 4
    assert rows["plain-decode"]["work"] == 2 * 3 * 2 * (40 + 5) * 16 * 4
    assert rows["cascade"]["unit"] == "byte"
    speed = {(s["impl"], s["baseline"]): (s["ms"], s["train_ms"]) for s in bench._serving_ratios(got)}
    assert speed == {("varlen", "padded-sdpa"): (5.0, 3.0), ("varlen", "padded-flashlib"): (3.0, 2.0),
                     ("paged-decode", "dense-decode"): (8 / 7, None), ("cascade", "plain-decode"): (10 / 9, None)}
    text = bench._format_serving(got)
    assert "varlen           padded-sdpa         5.00x    3.00x" in text
    assert "paged-decode vs dense-decode: 0.00e+00" in text
    assert "cascade train_ms: not timed: decoding is inference only" in text
    assert "lengths 13..40, page size 3, cascade prefix 40 + suffix 5" in text


def test_serving_checks_would_notice_a_wrong_row(monkeypatch):
    """The checks compare real outputs: a decode that ignores its block table is caught."""
    real = flashlib.decode

    def forgetful(q, k_cache, v_cache, *, block_table=None, **kw):
        if block_table is not None:                   # read pages in their stored order, not the table's
            block_table = torch.arange(block_table.numel(), dtype=torch.int32).view(block_table.shape)
        return real(q, k_cache, v_cache, block_table=block_table, **kw)
    monkeypatch.setattr(flashlib, "decode", forgetful)
    got = bench.serving(**SMALL_SERVING, timer=_counting_timer())
    assert got["checks"]["paged-decode vs dense-decode"] > 0.01


def test_serving_refuses_bad_sizes_naming_them():
    for kwargs, message in ((dict(page_size=0), "serving: page_size must be a positive int, got 0"),
                            (dict(heads=4, kv_heads=3), r"serving: kv_heads must be a divisor of heads=4"),
                            (dict(dtype="float64"), "serving: dtype must be one of"),
                            (dict(suffix=True), "serving: suffix must be a positive int, got True")):
        with pytest.raises(ValueError, match=message):
            bench.serving(**{**SMALL_SERVING, **kwargs}, timer=_counting_timer())


def test_the_command_runs_the_serving_rows_and_prints_them(monkeypatch, capsys):
    """--serving reaches serving() with the options (the run itself replaced: the CLI's plumbing only);
    --save and --generate are refused with it; on a machine without a GPU nothing is timed."""
    made_up = bench.serving(**SMALL_SERVING, timer=_counting_timer())
    got = []
    fake_gpu(monkeypatch)
    monkeypatch.setattr(bench, "serving", lambda **kw: got.append(kw) or made_up)
    assert cli_main(["bench", "--serving", "--batch", "3", "--max-len", "40", "--page-size", "3",
                     "--suffix", "5", "--dtype", "float32"]) == 0
    assert got[-1] == {"batch": 3, "heads": 16, "kv_heads": None, "head_dim": 128, "dtype": "float32",
                       "max_len": 40, "page_size": 3, "suffix": 5}
    out = capsys.readouterr().out
    assert "speedup (baseline time / row time" in out and "cascade          plain-decode" in out
    for flags, message in ((["--save", "x.json"], "argument --save: --serving prints"),
                           (["--generate"], "argument --serving: --generate and --serving")):
        with pytest.raises(SystemExit) as exited:
            cli_main(["bench", "--serving", *flags])
        assert exited.value.code == 2 and message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["bench", "--serving", "--page-size", "0"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("flashlib.tools.compile_report.compile_report", lambda *a, **kw: None)
    monkeypatch.setattr("flashlib.tools.compile_report.summary", lambda report: "(compile summary)")
    got.clear()
    assert cli_main(["bench", "--serving"]) == 0 and got == []
    assert "No CUDA GPU on this machine: nothing to time" in capsys.readouterr().out


def test_serving_records_an_sdpa_refusal_instead_of_a_time(monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("No available kernel. Aborting execution.")
    monkeypatch.setattr(bench, "_sdpa", refuse)
    got = bench.serving(**SMALL_SERVING, timer=_counting_timer())
    sdpa = next(r for r in got["rows"] if r["impl"] == "padded-sdpa")
    assert sdpa["ms"] is None and sdpa["train_ms"] is None
    assert "No available kernel" in sdpa["why"]["ms"] and "No available kernel" in sdpa["why"]["train_ms"]
    assert "varlen vs padded-sdpa" not in got["checks"] and "varlen vs padded-flashlib" in got["checks"]
    speed = {(s["impl"], s["baseline"]): s["ms"] for s in bench._serving_ratios(got)}
    assert speed[("varlen", "padded-sdpa")] is None
    assert "padded-sdpa ms: RuntimeError: No available kernel" in bench._format_serving(got)
