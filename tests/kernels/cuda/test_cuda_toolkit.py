"""flashlib.kernels.cuda.toolkit: which -I directories NVRTC gets, tried on fake directory trees.

The defect this guards against: CuPy's get_cuda_path() named a pip wheel folder whose include/mma.h
includes crt/mma.h, which that wheel does not ship, although /usr/local/cuda was complete. Every tree
here is built in tmp_path, and every search is told where to look (env, prefixes, site dirs, CuPy's
answer), so nothing depends on this machine's CUDA installation.
"""
from __future__ import annotations

import os
import pathlib

import pytest

from flashlib.kernels.cuda import toolkit

# What the kernels include, and what those headers include with quotes, as in a real toolkit.
COMPLETE = {
    "mma.h": '#include "crt/mma.h"\n',
    "crt/mma.h": '#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n#include "mma.hpp"\n',
    "crt/mma.hpp": "",
    "cuda_fp16.h": '#include <nv/target>\n#include "cuda_fp16.hpp"\n',
    "cuda_fp16.hpp": "",
    "cuda_bf16.h": '#include "cuda_fp16.h"\n# include "cuda_bf16.hpp"\n',
    "cuda_bf16.hpp": "",
}
NO_CRT = {k: v for k, v in COMPLETE.items() if not k.startswith("crt/")}   # the cu13 wheel on the H100


def tree(root: pathlib.Path, files=COMPLETE, sub="include") -> pathlib.Path:
    for name, text in files.items():
        path = root / sub / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def where(tmp_path, prefixes=(), site_dirs=(), cupy=None):
    """Search arguments that look only at tmp_path."""
    return dict(prefixes=[str(p) for p in prefixes], site_dirs=[str(s) for s in site_dirs],
                cupy_cuda_path=lambda: None if cupy is None else str(cupy))


def test_required_headers_are_read_from_the_kernels(tmp_path):
    assert toolkit.required_headers() == ("cuda_bf16.h", "cuda_fp16.h", "mma.h")
    extra = tmp_path / "k.cu"
    extra.write_text('#include <cuda_fp8.h>\n  #  include "mine.cuh"\n// #include <not_this.h> is text\n')
    assert toolkit.required_headers([extra]) == ("cuda_fp8.h", "mine.cuh")


def test_missing_headers_follow_quoted_includes(tmp_path):
    full = tree(tmp_path / "full") / "include"
    assert toolkit.missing_headers([full]) == ()        # "mma.hpp" found next to crt/mma.h, as cpp does
    (full / "crt" / "mma.hpp").unlink()
    assert toolkit.missing_headers([full]) == ("mma.hpp (included by crt/mma.h)",)
    inc = tree(tmp_path / "wheel", NO_CRT) / "include"
    assert toolkit.missing_headers([inc]) == ("crt/mma.h (included by mma.h)",)
    (inc / "cuda_fp16.hpp").write_text('#include "crt/mma.h"\n')   # missing twice: named once
    assert toolkit.missing_headers([inc]) == ("crt/mma.h (included by mma.h)",)
    (inc / "cuda_fp16.hpp").write_text("")
    (inc / "mma.h").unlink()
    assert toolkit.missing_headers([inc]) == ("mma.h",)
    assert toolkit.missing_headers([inc], headers=["cuda_fp16.h"]) == ()


def test_env_var_missing_crt_is_skipped_and_a_later_complete_candidate_wins(tmp_path):
    wheel, full = tree(tmp_path / "cu13", NO_CRT), tree(tmp_path / "cuda-13.0")
    env = {"CUDA_PATH": str(wheel), "CUDA_HOME": str(wheel), "PATH": ""}
    tried = toolkit.search(env, **where(tmp_path, prefixes=[full]))
    assert [c.ok for c in tried] == [False, False, True]            # each origin is reported
    assert tried[0].missing == tried[1].missing == ("crt/mma.h (included by mma.h)",)
    assert toolkit.find_include_dirs(env, **where(tmp_path, prefixes=[full])) == [full / "include"]


def test_the_h100_case_cupy_names_a_wheel_without_crt(tmp_path):
    """get_cuda_path() -> site-packages/nvidia/cu13 (no crt/); /usr/local/cuda complete: it wins."""
    site = tmp_path / "site-packages"
    cu13 = tree(site / "nvidia" / "cu13", NO_CRT)
    full = tree(tmp_path / "usr-local-cuda")
    kw = where(tmp_path, prefixes=[full], site_dirs=[site], cupy=cu13)
    assert toolkit.find_include_dirs({"PATH": ""}, **kw) == [full / "include"]
    kw = where(tmp_path, site_dirs=[site], cupy=cu13)               # without the toolkit: nothing
    assert toolkit.find_include_dirs({"PATH": ""}, **kw) is None
    tried = toolkit.search({"PATH": ""}, stop=False, **kw)
    assert [c.origin.split()[0] for c in tried] == ["NVIDIA", "cupy.cuda.get_cuda_path()"]
    assert all("crt/mma.h (included by mma.h)" in c.missing for c in tried)


