"""Tests of the supported-Triton range (flashlib/kernels/triton/versions.py) and what flashlib does
with it: the check at import, backend="auto" choosing another backend where Triton cannot run, the
UPCAST rule (configs.upcast_tiles: fp32 tiles where fp16 ones do not compile, sm_75 with triton 3.3.x)
reaching every launcher, the one case that still cannot fit refused clearly, and the TMA kernels
falling back to versions 1 and 2 on a Triton without tensor descriptors. Versions are faked (the
``version=`` arguments, or a child process whose triton says another version): no GPU and no other
Triton needed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import ROOT
from triton_cases import make_qkv

import flashlib
import flashlib.kernels.triton as ft
from flashlib import backends
from flashlib.backends import triton as triton_backend
from flashlib.kernels.triton import configs, decode_v3 as decode, fa2_bwd_v2, fa2_fwd_v1, fa2_fwd_v4_tma, tables, versions
from flashlib.kernels.triton.spec import KernelSpec


# ---------------------------------------------------------------------------------- versions.py itself

@pytest.mark.parametrize("text,parsed", [("3.3.1", (3, 3, 1)), ("3.5.0+git1234", (3, 5, 0)),
                                         ("3.2", (3, 2, 0)), ((3, 4), (3, 4, 0))])
def test_parse_reads_release_strings_and_tuples(text, parsed):
    assert versions.parse(text) == parsed


@pytest.mark.parametrize("bad,error", [("three", ValueError), ((3, "3"), ValueError), (3.3, TypeError)])
def test_parse_refuses_what_is_no_version(bad, error):
    with pytest.raises(error, match="version must"):
        versions.parse(bad)


def test_check_supported_refuses_older_than_the_minimum_naming_the_version_and_the_fix():
    with pytest.raises(ImportError, match=r"triton 3\.1\.0.*triton>=3\.2"):
        versions.check_supported("3.1.0")
    for ok in ("3.2.0", "3.3.1", "3.6.0", "3.9.0", "4.0.0"):
        versions.check_supported(ok)                # inside the range, or newer: no error
    versions.check_supported()                      # the installed one (the test environment's pin)


def test_the_range_covers_every_colab_runtime_and_the_pinned_triton():
    """Colab's GPU runtimes shipped 3.2.0, 3.4.0, 3.5.0, 3.6.0 (versions.py names the source); torch 2.7
    pins 3.3.x, torch 2.13 3.7.1. pyproject's extras say the same minimum, with no upper bound."""
    for v in ("3.2.0", "3.3.1", "3.4.0", "3.5.0", "3.6.0", "3.7.1", versions.COLAB, versions.PINNED):
        versions.check_supported(v)
    assert versions.parse(versions.TESTED[0])[:2] == versions.MINIMUM
    text = (ROOT / "pyproject.toml").read_text()
    wanted = f"triton>={versions.MINIMUM[0]}.{versions.MINIMUM[1]};"
    assert text.count(wanted) == 2 and "triton<" not in text and "triton>=3.0" not in text


@pytest.mark.parametrize("arch,version,tc,bf16,fp32_tiles", [
    ("sm_75", "3.2.0", True, False, False), ("sm_75", "3.3.1", False, False, True),
    ("sm_75", "3.4.0", False, True, False), ("sm_75", "3.6.0", False, True, False),
    ("sm_80", "3.3.1", True, True, False), ("sm_90a", "3.2.0", True, True, False)])
def test_version_dependent_facts(arch, version, tc, bf16, fp32_tiles):
    assert versions.mma_on_tensor_cores(arch, version) is tc
    assert versions.bf16_compiles(arch, version) is bf16
    assert versions.dot_needs_fp32_tiles(arch, version) is fp32_tiles


def test_feature_gates_and_describe():
    assert not versions.has_tensor_descriptors("3.3.1") and versions.has_tensor_descriptors("3.4.0")
    assert not versions.dumps_ptxas_log("3.4.0") and versions.dumps_ptxas_log("3.5.0")
    assert not versions.astsource_takes_attrs_dict("3.2.0")
    assert versions.astsource_takes_attrs_dict("3.3.1")
    assert "fp32 tiles" in versions.describe("3.3.1") and "tested" in versions.describe(versions.PINNED)
    assert "newer than the newest tested" in versions.describe("4.1.0")
    with pytest.raises(ValueError, match="arch must look like"):
        versions.mma_on_tensor_cores("turing", "3.3.1")


