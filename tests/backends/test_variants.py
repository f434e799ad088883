"""Kernel versions (flashlib/backends/variants.py): one table per backend and role, one pick, and the
public API's ``kernel=``, the same for Triton and CUDA."""
from __future__ import annotations

import pytest
import torch
from triton_cases import make_qkv
from conftest import DEVICE

import flashlib
from flashlib.backends import BACKENDS
from flashlib.backends.variants import Family, Variant, check_decode_kernel, check_kernel

SMALL = Family("toy forward", (
    Variant("v1", "always"),
    Variant("v2", "even lengths only", lambda n: None if n % 2 == 0 else f"length {n} is odd"),
), env="TOY_FWD", aliases={"even": "v2"})


def test_pick_takes_the_callers_version_or_says_why_it_cannot(monkeypatch):
    monkeypatch.setenv("TOY_FWD", "v1")                   # the caller's choice wins over the default
    assert SMALL.pick("v2", 4).name == "v2"
    with pytest.raises(ValueError, match=r"kernel='v2' \(toy forward\) cannot run these inputs: length 3 is odd"):
        SMALL.pick("v2", 3)
    with pytest.raises(ValueError, match=r"kernel must be one of \('v1', 'v2'\) or an alias \('even',\)"):
        SMALL.pick("v3", 4)


def test_the_environment_is_a_default_that_applies_where_it_can(monkeypatch):
    monkeypatch.delenv("TOY_FWD", raising=False)
    assert SMALL.pick(None, 4).name == "v1"                 # the first in preference order
    monkeypatch.setenv("TOY_FWD", "even")
    assert SMALL.pick(None, 4).name == "v2" and SMALL.pick(None, 3).name == "v1"
    monkeypatch.setenv("TOY_FWD", "v9")
    with pytest.raises(ValueError, match=r"TOY_FWD must be one of"):
        SMALL.pick(None, 4)
    with pytest.raises(ValueError, match=r"TOY_FWD must be one of"):
        SMALL.check_env()


def test_the_first_supported_version_is_the_default_and_none_is_a_clear_error():
    only_even = Family("strict", (Variant("v2", "even", lambda n: None if n % 2 == 0 else "odd"),))
    assert only_even.pick(None, 2).name == "v2"
    with pytest.raises(ValueError, match=r"no strict kernel runs these inputs: v2: odd"):
        only_even.pick(None, 1)


def test_the_api_argument_is_checked_against_the_backends_tables():
    triton = BACKENDS["triton"].kernels
    assert check_kernel(None, "triton", triton) == (None, None)
    assert check_kernel("v4", "triton", triton) == ("v4", None)
    assert check_kernel(("v1", "v5"), "triton", triton) == ("v1", "v5")
    assert check_kernel([None, "tma"], "triton", triton) == (None, "tma")
    with pytest.raises(ValueError, match=r"kernel must be one of \('v1', 'v4'\)"):
        check_kernel("v2", "triton", triton)            # the Triton backward's name, not a forward's
    with pytest.raises(TypeError, match="kernel must be None, a version name"):
        check_kernel(("v1", "v2", "v3"), "triton", triton)
    with pytest.raises(TypeError, match="kernel must be None, a version name"):
        check_kernel(4, "triton", triton)
    with pytest.raises(ValueError, match="backend='reference' has one forward and no versions"):
        check_kernel("v1", "reference", BACKENDS["reference"].kernels)
    assert check_decode_kernel("v3", "triton", triton) == "v3"
    with pytest.raises(ValueError, match=r"kernel must be one of \('v1',\) \(cuda decode\)"):
        check_decode_kernel("v3", "cuda", BACKENDS["cuda"].kernels)
    with pytest.raises(TypeError, match="kernel must be None or a version name"):
        check_decode_kernel(("v3",), "triton", triton)


