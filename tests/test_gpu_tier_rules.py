"""The GPU tier's rules, checked on a CPU: no skip in tests/gpu survives FLASHLIB_REQUIRE_ALL, and its
cases are chosen by the GPU's capability when collected.

Issue 20 found tests/gpu/test_cuda_gpu.py doing ``pytest.importorskip("cupy")`` at module level: without
CuPy the whole NVRTC path "skipped" even under FLASHLIB_REQUIRE_ALL=1 and ``make test-gpu`` passed. Three
guards, tested here:

* no source in tests/gpu calls ``pytest.skip``/``importorskip``/``xfail`` or uses a skip marker (a
  missing package goes through tests/conftest.py's need_module/require, which fail under REQUIRE_ALL);
* tests/gpu/conftest.py turns any skip that still happens (an empty parameter list, say) into a failure
  under REQUIRE_ALL;
* the tier, collected with torch made to see a fake GPU (sm_70, sm_75 = a T4, sm_80, sm_90), has no
  bfloat16 case below sm_80 and no v3/CUDA-backward case below sm_75, tests those refusals instead, and
  fails to collect under REQUIRE_ALL where CuPy is missing.

The fake GPU (a pytest plugin written to tmp_path) only lets the tier be collected: nothing runs on it.
"""
from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

import pytest

from conftest import ROOT

GPU_TESTS = sorted((ROOT / "tests" / "gpu").glob("*.py"))
FORBIDDEN = {"skip", "skipif", "importorskip", "xfail"}