# ------------------------------------------------------------------ import check and backend="auto"

def _child(code: str) -> dict:
    """Run ``code`` in a fresh interpreter (Triton interpreted) whose triton says it is 3.1.0; it prints
    one JSON line."""
    prelude = "import triton\ntriton.__version__ = '3.1.0'\n"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_an_old_triton_is_refused_at_import_and_auto_takes_the_next_backend():
    """Finding: nothing checked the Triton version. With triton 3.1 importing the kernels raises
    ImportError naming 3.1.0 and the fix; backend="triton" says so as RuntimeError; backend="auto",
    made to choose triton for CPU tensors here as it does for CUDA ones, computes with "reference"
    instead and warns why; flashlib.auto's router leaves such a call to SDPA."""
    out = _child("""
        import json, warnings, torch, flashlib
        from flashlib import backends
        from flashlib.auto import _gpu_backend_reason
        try:
            import flashlib.kernels.triton
            imported = "imported"
        except ImportError as e:
            imported = str(e)
        q = torch.randn(1, 2, 8, 16)
        try:
            flashlib.attention(q, q, q, backend="triton")
            explicit = "ran"
        except RuntimeError as e:
            explicit = str(e)
        backends.AUTO["cpu"] = "triton"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            o = flashlib.attention(q, q, q, causal=True)
        ref = flashlib.attention(q, q, q, causal=True, backend="reference")
        print(json.dumps(dict(imported=imported, explicit=explicit, choice=backends.auto_choice(q),
                              warned=[str(w.message) for w in caught], same=bool(torch.equal(o, ref)),
                              router=_gpu_backend_reason(q))))
    """)
    assert "triton 3.1.0" in out["imported"] and "triton>=3.2" in out["imported"]
    assert out["explicit"].startswith("backend='triton' cannot run here") and "3.1.0" in out["explicit"]
    name, why = out["choice"]
    assert name == "reference" and "3.1.0" in why
    assert out["same"] and any("uses 'reference'" in w and "3.1.0" in w for w in out["warned"])
    assert "no GPU backend" in out["router"] and "3.1.0" in out["router"]


def test_auto_keeps_its_choice_where_it_can_run_and_a_refused_input_stays_refused(monkeypatch):
    q = torch.randn(1, 2, 8, 16)
    assert backends.auto_choice(q) == ("reference", None)
    monkeypatch.setitem(backends.AUTO, "cpu", "triton")        # triton 3.9 here: it runs
    assert backends.auto_choice(q) == ("triton", None)
    with pytest.raises(TypeError, match="float64"):             # the input's fault: no fallback
        backends.auto_choice(q.double())


# ------------------------------------------------------------------------------------ UPCAST, one rule

@pytest.mark.parametrize("dtype,arch,version,interpreting,want", [
    ("bfloat16", None, None, True, True), ("float16", None, None, True, False),
    ("float32", None, None, True, False),
    ("float16", "sm_75", "3.3.1", False, True), ("bfloat16", "sm_75", "3.3.0", False, True),
    ("float32", "sm_75", "3.3.1", False, False), ("float16", "sm_75", "3.4.0", False, False),
    ("float16", "sm_75", "3.2.0", False, False), ("float16", "sm_80", "3.3.1", False, False),
    ("bfloat16", "sm_90", "3.9.0", False, False)])
def test_upcast_tiles_is_true_exactly_where_fp16_tiles_fail(dtype, arch, version, interpreting, want):
    assert configs.upcast_tiles(dtype, arch, version, interpreting=interpreting) is want


def test_upcast_tiles_refuses_a_bad_dtype():
    with pytest.raises(ValueError, match="dtype_name must be"):
        configs.upcast_tiles("float64", "sm_75", "3.3.1")


