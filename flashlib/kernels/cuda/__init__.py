"""flashlib's CUDA C++ kernels, and the CPU emulator that runs them under sanitizers.

The kernels live in ``flashlib/kernels/cuda/csrc`` (one file per version, each opening with a header that says what
changed, where the idea comes from, its limits and how to run it):

* ``fa2_fwd_v1_scalar.cu`` — v1, scalar fp32 FlashAttention-2 forward, one thread per query row;
* ``fa2_fwd_v2_wmma.cu`` — v2, the same on tensor cores (WMMA 16x16x16, fp16, bf16 on sm_80+);
* ``fa2_fwd_v3_mma.cu`` — v3, mma.sync/ldmatrix/cp.async as inline PTX (``ptx.h``), S, P and O in
  registers (fp16 on sm_75+, bf16 on sm_80+): what float16/bfloat16 run by default;
* ``decode_v1_splitkv.cu`` — Flash-Decoding: split-KV partial attention, then a combine kernel;
* ``fa2_bwd_v1_mma.cu`` — the backward (dQ, dK, dV) in v3's style, fp16/bf16, d <= 128.

Entry points (what ``flashlib.attention(..., backend="cuda")`` and ``flashlib.decode`` call):
:func:`forward`, :func:`backward`, :func:`decode`, :func:`compile_rows`, and :func:`source` to show a kernel's code.
CUDA tensors run on the GPU (NVRTC through CuPy); CPU tensors run in the emulator (``emulator.h``),
optionally under AddressSanitizer or ThreadSanitizer.

Explained in: notebooks/08_cuda.
"""
from __future__ import annotations

import concurrent.futures
import os
import re

from ...validation import (check_cache_seqlens, check_num_splits, check_scale, check_tensors,
                           lengths_as_int32)
from ...tools import toolchain
from . import build, launch
from .launch import EmulatorError, LaunchSpec

__all__ = ["forward", "backward", "backward_supported", "decode", "pick_version", "compile_rows",
           "compile_configs", "prebuild", "source", "excerpt", "SOURCES", "ARCHS",
           "LaunchSpec", "EmulatorError", "build", "launch"]

SOURCES = {"v1": "fa2_fwd_v1_scalar.cu", "v2": "fa2_fwd_v2_wmma.cu", "v3": "fa2_fwd_v3_mma.cu",
           "decode": "decode_v1_splitkv.cu", "bwd": "fa2_bwd_v1_mma.cu"}
ARCHS = ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90")
_VERSION_DTYPES = {"v1": ("float32",), "v2": ("float16", "bfloat16"), "v3": ("float16", "bfloat16")}
# The oldest GPU each version runs on, and for bfloat16 (major, minor); the emulator runs them all.
_MIN_SM = {"v1": (0, 0), "v2": (7, 0), "v3": (7, 5)}
_MIN_SM_BF16 = {"v2": ((8, 0), "WMMA has no bf16 before Ampere"),
                "v3": ((8, 0), "mma.sync m16n8k16 with bf16 needs Ampere")}


def source(version: str, function: str | None = None, *more: str, fold=()):
    """The CUDA source of ``version`` ("v1", "v2", "v3", "decode" or "bwd"), or of functions in it.

    With no ``function``: the whole file (its header's "Explained in" / "Tested in" lines left out,
    as :func:`flashlib.show` leaves them out). With ``function``, the name of a ``__global__`` kernel
    or a ``__device__`` helper of that file: its definition alone, found by brace matching, with the
    ``template`` line and the comment lines right above it. ``more`` names further functions that
    follow in the same listing (a kernel and the helpers it calls, read in one place); a name also
    in ``fold`` is shown folded, its signature a click away. Returns a
    :class:`flashlib.display.Listing` highlighted as CUDA; its text (``str``, ``.data``) is the
    whole source shown, folded parts included.

    Explained in: notebooks/08_cuda.

    Tested in: tests/kernels/cuda/test_cuda_source.py.
    """
    text = _file_text(version)
    names = ((function,) if function is not None else ()) + more
    fold = (fold,) if isinstance(fold, str) else tuple(fold)
    if function is None:
        if more or fold:
            raise ValueError("more and fold need a function: source(version, function, *more)")
        return _listing([(text, False, None)])
    for i, name in enumerate(names):
        if not isinstance(name, str):
            what = "function" if i == 0 else f"more[{i - 1}]"
            raise TypeError(f"{what} must be a str (a function name), got {type(name).__name__}")
    unknown = [f for f in fold if f not in names]
    if unknown:
        raise ValueError(f"fold must name functions that are shown, got {unknown[0]!r}")
    parts = []
    for name in names:
        body, signature = function_source(text, name, where=SOURCES[version])
        parts.append((body, name in fold, signature))
    return _listing(parts)


