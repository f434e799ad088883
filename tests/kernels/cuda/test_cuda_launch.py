"""flashlib.kernels.cuda.launch without a GPU: grids within CUDA's limits for any B x H, and the GPU path's
Python side (torch -> CuPy conversion, compile choice) with CuPy replaced by a fake.

The launch itself (``fn(grid, block, args)``) and NVRTC need a GPU: tests/gpu/test_cuda_gpu.py.
"""
from __future__ import annotations

import re
import sys
import types

import pytest

import flashlib.kernels.cuda as fc
from flashlib.kernels.cuda import build, launch, toolkit
from flashlib.tools import toolchain
from flashlib.hardware import CUDA_GRID_MAX

torch = pytest.importorskip("torch")


def all_specs(b, h, hkv, nq, nk, d):
    """Every kernel's LaunchSpecs at one shape: v1, v2, v3 and the backward (f16, bf16), decode split +
    combine (3 dtypes)."""
    specs = launch.v1_launch(b, h, hkv, nq, nk, d, 1.0, True)
    for dt in ("f16", "bf16"):
        specs += launch.v2_launch(b, h, hkv, nq, nk, d, 1.0, True, dt)
        specs += launch.v3_launch(b, h, hkv, nq, nk, d, 1.0, True, dt)
        if d <= launch.BWD_HEAD_DIMS[-1]:                # the backward stops at d = 128
            specs += launch.bwd_launch(b, h, hkv, nq, nk, d, 1.0, True, dt)
    for dt in ("f32", "f16", "bf16"):
        specs += launch.decode_launch(b, h, hkv, 1, nk, d, 1.0, False, 4, dt)
    return specs


# B x H = 131072 (above 65,535 in either factor) and B = 100,000 sequences of 16 tokens.
@pytest.mark.parametrize("b, h, hkv, n, d", [(131072, 1, 1, 16, 64), (1024, 128, 8, 300, 128),
                                             (100000, 1, 1, 16, 64), (1, 131072, 1, 2, 16)])