@pytest.mark.parametrize("winner", ["CUDA_PATH", "CUDA_HOME", "nvcc", "prefix", "wheels", "cupy"])
def test_candidates_are_tried_in_the_documented_order(tmp_path, winner):
    """Every candidate is complete from ``winner`` on and incomplete before it: ``winner`` is chosen."""
    order = ["CUDA_PATH", "CUDA_HOME", "nvcc", "prefix", "wheels", "cupy"]
    files = {name: (COMPLETE if order.index(name) >= order.index(winner) else NO_CRT) for name in order}
    roots = {name: tree(tmp_path / name, files[name]) for name in ("CUDA_PATH", "CUDA_HOME", "prefix", "cupy")}
    nvcc_root = tree(tmp_path / "toolkit", files["nvcc"])
    (nvcc_root / "bin").mkdir()
    (nvcc_root / "bin" / "nvcc").write_text("#!/bin/sh\n")
    (nvcc_root / "bin" / "nvcc").chmod(0o755)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").symlink_to(nvcc_root / "bin" / "nvcc")      # resolved to the toolkit
    site = tmp_path / "site"
    tree(site / "nvidia" / "cuda_runtime", {k: v for k, v in files["wheels"].items() if not k.startswith("crt/")})
    tree(site / "nvidia" / "cuda_nvcc", {k: v for k, v in files["wheels"].items() if k.startswith("crt/")})
    env = {"CUDA_PATH": str(roots["CUDA_PATH"]), "CUDA_HOME": str(roots["CUDA_HOME"]),
           "PATH": str(tmp_path / "bin")}
    kw = where(tmp_path, prefixes=[roots["prefix"]], site_dirs=[site], cupy=roots["cupy"])
    expected = {"nvcc": [nvcc_root / "include"],
                "wheels": [site / "nvidia/cuda_nvcc/include", site / "nvidia/cuda_runtime/include"]}
    got = toolkit.find_include_dirs(env, **kw)
    assert got == expected.get(winner, [roots.get(winner, tmp_path) / "include"])
    tried = toolkit.search(env, **kw)
    assert len(tried) == order.index(winner) + 1 and tried[-1].ok


def test_wheels_are_combined_only_when_together_complete(tmp_path):
    site = tmp_path / "site"
    tree(site / "nvidia" / "cuda_runtime", NO_CRT)
    kw = where(tmp_path, site_dirs=[site])
    assert toolkit.find_include_dirs({"PATH": ""}, **kw) is None
    tree(site / "nvidia" / "cuda_nvcc", {k: v for k, v in COMPLETE.items() if k.startswith("crt/")})
    assert toolkit.find_include_dirs({"PATH": ""}, **kw) == [site / "nvidia/cuda_nvcc/include",
                                                              site / "nvidia/cuda_runtime/include"]


def test_versioned_prefixes_newest_first(tmp_path):
    for v in ("11.8", "12.4", "12.10"):
        tree(tmp_path / f"cuda-{v}")
    kw = where(tmp_path, prefixes=[tmp_path / "cuda", tmp_path / "cuda-*"])
    tried = toolkit.search({"PATH": ""}, stop=False, **kw)
    assert [c.origin for c in tried] == [str(tmp_path / n) for n in ("cuda", "cuda-12.10", "cuda-12.4", "cuda-11.8")]
    assert toolkit.find_include_dirs({"PATH": ""}, **kw) == [tmp_path / "cuda-12.10" / "include"]


def test_a_folder_reached_twice_is_reported_twice_and_read_once(tmp_path, monkeypatch):
    wheel = tree(tmp_path / "cuda-13.0", NO_CRT)
    os.symlink(wheel, tmp_path / "cuda")
    calls = []
    real = toolkit.missing_headers
    monkeypatch.setattr(toolkit, "missing_headers", lambda dirs, headers=None: calls.append(dirs) or real(dirs))
    tried = toolkit.search({"CUDA_HOME": str(tmp_path / "cuda"), "PATH": ""},
                           **where(tmp_path, prefixes=[tmp_path / "cuda", wheel]))
    assert [c.origin for c in tried] == [f"$CUDA_HOME={tmp_path / 'cuda'}", str(tmp_path / "cuda"), str(wheel)]
    assert len(calls) == 1 and not any(c.ok for c in tried)


