"""Tests of flashlib/tools/bench.py and its command (the parser itself: tests/test_main.py).

No GPU number is made here. The result files these tests write are synthetic (their device is called
SYNTHETIC, their times are round numbers) and live only in pytest's tmp_path, never under benchmarks/;
the only timings are toy-size CPU runs of the plumbing, which are never saved or shown.
"""
from __future__ import annotations

import json
import re
import subprocess

import pytest
import torch

import flashlib
from conftest import DEVICE, ROOT, run_cli
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
    impls = ["flashlib", "flashlib-cuda", *bench.SDPA_BACKENDS, "naive"]
    assert [(r["n"], r["impl"]) for r in res["rows"]] == [(n, i) for n in (16, 24) for i in impls]
    for r in res["rows"]:
        for key, derived in zip(bench.TIMES, ("fwd_tflops", "bwd_tflops", "decode_gbs")):
            if r["impl"] == "flashlib-cuda" and key == "bwd_ms":     # float32: Triton's backward, not timed twice
                assert r[key] is None and r["why"][key].startswith(bench.CUDA_NO_BACKWARD)
                assert "takes float16 and bfloat16, not float32" in r["why"][key]
            elif r["impl"] in ("flashlib", "flashlib-cuda", "naive"):
                assert r[key] > 0 and r[derived] > 0, (r, key)
            else:                   # an SDPA backend: timed, or refused with the reason kept
                assert (r[key] > 0 and r[derived] > 0) if r[key] is not None else r["why"][key], (r, key)
    if DEVICE == "cpu":             # torch's memory-efficient and cuDNN kernels are CUDA-only: refused here
        for r in res["rows"]:
            if r["impl"] in ("sdpa-efficient", "sdpa-cudnn"):
                assert r["fwd_ms"] is None and "RuntimeError" in r["why"]["fwd_ms"]
                assert r["why"]["bwd_ms"] == "not timed: the forward has no time"
    assert res["config"] == dict(ns=[16, 24], batch=1, heads=2, kv_heads=1, head_dim=16, dtype="float32",
                                 causal=False, timer="test_run_and_plot_plumbing.<locals>.<lambda>")
    assert res["environment"]["device"] == ("cpu" if DEVICE == "cpu" else torch.cuda.get_device_name(0))
    path = tmp_path / "bench.png"
    bench.plot(res, path)
    assert path.stat().st_size > 1000
    text = bench.format_results(res)
    assert len(text.split("\n\n")[0].splitlines()) == 1 + len(res["rows"])
    assert ("refused" in text) == any(not why.startswith("not timed")
                                      for r in res["rows"] for why in r["why"].values())
    assert "flashlib-cuda's speed against SDPA" in text and "flashlib-cuda bwd: " + bench.CUDA_NO_BACKWARD in text
    half = bench.run([16], batch=1, heads=2, head_dim=16, dtype="float16", device=DEVICE, timer=lambda fn: 1.0,
                     progress=False)                         # fp16: the CUDA backward is timed
    assert all(r["bwd_ms"] == 1.0 for r in half["rows"] if r["impl"] in ("flashlib", "flashlib-cuda")), half
    without = bench.run([16], batch=1, heads=2, head_dim=16, dtype="float32", device=DEVICE, cuda=False,
                        timer=lambda fn: 1.0, progress=False)
    assert "flashlib-cuda" not in {r["impl"] for r in without["rows"]}
    with pytest.raises(TypeError, match="run: cuda must be a bool .* got 'no'"):
        bench.run([16], device=DEVICE, cuda="no", timer=lambda fn: 1.0, progress=False)
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
    (("schema",), "flashlib-bench/0", "schema must be 'flashlib-bench/1'"),
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