def excerpt(version: str, start: str, end: str | None = None):
    """The lines of ``version``'s file from the first that contains ``start`` up to, not including,
    the next that contains ``end`` (with ``end`` None: to the end of the block ``start`` opens, found
    by brace matching), dedented: the part of a long kernel the prose discusses. A
    :class:`flashlib.display.Listing` highlighted as CUDA.

    Explained in: notebooks/08b_v3_registers.

    Tested in: tests/kernels/cuda/test_cuda_source.py.
    """
    if not isinstance(start, str) or not (end is None or isinstance(end, str)):
        raise TypeError("start and end must be str (end may be None)")
    text = _file_text(version)
    lines = text.splitlines(True)
    first = next((n for n, line in enumerate(lines) if start in line), None)
    if first is None:
        raise ValueError(f"start {start!r} is not in {SOURCES[version]}")
    if end is None:
        offset = sum(len(line) for line in lines[:first])
        brace = _code_index(text, "{", offset)
        if brace < 0:
            raise ValueError(f"no block opens at {start!r} in {SOURCES[version]}")
        close = _matching_brace(text, brace)
        last = text.count("\n", 0, close) + 1
    else:
        last = next((n for n in range(first + 1, len(lines)) if end in lines[n]), None)
        if last is None:
            raise ValueError(f"end {end!r} does not follow {start!r} in {SOURCES[version]}")
    part = lines[first:last]
    # dedent, ignoring preprocessor lines (`#pragma unroll` sits at column 0 inside a loop)
    cut = min((len(ln) - len(ln.lstrip(" ")) for ln in part if ln.strip() and not ln.startswith("#")),
              default=0)
    part = [ln[cut:] if ln[:cut].strip() == "" else ln for ln in part]
    return _listing([("".join(part), False, None)])


def _file_text(version) -> str:
    if version not in SOURCES:
        raise ValueError(f"version must be one of {sorted(SOURCES)}, got {version!r}")
    from ...display import _without_comment_pointers   # the header's pointers are for maintainers
    return _without_comment_pointers((build.CSRC / SOURCES[version]).read_text())


def _skip(text: str, i: int) -> int:
    """The index after a comment or a string/char literal starting at ``i``, or ``i`` if none does."""
    if text.startswith("//", i):
        j = text.find("\n", i)
        return len(text) if j < 0 else j
    if text.startswith("/*", i):
        j = text.find("*/", i + 2)
        return len(text) if j < 0 else j + 2
    if text[i] in "\"'":
        j = i + 1
        while j < len(text) and text[j] != text[i]:
            j += 2 if text[j] == "\\" else 1
        return j + 1
    return i


def _code_index(text: str, char: str, i: int) -> int:
    """The first ``char`` at or after ``i`` outside comments and literals, or -1."""
    while i < len(text):
        j = _skip(text, i)
        if j != i:
            i = j
        elif text[i] == char:
            return i
        else:
            i += 1
    return -1


def _matching_brace(text: str, i: int) -> int:
    """The index of the bracket closing the one at ``i`` (``(`` or ``{``), skipping comments."""
    open_, close = text[i], {"(": ")", "{": "}"}[text[i]]
    depth = 0
    while i < len(text):
        j = _skip(text, i)
        if j != i:
            i = j
            continue
        depth += (text[i] == open_) - (text[i] == close)
        if depth == 0:
            return i
        i += 1
    raise ValueError(f"unbalanced {open_!r} in the CUDA source")


