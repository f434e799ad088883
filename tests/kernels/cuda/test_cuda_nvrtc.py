"""Every CUDA kernel source compiles with NVRTC, as ``backend="cuda"`` compiles it on a GPU — on a CPU.

On a GPU flashlib hands each ``csrc/*.cu`` file to NVRTC (through CuPy) with the options of
:func:`flashlib.kernels.cuda.launch.nvrtc_options` and the header dirs
:func:`flashlib.kernels.cuda.toolkit.find_include_dirs` finds. The first H100 run showed that this path
can fail while every nvcc cross-compile passes: NVRTC is its own compiler front end, with its own
rules (no host C/C++ headers unless the kernel guards them with ``__CUDACC_RTC__``; only the ``-I``
dirs it is given). NVRTC needs no GPU to compile, so this test drives NVIDIA's ``libnvrtc`` (from the
``nvidia-cuda-nvrtc`` wheel, pinned in constraints.txt) through ``ctypes`` here, for every source and
every architecture the book targets, and checks that each kernel is in the cubin. Loading and running
the result needs a GPU: tests/gpu/test_cuda_gpu.py.
"""
from __future__ import annotations

import ctypes
import functools
import glob
import importlib.util
import os

import pytest
from conftest import require

from flashlib.kernels.cuda import build, launch, toolkit

ARCHS = ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90")
SOURCES = sorted(p.name for p in build.CSRC.glob("*.cu"))


@functools.lru_cache(maxsize=None)
def libnvrtc():
    """NVRTC's shared library from the nvidia-cuda-nvrtc wheel, or None where it is not installed.
    Its builtins library is loaded first, globally: NVRTC opens it by name, which the loader finds
    only in the system's folders unless it is already loaded."""
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for lib in sorted(glob.glob(os.path.join(root, "*", "lib"))):
            main = [p for p in glob.glob(os.path.join(lib, "libnvrtc.so.*")) if ".alt." not in p]
            builtins = [p for p in glob.glob(os.path.join(lib, "libnvrtc-builtins.so.*")) if ".alt." not in p]
            if main and builtins:
                ctypes.CDLL(builtins[0], mode=ctypes.RTLD_GLOBAL)
                return ctypes.CDLL(main[0])
    return None


def nvrtc_compile(lib, text: str, name: str, options) -> tuple[int, bytes, str]:
    """``(result, cubin, log)`` of NVRTC compiling ``text`` with ``options`` (0: success)."""
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), text.encode(), name.encode(), 0, None, None) == 0
    try:
        opts = [o.encode() for o in options]
        result = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        cubin = b""
        if result == 0:
            lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value)
            assert lib.nvrtcGetCUBIN(prog, buf) == 0
            cubin = buf.raw
        return result, cubin, log.value.decode(errors="replace")
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


@pytest.fixture(scope="module")
def nvrtc():
    lib = libnvrtc()
    require(lib is not None, "NVIDIA's NVRTC library is not installed (pip install nvidia-cuda-nvrtc)")
    dirs = toolkit.find_include_dirs()
    require(dirs is not None, "no CUDA headers found for NVRTC: " + toolkit.explain(toolkit.search(stop=False)))
    return lib, launch.nvrtc_options(dirs)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", SOURCES)
def test_every_kernel_compiles_with_nvrtc_and_the_options_used_on_a_gpu(nvrtc, source, arch):
    lib, options = nvrtc
    result, cubin, log = nvrtc_compile(lib, (build.CSRC / source).read_text(), source,
                                       (*options, f"--gpu-architecture={arch}"))
    assert result == 0, f"NVRTC cannot compile {source} for {arch}:\n{log}"
    # every kernel, on every architecture: where one cannot run (v3's bf16 kernels on sm_75) its body
    # is a __trap(), and pick_version does not launch it
    names = build.kernel_names((build.CSRC / source).read_text())
    assert names, source
    missing = [n for n in names if n.encode() + b"\0" not in cubin]
    assert not missing, f"{source} for {arch}: kernels flashlib launches are not in the cubin: {missing}"


def test_nvrtc_reports_a_host_header_it_cannot_open(nvrtc):
    """The failure this test guards against, planted: an unguarded host header stops NVRTC with its
    name in the log (nvcc would have found it on the host)."""
    lib, options = nvrtc
    text = "#include <cstdio>\n" + (build.CSRC / "fa2_fwd_v1_scalar.cu").read_text()
    result, cubin, log = nvrtc_compile(lib, text, "planted", (*options, "--gpu-architecture=sm_80"))
    assert result != 0 and not cubin and "cstdio" in log
