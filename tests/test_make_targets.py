"""Tests of the Makefile's GPU targets that can run on a CPU: what `make bench-gpu` and `make test-gpu` run.

The Python is a stand-in script that records its arguments (and the environment variables the GPU tier
reads), so nothing is timed or tested: the tests check that the sweep asks the bench for every dtype,
head dim and causal combination, saves each run under benchmarks/, reports a run the GPU cannot make
(flashlib.tools.bench.EXIT_NOT_SUPPORTED: bfloat16 on a T4) as skipped and goes on, stops at any other
failure, and repeats every MISSED speed goal at the end; and that the GPU tier runs under
FLASHLIB_REQUIRE_ALL=1 unless told otherwise.
"""
from __future__ import annotations

import itertools
import shutil
import subprocess

from conftest import ROOT, require_tool
from flashlib.tools import bench


def _make(tmp_path, target="bench-gpu", fail_on=None, code=3, say="", **variables):
    """``make <target>`` with PY a stand-in that logs ``$*`` (and FLASHLIB_REQUIRE_ALL, FLASHLIB_GPU_COUNT)
    and exits ``code`` when its arguments contain ``fail_on``; it prints ``say`` when they contain
    --generate."""
    require_tool("make")
    log = tmp_path / "calls.txt"
    fake = tmp_path / "python"
    fail = f'case "$*" in *{fail_on}*) exit {code};; esac\n' if fail_on else ""
    speak = f'case "$*" in *--generate*) echo "{say}";; esac\n' if say else ""
    fake.write_text(f'#!/bin/sh\necho "$* | REQUIRE_ALL=$FLASHLIB_REQUIRE_ALL GPUS=$FLASHLIB_GPU_COUNT" >> {log}\n'
                    f'{speak}{fail}')
    fake.chmod(0o755)
    args = [f"{k}={v}" for k, v in {"PY": fake, "BENCH_LOG": tmp_path / "bench.log", **variables}.items()]
    r = subprocess.run([shutil.which("make"), "-s", "-C", str(ROOT), target, *args],
                       capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    calls = log.read_text().splitlines() if log.exists() else []
    return r, [c.split(" | ")[0] for c in calls], calls


def test_bench_gpu_sweeps_dtypes_head_dims_and_causal_saving_each_run(tmp_path):
    r, calls, _ = _make(tmp_path, BENCH_NS="16 32", DECODE_NS="64 128")
    assert r.returncode == 0, r.stderr
    want = {(dtype, d, causal) for dtype, d, causal in
            itertools.product(("float16", "bfloat16"), ("64", "128"), (False, True))}
    got, decode = set(), []
    assert calls[-1] == "-m flashlib bench --generate"       # last: flashlib.auto's time per token
    for call in calls[:-1]:
        words = call.split()
        assert words[:3] == ["-m", "flashlib", "bench"] and words[words.index("--save") + 1] == "benchmarks/", call
        if "--only" in words:                              # the decode sweep: a Llama-like GQA shape
            assert words[words.index("--only") + 1] == "decode" and "--no-small" in words, call
            assert [words[words.index(f) + 1] for f in ("--batch", "--heads", "--kv-heads", "--head-dim")] == \
                ["1", "32", "8", "128"], call
            assert words[words.index("--n") + 1:][:2] == ["64", "128"], call
            decode.append(words[words.index("--dtype") + 1])
            continue
        assert words[words.index("--n") + 1:][:2] == ["16", "32"], call
        got.add((words[words.index("--dtype") + 1], words[words.index("--head-dim") + 1], "--causal" in words))
    assert len(calls) == 11 and got == want and decode == ["float16", "bfloat16"]
    assert "no speed goal measured here was missed" in r.stdout


def test_bench_gpu_stops_at_the_first_failing_run(tmp_path):
    r, calls, _ = _make(tmp_path, fail_on="bfloat16")
    assert r.returncode != 0 and "Error 3" in r.stderr          # make names the recipe's exit code
    assert len(calls) == 5 and "bfloat16" in calls[-1]         # 4 float16 runs, then the failing one
    assert "bench-gpu: stopped, exit 3: bench --dtype bfloat16" in r.stdout


def test_bench_gpu_reports_a_run_this_gpu_cannot_make_as_skipped_and_goes_on(tmp_path):
    """A T4: every bfloat16 run exits EXIT_NOT_SUPPORTED having run nothing; the sweep makes all its runs
    (before, it stopped at the first bfloat16 one) and succeeds, naming each skipped run."""
    r, calls, _ = _make(tmp_path, fail_on="bfloat16", code=bench.EXIT_NOT_SUPPORTED)
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(calls) == 11
    skipped = [line for line in r.stdout.splitlines() if line.startswith("bench-gpu: skipped, not supported here")]
    assert len(skipped) == 5 and all("--dtype bfloat16" in line for line in skipped), r.stdout


def test_bench_gpu_repeats_every_missed_goal_at_the_end_without_failing(tmp_path):
    missed = bench.goal_line("generate", 1.4)
    r, calls, _ = _make(tmp_path, say=missed)
    assert r.returncode == 0, r.stderr
    tail = r.stdout.splitlines()[-2:]
    assert tail == ["bench-gpu: speed goals MISSED on this GPU:", missed], r.stdout


def test_test_gpu_runs_the_gpu_tier_under_require_all_and_states_the_gpu_count(tmp_path):
    r, _, raw = _make(tmp_path, target="test-gpu")
    assert r.returncode == 0, r.stderr
    tier = [c for c in raw if "pytest" in c and c.split(" | ")[0].endswith("tests/gpu")]
    rest = [c for c in raw if "pytest" in c and c.split(" | ")[0].endswith(" tests")]
    assert len(tier) == 1 and tier[0].endswith("| REQUIRE_ALL=1 GPUS=1"), raw
    assert len(rest) == 1 and rest[0].endswith("| REQUIRE_ALL= GPUS="), raw      # the library suite: as set
    assert any(c.startswith("-m flashlib check") for c in raw)
    (tmp_path / "again").mkdir()
    r, _, raw = _make(tmp_path / "again", target="test-gpu", REQUIRE_ALL=0, GPUS=2)
    tier = [c for c in raw if "pytest" in c and c.split(" | ")[0].endswith("tests/gpu")]
    assert len(tier) == 1 and tier[0].endswith("| REQUIRE_ALL=0 GPUS=2"), raw
