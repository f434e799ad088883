"""The T4 rehearsal: CPU tensors stand for a GPU in flashlib's device facts (flashlib.hardware.rehearse,
FLASHLIB_REHEARSE), and chapter 7 runs under it as on a T4 (flashlib.testing.rehearsal.run_notebook).

The hooks: kernel_dtypes (no bfloat16 on sm_75), the Triton config tables (sm_75's, with the T4's
65,536 bytes, instead of the interpreter's one config), the "triton" backend's check (bfloat16 refused
before sm_80) and decode's default split count (the T4's 40 SMs).
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from conftest import DEVICE, ROOT, require, require_module

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import flashlib  # noqa: E402
from flashlib import hardware  # noqa: E402
from flashlib.backends import triton as triton_backend  # noqa: E402
from flashlib.kernels.triton import configs, decode_v3 as decode, fa2_bwd_v2, fa2_fwd_v1, tables# noqa: E402
from flashlib.ladder.decoding import choose_num_splits  # noqa: E402
from flashlib.testing import rehearsal  # noqa: E402

CPU = torch.device("cpu")
T4 = hardware.CudaDevice(-1, "sm_75", 40, 65536)
TABLE_SPECS = (fa2_fwd_v1.SPEC, fa2_bwd_v2.DKDV_SPEC, fa2_bwd_v2.DQ_SPEC, decode.SPLIT_SPEC)

# Chapter 7's cells that only read the compile report (rows of kernels compiled for every architecture
# in child processes): no device choice in them, and a cold report costs minutes. Nothing else is
# left out.
COMPILE_REPORT_CELLS = ("fi.", "in rows", "pair[", "by[")
CHAPTER_7 = ROOT / "notebooks" / "07_triton.ipynb"


def test_rehearse_stands_in_a_gpu_and_restores_what_was_before():
    assert hardware.rehearsing() is None
    with hardware.rehearse("T4") as t4:
        assert t4 == hardware.rehearsing() == T4
        assert hardware.device_facts("cpu") == T4
        with hardware.rehearse("H100-SXM"):
            assert hardware.device_facts(CPU) == hardware.CudaDevice(-1, "sm_90", 132, 227 * 1024)
        assert hardware.rehearsing() == T4
        with pytest.raises(RuntimeError, match="inside"):
            with hardware.rehearse("A100-80GB"):
                raise RuntimeError("inside")
        assert hardware.rehearsing() == T4
    assert hardware.rehearsing() is None and hardware.device_facts("cpu") is None


def test_rehearse_refuses_a_gpu_it_does_not_know():
    with pytest.raises(ValueError, match=r"name must be one of \[.*'T4'.*\], got 'T5'"):
        with hardware.rehearse("T5"):
            pass
    with pytest.raises(TypeError, match="name must be a str naming a GPU of flashlib.hardware.GPUS, "
                                        "got int"):
        with hardware.rehearse(75):
            pass
    assert hardware.rehearsing() is None


def _in_a_fresh_python(code, rehearse):
    env = {**os.environ, hardware.REHEARSE_ENV: rehearse}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=120)


def test_the_environment_variable_rehearses_a_whole_process():
    code = "from flashlib import hardware; print(hardware.rehearsing())"
    assert _in_a_fresh_python(code, "T4").stdout.strip() == repr(T4)
    assert _in_a_fresh_python(code, "").stdout.strip() == "None"
    bad = _in_a_fresh_python(code, "T5")
    assert bad.returncode != 0
    assert "FLASHLIB_REHEARSE must be one of" in bad.stderr and "got 'T5'" in bad.stderr


def test_kernel_dtypes_on_a_rehearsed_t4_leave_out_bfloat16():
    assert hardware.kernel_dtypes("cpu") == ("float16", "bfloat16", "float32")
    with hardware.rehearse("T4"):
        assert hardware.kernel_dtypes("cpu") == ("float16", "float32")
        assert hardware.kernel_dtypes(CPU) == ("float16", "float32")
    with hardware.rehearse("L4"):
        assert hardware.kernel_dtypes("cpu") == ("float16", "bfloat16", "float32")


@pytest.mark.parametrize("spec", TABLE_SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize("block_d, elem_bytes", [(64, 2), (128, 2), (128, 4), (256, 4)])
def test_config_tables_are_the_t4s_while_rehearsing(spec, block_d, elem_bytes):
    spec = dataclasses.replace(spec)                                 # a fresh spec: empty caches
    interpreter = (tables.INTERPRETER[spec.config],)
    assert configs._device_candidates(spec, CPU, block_d, elem_bytes) == interpreter
    with hardware.rehearse("T4"):
        got = configs._device_candidates(spec, CPU, block_d, elem_bytes)
        assert got == tuple(configs.arch_candidates(spec, "sm_75", block_d, elem_bytes, limit=65536))
        assert set(got) <= set(tables.table("sm_75", elem_bytes)[spec.config])   # SM75 or SM75_FP32
        assert configs.pick_config(spec, CPU, block_d, elem_bytes) == got[0]
    with hardware.rehearse("H100-SXM"):                              # the cache keeps the stand-ins apart
        assert configs._device_candidates(spec, CPU, block_d, elem_bytes) == tuple(
            configs.arch_candidates(spec, "sm_90", block_d, elem_bytes, limit=227 * 1024))
    assert configs._device_candidates(spec, CPU, block_d, elem_bytes) == interpreter


def test_the_t4s_table_differs_from_the_interpreters():
    """Else the test above could not tell the two apart."""
    with hardware.rehearse("T4"):
        chosen = {s.config: configs.pick_config(s, CPU, 128, 2) for s in TABLE_SPECS}
    assert chosen != {s.config: tables.INTERPRETER[s.config] for s in TABLE_SPECS}


def _qkv(dtype, n=20, d=16):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, 2, n, d, generator=g).to(dtype) for _ in range(3))


@pytest.mark.skipif(DEVICE != "cpu", reason="the rehearsal is of CPU tensors (Triton's interpreter)")
def test_the_triton_backend_refuses_bfloat16_on_a_rehearsed_t4_only():
    q, k, v = _qkv(torch.bfloat16)
    with hardware.rehearse("T4"):
        with pytest.raises(ValueError, match=r"bfloat16 needs compute capability 8\.0 \(sm_80\).*sm_75"):
            flashlib.attention(q, k, v, backend="triton")
        triton_backend.check(q.half(), "forward")                   # float16 passes
    with hardware.rehearse("A100-80GB"):
        triton_backend.check(q, "forward")
    o = flashlib.attention(q, k, v, backend="triton")               # not rehearsing: a CPU takes bf16
    assert o.dtype == torch.bfloat16


def test_decode_splits_for_the_rehearsed_gpus_sms():
    from flashlib.api import CPU_SPLIT_SMS, default_num_splits
    q, k_cache = torch.zeros(1, 8, 1, 64), torch.zeros(1, 8, 8192, 64)       # 8 work items unsplit
    assert default_num_splits(q, k_cache) == choose_num_splits(8, 1, 8192, CPU_SPLIT_SMS) == 1
    with hardware.rehearse("T4"):
        assert default_num_splits(q, k_cache) == choose_num_splits(8, 1, 8192, 40) == 5
    with hardware.rehearse("H100-SXM"):
        assert default_num_splits(q, k_cache) == choose_num_splits(8, 1, 8192, 132) == 17


def test_a_faked_cuda_device_takes_the_same_road(monkeypatch):
    """The GPU path itself, on a CPU: a T4's facts where the driver's would be (cuda:0, never asked)."""
    monkeypatch.setitem(hardware._CUDA_DEVICES, 0, hardware.CudaDevice(0, "sm_75", 40, 65536))
    gpu0 = torch.device("cuda", 0)
    assert hardware.device_facts(gpu0).arch == "sm_75"
    assert hardware.kernel_dtypes(gpu0) == ("float16", "float32")
    spec = dataclasses.replace(fa2_bwd_v2.DQ_SPEC)
    assert configs._device_candidates(spec, gpu0, 128, 2) == tuple(
        configs.arch_candidates(spec, "sm_75", 128, 2, limit=65536))


# --- running a chapter under the rehearsal (nbclient, a fresh Jupyter kernel) -------------------------

def _require_jupyter():
    for name in ("nbclient", "nbformat", "ipykernel"):
        require_module(name)


def _notebook(tmp_path, *sources):
    cells = [{"cell_type": "code", "id": f"c{i}", "metadata": {}, "source": s, "outputs": [],
              "execution_count": None} for i, s in enumerate(sources)]
    path = tmp_path / "rehearsed.ipynb"
    path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    return path


CHAPTER_7_BF16_CELL = """\
import torch, flashlib
q = torch.randn(1, 2, 20, 16)
for dtype in (torch.float16, torch.bfloat16):
    flashlib.attention(*(q.to(dtype),) * 3, backend="triton")
