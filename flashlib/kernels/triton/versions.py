# versions.py — which Triton releases flashlib supports, and the facts that hold for some of them only.
# Changed from "one Triton for all" (the pinned 3.9 every earlier compile report used): readers run
#   whatever Triton their torch brings. Colab's GPU runtimes shipped triton 3.2.0 (runtime 2025.07,
#   torch 2.6), 3.4.0 (2025.10, torch 2.8), 3.5.0 (2026.01, torch 2.9) and 3.6.0 (2026.04 to today,
#   torch 2.10-2.11) (Colab's backend-info history); torch 2.7 wheels pin 3.3.x and torch 2.13's GPU
#   build pins 3.7.1. The facts below were read off cross-compiles of every flashlib kernel for sm_75 to
#   sm_90 with each release (tests/kernels/triton/test_triton_matrix.py compiles them again in CI).
# Idea: check versions at import with a clear message (flash-attn and xformers refuse a torch they were
#   not built for); a fact that depends on the compiler is a function of its version, not a constant.
# Limits: Triton's own version only; the driver and ptxas that ship with it are taken as they come.
# Run: versions.describe(); versions.dot_needs_fp32_tiles("sm_75", "3.3.1").
"""The Triton versions flashlib supports and what differs between them.  Explained in: notebooks/appendix_verification."""
from __future__ import annotations

import re

__all__ = ["MINIMUM", "TESTED", "COLAB", "PINNED", "parse", "installed", "check_supported",
           "mma_on_tensor_cores", "bf16_compiles", "dot_needs_fp32_tiles", "has_tensor_descriptors",
           "dumps_ptxas_log", "astsource_takes_attrs_dict", "describe"]

MINIMUM = (3, 2)            # the oldest Triton a Colab GPU runtime ships today (2025.07: 3.2.0)
# The releases the version matrix compiles every kernel with in CI: the oldest supported, the one torch
# 2.7 pins (the T4 special case below), Colab's current one, and the one the test environment pins.
TESTED = ("3.2.0", "3.3.1", "3.6.0", "3.9.0")
COLAB = "3.6.0"             # Colab's GPU runtime since 2026.04 (torch 2.10-2.11)
PINNED = "3.9.0"            # constraints.txt: the CPU test environment (no torch GPU build ships it)
NEWEST_TESTED = (3, 9)