def test_the_error_names_missing_headers_places_and_fixes(tmp_path):
    wheel = tree(tmp_path / "cu13", NO_CRT)
    env = {"CUDA_PATH": str(tmp_path / "nowhere"), "PATH": ""}
    tried = toolkit.search(env, stop=False, **where(tmp_path, prefixes=[tmp_path / "opt-cuda"], cupy=wheel))
    msg = str(toolkit.not_found_error(tried))
    for part in ("cuda_bf16.h, cuda_fp16.h, mma.h", f"$CUDA_PATH={tmp_path / 'nowhere'}: no include folder there",
                 f"{tmp_path / 'opt-cuda'}: no include folder there",
                 f"cupy.cuda.get_cuda_path() = {wheel}: {wheel / 'include'}: missing crt/mma.h (included by mma.h)",
                 "install the CUDA toolkit", "pip install nvidia-cuda-nvcc-cu12", "set CUDA_PATH"):
        assert part in msg, (part, msg)


def test_this_machines_toolkit_qualifies_when_nvcc_is_installed():
    """Where nvcc is installed (as on CI), its toolkit's headers are found by the default search."""
    from conftest import require_tool
    require_tool("nvcc")
    dirs = toolkit.find_include_dirs()
    assert dirs and toolkit.missing_headers(dirs) == ()
    assert any((d / "crt" / "mma.h").is_file() for d in dirs)


def test_candidates_lists_every_place_in_order(tmp_path):
    """$CUDA_PATH, then $CUDA_HOME, then the install prefixes; a place that does not exist has no dirs."""
    (tmp_path / "ch" / "include").mkdir(parents=True)
    env = {"CUDA_PATH": str(tmp_path / "cp"), "CUDA_HOME": str(tmp_path / "ch"), "PATH": ""}
    got = list(toolkit.candidates(env, prefixes=[str(tmp_path / "pre")], site_dirs=[], cupy_cuda_path=lambda: None))
    assert [origin for origin, _ in got] == [f"$CUDA_PATH={tmp_path}/cp", f"$CUDA_HOME={tmp_path}/ch",
                                             f"{tmp_path}/pre"]
    assert got[0][1] == () and list(got[1][1]) == [tmp_path / "ch" / "include"]


# ---- nvcc's CUDA against the driver's (flashlib.kernels.cuda.launch asks before building a cubin) -----
def test_nvcc_cuda_version_reads_the_release_line():
    text = ("nvcc: NVIDIA (R) Cuda compiler driver\nCopyright (c) 2005-2025 NVIDIA Corporation\n"
            "Cuda compilation tools, release 13.0, V13.0.48\nBuild cuda_13.0.r13.0/compiler.36260728_0\n")
    assert toolkit.nvcc_cuda_version(text) == (13, 0)
    assert toolkit.nvcc_cuda_version("Cuda compilation tools, release 12.10, V12.10.1") == (12, 10)
    with pytest.raises(ValueError, match="version_text: expected `nvcc --version` output"):
        toolkit.nvcc_cuda_version("g++ (GCC) 13.2.0")
    with pytest.raises(TypeError, match="version_text must be"):
        toolkit.nvcc_cuda_version(None)


@pytest.mark.parametrize("nvcc, driver, loads", [((13, 0), (12, 9), False), ((12, 4), (11, 8), False),
                                                 ((12, 8), (12, 4), True), ((12, 4), (13, 0), True),
                                                 ((13, 0), (13, 0), True)])
def test_a_cubin_from_a_newer_cuda_major_is_refused_naming_both(nvcc, driver, loads):
    if loads:
        assert toolkit.check_cubin_loads(nvcc, driver) is None
        return
    with pytest.raises(RuntimeError) as err:
        toolkit.check_cubin_loads(nvcc, driver, nvcc="/usr/local/cuda-13.0/bin/nvcc")
    msg = str(err.value)
    assert f"/usr/local/cuda-13.0/bin/nvcc (CUDA {nvcc[0]}.{nvcc[1]})" in msg
    assert f"driver runs CUDA up to {driver[0]}.{driver[1]}" in msg and "upgrade the driver" in msg


def test_cubin_check_rejects_versions_that_are_not_pairs():
    with pytest.raises(TypeError, match=r"driver_version must be a \(major, minor\) tuple of ints, got 12040"):
        toolkit.check_cubin_loads((12, 4), 12040)