def function_source(text: str, name: str, where: str = "the source") -> tuple[str, str]:
    """``(definition, signature line)`` of the ``__global__`` or ``__device__`` function ``name`` in
    ``text`` (CUDA C++): from its ``template``/``extern`` line, with the comment lines right above,
    to its closing brace, found by brace matching; declarations without a body are passed over.
    The first definition is taken; a ValueError names ``where`` if there is none.

    Explained in: notebooks/08_cuda.

    Tested in: tests/kernels/cuda/test_cuda_source.py.
    """
    if not isinstance(text, str) or not isinstance(name, str):
        raise TypeError("text and name must be str")
    if not re.fullmatch(r"[A-Za-z_]\w*", name):
        raise ValueError(f"name must be a C++ identifier, got {name!r}")
    starts = [0] + [m.end() for m in re.finditer("\n", text)]
    for m in re.finditer(rf"\b{name}\s*(?:<[^<>;{{}}()]*>\s*)?\(", text):
        if _skip_context(text, m.start()):
            continue                                  # inside a comment or literal
        paren = m.end() - 1
        close = _matching_brace(text, paren)
        k = close + 1                                 # after the parameters: qualifiers, then { or ;
        while k < len(text) and text[k] not in "{;=)":
            k = _skip(text, k) if _skip(text, k) != k else k + 1
        if k >= len(text) or text[k] != "{":
            continue                                  # a declaration or a call
        line = text.count("\n", 0, m.start())
        head = line                                   # the lines of the declaration before the name
        while head > 0:
            prev = text[starts[head - 1]:starts[head]].strip()
            if prev and not prev.startswith(("//", "#")) and not prev.endswith((";", "}", "{", ")")) \
                    or prev.startswith("template") or "__global__" in prev:
                head -= 1
            else:
                break
        decl = text[starts[head]:m.start()]
        if "__global__" not in decl and "__device__" not in decl:
            continue                                  # not a kernel or device function (a call)
        signature = " ".join(text[starts[head]:paren].split()) + "(…)"
        while head > 0 and text[starts[head - 1]:starts[head]].lstrip().startswith("//"):
            head -= 1                                 # its comment
        end = text.find("\n", _matching_brace(text, k))
        body = text[starts[head]:len(text) if end < 0 else end + 1]
        return body, signature
    raise ValueError(f"no __global__ or __device__ function {name!r} defined in {where}")


def _skip_context(text: str, i: int) -> bool:
    """Whether index ``i`` of ``text`` lies inside a comment or a literal."""
    j = 0
    while j < i:
        k = _skip(text, j)
        if k != j:
            if k > i:
                return True
            j = k
        else:
            j += 1
    return False


def _listing(parts):
    """A CUDA :class:`flashlib.display.Listing` of ``(text, folded, summary)`` parts."""
    from ...display import Listing
    return Listing(parts, language="cuda")



def prebuild(versions=("v1", "v2", "v3", "decode"), sanitizers=(None,)):
    """Build the emulator executables for ``versions`` x ``sanitizers`` now, in parallel (g++ runs
    take seconds each; later calls find them in the cache). Returns their paths.

    Explained in: notebooks/appendix_verification.

    Tested in: tests/kernels/cuda/test_cuda_kernels.py.
    """
    jobs = [(SOURCES[v], s) for v in versions for s in sanitizers]
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        return list(pool.map(lambda job: build.emulator_binary(*job), jobs))


def _torch():
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - torch is a dependency of backend="cuda"
        raise ImportError("flashlib.kernels.cuda needs PyTorch (pip install torch)") from exc
    return torch


def _as_tensor(x, name):
    torch = _torch()
    if isinstance(x, torch.Tensor):
        return x, True
    try:
        import numpy as np
    except ImportError:  # pragma: no cover
        np = None
    if np is not None and isinstance(x, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(x)), False
    raise TypeError(f"{name} must be a torch.Tensor or a NumPy array, got {type(x).__name__}")


def _check_sanitizer(sanitizer, device_type):
    if sanitizer not in build.SANITIZERS:
        raise ValueError(f"sanitizer must be None, 'address' or 'thread', got {sanitizer!r}")
    if sanitizer is not None and device_type == "cuda":
        raise ValueError("sanitizer applies to the CPU emulator only; got CUDA tensors "
                         "(on a GPU use compute-sanitizer)")


def _dtype_name(t) -> str:
    return str(t.dtype).replace("torch.", "")