def test_a_t4_with_triton_3_3_budgets_fp32_tiles(monkeypatch):
    """Finding 1: on sm_75 with triton 3.3.x the kernels load fp32 tiles, so the config choice must
    budget 4 bytes per element (SM75_FP32), as a rehearsed T4 shows on CPU tensors."""
    hardware = pytest.importorskip("flashlib.hardware")
    monkeypatch.setattr(configs, "_PLANS", {})
    q = torch.zeros(1, 1, 4, 64, dtype=torch.float16)
    monkeypatch.setattr(versions, "installed", lambda: (3, 3, 1))
    with hardware.rehearse("T4"):
        assert configs.tile_plan(q) == (False, 4)      # interpreted: fp16 tiles run as they are
    monkeypatch.setattr(configs, "_PLANS", {})
    monkeypatch.setattr(versions, "installed", lambda: (3, 6, 0))
    with hardware.rehearse("T4"):
        assert configs.tile_plan(q) == (False, 2)
    assert configs.tile_plan(q.to(torch.bfloat16)) == (True, 2)   # the interpreter's bf16 rule
    last = tables.SM75_FP32["bwd_dkdv"][-1]
    assert configs.arch_candidates(fa2_bwd_v2.DKDV_SPEC, "sm_75", 256, 4) == [last]


def test_every_launcher_takes_upcast_and_its_budget_from_tile_plan(monkeypatch):
    """Before, each launcher computed UPCAST inline (interpreter and bf16 only) and budgeted the inputs'
    element size: a T4 with triton 3.3 got fp16 tiles that do not compile. Here tile_plan is made to say
    (True, 4) for float16; every kernel with a tl.dot must be launched with UPCAST=True and budget 4
    (KernelSpec.launch sets both, for every launcher)."""
    monkeypatch.setattr(configs, "_PLANS", {})
    monkeypatch.setattr(configs, "upcast_tiles", lambda name, arch, version=None, **kw:
                        name == "float16")
    monkeypatch.setattr(configs, "device_facts", lambda device: _FakeFacts())   # a T4
    seen, budgets = [], []

    def spy_run(self, grid, args, kwargs):
        seen.append((self.name, kwargs.get("UPCAST")))

    def spy_candidates(spec, device, block_d, elem_bytes, config=None):
        budgets.append((spec.name, elem_bytes))
        return (tables.INTERPRETER[spec.config],)
    monkeypatch.setattr(KernelSpec, "_run", spy_run)
    monkeypatch.setattr(configs, "candidates", spy_candidates)
    q, k, v, do = make_qkv(1, 2, 1, 5, 40, 64, dtype=torch.float16)
    fa2_fwd_v1.forward(q, k, v, causal=True, scale=0.125)
    fa2_bwd_v2.backward(q, k, v, q, torch.zeros(1, 2, 5), do, causal=True, scale=0.125)
    decode.decode(q, k, v, None, num_splits=2, scale=0.125)
    dot_kernels = {n for n, u in seen if u is not None}
    assert dot_kernels == {"fa2_fwd", "fa2_bwd_dkdv", "fa2_bwd_dq", "decode_split"}
    assert all(u is True for n, u in seen if u is not None)
    assert sorted(budgets) == sorted((n, 4) for n in dot_kernels)


class _FakeFacts:
    arch = "sm_75"


# --------------------------------------------------------------------------- TMA kernels on old Triton

def test_descriptors_missing_names_the_version():
    why = fa2_fwd_v4_tma.descriptors_missing("3.3.1")
    assert "triton 3.3.1" in why and "3.4" in why and "versions 1 and 2" in why
    assert fa2_fwd_v4_tma.descriptors_missing("3.4.0") is None
    assert fa2_fwd_v4_tma.descriptors_missing() is None               # the pinned 3.9 has them


@pytest.mark.parametrize("old", ["3.2.0", "3.3.1"])
def test_tma_opt_in_falls_back_to_versions_1_and_2_on_a_triton_without_descriptors(old, monkeypatch):
    """Finding 6: supported() did not look at the version, so FLASHLIB_TRITON_FWD/BWD=tma chose the TMA
    kernels on triton 3.2/3.3 and failed with AttributeError (no tl.make_tensor_descriptor)."""
    monkeypatch.setattr(fa2_fwd_v4_tma, "_NO_DESCRIPTORS", fa2_fwd_v4_tma.descriptors_missing(old))
    monkeypatch.setenv("FLASHLIB_TRITON_FWD", "tma")
    monkeypatch.setenv("FLASHLIB_TRITON_BWD", "tma")
    q, k, v, do = make_qkv(1, 2, 2, 20, 20, 64, dtype=torch.float16)
    assert old in fa2_fwd_v4_tma.supported(q, k, v)
    assert triton_backend.forward_version(q, k, v) == "v1"
    assert triton_backend.backward_version(q, k, v, do) == "v2"
    with pytest.raises(ValueError, match=f"fa2_fwd_v4_tma.forward: triton {old}"):
        fa2_fwd_v4_tma.forward(q, k, v, causal=True, scale=0.125)
    q.requires_grad_(True)
    o = flashlib.attention(q, k, v, causal=True, backend="triton")      # versions 1 and 2 ran
    o.backward(do)
    assert torch.isfinite(o).all() and torch.isfinite(q.grad).all()
    assert ft.INTERPRET


