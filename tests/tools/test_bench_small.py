"""Tests of the bench's small call (flashlib/tools/bench.py: SMALL_SHAPE, host_timer, small_ratios).

Issue "host overhead": a small call (B1 H8 N128 d64) should take at most twice SDPA's latency. The bench
times it back to back (host time included) for every implementation in the same run. No GPU number is
made here: runs use a fake timer or a toy CPU timing that is never saved or shown; files are synthetic.
"""
from __future__ import annotations

import json
import os
import re

import pytest
import torch

from conftest import DEVICE
from flashlib.tools import bench
from flashlib.__main__ import main as cli_main


def _recording_timer(record):
    """A small_timer that runs the call once and reports 1 ms for "flashlib" rows' inference calls, 2 ms
    for their training calls, and records what ran: (kind of result, FLASHLIB_TRITON_FWD at the call)."""
    def timer(call):
        out = call()
        kind = "grads" if isinstance(out, tuple) else "output"
        record.append((kind, tuple(out[0].shape) if kind == "grads" else tuple(out.shape),
                       os.environ.get("FLASHLIB_TRITON_FWD")))
        return 1.0 if kind == "output" else 2.0
    return timer


def test_run_times_one_small_call_of_every_implementation():
    record, before = [], os.environ.get("FLASHLIB_TRITON_FWD")
    res = bench.run([16], batch=1, heads=2, head_dim=16, dtype="float16", device=DEVICE, cuda=False,
                    timer=lambda fn: 1.0, progress=False, small=(1, 3, 20, 16),
                    small_timer=_recording_timer(record))
    small = res["small"]
    assert small["shape"] == [1, 3, 20, 16]
    rows = {r["impl"]: r for r in small["rows"]}
    assert list(rows) == ["flashlib", "flashlib-tma", *bench.SDPA_BACKENDS, "naive"]
    for impl in ("flashlib", "flashlib-tma", "naive"):
        assert rows[impl]["call_ms"] == 1.0 and rows[impl]["train_ms"] == 2.0 and rows[impl]["why"] == {}
    # every timed call ran at the small shape: outputs and gradients (1, 3, 20, 16)
    assert record and all(shape == (1, 3, 20, 16) for _, shape, _ in record)
    # the Triton rows ran their own kernels: versions 1/2 for "flashlib", the TMA kernels for "flashlib-tma"
    assert [env for _, _, env in record[:4]] == ["v1", "v1", "v4", "v4"]
    assert os.environ.get("FLASHLIB_TRITON_FWD") == before                  # restored after the row
    for impl in bench.SDPA_BACKENDS:            # timed, or refused with torch's reason (cuDNN on a CPU)
        r = rows[impl]
        assert r["call_ms"] == 1.0 or "RuntimeError" in r["why"]["call_ms"], r
    if DEVICE == "cpu":
        assert rows["sdpa-cudnn"]["call_ms"] is None and rows["sdpa-cudnn"]["train_ms"] is None
    assert "small" not in bench.run([16], batch=1, heads=2, head_dim=16, dtype="float16", device=DEVICE,
                                    cuda=False, tma=False, timer=lambda fn: 1.0, progress=False)


def test_the_tma_row_is_refused_in_float32_and_the_cuda_row_says_which_backward_is_not_its_own():
    res = bench.run([16], batch=1, heads=2, head_dim=16, dtype="float32", device=DEVICE,
                    timer=lambda fn: 1.0, progress=False, small=(1, 2, 16, 16), small_timer=lambda fn: 1.0)
    rows = {r["impl"]: r for r in res["small"]["rows"]}
    tma = rows["flashlib-tma"]
    assert tma["call_ms"] is None and tma["why"]["call_ms"].startswith(bench.TMA_REFUSED)
    cuda = rows["flashlib-cuda"]                 # float32: the CUDA backend's backward is Triton's
    assert cuda["call_ms"] == 1.0 and cuda["train_ms"] is None
    assert cuda["why"]["train_ms"].startswith(bench.CUDA_NO_BACKWARD)


@pytest.mark.parametrize("shape", [(1, 8, 128), (1, 8, 0, 64), "small", (1, 8, 128, 64.0)])
def test_run_refuses_a_bad_small_shape(shape):
    with pytest.raises(ValueError, match=re.escape("run: small must be (B, H, N, d) of positive ints")):
        bench.run([16], batch=1, heads=2, head_dim=16, dtype="float32", device=DEVICE, cuda=False, tma=False,
                  timer=lambda fn: 1.0, progress=False, small=shape, small_timer=lambda fn: 1.0)