def pick_version(dtype: str, version=None, capability=None) -> str:
    """The forward kernel that runs for ``dtype`` ("float32", "float16", "bfloat16"): ``version`` if
    given (checked), else "v1" for float32 and "v3" for float16/bfloat16 — "v2" on a GPU older than
    sm_75 (``capability``: the GPU's ``(major, minor)``; None for the CPU emulator, which runs all).

    Raises TypeError naming the dtype or GPU a version cannot take, ValueError for an unknown version.

    Explained in: notebooks/08b_v3_registers.

    Tested in: tests/kernels/cuda/test_cuda_v3.py.
    """
    if version is None:
        if dtype == "float32":
            version = "v1"
        elif dtype in ("float16", "bfloat16"):
            version = "v2" if capability is not None and tuple(capability) < _MIN_SM["v3"] else "v3"
        else:
            raise TypeError(f"q must be float32 (v1), float16 or bfloat16 (v3, or v2), got {dtype}")
    if version not in _VERSION_DTYPES:
        raise ValueError(f"version must be None, 'v1', 'v2' or 'v3', got {version!r}")
    if dtype not in _VERSION_DTYPES[version]:
        raise TypeError(f"CUDA kernel {version} supports dtypes {', '.join(_VERSION_DTYPES[version])}; got {dtype}"
                        + (" (use version='v3', 'v2' or None)" if version == "v1" else " (use version='v1' or None)"))
    if capability is not None:
        cap = tuple(capability)
        if dtype == "bfloat16" and version in _MIN_SM_BF16 and cap < _MIN_SM_BF16[version][0]:
            (major, minor), why = _MIN_SM_BF16[version]
            raise TypeError(f"CUDA kernel {version} in bfloat16 needs sm_{major}{minor} or newer ({why}); "
                            f"this GPU is sm_{cap[0]}{cap[1]} — use float16")
        if cap < _MIN_SM[version]:
            major, minor = _MIN_SM[version]
            raise TypeError(f"CUDA kernel {version} needs sm_{major}{minor} or newer; this GPU is "
                            f"sm_{cap[0]}{cap[1]} — use version=None")
    return version


def forward(q, k, v, *, causal=False, scale=None, version=None, sanitizer=None):
    """FlashAttention-2 forward with flashlib's CUDA kernels; returns ``(o, lse)``.

    Args:
        q ``(B, H, Nq, d)``; k, v ``(B, Hkv, Nk, d)`` with ``H % Hkv == 0`` (GQA/MQA: query head h reads
            kv head ``h // (H // Hkv)``, nothing is copied). torch tensors (CPU or CUDA) or NumPy
            arrays; d <= 256.
        causal: bottom-right aligned when Nq != Nk. scale: defaults to ``d ** -0.5``.
        version: None picks "v1" for float32 and "v3" for float16/bfloat16 ("v2" on GPUs before sm_75;
            bf16 on a GPU needs sm_80+), as :func:`pick_version`; "v1", "v2", "v3" force one.
        sanitizer: CPU emulator only — None, "address" (ASan) or "thread" (TSan).

    Returns:
        ``o`` shaped and typed like q (same kind: tensor or array), ``lse (B, H, Nq)`` float32 (natural
        log; ``-inf`` with ``o = 0`` for a row that sees no key).

    Raises:
        TypeError/ValueError naming the argument (shape, dtype, head dim, or the version that cannot
        take them); RuntimeError naming the missing tool (g++ for CPU tensors, CuPy/NVRTC for CUDA
        tensors); :class:`EmulatorError` when the emulator or a sanitizer stops the run.

    Explained in: notebooks/08_cuda.

    Tested in: tests/kernels/cuda/test_cuda_kernels.py.
    """
    torch = _torch()
    (q, q_torch), (k, _), (v, _) = _as_tensor(q, "q"), _as_tensor(k, "k"), _as_tensor(v, "v")
    check_tensors(q, k, v)
    b, h, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    dtype = _dtype_name(q)
    _check_sanitizer(sanitizer, q.device.type)
    capability = _torch().cuda.get_device_capability(q.device) if q.device.type == "cuda" else None
    version = pick_version(dtype, version, capability)
    scale = check_scale(scale, d)
    if version == "v1":
        specs = launch.v1_launch(b, h, hkv, nq, nk, d, scale, bool(causal))
    else:
        short = "f16" if dtype == "float16" else "bf16"
        specs = (launch.v2_launch if version == "v2" else launch.v3_launch)(b, h, hkv, nq, nk, d, scale,
                                                                            bool(causal), short)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = torch.empty_like(q)
    lse = torch.empty((b, h, nq), dtype=torch.float32, device=q.device)
    bufs = {"q": q, "k": k, "v": v, "o": o, "lse": lse}
    if q.device.type == "cuda":
        launch.run_gpu(specs, bufs)
    else:
        launch.run_emulated(specs, bufs, ["o", "lse"], sanitizer=sanitizer)
    return (o, lse) if q_torch else (o.numpy(), lse.numpy())