# ------------------------------------------------- what triton 3.3 on a T4 cannot fit: a clear refusal

def test_refusal_names_the_two_cases_that_do_not_fit():
    """fp16 on triton 3.3.x (fp32 tiles) and fp32 on triton <= 3.2: the version matrix compiled the
    dK/dV kernel's smallest sm_75 tile at d = 256 into 66,560 B with both (3.4+: fits)."""
    why = configs.refusal("bwd_dkdv", "sm_75", 256, "float16", "3.3.1")
    assert "triton 3.3.1" in why and "66,560" in why and "3.4 or newer" in why
    why = configs.refusal("bwd_dkdv", "sm_75", 256, "float32", "3.2.0")
    assert "float32 backward" in why and "triton 3.2.0" in why and "3.4 or newer" in why
    for args in (("bwd_dkdv", "sm_75", 256, "float16", "3.4.0"),
                 ("bwd_dkdv", "sm_75", 256, "float32", "3.6.0"),
                 ("bwd_dkdv", "sm_75", 256, "float16", "3.2.0"),
                 ("bwd_dkdv", "sm_75", 128, "float16", "3.3.1"),
                 ("bwd_dkdv", "sm_75", 256, "float32", "3.3.1"),
                 ("bwd_dkdv", "sm_80", 256, "float16", "3.3.1"),
                 ("bwd_dq", "sm_75", 256, "float16", "3.3.1")):
        assert configs.refusal(*args) is None, args


def test_a_t4_with_triton_3_3_refuses_the_fp16_backward_past_d128_before_launching(monkeypatch):
    """On a rehearsed T4 with triton 3.3.1 (faked), the fp16 backward at d = 256 stops with the refusal
    instead of Triton's OutOfResources at launch; at d = 128 it runs."""
    hardware = pytest.importorskip("flashlib.hardware")
    monkeypatch.setattr(configs, "_PLANS", {})
    monkeypatch.setattr(versions, "installed", lambda: (3, 3, 1))
    ran = []
    monkeypatch.setattr(KernelSpec, "launch", lambda self, cfg=None, **values: ran.append(self.name))
    with hardware.rehearse("T4"):
        q, k, v, do = make_qkv(1, 1, 1, 4, 4, 256, dtype=torch.float16)
        with pytest.raises(RuntimeError, match=r"triton 3\.3\.1.*Upgrade Triton to 3\.4"):
            fa2_bwd_v2.backward(q, k, v, q, torch.zeros(1, 1, 4), do, causal=False, scale=0.0625)
        assert ran == []
        q, k, v, do = make_qkv(1, 1, 1, 4, 4, 128, dtype=torch.float16)
        fa2_bwd_v2.backward(q, k, v, q, torch.zeros(1, 1, 4), do, causal=False, scale=0.0625)
        assert ran == ["fa2_bwd_preprocess", "fa2_bwd_dkdv", "fa2_bwd_dq"]


def test_the_sdpa_router_leaves_such_a_training_call_to_sdpa(monkeypatch):
    """flashlib.auto routes a CUDA call needing gradients to flashlib only if its backward can run: on a
    T4 with triton 3.3 (rehearsed, faked) an fp16 call at d = 256 goes to SDPA, saying why."""
    hardware = pytest.importorskip("flashlib.hardware")
    from flashlib.auto import _gpu_backend_reason
    monkeypatch.setitem(backends.AUTO, "cpu", "triton")            # CPU tensors stand in for CUDA ones
    monkeypatch.setattr(versions, "installed", lambda: (3, 3, 1))
    q = torch.zeros(1, 2, 4, 256, dtype=torch.float16)
    with hardware.rehearse("T4"):
        assert "triton 3.3.1" in _gpu_backend_reason(q, grad=True)
        assert _gpu_backend_reason(q, grad=False) is None            # inference: the forward fits
        assert _gpu_backend_reason(q[..., :128], grad=True) is None
    assert _gpu_backend_reason(q, grad=True) is None                 # no GPU stood in for: nothing known