def parse(version) -> tuple[int, int, int]:
    """``"3.3.1"`` (or ``"3.5.0+git1234"``, or a tuple) -> ``(3, 3, 1)``; ValueError otherwise.

    Explained in: notebooks/appendix_verification.
    Tested in: tests/kernels/triton/test_triton_versions.py.
    """
    if isinstance(version, tuple):
        if not (1 <= len(version) <= 3 and all(isinstance(p, int) for p in version)):
            raise ValueError(f"version must be a tuple of up to 3 ints like (3, 3, 1), got {version!r}")
        return (tuple(version) + (0, 0))[:3]
    if not isinstance(version, str):
        raise TypeError(f"version must be a str like '3.3.1' or a tuple, got {type(version).__name__}")
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if not m:
        raise ValueError(f"version must look like '3.3.1', got {version!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def installed() -> tuple[int, int, int]:
    """The version of the ``triton`` this process imported (importing it if need be).

    Explained in: notebooks/appendix_verification.
    Tested in: tests/kernels/triton/test_triton_versions.py.
    """
    import triton
    return parse(triton.__version__)


def _version(version) -> tuple[int, int, int]:
    """``version`` parsed (:func:`parse`), or the installed Triton's when None: what every fact asks."""
    return parse(version) if version is not None else installed()


def _cc(arch: str) -> int:
    if not isinstance(arch, str) or not re.fullmatch(r"sm_\d{2,3}a?", arch):
        raise ValueError(f"arch must look like 'sm_75' or 'sm_90a', got {arch!r}")
    return int(arch.removeprefix("sm_").rstrip("a"))


def check_supported(version=None) -> None:
    """Raise ImportError, naming the version and the fix, for a Triton older than :data:`MINIMUM`.

    Newer releases than :data:`NEWEST_TESTED` are allowed (Triton keeps ``tl``'s API) and say they are
    untested in :func:`describe`. Called when :mod:`flashlib.kernels.triton` is imported.

    Explained in: notebooks/appendix_verification.
    Tested in: tests/kernels/triton/test_triton_versions.py.
    """
    v = _version(version)
    if v[:2] < MINIMUM:
        raise ImportError(
            f"flashlib's Triton kernels need triton >= {MINIMUM[0]}.{MINIMUM[1]} (tested: "
            f"{', '.join(TESTED)}); this Python has triton {'.'.join(map(str, v))}. Upgrade torch (which "
            f"brings its Triton: torch >= 2.6), or `pip install 'triton>={MINIMUM[0]}.{MINIMUM[1]}'`; "
            "or use backend='reference'.")


def mma_on_tensor_cores(arch: str, version=None) -> bool:
    """Whether Triton compiles ``tl.dot`` to tensor-core instructions on ``arch``.

    sm_80 and newer: always (HMMA; HGMMA on sm_90). sm_75 (T4): up to 3.2 yes (HMMA.1688.F32), from
    3.3 on no (FFMA on CUDA cores: Triton dropped pre-Ampere MMA in 3.3, triton PR 5066; 3.4's path for
    sm_75 still emits FFMA).

    Explained in: notebooks/appendix_verification.
    Tested in: tests/kernels/triton/test_triton_versions.py.
    """
    cc, v = _cc(arch), _version(version)
    return cc >= 80 or (cc >= 75 and v[:2] <= (3, 2))


def bf16_compiles(arch: str, version=None) -> bool:
    """Whether Triton compiles flashlib's bfloat16 kernels for ``arch``: sm_80+ always; sm_75 from 3.4
    on (up to 3.3 it fails to compile). flashlib still refuses bf16 below sm_80: no bf16 tensor cores
    there (see :func:`flashlib.kernels.triton.configs.check_dtype_arch`).

    Explained in: notebooks/appendix_verification.
    Tested in: tests/kernels/triton/test_triton_versions.py.
    """
    cc, v = _cc(arch), _version(version)
    return cc >= 80 or (cc >= 75 and v[:2] >= (3, 4))


def dot_needs_fp32_tiles(arch: str, version=None) -> bool:
    """Whether ``tl.dot`` on fp16 tiles fails to compile for ``arch`` with this Triton, so that the
    kernels must load fp32 tiles (their UPCAST switch) instead: sm_75 with triton 3.3.x ("Unsupported
    conversion from f16 to f16", ``RuntimeError: PassManager::run failed``; triton issue 6698, fixed
    in 3.4).

    Explained in: notebooks/appendix_verification.
    Tested in: tests/kernels/triton/test_triton_versions.py.
    """
    cc, v = _cc(arch), _version(version)
    return cc < 80 and v[:2] == (3, 3)


def has_tensor_descriptors(version=None) -> bool:
    """``tl.make_tensor_descriptor`` (the TMA kernels) exists from triton 3.4 on.

    Explained in: notebooks/appendix_verification.
    Tested in: tests/kernels/triton/test_triton_versions.py.
    """
    v = _version(version)
    return v[:2] >= (3, 4)


def dumps_ptxas_log(version=None) -> bool:
    """``TRITON_DUMP_PTXAS_LOG`` (ptxas -v printed at compile time) exists from triton 3.5 on.

    Explained in: notebooks/appendix_verification.
    Tested in: tests/kernels/triton/test_triton_versions.py.
    """
    v = _version(version)
    return v[:2] >= (3, 5)


def astsource_takes_attrs_dict(version=None) -> bool:
    """``ASTSource(fn, signature, constexprs, attrs)`` with attrs ``{(i,): [["tt.divisibility", 16]]}``:
    the format of triton 3.3 on; up to 3.2 attrs is an ``AttrsDescriptor``.

    Explained in: notebooks/appendix_verification.
    Tested in: tests/kernels/triton/test_triton_versions.py.
    """
    v = _version(version)
    return v[:2] >= (3, 3)


def describe(version=None) -> str:
    """One line: this Triton, whether it is tested, and what differs for it on a T4 (sm_75).

    Explained in: notebooks/appendix_verification.
    Tested in: tests/kernels/triton/test_triton_versions.py.
    """
    v = _version(version)
    s = ".".join(map(str, v))
    tested = "tested" if s in TESTED else ("newer than the newest tested" if v[:2] > NEWEST_TESTED
                                           else "inside the tested range")
    t4 = ("tl.dot on tensor cores" if mma_on_tensor_cores("sm_75", v) else "tl.dot on CUDA cores (FFMA)")
    if dot_needs_fp32_tiles("sm_75", v):
        t4 += ", fp32 tiles into tl.dot (fp16 ones do not compile)"
    return f"triton {s} ({tested}; supported >= {MINIMUM[0]}.{MINIMUM[1]}); on a T4 (sm_75): {t4}"