def _backward_refusal(q) -> Exception | None:
    """Why :func:`backward` cannot take ``q`` (an exception naming q), or None. The backward is built from
    v3's instructions, so on a GPU it needs what v3 needs (:func:`pick_version`)."""
    dtype, d = _dtype_name(q), q.shape[-1]
    if dtype not in ("float16", "bfloat16"):
        return TypeError(f"q: the CUDA backward takes float16 and bfloat16, not {dtype}")
    if d > launch.BWD_HEAD_DIMS[-1]:
        return ValueError(f"q: the CUDA backward supports head dims up to {launch.BWD_HEAD_DIMS[-1]}, not {d}")
    if q.device.type == "cuda":
        try:
            pick_version(dtype, "v3", _torch().cuda.get_device_capability(q.device))
        except TypeError as exc:
            return TypeError(f"q: the CUDA backward is built on kernel v3: {exc}")
    return None


def backward_supported(q) -> str | None:
    """None where :func:`backward` takes ``q``'s dtype, head dim and GPU; else why not (float32, d > 128,
    a GPU before sm_75, bfloat16 before sm_80) — the CUDA backend then takes another backward.

    Explained in: notebooks/08c_backward_decoding.
    Tested in: tests/kernels/cuda/test_cuda_bwd.py.
    """
    refusal = _backward_refusal(q)
    return None if refusal is None else str(refusal).removeprefix("q: ")


def backward(q, k, v, o, lse, do, *, causal=False, scale=None, sanitizer=None):
    """FlashAttention-2 backward with flashlib's CUDA kernels (fa2_bwd_v1_mma.cu); ``(dq, dk, dv)``.

    Args:
        q ``(B, H, Nq, d)``; k, v ``(B, Hkv, Nk, d)``, H % Hkv == 0 (dk, dv sum over each GQA group);
            o, do like q; lse ``(B, H, Nq)`` float32 from :func:`forward`. float16 or bfloat16 torch
            tensors (CPU: the emulator; CUDA: NVRTC), d <= 128.
        causal, scale: as the forward that made o and lse. sanitizer: CPU emulator only.

    Returns:
        ``dq`` like q, ``dk`` and ``dv`` like k and v. Rows that saw no key give dq = 0 and add nothing.

    Raises:
        TypeError/ValueError naming the argument (dtype, head dim, a shape that does not match q's, a
        GPU that cannot run it); RuntimeError naming a missing tool; :class:`EmulatorError`.

    Explained in: notebooks/08_cuda.
    Tested in: tests/kernels/cuda/test_cuda_bwd.py.
    """
    torch = _torch()
    for name, x in (("q", q), ("k", k), ("v", v), ("o", o), ("lse", lse), ("do", do)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    check_tensors(q, k, v)
    b, h, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    refusal = _backward_refusal(q)
    if refusal is not None:
        raise refusal
    for name, x in (("o", o), ("do", do)):
        if x.shape != q.shape or x.dtype != q.dtype or x.device != q.device:
            raise ValueError(f"{name} must match q: shape {tuple(q.shape)}, {q.dtype} on {q.device}; got "
                             f"shape {tuple(x.shape)}, {x.dtype} on {x.device}")
    if lse.shape != (b, h, nq) or lse.dtype != torch.float32 or lse.device != q.device:
        raise ValueError(f"lse must be float32 of shape {(b, h, nq)} on {q.device} (forward's lse); got "
                         f"{lse.dtype} of shape {tuple(lse.shape)} on {lse.device}")
    _check_sanitizer(sanitizer, q.device.type)
    scale = check_scale(scale, d)
    short = "f16" if q.dtype == torch.float16 else "bf16"
    specs = launch.bwd_launch(b, h, hkv, nq, nk, d, scale, bool(causal), short)
    q, k, v, o, do, lse = (x.detach().contiguous() for x in (q, k, v, o, do, lse))
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)   # no rows: zeros
    bufs = {"q": q, "k": k, "v": v, "o": o, "do": do, "lse": lse,
            "delta": torch.empty((b, h, nq), dtype=torch.float32, device=q.device), "dq": dq, "dk": dk, "dv": dv}
    if not specs:
        return dq, dk, dv
    if q.device.type == "cuda":
        launch.run_gpu(specs, bufs)
    else:
        launch.run_emulated(specs, bufs, ["dq", "dk", "dv"], sanitizer=sanitizer)
    return dq, dk, dv


