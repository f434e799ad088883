"""Tests of the Makefile's GPU targets that can run on a CPU: what `make bench-gpu` runs.

The Python is a stand-in script that records its arguments, so nothing is timed: the test checks that
the sweep asks the bench for every dtype, head dim and causal combination, saves each run under
benchmarks/, and stops at the first failing run.
"""
from __future__ import annotations

import itertools
import shutil
import subprocess

from conftest import ROOT, require_tool


def _make(tmp_path, fail_on=None, **variables):
    require_tool("make")
    log = tmp_path / "calls.txt"
    fake = tmp_path / "python"
    fail = f'case "$*" in *{fail_on}*) exit 3;; esac\n' if fail_on else ""
    fake.write_text(f'#!/bin/sh\necho "$*" >> {log}\n{fail}')
    fake.chmod(0o755)
    args = [f"{k}={v}" for k, v in {"PY": fake, **variables}.items()]
    r = subprocess.run([shutil.which("make"), "-s", "-C", str(ROOT), "bench-gpu", *args],
                       capture_output=True, text=True, timeout=60)
    return r, (log.read_text().splitlines() if log.exists() else [])


def test_bench_gpu_sweeps_dtypes_head_dims_and_causal_saving_each_run(tmp_path):
    r, calls = _make(tmp_path, BENCH_NS="16 32", DECODE_NS="64 128")
    assert r.returncode == 0, r.stderr
    want = {(dtype, d, causal) for dtype, d, causal in
            itertools.product(("float16", "bfloat16"), ("64", "128"), (False, True))}
    got, decode = set(), []
    for call in calls:
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
    assert len(calls) == 10 and got == want and decode == ["float16", "bfloat16"]


def test_bench_gpu_stops_at_the_first_failing_run(tmp_path):
    r, calls = _make(tmp_path, fail_on="bfloat16")
    assert r.returncode != 0
    assert len(calls) == 5 and "bfloat16" in calls[-1]         # 4 float16 runs, then the failing one