def forbidden_skips(text: str) -> list[str]:
    """``"line N: pytest.<what>"`` for every ``pytest.skip(...)``, ``pytest.importorskip(...)``,
    ``pytest.xfail(...)``, ``pytest.mark.skip/skipif/xfail`` and ``from pytest import skip`` in ``text``."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Attribute) and node.attr in FORBIDDEN:
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id == "pytest":
                found.append((node.lineno, f"line {node.lineno}: {ast.unparse(node)}"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pytest"):
            found += [(node.lineno, f"line {node.lineno}: from {node.module} import {a.name}")
                      for a in node.names if a.name in FORBIDDEN]
    return [text for _, text in sorted(found)]


def test_no_gpu_test_skips_by_itself():
    assert len(GPU_TESTS) >= 10
    found = {p.name: forbidden_skips(p.read_text()) for p in GPU_TESTS}
    assert not any(found.values()), {k: v for k, v in found.items() if v}


def test_the_scan_finds_the_skips_the_tier_used_to_have():
    """The lines issue 20 found (test_cuda_gpu.py, test_multi_gpu.py, test_auto_gpu.py), as they were."""
    old = ('import pytest\nfrom pytest import importorskip\npytest.importorskip("cupy")\n'
           'pytestmark = pytest.mark.skipif(n < 2, reason="needs two CUDA GPUs")\n'
           'def test_v2(dtype):\n    if dtype == 1:\n        pytest.skip("bf16 WMMA needs sm_80+")\n'
           '@pytest.mark.xfail\ndef test_x():\n    pass\n')
    assert forbidden_skips(old) == ["line 2: from pytest import importorskip", "line 3: pytest.importorskip",
                                    "line 4: pytest.mark.skipif", "line 7: pytest.skip", "line 8: pytest.mark.xfail"]
    assert forbidden_skips('from conftest import need_module\nneed_module("cupy")\nskip = 1\n') == []


FAKE_GPU = '''
import importlib.machinery, os, sys, types
import torch
ARCH = os.environ["FAKE_GPU_ARCH"]
MAJOR, MINOR = int(ARCH[:-1]), int(ARCH[-1])
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
torch.cuda.current_device = lambda: 0
torch.cuda.get_device_capability = lambda device=None: (MAJOR, MINOR)
torch.cuda.get_device_name = lambda device=None: "FAKE sm_" + ARCH
torch.cuda.get_device_properties = lambda device=None: types.SimpleNamespace(
    name="FAKE sm_" + ARCH, major=MAJOR, minor=MINOR, multi_processor_count=40,
    shared_memory_per_block_optin=65536)
for name, attrs in (("cupy", ()), ("transformers", ("LlamaConfig", "LlamaForCausalLM"))):
    if name in os.environ.get("FAKE_GPU_MISSING", "").split(","):
        sys.modules[name] = None            # find_spec answers None, import raises: missing, installed or not
    else:
        mod = types.ModuleType(name)
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
        for attr in attrs:
            setattr(mod, attr, object)
        sys.modules[name] = mod

def pytest_collection_finish(session):
    with open(os.environ["FAKE_GPU_ITEMS"], "w") as f:
        for item in session.items:
            f.write(item.nodeid + "\\t" + ",".join(sorted({m.name for m in item.iter_markers()})) + "\\n")
'''


def _collect(tmp_path, arch, *, require_all=True, missing=(), paths=("tests/gpu",), cwd=ROOT, collect=True):
    """pytest on ``paths`` with torch seeing one fake sm_<arch> GPU (and CuPy and transformers present as
    stand-ins, except ``missing``): ``(completed process, {node id: markers})``."""
    (tmp_path / "fakegpu.py").write_text(FAKE_GPU)
    items = tmp_path / f"items-{arch}.txt"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FLASHLIB_REQUIRE_ALL")}
    env.update(FAKE_GPU_ARCH=arch, FAKE_GPU_ITEMS=str(items), FAKE_GPU_MISSING=",".join(missing),
               FLASHLIB_REQUIRE_ALL="1" if require_all else "0",
               PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT), env.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "fakegpu", "-p", "no:randomly", "-p",
                        "no:cacheprovider", "-q", *(["--collect-only"] if collect else []), *paths],
                       capture_output=True, text=True, cwd=cwd, env=env, timeout=600)
    got = dict(line.split("\t") for line in items.read_text().splitlines()) if items.exists() else {}
    return r, got


@pytest.mark.parametrize("arch", ["70", "75", "80", "90"])
def test_the_tier_chooses_its_cases_by_capability_and_tests_the_refusals(tmp_path, arch):
    r, items = _collect(tmp_path, arch)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert len(items) > 100
    skipping = {i: m for i, m in items.items() if set(m.split(",")) & FORBIDDEN}
    assert not skipping, skipping                      # an empty parameter list would show up here
    refusals = {i for i in items if "refused" in i}
    bf16 = {i for i in items if "bf16" in i or "bfloat16" in i} - refusals
    v3 = {i for i in items if "cuda_gpu" in i and ("v3" in i or "cuda_backward" in i)} - refusals
    if int(arch) < 80:          # a T4 (and older): no bfloat16 case; the refusal tested for both backends
        assert not bf16, sorted(bf16)
        assert {i.split("::")[0] for i in refusals if "bf16" in i or "bfloat16" in i} == {
            "tests/gpu/test_cuda_gpu.py", "tests/gpu/test_triton_gpu.py"}
    else:
        assert len(bf16) > 50 and not refusals, sorted(refusals)
    if int(arch) < 75:          # no v3 nor CUDA backward: their refusal instead
        assert not v3, sorted(v3)
        assert "tests/gpu/test_cuda_gpu.py::test_v3_and_the_cuda_backward_are_refused_below_sm75_with_the_" \
               "documented_error" in refusals
    else:
        assert len(v3) > 20
    assert "tests/gpu/test_machine_gpu.py::test_the_machine_shows_its_gpus" in items
    assert not any("test_multi_gpu" in i for i in items)       # one GPU: not collected (not skipped)


def test_without_cupy_the_cuda_tests_fail_under_require_all_and_skip_otherwise(tmp_path):
    """The finding itself: the NVRTC path must not pass by skipping where CI-style runs require it."""
    r, _ = _collect(tmp_path, "90", missing=("cupy",), paths=("tests/gpu/test_cuda_gpu.py",))
    assert r.returncode != 0 and "Python module 'cupy' is not installed" in r.stdout + r.stderr, r.stdout[-2000:]
    r, items = _collect(tmp_path, "90", missing=("cupy",), require_all=False, paths=("tests/gpu/test_cuda_gpu.py",))
    assert r.returncode in (0, 5) and not items, r.stdout[-2000:]      # skipped with the reason, not failed
    assert "cupy" in r.stdout


def test_any_skip_left_fails_under_require_all(tmp_path):
    """tests/gpu/conftest.py's hook, on copies of both conftests and a file that skips twice (a call and
    an empty parameter list): two failures under REQUIRE_ALL, two skips without it."""
    gpu = tmp_path / "tests" / "gpu"
    gpu.mkdir(parents=True)
    (tmp_path / "tests" / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (gpu / "conftest.py").write_text((ROOT / "tests" / "gpu" / "conftest.py").read_text())
    (gpu / "test_skips.py").write_text("import pytest\n\ndef test_a():\n    pytest.skip('planted')\n\n"
                                       "@pytest.mark.parametrize('x', [])\ndef test_b(x):\n    pass\n")
    r, _ = _collect(tmp_path, "90", paths=("tests/gpu",), cwd=tmp_path, collect=False)
    tail = r.stdout.strip().splitlines()[-1]
    assert r.returncode == 1 and "skipped" not in tail, r.stdout[-3000:]     # a skip in setup: an error
    for name, why in (("test_a", "planted"), ("test_b[NOTSET]", "got empty parameter set")):
        assert (f"tests/gpu/test_skips.py::{name} was skipped (Skipped: {why}" in r.stdout
                and "FLASHLIB_REQUIRE_ALL is set: the GPU tier allows no skip" in r.stdout), r.stdout[-3000:]
    r, _ = _collect(tmp_path, "90", paths=("tests/gpu",), cwd=tmp_path, collect=False, require_all=False)
    assert "2 skipped" in r.stdout and r.returncode == 0, r.stdout[-3000:]