def decode(q, k_cache, v_cache, *, cache_seqlens, num_splits, scale=None, causal=False, sanitizer=None):
    """Flash-Decoding with flashlib's CUDA kernels: split-KV partials, then a combine; ``(o, lse)``.

    Args:
        q ``(B, H, Nq, d)`` (decoding: Nq = 1); k_cache, v_cache ``(B, Hkv, Nmax, d)``, H % Hkv == 0.
        cache_seqlens: ``(B,)`` int32/int64 in ``[0, Nmax]``, on q's device; sequence b attends to keys
            ``[0, cache_seqlens[b])`` only (0 keys: o = 0, lse = -inf).
        num_splits: contiguous key chunks per sequence (>= 1), split as
            :func:`flashlib.ladder.decoding.split_bounds` does; each chunk is one block of the split
            kernel. More than Nmax act as Nmax (the others would hold no key).
        scale: ``d ** -0.5`` by default. causal: bottom-right within each sequence's own length
            (query i sees key j iff ``j <= i + len_b - Nq``). sanitizer: as :func:`forward`.
        float32, float16 and bfloat16 (no tensor cores: one query row is a matrix-vector product).

    Returns:
        ``o`` like q, ``lse (B, H, Nq)`` float32.

    Explained in: notebooks/08c_backward_decoding (and notebooks/06_flash_decoding for the algorithm).

    Tested in: tests/kernels/cuda/test_cuda_kernels.py.
    """
    torch = _torch()
    (q, q_torch), (k, _), (v, _) = (_as_tensor(q, "q"), _as_tensor(k_cache, "k_cache"),
                                    _as_tensor(v_cache, "v_cache"))
    check_tensors(q, k, v, k_name="k_cache", v_name="v_cache")
    b, h, nq, d = q.shape
    hkv, nmax = k.shape[1], k.shape[2]
    dtype = _dtype_name(q)
    short = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}.get(dtype)
    if short is None:
        raise TypeError(f"CUDA decode supports float32, float16 and bfloat16; got {dtype}")
    num_splits = min(check_num_splits(num_splits), nmax)   # a split holds >= 1 key (split_bounds)
    seq = check_cache_seqlens(_as_tensor(cache_seqlens, "cache_seqlens")[0], q, nmax)
    _check_sanitizer(sanitizer, q.device.type)
    scale = check_scale(scale, d)
    specs = launch.decode_launch(b, h, hkv, nq, nmax, d, scale, bool(causal), int(num_splits), short)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    seq = lengths_as_int32(seq, nmax).to(q.device)     # clamped in 64 bits before the narrowing
    o = torch.empty_like(q)
    lse = torch.empty((b, h, nq), dtype=torch.float32, device=q.device)
    o_parts = torch.empty((num_splits, b, h, nq, d), dtype=torch.float32, device=q.device)
    lse_parts = torch.empty((num_splits, b, h, nq), dtype=torch.float32, device=q.device)
    bufs = {"q": q, "k": k, "v": v, "seqlens": seq, "o_parts": o_parts, "lse_parts": lse_parts,
            "o": o, "lse": lse}
    if q.device.type == "cuda":
        launch.run_gpu(specs, bufs)
    else:
        launch.run_emulated(specs, bufs, ["o", "lse"], sanitizer=sanitizer)
    return (o, lse) if q_torch else (o.numpy(), lse.numpy())