def test_every_backend_names_its_versions_as_its_files_do():
    """Each version's summary names its file, which exists and carries the version: Triton's versions
    1-5 and CUDA's v1-v3 (one scheme: <role>_v<N>[_<idea>])."""
    import pathlib

    import flashlib.kernels.cuda as cuda_kernels
    import flashlib.kernels.triton as triton_kernels
    folders = {"cuda": pathlib.Path(cuda_kernels.__file__).parent / "csrc",
               "triton": pathlib.Path(triton_kernels.__file__).parent}
    for backend, folder in folders.items():
        for family in BACKENDS[backend].kernels.values():
            for v in family.variants:
                name = v.summary.split(":")[0]
                assert (folder / name).is_file() and f"_{v.name}" in name, (backend, v)
    assert [f.names for f in BACKENDS["triton"].kernels.values()] == [("v1", "v4"), ("v2", "v5"), ("v3",)]


@pytest.mark.parametrize("kernel, fwd, bwd", [(None, "_fwd_kernel", "_bwd_dkdv"),
                                             ("v4", "_fwd_tma_kernel", "_bwd_dkdv"),
                                             (("v4", "v5"), "_fwd_tma_kernel", "_bwd_dkdv_tma"),
                                             ((None, "v5"), "_fwd_kernel", "_bwd_dkdv_tma")])
def test_kernel_chooses_the_triton_kernels_that_run(monkeypatch, kernel, fwd, bwd):
    """The named versions run (the real kernels, in the interpreter), and agree with the default's."""
    from flashlib.kernels.triton import spec as spec_module
    ran = []
    real = spec_module.KernelSpec._run
    monkeypatch.setattr(spec_module.KernelSpec, "_run",
                        lambda self, *a: ran.append(self.fn.fn.__name__) or real(self, *a))
    monkeypatch.delenv("FLASHLIB_TRITON_FWD", raising=False)
    monkeypatch.delenv("FLASHLIB_TRITON_BWD", raising=False)
    q, k, v, do = make_qkv(1, 2, 1, 20, 27, 32, dtype=torch.float16, seed=2, device=DEVICE)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o = flashlib.attention(*leaves, causal=True, backend="triton", kernel=kernel)
    grads = torch.autograd.grad(o, leaves, do)
    assert ran == [fwd, "_bwd_preprocess", bwd, "_bwd_dq"]
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o1 = flashlib.attention(*leaves, causal=True, backend="triton")
    assert torch.equal(o, o1)                         # the interpreter: the same arithmetic, bit for bit
    assert all(torch.equal(a, b) for a, b in zip(grads, torch.autograd.grad(o1, leaves, do)))


def test_a_named_version_that_cannot_run_is_an_error_not_a_silent_fallback(monkeypatch):
    monkeypatch.setenv("FLASHLIB_TRITON_FWD", "v4")       # the environment falls back: d = 59 runs v1
    q, k, v, _ = make_qkv(1, 2, 2, 9, 9, 59, dtype=torch.float16, device=DEVICE)
    flashlib.attention(q, k, v, backend="triton")
    with pytest.raises(ValueError, match=r"kernel='v4' \(triton forward\) cannot run these inputs: .*16 bytes"):
        flashlib.attention(q, k, v, backend="triton", kernel="v4")
    with pytest.raises(ValueError, match=r"kernel: backend='reference' has one forward"):
        flashlib.attention(q, k, v, backend="reference", kernel="v1")


def test_cuda_versions_are_chosen_the_same_way():
    """The CUDA backend's table: v3 for 16-bit by default, kernel="v2" runs WMMA (the emulator on a
    CPU), and v1 refuses 16-bit inputs with the reason."""
    q, k, v, _ = make_qkv(1, 2, 1, 9, 11, 16, dtype=torch.float16, seed=5)
    cuda = BACKENDS["cuda"].kernels
    assert cuda["forward"].pick(None, q, k, v).name == "v3"
    assert cuda["forward"].pick(None, q.float(), k.float(), v.float()).name == "v1"
    with pytest.raises(ValueError, match=r"kernel='v1' \(cuda forward\) cannot run these inputs: .*float32"):
        flashlib.attention(q, k, v, backend="cuda", kernel="v1")
    o2 = flashlib.attention(q, k, v, backend="cuda", kernel="v2")
    o3 = flashlib.attention(q, k, v, backend="cuda")
    torch.testing.assert_close(o2, o3, atol=2e-3, rtol=0)