"""


def test_run_notebook_names_the_cell_and_the_gpu_that_refused(tmp_path, capsys):
    _require_jupyter()
    before = dict(os.environ)
    path = _notebook(tmp_path,
                     "from flashlib import hardware\nassert hardware.rehearsing().arch == 'sm_75'",
                     "import flashlib.kernels.triton as ft\nassert ft.INTERPRET", CHAPTER_7_BF16_CELL,
                     "print('never reached')")
    refused = r"rehearsed\.ipynb, rehearsing a T4 \(sm_75\) on a CPU: cell 2 raised ValueError: .*sm_80"
    with pytest.raises(rehearsal.RehearsalError, match=refused):
        rehearsal.run_notebook(path, "T4")
    assert dict(os.environ) == before           # FLASHLIB_REHEARSE, TRITON_INTERPRET, PYTHONPATH restored
    assert rehearsal.main([str(path), "--gpu", "H100-SXM"]) == 1        # cell 0 fails there: not sm_75
    assert "cell 0 raised AssertionError" in capsys.readouterr().out
    ok = rehearsal.run_notebook(path, "T4", skip=("bfloat16",))
    assert ok.metadata["rehearsal"]["gpu"] == "T4" and ok.cells[2].source == ""
    assert "never reached" in ok.cells[3].outputs[0]["text"]
    assert dict(os.environ) == before                               # set for the kernels only


def test_run_notebook_checks_its_arguments(tmp_path):
    with pytest.raises(ValueError, match="name must be one of"):
        rehearsal.run_notebook(CHAPTER_7, "T5")
    with pytest.raises(ValueError, match="path must be a notebook file, got .*missing.ipynb"):
        rehearsal.run_notebook(tmp_path / "missing.ipynb")
    with pytest.raises(TypeError, match="skip must be a sequence of strings, got 'fi.'"):
        rehearsal.run_notebook(CHAPTER_7, skip="fi.")


CHAPTER_7_PAGES = sorted((ROOT / "notebooks").glob("07*_*.ipynb"))      # 07_triton, 07b_..., 07c_...


def test_the_rehearsal_leaves_out_no_cell():
    """Chapter 7's pages hold no compile-report cell any more (it moved to Appendix B): the rehearsal
    runs every cell of them."""
    assert [p.name[:3] for p in CHAPTER_7_PAGES] == ["07_", "07b", "07c"]
    for page in CHAPTER_7_PAGES:
        nb = json.loads(page.read_text())
        cells = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
        assert not [c for c in cells if any(s in c for s in COMPILE_REPORT_CELLS)], page.name


@pytest.mark.skipif(DEVICE != "cpu", reason="the rehearsal is of CPU tensors (Triton's interpreter)")
@pytest.mark.parametrize("page", CHAPTER_7_PAGES, ids=lambda p: p.stem)
def test_chapter_7_runs_as_on_a_t4(page):
    """Every cell of chapter 7's pages, as a T4 reader runs them (about a minute each)."""
    _require_jupyter()
    nb = rehearsal.run_notebook(page, "T4")
    assert nb.metadata["rehearsal"]["gpu"] == "T4"