def compile_configs():
    """The (version, LaunchSpec) pairs the compile report covers: each forward kernel at d = 64, 128 and
    256, v3 also at d = 32 (its smallest head-dim bucket), the backward ("bwd": delta, dK/dV, dQ) at
    d = 64 and 128, decode at d = 128.

    Explained in: notebooks/appendix_verification.
    Tested in: tests/kernels/cuda/test_cuda_compile.py.
    """
    out = [("v3", s) for dt in ("f16", "bf16") for s in launch.v3_launch(1, 1, 1, 128, 128, 32, 1.0, True, dt)]
    for d in (64, 128, 256):
        out += [("v1", s) for s in launch.v1_launch(1, 1, 1, 128, 128, d, 1.0, True)]
        for dt in ("f16", "bf16"):
            out += [("v2", s) for s in launch.v2_launch(1, 1, 1, 128, 128, d, 1.0, True, dt)]
            out += [("v3", s) for s in launch.v3_launch(1, 1, 1, 128, 128, d, 1.0, True, dt)]
            if d <= launch.BWD_HEAD_DIMS[-1]:
                out += [("bwd", s) for s in launch.bwd_launch(1, 1, 1, 128, 128, d, 1.0, True, dt)
                        if "delta" not in s.kernel or d == 64]          # delta has no head-dim bucket
    for dt in ("f32", "f16", "bf16"):
        out += [("decode", s) for s in launch.decode_launch(1, 1, 1, 1, 1024, 128, 1.0, False, 4, dt)]
    return out


def compile_rows(archs=ARCHS) -> list[dict]:
    """Compile-report rows (backend "cuda") for every kernel configuration and architecture.

    Each row: ``backend, kernel, config, arch, compiler ("nvcc 13.0"), ok, registers, spill_bytes,
    shared_bytes, mma_instructions, ldsm_instructions, ldgsts_instructions, tensor_cores`` (+ ``error``
    when ``ok`` is False). ``registers`` and ``spill_bytes`` (spill stores + loads) come from
    ``nvcc -cubin -arch=<arch> --resource-usage``; ``shared_bytes`` is the kernel's static shared memory
    plus the dynamic bytes its LaunchSpec asks for; ``mma_instructions`` counts HMMA/HGMMA,
    ``ldsm_instructions`` LDSM (ldmatrix) and ``ldgsts_instructions`` LDGSTS (cp.async) in
    ``cuobjdump -sass``. bf16 v2, v3 and backward rows are omitted on sm_75 (no bf16 tensor cores there;
    those kernels compile to nothing, or to a ``__trap()``). Raises RuntimeError naming the tool when nvcc
    or cuobjdump is missing.

    Explained in: notebooks/appendix_verification.

    Tested in: tests/kernels/cuda/test_cuda_compile.py.
    """
    archs = [archs] if isinstance(archs, str) else list(archs)
    compiler = toolchain.tool_label("nvcc")
    rows = []
    usage = {}
    pairs = sorted({(spec.source, arch) for arch in archs for _, spec in compile_configs()})
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:   # nvcc in parallel
        futures = {pair: pool.submit(build.nvcc_usage, *pair) for pair in pairs}
        for pair, fut in futures.items():
            try:
                usage[pair] = fut.result()
            except RuntimeError:
                pass                                  # reported per row below
    for arch in archs:
        for version, spec in compile_configs():
            if arch == "sm_75" and "_bf16" in spec.kernel and version in ("v2", "v3", "bwd"):
                continue                              # no bf16 tensor cores before sm_80: empty kernels
            row = {"backend": "cuda", "kernel": spec.kernel, "config": spec.config, "arch": arch,
                   "compiler": compiler, "ok": False,
                   "registers": None, "spill_bytes": None, "shared_bytes": None, "mma_instructions": None,
                   "ldsm_instructions": None, "ldgsts_instructions": None, "tensor_cores": False}
            try:
                key = (spec.source, arch)
                if key not in usage:
                    usage[key] = build.nvcc_usage(spec.source, arch)
                u = usage[key][spec.kernel]
            except (RuntimeError, KeyError) as exc:
                row["error"] = str(exc)[:500]
                rows.append(row)
                continue
            row.update(ok=True, registers=u["registers"], spill_bytes=u["spill_bytes"],
                       shared_bytes=u["static_smem"] + spec.shared_bytes,
                       mma_instructions=u["mma_instructions"], tensor_cores=u["mma_instructions"] > 0,
                       ldsm_instructions=u["ldsm_instructions"], ldgsts_instructions=u["ldgsts_instructions"])
            rows.append(row)
    return rows