def test_host_timer_runs_the_call_back_to_back_and_reports_ms_per_call():
    calls = []
    ms = bench.host_timer(lambda: calls.append(1), calls=5, repeats=3)
    assert len(calls) == 1 + 5 * 3                         # one warm-up call, then 3 runs of 5
    assert 0 < ms < 10
    with pytest.raises(TypeError, match="host_timer: fn must be a callable taking no arguments, got int"):
        bench.host_timer(3)
    for bad in ({"calls": 0}, {"repeats": 2.0}, {"calls": True}):
        with pytest.raises(ValueError, match=f"host_timer: {next(iter(bad))} must be a positive int"):
            bench.host_timer(lambda: None, **bad)


def synthetic_small(call=None) -> dict:
    """A small-call section shaped as run() returns it, made up for these tests (never a measurement)."""
    call = call or {"flashlib": (0.030, 0.100), "flashlib-tma": (None, None), "sdpa-flash": (0.010, 0.050),
                    "sdpa-cudnn": (0.015, None), "sdpa-efficient": (0.012, 0.040)}
    rows = []
    for impl, times in call.items():
        row = {"impl": impl, **dict(zip(bench.SMALL_TIMES, times))}
        row["why"] = {t: "synthetic refusal" for t in bench.SMALL_TIMES if row[t] is None}
        rows.append(row)
    return {"shape": list(bench.SMALL_SHAPE), "rows": rows}


def _synthetic(tmp_path):
    from test_bench import synthetic_results
    results = synthetic_results()
    results["small"] = synthetic_small()
    return results


def test_the_small_section_saves_loads_and_gives_ratios_against_sdpa(tmp_path):
    results = _synthetic(tmp_path)
    path = bench.save(results, tmp_path / "s.json")
    data = json.loads(path.read_text())
    assert data["schema"] == "flashlib-bench/2" and data["small"] == results["small"]
    loaded = bench.load(path)
    assert loaded["small"] == results["small"]
    got = {(s["impl"], s["baseline"]): (s["call"], s["train"]) for s in bench.small_ratios(loaded)}
    assert got[("flashlib", "sdpa-flash")] == (pytest.approx(1 / 3), pytest.approx(0.5))
    assert got[("flashlib", "sdpa-cudnn")] == (pytest.approx(0.5), None)
    assert got[("flashlib-tma", "sdpa-flash")] == (None, None)
    assert len(got) == 2 * len(bench.SDPA_BACKENDS)
    text = bench.format_results(loaded)
    assert re.search(r"\nflashlib\s+30\.0\s+100\.0\n", text), text               # microseconds per call
    assert re.search(r"\nflashlib\s+sdpa-flash\s+0\.33x\s+0\.50x\n", text), text
    assert "flashlib-tma (small call) call, train: synthetic refusal" in text
    # the goal (within 2x of SDPA's latency) against the fastest SDPA backend: 1/3 < 0.5, reported MISSED
    assert "\ngoal MISSED: the small call's speed against the fastest SDPA backend" in text
    assert "0.33 (at least 0.5)" in text
    assert bench.small_ratios({"rows": []}) == []


def test_a_schema_1_file_still_loads_but_may_not_hold_a_small_section(tmp_path):
    results = _synthetic(tmp_path)
    data = json.loads(bench.save(results, tmp_path / "s.json").read_text())
    old = {k: v for k, v in data.items() if k != "small"}
    old["schema"] = "flashlib-bench/1"
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert "small" not in bench.load(tmp_path / "old.json")
    (tmp_path / "odd.json").write_text(json.dumps({**data, "schema": "flashlib-bench/1"}))
    with pytest.raises(ValueError, match="small must be absent in a flashlib-bench/1 file"):
        bench.load(tmp_path / "odd.json")


@pytest.mark.parametrize("spoil,message", [
    (lambda s: s.update(shape=[1, 8, 128]), r"small.shape must be \[B, H, N, d\]"),
    (lambda s: s["rows"][0].update(call_ms=-1.0), r"small.rows\[0\].call_ms must be a positive number"),
    (lambda s: s["rows"][0].update(call_ms=None), r"small.rows\[0\].why.call_ms must be the reason"),
    (lambda s: s["rows"].pop(2), r"small.rows must be a row for each of \['sdpa-flash'\]"),
    (lambda s: s.update(rows=[]), "small.rows must be a non-empty list of dicts"),
])
def test_save_refuses_a_bad_small_section_naming_the_field(tmp_path, spoil, message):
    results = _synthetic(tmp_path)
    spoil(results["small"])
    with pytest.raises(ValueError, match="results: " + message):
        bench.save(results, tmp_path / "never.json")
    assert not (tmp_path / "never.json").exists()


