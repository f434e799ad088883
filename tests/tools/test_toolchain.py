"""flashlib.tools.toolchain: the cache folder, the build lock, finding the tools, and reading ptxas and
cuobjdump output (samples below were captured from nvcc 13.0 and cuobjdump 13.0 on this project's
kernels and on two small kernels built for the purpose)."""
from __future__ import annotations

import ast
import fcntl
import subprocess
import sys
import threading
import time

import pytest

from conftest import ROOT
from flashlib.tools import toolchain


# ---- the cache and the lock ---------------------------------------------------------------------
def test_cache_dir_is_flashlib_cache_dir_or_home(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHLIB_CACHE_DIR", str(tmp_path / "c"))
    assert toolchain.cache_dir("cuda") == tmp_path / "c" / "cuda" and (tmp_path / "c" / "cuda").is_dir()
    monkeypatch.delenv("FLASHLIB_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert toolchain.cache_dir("compile-report") == tmp_path / "home" / ".cache" / "flashlib" / "compile-report"


def test_locked_holds_an_exclusive_lock(tmp_path):
    lock = tmp_path / "x.lock"
    with toolchain.locked(lock):
        with open(lock) as other, pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)        # another holder must wait
    with open(lock) as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)            # released at the block's end


def test_once_builds_once_across_threads(tmp_path):
    calls = []

    def make(tmp):
        calls.append(tmp)
        time.sleep(0.2)                                  # the others arrive while this one builds
        tmp.write_text("built")

    out = tmp_path / "artifact"
    threads = [threading.Thread(target=toolchain.once, args=(out, make)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and out.read_text() == "built"
    assert calls[0].name.startswith("artifact.tmp")       # written beside, then moved into place
    assert toolchain.once(out, make) == out and len(calls) == 1
    toolchain.once(out, lambda tmp: tmp.write_text("again"), fresh=True)
    assert out.read_text() == "again"


def test_a_failed_build_leaves_nothing(tmp_path):
    def make(tmp):
        tmp.write_text("half")
        raise RuntimeError("compiler error")

    with pytest.raises(RuntimeError, match="compiler error"):
        toolchain.once(tmp_path / "a", make)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.lock"]


# ---- finding the tools ----------------------------------------------------------------------------
def _tool(folder, name, version="Cuda compilation tools, release 13.0, V13.0.88"):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(f"#!/bin/sh\necho '{version}'\n")
    path.chmod(0o755)
    return str(path)


@pytest.fixture
def nowhere(tmp_path, monkeypatch):
    """No tool anywhere: an empty PATH, no CUDA variables, no default CUDA, an empty triton wheel."""
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    for var in ("CXX", "NVCC", "CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(toolchain, "CUDA_DEFAULT", str(tmp_path / "no-cuda"))
    monkeypatch.setattr(toolchain, "triton_bin", lambda: tmp_path / "wheel")
    return tmp_path


def test_lookup_order(nowhere, monkeypatch):
    t = nowhere
    assert toolchain.find_tool("cuobjdump") is None
    wheel = _tool(t / "wheel", "cuobjdump")                                  # last: the triton wheel
    assert toolchain.find_tool("cuobjdump") == wheel
    default = _tool(t / "no-cuda" / "bin", "cuobjdump")                     # before it: /usr/local/cuda
    assert toolchain.find_tool("cuobjdump") == default
    monkeypatch.setenv("CUDA_PATH", str(t / "cp"))
    cuda_path = _tool(t / "cp" / "bin", "cuobjdump")                          # $CUDA_PATH before that
    assert toolchain.find_tool("cuobjdump") == cuda_path
    monkeypatch.setenv("CUDA_HOME", str(t / "ch"))
    cuda_home = _tool(t / "ch" / "bin", "cuobjdump")                          # $CUDA_HOME first of them
    assert toolchain.find_tool("cuobjdump") == cuda_home
    monkeypatch.setenv("PATH", str(t / "path"))
    on_path = _tool(t / "path", "cuobjdump")                                  # PATH before every folder
    assert toolchain.find_tool("cuobjdump") == on_path
    assert toolchain.find_tool("cuobjdump", triton_first=True) == wheel       # ... unless the wheel's asked


def test_a_tool_next_to_the_nvcc_on_path(nowhere, monkeypatch):
    t = nowhere
    real = _tool(t / "toolkit" / "bin", "nvcc")
    ptxas = _tool(t / "toolkit" / "bin", "ptxas")
    (t / "links").mkdir()
    (t / "links" / "nvcc").symlink_to(real)
    monkeypatch.setenv("PATH", str(t / "links"))
    assert toolchain.find_tool("ptxas") == ptxas


def test_explicit_choices_win_and_gxx_is_only_looked_for_on_path(nowhere, monkeypatch):
    t = nowhere
    _tool(t / "path", "nvcc")
    chosen = _tool(t / "mine", "nvcc")
    monkeypatch.setenv("PATH", str(t / "path"))
    monkeypatch.setenv("NVCC", chosen)
    assert toolchain.find_tool("nvcc") == chosen
    monkeypatch.setenv("CUDA_HOME", str(t / "ch"))
    _tool(t / "ch" / "bin", "g++")
    assert toolchain.find_tool("g++") is None                  # a C++ compiler is not a CUDA tool
    with pytest.raises(RuntimeError, match="the CUDA emulator needs `g\\+\\+`.*install a C\\+\\+20 compiler"):
        toolchain.require_tool("g++", "the CUDA emulator")
    with pytest.raises(RuntimeError, match="reading SASS needs `nvdisasm`, which was not found on PATH, in CUDA"):
        toolchain.require_tool("nvdisasm", "reading SASS")
    with pytest.raises(TypeError, match="name must be a tool name"):
        toolchain.find_tool(None)


def test_the_wheel_is_found_without_importing_triton():
    code = ("import sys; from flashlib.tools import toolchain; before = 'triton' in sys.modules; "
            "toolchain.find_tool('cuobjdump'); toolchain.triton_bin(); print(before, 'triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_toolchain_is_the_lower_layer():
    """No kernels, compile report, torch or triton behind it: both builders import it, not the reverse."""
    tree = ast.parse((ROOT / "flashlib" / "tools" / "toolchain.py").read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {("." * n.level) + (n.module or "") for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not {n for n in names if n.startswith(".") or n.split(".")[0] in ("torch", "triton", "flashlib")}, names


def test_labels_and_failures(nowhere, monkeypatch):
    t = nowhere
    monkeypatch.setenv("PATH", str(t / "path"))
    assert toolchain.tool_label("nvcc") == "nvcc (not found)"
    _tool(t / "path", "nvcc")
    _tool(t / "path", "g++", version="g++ (Debian 12.2.0-14) 12.2.0")
    assert toolchain.tool_label("nvcc") == "nvcc 13.0" and toolchain.tool_label("g++") == "g++ 12.2.0"
    bad = t / "path" / "cuobjdump"
    bad.write_text("#!/bin/sh\necho 'cuobjdump fatal   : Could not open input file' >&2\nexit 1\n")
    bad.chmod(0o755)
    with pytest.raises(RuntimeError, match=r"(?s)the report: `cuobjdump -sass k.cubin` failed \(exit 1\).*"
                                           r"Could not open input file"):
        toolchain.run_tool("cuobjdump", "-sass", "k.cubin", purpose="the report")


# ---- reading ptxas -v and SASS ------------------------------------------------------------------
# nvcc -cubin -arch=sm_80 --resource-usage -maxrregcount=24 (a kernel made to spill)
PTXAS_SM80_SPILLS = """\
ptxas info    : Overriding maximum register limit 256 for 'spills' with  24 of maxrregcount option
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'spills' for 'sm_80'
ptxas info    : Function properties for spills
    224 bytes stack frame, 424 bytes spill stores, 440 bytes spill loads
ptxas info    : Used 24 registers, used 0 barriers, 224 bytes cumulative stack size, 372 bytes cmem[0]
ptxas info    : Compile time = 13.618 ms
"""
# nvcc -cubin -arch=sm_90a --resource-usage: static shared memory, and a device function not inlined
PTXAS_SM90A = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'tiny' for 'sm_90a'
ptxas info    : Function properties for tiny
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 8 registers, used 0 barriers
ptxas info    : Compile time = 2.240 ms
ptxas info    : Compiling entry function 'with_smem' for 'sm_90a'
ptxas info    : Function properties for with_smem
    256 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 24 registers, used 1 barriers, 256 bytes cumulative stack size, 1024 bytes smem
ptxas info    : Compile time = 19.089 ms
ptxas info    : Function properties for _Z6helperPfi
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
"""


def test_parse_ptxas():
    assert toolchain.parse_ptxas(PTXAS_SM80_SPILLS) == {"spills": dict(
        registers=24, stack_bytes=224, spill_stores=424, spill_loads=440, static_smem=0)}
    usage = toolchain.parse_ptxas(PTXAS_SM90A)
    assert usage["tiny"] == dict(registers=8, stack_bytes=0, spill_stores=0, spill_loads=0, static_smem=0)
    assert usage["with_smem"] == dict(registers=24, stack_bytes=256, spill_stores=0, spill_loads=0,
                                      static_smem=1024)    # not the helper's 0-byte frame printed after it
    assert toolchain.parse_ptxas("ptxas info    : 0 bytes gmem\n") == {}


# cuobjdump -sass, trimmed: Triton's fa2_fwd_v1 for sm_90, flashlib's v2 for sm_80, a kernel without MMA
SASS = """
\t\tFunction : _fwd_kernel
\t.headerflags\t@"EF_CUDA_ACCELERATORS EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*1be0*/                   WARPGROUP.ARRIVE ;
        /*1bf0*/                   HGMMA.64x64x16.F32 R88, gdesc[UR12], RZ, !UPT ;
        /*1c00*/                   UIADD3 UR12, UR10, 0x2, URZ ;
        /*1c40*/                   HGMMA.64x64x16.F32 R88, gdesc[UR12], R88 ;
\t\tFunction : fa2_fwd_v2_bf16
        /*2180*/                   UIADD3 UR5, UR5, 0x40, URZ ;                               /* 0x0000004005057890 */
        /*2190*/                   HMMA.16816.F32.BF16 R48, R40.reuse, R82, R48 ;             /* 0x000000522830723c */
        /*21a0*/                   HMMA.16816.F32.BF16 R40, R40, R80, R44 ;                   /* 0x000000502828723c */
        /*21b0*/                   @!UPT UIADD3 URZ, URZ, URZ, URZ ;                          /* 0x0000003f3f3ff290 */
        /*21c0*/                   HMMA.16816.F32.BF16 R48, R36.reuse, R76, R48 ;             /* 0x0000004c2430723c */
\t\tFunction : tiny
        /*0060*/                   FADD R5, R0, 1 ;                          /* 0x3f80000000057421 */
        /*0080*/                   EXIT ;                                    /* 0x000000000000794d */
"""


def test_count_mma_per_function():
    assert toolchain.count_mma(SASS) == {"_fwd_kernel": 2, "fa2_fwd_v2_bf16": 3, "tiny": 0}
    assert toolchain.count_mma("") == {}


def test_one_list_of_tensor_core_opcodes():
    for op in ("HMMA.16816.F32", "HGMMA.64x64x16.F32", "IMMA.16832.S8.S8", "UTCHMMA", "QGMMA.64x128x32"):
        assert toolchain.MMA_RE.search(f"  /*0100*/  {op} R0, R4, R8, R0 ;"), op
    for not_mma in ("FFMA R1, R2, R3, R4 ;", "WARPGROUP.ARRIVE ;", "LDSM.16.M88.4 R4, [R2] ;"):
        assert not toolchain.MMA_RE.search(not_mma), not_mma


def test_build_atomically_replaces_in_one_step_and_tool_version_is_asked_once(tmp_path):
    out = tmp_path / "x.bin"
    out.write_text("old")
    seen = []

    def make(tmp):
        seen.append(out.read_text())          # the old file is still whole while the new one is made
        tmp.write_text("new")

    assert toolchain.build_atomically(out, make) == out and out.read_text() == "new" and seen == ["old"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.bin"]
    counter = tmp_path / "count"
    tool = _tool(tmp_path / "bin", "fake-nvcc", version="fake 1.2")
    with open(tool, "a") as f:
        f.write(f"echo run >> {counter}\n")
    assert toolchain.tool_version(tool) == "fake 1.2" == toolchain.tool_version(tool)
    assert counter.read_text().count("run") == 1