def test_every_grid_is_within_cuda_limits(b, h, hkv, n, d):
    specs = all_specs(b, h, hkv, n, n, d)
    family = lambda kernel: re.sub(r"_d\d+$", "", kernel)      # v3 has one kernel per head-dim bucket  # noqa: E731
    assert {family(s.kernel) for s in specs} == {family(s.kernel) for _, s in fc.compile_configs()}
    for s in specs:
        x, y, z = s.grid
        assert all(1 <= n <= limit for n, limit in zip((x, y, z), CUDA_GRID_MAX)), s
        bx, by, bz = s.block
        assert bx * by * bz <= 1024
    tiles = {"fa2_fwd_v1_f32": -(-n // launch.v1_tile(d)[0]), "fa2_fwd_v2_f16": -(-n // launch.v2_tile(d)[0])}
    tiles["fa2_fwd_v2_bf16"] = tiles["fa2_fwd_v2_f16"]
    tiles.update({f"fa2_fwd_v3_{dt}_d{launch.v3_tile(d)[0]}": -(-n // launch.v3_tile(d)[1]) for dt in ("f16", "bf16")})
    rows64 = -(-n // (16 * launch.BWD_WARPS))              # the backward: 64 keys (dK/dV) or queries (dQ) a block
    for dt in ("f16", "bf16"):
        dim = launch.bwd_tile(d)[0]
        tiles.update({f"fa2_bwd_v1_dq_{dt}_d{dim}": rows64, f"fa2_bwd_v1_delta_{dt}": -(-n // launch.BWD_WARPS)})
    for s in specs:                                      # one block per (tile | split | row, head, batch)
        per_bh = tiles.get(s.kernel, 4 if "split" in s.kernel else 1)
        heads = hkv if "_dkdv_" in s.kernel else h       # dK/dV: a block per 64 keys of a kv head
        if "_dkdv_" in s.kernel:
            per_bh = rows64
        assert s.grid == (per_bh * heads * b, 1, 1), s


def test_a_grid_beyond_cudas_limit_is_a_value_error():
    assert launch.flat_grid(3, 5, 7) == (105, 1, 1)
    with pytest.raises(ValueError, match="outside CUDA's grid limit"):
        launch.flat_grid(2 ** 16, 2 ** 16)
    with pytest.raises(ValueError, match="outside CUDA's grid limit"):
        launch.decode_launch(2 ** 20, 64, 8, 1, 10, 64, 1.0, False, 2 ** 12, "f16")


# ---- the kernels' constants, read from their sources ------------------------------------------------
@pytest.mark.parametrize("source, declaration, value", [
    ("fa2_fwd_v1_scalar.cu", "constexpr int V1_BC = ", lambda: launch.V1_BC),
    ("fa2_fwd_v2_wmma.cu", "constexpr int BC = ", lambda: launch.V2_BC),
    ("decode_v1_splitkv.cu", "constexpr int THREADS = ", lambda: launch.DECODE_THREADS)])
def test_launch_uses_the_constants_the_sources_declare(source, declaration, value):
    text = (build.CSRC / source).read_text()
    assert f"{declaration}{value()};" in text
    assert build.cu_constant(source, declaration.split()[-2]) == value()
    edited = text.replace(f"{declaration}{value()};", f"{declaration}{2 * value()};")   # read, not copied
    assert build.cu_constant((source, edited), declaration.split()[-2]) == 2 * value()


def test_the_geometry_follows_the_constants():
    spec, = launch.v1_launch(1, 1, 1, 64, 64, 64, 1.0, False)
    assert f"BC={launch.V1_BC}" in spec.config
    split, combine = launch.decode_launch(1, 1, 1, 1, 64, 128, 1.0, False, 4, "f16")
    assert split.block == combine.block == (launch.DECODE_THREADS, 1, 1)
    assert split.shared_bytes == (128 + launch.DECODE_THREADS // 32 * 130) * 4      # q row + per-warp m, l, O


@pytest.mark.parametrize("text, why", [
    ("constexpr int BR = 64;\n", "found 0"),                          # not declared
    ("// constexpr int BC = 32;\n", "found 0"),                       # commented out
    ("constexpr int BC = 2 * 16;\n", "found 0"),                      # not an integer literal
    ("constexpr int BC = 32;\n#define BC 64\n", "found 2")])
def test_a_source_without_the_constant_is_refused_naming_file_and_constant(text, why):
    with pytest.raises(ValueError, match=rf"k\.cu must declare the constant BC once.*{why}"):
        build.cu_constant(("k.cu", text), "BC")


def test_define_is_read_too():
    assert build.cu_constant(("k.cu", "#define BC 48   // keys per tile\n"), "BC") == 48


def test_no_launch_exceeds_its_kernels_launch_bounds():
    """Every block fits the ``__launch_bounds__`` its kernel declares (a launch above them fails on a GPU)."""
    for d in (8, 16, 40, 64, 100, 128, 200, 256):
        for s in all_specs(2, 4, 2, 300, 300, d):
            text = (build.CSRC / s.source).read_text()
            bound = re.search(rf"__launch_bounds__\(([^,)]+)[^)]*\)\s*{s.kernel}\(", text).group(1).strip()
            limit = int(bound) if bound.isdigit() else build.cu_constant(s.source, bound.split("::")[-1])
            assert s.block[0] * s.block[1] * s.block[2] <= limit, (s, limit)


# ---- the GPU path with CuPy faked ------------------------------------------------------------------
class FakeCompileError(Exception):
    pass


class FakeStream:
    """CuPy's ExternalStream: entering it makes it CuPy's current stream (``cp.current``)."""

    def __init__(self, cp, ptr):
        self.cp, self.ptr = cp, ptr

    def __enter__(self):
        self.outer, self.cp.current = self.cp.current, self.ptr
        return self

    def __exit__(self, *exc):
        self.cp.current = self.outer
        return False


@pytest.fixture
def fake_cupy(monkeypatch):
    """A stand-in ``cupy``: from_dlpack goes through the tensor's real ``__dlpack__`` (which refuses
    tensors that require grad, exactly like CuPy's BufferError) and records CuPy's current stream at
    that moment (what real CuPy hands DLPack), ExternalStream becomes the current stream while entered
    (``cp.current``; None: CuPy's default, the legacy stream), devices are no-ops, RawModule records how
    it was built, and the driver runs CUDA 13.0 (``cp.driver``)."""
    cp = types.ModuleType("cupy")
    cp.modules, cp.current, cp.converted_on, cp.driver = [], None, [], 13000

    def from_dlpack(t):
        cp.converted_on.append(cp.current)
        return torch.utils.dlpack.from_dlpack(t.__dlpack__())   # BufferError if t requires grad

    class Module:
        def __init__(self, code=None, options=(), backend=None, path=None):
            self.code, self.options, self.backend, self.path = code, tuple(options), backend, path
            cp.modules.append(self)

        def compile(self):
            if cp.nvrtc_fails:
                raise cp.nvrtc_fails

        def get_function(self, name):
            return ("function", name, self)

    class Device:
        compute_capability = "90"

        def __init__(self, index=None):
            self.index = index

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    cp.from_dlpack, cp.RawModule, cp.nvrtc_fails = from_dlpack, Module, None
    cp.cuda = types.SimpleNamespace(Device=Device, ExternalStream=lambda ptr: FakeStream(cp, ptr), Stream=object,
                                    compiler=types.SimpleNamespace(CompileException=FakeCompileError),
                                    runtime=types.SimpleNamespace(driverGetVersion=lambda: cp.driver))
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setattr(launch, "_GPU_MODULES", {})
    launch._include_dirs.cache_clear()
    yield cp
    launch._include_dirs.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_to_cupy_takes_tensors_that_require_grad_and_shares_their_memory(fake_cupy, dtype):
    t = torch.zeros(2, 3, dtype=dtype, requires_grad=True)
    with pytest.raises(BufferError):
        fake_cupy.from_dlpack(t)                         # what run_gpu used to do
    a = launch.to_cupy(fake_cupy, t)
    if dtype == torch.float32:
        a.fill_(1.0)
    else:                                                # CuPy has no bfloat16: the bytes go as int16
        assert a.dtype == torch.int16
        a.fill_(0x3C00)                                  # fp16 1.0; as bf16 the same bits are 2^-7
    want = 2.0 ** -7 if dtype == torch.bfloat16 else 1.0
    assert bool((t.detach() == want).all())              # the kernel's writes land in the caller's tensor


def test_run_gpu_with_requires_grad_inputs_writes_the_callers_outputs(fake_cupy, monkeypatch):
    """run_gpu over the buffers forward() builds: every tensor converted, kernels called with the
    spec's grid, and what the "kernel" writes lands in the caller's o and lse."""
    q = torch.randn(2, 3, 5, 8, dtype=torch.float16, requires_grad=True)
    k = v = torch.randn(2, 1, 7, 8, dtype=torch.float16, requires_grad=True)
    o, lse = torch.zeros_like(q.detach()), torch.zeros(2, 3, 5)
    specs = launch.v2_launch(2, 3, 1, 5, 7, 8, 0.5, False, "f16")
    calls = []

    def kernel(grid, block, args, shared_mem):
        calls.append((grid, block, shared_mem))
        o_arr, lse_arr = args[3], args[4]
        assert o_arr.dtype == torch.int16 and lse_arr.dtype == torch.float32
        o_arr.copy_(torch.full_like(o_arr, 0x3C00))      # fp16 1.0, written through the int16 view
        lse_arr.fill_(2.5)

    monkeypatch.setattr(launch, "_gpu_function", lambda source, name: kernel)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=0))
    launch.run_gpu(specs, {"q": q, "k": k, "v": v, "o": o, "lse": lse})
    assert calls == [(specs[0].grid, specs[0].block, specs[0].shared_bytes)]
    assert bool((o == 1).all()) and bool((lse == 2.5).all())


def test_run_gpu_converts_and_launches_on_torchs_current_stream(fake_cupy, monkeypatch):
    """Every tensor is handed to CuPy, and every kernel launched, with torch's current stream entered:
    CuPy passes its current stream to DLPack, so a conversion made before entering it ran on CuPy's
    default (the legacy stream) and synchronised with it, which CUDA-graph capture forbids."""
    q = torch.randn(1, 2, 5, 8, dtype=torch.float16)
    k = v = torch.randn(1, 1, 7, 8, dtype=torch.float16)
    bufs = {"q": q, "k": k, "v": v, "o": torch.zeros_like(q), "lse": torch.zeros(1, 2, 5)}
    specs = launch.v3_launch(1, 2, 1, 5, 7, 8, 0.5, True, "f16") * 2          # two launches
    launched_on = []

    def kernel(grid, block, args, shared_mem):
        launched_on.append(fake_cupy.current)

    monkeypatch.setattr(launch, "_gpu_function", lambda source, name: kernel)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=0xCAFE))
    launch.run_gpu(specs, bufs)
    assert fake_cupy.converted_on == [0xCAFE] * len(bufs), fake_cupy.converted_on
    assert launched_on == [0xCAFE, 0xCAFE]
    assert fake_cupy.current is None                         # left as it was


def test_gpu_module_uses_nvrtc_with_the_found_include_dirs(fake_cupy, monkeypatch, tmp_path):
    monkeypatch.setattr(toolkit, "find_include_dirs", lambda: [tmp_path / "a", tmp_path / "b"])
    fn = launch._gpu_function("fa2_fwd_v2_wmma.cu", "fa2_fwd_v2_f16")
    mod, = fake_cupy.modules
    assert fn == ("function", "fa2_fwd_v2_f16", mod)
    assert mod.backend == "nvrtc" and mod.options == ("-std=c++17", f"-I{build.CSRC}", f"-I{tmp_path / 'a'}",
                                                   f"-I{tmp_path / 'b'}")   # csrc: flashlib's ptx.h
    assert mod.code == (build.CSRC / "fa2_fwd_v2_wmma.cu").read_text()
    launch._gpu_function("fa2_fwd_v2_wmma.cu", "fa2_fwd_v2_bf16")         # cached per (source, arch)
    assert len(fake_cupy.modules) == 1


NVCC_12_4 = "nvcc: NVIDIA (R) Cuda compiler driver\nCuda compilation tools, release 12.4, V12.4.131\n"


def _nvcc_on_path(monkeypatch, tmp_path, version=NVCC_12_4):
    """nvcc found at /opt/cuda/bin/nvcc printing ``version``; build.nvcc_cubin records its calls."""
    monkeypatch.setattr(toolchain, "find_tool", lambda name, **kw: "/opt/cuda/bin/nvcc" if name == "nvcc" else None)
    monkeypatch.setattr(toolchain, "tool_version", lambda path: version)
    built = []
    monkeypatch.setattr(build, "nvcc_cubin", lambda source, arch: built.append((source, arch)) or tmp_path / "k.cubin")
    return built


# NVRTC rejecting the headers (CompileException), and NVRTC unable to run at all: what CuPy raises when
# libnvrtc cannot be loaded (RuntimeError "CuPy failed to load libnvrtc.so.12: OSError: ..."), a library
# or module absent (OSError, ImportError), or the compiled module failing to load in the driver.
NVRTC_FAILURES = {
    "NVRTC rejects the headers": FakeCompileError('catastrophic error: cannot open source file "crt/mma.h"'),
    "libnvrtc does not load": RuntimeError("CuPy failed to load libnvrtc.so.12: OSError: libnvrtc.so.12: "
                                           "cannot open shared object file: No such file or directory"),
    "a library is missing": OSError("libnvrtc-builtins.so.12.4: cannot open shared object file"),
    "a module is missing": ImportError("cannot import name 'nvrtc' from 'cupy_backends.cuda.libs'"),
}


@pytest.mark.parametrize("why", ["no include dir qualifies", *NVRTC_FAILURES])
def test_gpu_module_falls_back_to_nvcc_saying_why(fake_cupy, monkeypatch, tmp_path, why):
    found = None if why == "no include dir qualifies" else [tmp_path]
    fake_cupy.nvrtc_fails = NVRTC_FAILURES.get(why)
    monkeypatch.setattr(toolkit, "find_include_dirs", lambda: found)
    built = _nvcc_on_path(monkeypatch, tmp_path)
    with pytest.warns(launch.CompileFallbackWarning) as warned:
        launch._gpu_function("decode_v1_splitkv.cu", "decode_split_f16")
    assert built == [("decode_v1_splitkv.cu", "sm_90")]
    assert fake_cupy.modules[-1].path == str(tmp_path / "k.cubin")
    msg = str(warned[0].message)
    assert "decode_v1_splitkv.cu" in msg and "compiling it with nvcc (/opt/cuda/bin/nvcc) for sm_90 instead" in msg
    if found is not None:                                  # what NVRTC failed with, by type and message
        exc = NVRTC_FAILURES[why]
        assert f"{type(exc).__name__}: {str(exc).splitlines()[0]}" in msg


@pytest.mark.parametrize("why", [w for w in NVRTC_FAILURES if w != "NVRTC rejects the headers"])
def test_nvrtc_that_cannot_run_without_nvcc_is_a_runtime_error_saying_what_failed(fake_cupy, monkeypatch,
                                                                                  tmp_path, why):
    fake_cupy.nvrtc_fails = NVRTC_FAILURES[why]
    monkeypatch.setattr(toolkit, "find_include_dirs", lambda: [tmp_path])
    monkeypatch.setattr(toolchain, "find_tool", lambda name, **kw: None)
    with pytest.raises(RuntimeError, match="NVRTC could not run here") as err:
        launch._gpu_function("fa2_fwd_v2_wmma.cu", "fa2_fwd_v2_f16")
    assert type(NVRTC_FAILURES[why]).__name__ in str(err.value) and "nvidia-cuda-nvrtc" in str(err.value)
    assert err.value.__cause__ is NVRTC_FAILURES[why]


@pytest.mark.parametrize("driver, loads", [(12040, False), (12090, False), (13000, True), (13020, True)])
def test_an_nvcc_newer_than_the_driver_is_refused_before_compiling(fake_cupy, monkeypatch, tmp_path, driver, loads):
    """nvcc 13.0 against drivers for CUDA 12.4/12.9 (refused: a CUDA 13 cubin does not load there) and
    13.0/13.2 (built: the same major release)."""
    fake_cupy.driver = driver
    monkeypatch.setattr(toolkit, "find_include_dirs", lambda: None)
    built = _nvcc_on_path(monkeypatch, tmp_path, version="Cuda compilation tools, release 13.0, V13.0.48")
    if loads:
        with pytest.warns(launch.CompileFallbackWarning):
            launch._gpu_function("fa2_fwd_v1_scalar.cu", "fa2_fwd_v1_f32")
        assert built == [("fa2_fwd_v1_scalar.cu", "sm_90")]
        return
    with pytest.raises(RuntimeError) as err:
        launch._gpu_function("fa2_fwd_v1_scalar.cu", "fa2_fwd_v1_f32")
    assert built == []                                       # refused before compiling
    have = f"12.{(driver % 1000) // 10}"
    assert f"(CUDA 13.0)" in str(err.value) and f"CUDA up to {have}" in str(err.value), str(err.value)
    assert "does not load on a 12.x driver" in str(err.value)


def test_driver_cuda_version_reads_cudas_integer(fake_cupy):
    fake_cupy.driver = 12040
    assert toolkit.driver_cuda_version(fake_cupy) == (12, 4)
    fake_cupy.driver = 13010
    assert toolkit.driver_cuda_version(fake_cupy) == (13, 1)


def test_gpu_module_without_headers_or_nvcc_names_what_is_missing(fake_cupy, monkeypatch, tmp_path):
    cu13 = tmp_path / "site-packages/nvidia/cu13"
    tried = [toolkit.Candidate("/usr/local/cuda", (), ()),
             toolkit.Candidate(f"cupy.cuda.get_cuda_path() = {cu13}", (cu13 / "include",),
                               ("crt/mma.h (included by mma.h)",))]
    monkeypatch.setattr(toolkit, "find_include_dirs", lambda: None)
    monkeypatch.setattr(toolkit, "search", lambda stop=True: tried)
    monkeypatch.setattr(toolchain, "find_tool", lambda name, **kw: None)
    with pytest.raises(RuntimeError) as err:
        launch._gpu_function("fa2_fwd_v2_wmma.cu", "fa2_fwd_v2_f16")
    msg = str(err.value)
    assert "missing crt/mma.h (included by mma.h)" in msg and "/usr/local/cuda: no include folder" in msg
    assert "nvidia-cuda-nvcc" in msg and "CUDA_PATH" in msg


def test_nvrtc_errors_surface_when_there_is_no_nvcc(fake_cupy, monkeypatch, tmp_path):
    fake_cupy.nvrtc_fails = FakeCompileError("catastrophic error: cannot open source file \"crt/mma.h\"")
    monkeypatch.setattr(toolkit, "find_include_dirs", lambda: [tmp_path])
    monkeypatch.setattr(toolchain, "find_tool", lambda name, **kw: None)
    with pytest.raises(FakeCompileError, match="crt/mma.h"):
        launch._gpu_function("fa2_fwd_v2_wmma.cu", "fa2_fwd_v2_f16")


def test_nvcc_cubin_builds_a_loadable_cubin():
    from conftest import require_tool
    require_tool("nvcc")
    cubin = build.nvcc_cubin("fa2_fwd_v1_scalar.cu", "sm_90")
    data = cubin.read_bytes()
    assert data[:4] == b"\x7fELF" and b"fa2_fwd_v1_f32" in data
    assert build.nvcc_cubin("fa2_fwd_v1_scalar.cu", "sm_90") == cubin         # cached
    with pytest.raises(ValueError, match="arch must look like"):
        build.nvcc_cubin("fa2_fwd_v1_scalar.cu", "90")