def test_the_command_times_the_small_call_unless_told_not_to(monkeypatch, capsys):
    """--no-small reaches run() as small=None, else SMALL_SHAPE (the run itself is replaced)."""
    from test_bench import fake_gpu, synthetic_results
    got, made_up = [], synthetic_results()
    made_up["rows"] = [bench._with_throughput(r, made_up["config"]) for r in made_up["rows"]]
    made_up["small"] = synthetic_small()
    fake_gpu(monkeypatch)
    monkeypatch.setattr(bench, "run", lambda *a, **kw: got.append(kw) or made_up)
    assert cli_main(["bench", "--n", "64", "--out", ""]) == 0
    assert got[-1]["small"] == bench.SMALL_SHAPE == (1, 8, 128, 64)
    assert "a small call (B=1 H=8 N=128 d=64)" in capsys.readouterr().out
    assert cli_main(["bench", "--n", "64", "--out", "", "--no-small"]) == 0
    assert got[-1]["small"] is None


def test_the_command_runs_without_tqdm_and_matplotlib(monkeypatch, capsys, tmp_path):
    """A GPU machine's bare Python (make test-gpu PY=python3) may lack both: no bar, no plot, said so."""
    import importlib.util
    from test_bench import fake_gpu, synthetic_results
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("tqdm", "matplotlib") else real(name, *a))
    got, made_up = [], synthetic_results()
    made_up["rows"] = [bench._with_throughput(r, made_up["config"]) for r in made_up["rows"]]
    fake_gpu(monkeypatch)
    monkeypatch.setattr(bench, "run", lambda *a, **kw: got.append(kw) or made_up)
    assert cli_main(["bench", "--n", "64", "--out", str(tmp_path / "p.png")]) == 0
    assert got[-1]["progress"] is False and not (tmp_path / "p.png").exists()
    assert "matplotlib is not installed, so no plot was drawn" in capsys.readouterr().err
    monkeypatch.setattr(importlib.util, "find_spec", real)
    assert cli_main(["bench", "--n", "64", "--out", str(tmp_path / "p.png")]) == 0
    assert got[-1]["progress"] is (real("tqdm") is not None)           # with them: the bar and the plot
    assert (tmp_path / "p.png").exists() is (real("matplotlib") is not None)


def test_sdpa_reads_gqa_k_and_v_as_they_are_where_its_backend_takes_enable_gqa(monkeypatch):
    """A GQA run (4 query heads on 1 kv head): each SDPA row that takes enable_gqa gets K and V with one
    head, as flashlib does, so a decode step of both reads the same bytes; the others get K and V
    expanded to 4 heads before timing. config["sdpa_kv"] says which, and a file keeps it."""
    import torch.nn.functional as F
    real, seen = F.scaled_dot_product_attention, []

    def spy(q, k, v, *args, **kwargs):
        seen.append((k.shape[1], kwargs.get("enable_gqa", False)))
        return real(q, k, v, *args, **kwargs)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    timed = []                                   # the SDPA calls inside each timed call, in order

    def timer(fn):
        seen.clear()
        fn()
        timed.append(list(seen))
        return 1.0
    res = bench.run([16], batch=1, heads=4, kv_heads=1, head_dim=16, dtype="float32", device=DEVICE,
                    cuda=False, tma=False, progress=False, timer=timer)
    kv = res["config"]["sdpa_kv"]
    assert set(kv) == set(bench.SDPA_BACKENDS)
    sdpa_calls = [calls for calls in timed if calls]     # flashlib's and naive's timed calls make none
    if DEVICE == "cpu":   # torch's CPU flash kernel takes enable_gqa; cuDNN and efficient are CUDA-only (refused)
        assert kv == {"sdpa-flash": "enable_gqa", "sdpa-cudnn": "expanded", "sdpa-efficient": "expanded"}
        assert sdpa_calls == [[(1, True)], [(1, True)]]  # sdpa-flash's forward and decode: one kv head
    else:
        wanted = [(1, True) if mode == "enable_gqa" else (4, False) for mode in kv.values()]
        assert all(call in wanted for calls in sdpa_calls for call in calls), sdpa_calls
    mha = bench.run([16], batch=1, heads=2, head_dim=16, dtype="float32", device=DEVICE, cuda=False, tma=False,
                    progress=False, timer=lambda fn: 1.0)
    assert "sdpa_kv" not in mha["config"]                  # MHA: nothing to say


@pytest.mark.parametrize("kv", [{"sdpa-fast": "expanded"}, {"sdpa-flash": "copied"}, "expanded"])
def test_load_refuses_a_bad_sdpa_kv(tmp_path, kv):
    from test_bench import synthetic_results
    results = synthetic_results()
    results["config"]["sdpa_kv"] = kv
    with pytest.raises(ValueError, match="results: config.sdpa_kv must be"):
        bench.save(results, tmp_path / "never.json")
    results["config"]["sdpa_kv"] = {"sdpa-flash": "enable_gqa", "sdpa-cudnn": "expanded"}
    assert bench.load(bench.save(results, tmp_path / "ok.json"))["config"]["sdpa_kv"] == results["config"]["sdpa_kv"]
