"""Benchmarks readers run on their GPU: flashlib's Triton and CUDA C++ kernels against torch SDPA and naive
attention.

Forward and backward throughput in TFLOP/s with FlashAttention-2's FLOP count (4·N²·d·H per batch
element forward, 2.5x that backward, halved for causal), and decode bandwidth in GB/s of K/V read,
across sequence lengths N. Timing: ``triton.testing.do_bench`` (CUDA events, warm-up, median).
torch's SDPA is timed in the same process once per backend (FlashAttention-2, cuDNN, memory-efficient),
forced with ``torch.nn.attention.sdpa_kernel``; speed is the ratio of their times to flashlib's
(:func:`ratios`). The Triton kernels are timed in both forms: row "flashlib" runs versions 1 and 2
(forward and backward, pointer loads) and row "flashlib-tma" the TMA kernels (the TMA forward and the
TMA dK/dV: tensor descriptors, TMA on sm_90), each forced through ``FLASHLIB_TRITON_FWD`` and
``FLASHLIB_TRITON_BWD`` around its own calls (:func:`triton_kernels`), so the two rows differ only in
how the kernels move their tiles, and in the TMA kernels' own host work (checking TMA's memory rules,
a scratch buffer for the descriptors: a few microseconds, which matter only at the smallest N).

A run can be saved (``python -m flashlib bench --save FILE.json``, :func:`save`): the file records the
GPU, driver, CUDA, torch, triton, flashlib's version and git commit, the UTC date, the configuration
and every measurement (schema :data:`SCHEMA`, described in ``benchmarks/README.md``). :func:`load`
validates one and :func:`plot_file` draws it, labelled with where and when it was measured.

On a machine with no CUDA GPU nothing is timed: :func:`main` says so and prints the compile report's
summary instead (what the kernels compile to on each GPU), and ``--save`` writes nothing — flashlib
never prints or records a GPU number it did not measure.

A dtype this GPU's kernels do not take (bfloat16 below sm_80: :func:`flashlib.hardware.kernel_dtypes`) is
refused before anything runs, with exit code :data:`EXIT_NOT_SUPPORTED` (``make bench-gpu`` reports it as
skipped and goes on). Speed goals are reported here, met or MISSED (:data:`GOALS`), never asserted by
the correctness tier: ``--generate`` times a tiny Llama's generation per token through flashlib.auto
against plain SDPA (:func:`generate_per_token`), and the small call is compared with SDPA's latency.

``--serving`` times the serving rows instead of the sweep (:func:`serving`): a ragged batch packed for
flashlib.attention_varlen against the same batch padded for SDPA, a decode step through a block table
(paged cache) against the same step on a dense cache, and cascade decoding (a shared prefix attended
once, then merge_states) against plain decoding; each row's output is checked against its baseline's
before anything is timed.

Explained in: notebooks/07_triton.
"""
from __future__ import annotations

import contextlib
import datetime
import importlib.util
import itertools
import json
import math
import numbers
import os
import pathlib
import re
import subprocess
import sys
import warnings
from typing import Callable
from unittest import mock

from ..validation import check_flag

__all__ = ["SCHEMA", "SMALL_SHAPE", "SMALL_TIMES", "NOT_ASKED", "SDPA_BACKENDS", "FLASHLIB_IMPLS", "TRITON_KERNELS",
           "CUDA_NO_BACKWARD", "host_timer", "small_ratios",
           "TMA_NO_DECODE", "TMA_REFUSED", "attention_flops", "decode_bytes", "environment", "triton_kernels", "run",
           "ratios", "save", "load", "result_name", "plot", "plot_file", "main", "EXIT_NOT_SUPPORTED", "GOALS",
           "SERVING_ROWS", "SERVING_PAIRS", "serving"]

DEFAULT_NS = (512, 1024, 2048, 4096, 8192, 16384)
SCHEMA = "flashlib-bench/2"        # the result file's format; a change to it gets a new number
SCHEMAS = ("flashlib-bench/1", SCHEMA)   # what load reads: /2 added the optional "small" section
# The rows that time torch's SDPA, and the torch.nn.attention.SDPBackend each one forces.
SDPA_BACKENDS = {"sdpa-flash": "FLASH_ATTENTION", "sdpa-cudnn": "CUDNN_ATTENTION",
                 "sdpa-efficient": "EFFICIENT_ATTENTION"}
# flashlib's rows: the backend each times. "flashlib-cuda" runs kernel v3 (mma.sync) for float16/bfloat16
# and v1 for float32 (flashlib.kernels.cuda.pick_version), and the CUDA backward (fa2_bwd_v1_mma) where it
# applies; where it does not (float32, d > 128) the backend's backward is Triton's, not timed twice.
# "flashlib-tma" is backend "triton" with the TMA kernels (version 4, flashlib.kernels.triton.fa2_fwd_v4_tma,
# and version 5, fa2_bwd_tma's dK/dV in the backward); its decode is row "flashlib"'s kernel, not timed
# twice.
FLASHLIB_IMPLS = {"flashlib": "triton", "flashlib-tma": "triton", "flashlib-cuda": "cuda"}
# The Triton rows' kernels, (FLASHLIB_TRITON_FWD, FLASHLIB_TRITON_BWD), set around each row's calls only:
# "flashlib" is pinned too, so that a reader's own FLASHLIB_TRITON_FWD=v4 cannot make both rows time
# the TMA kernels.
TRITON_KERNELS = {"flashlib": ("v1", "v2"), "flashlib-tma": ("v4", "v5")}
CUDA_NO_BACKWARD = ("not timed: backend='cuda' takes the Triton kernel's backward here, timed in row "
                    "'flashlib'")
TMA_NO_DECODE = ("not timed: the TMA kernels are a forward and a dK/dV; the decode kernel is the one timed "
                 "in row 'flashlib'")
TMA_REFUSED = ("the TMA kernels do not take these tensors (versions 1 and 2, which "
               "FLASHLIB_TRITON_FWD/BWD=v4/v5 run instead, are row 'flashlib')")
# config["sdpa_kv"] in a GQA run: how each SDPA row got K and V (see _sdpa_native_gqa)
SDPA_KV = {True: "enable_gqa", False: "expanded"}
NOT_ASKED = "not timed: not asked for (run(only=...), --only)"
# plot: the line style of each of flashlib's rows against SDPA (bottom panels)
LINESTYLES = {"flashlib": "-", "flashlib-tma": "-.", "flashlib-cuda": "--"}
TIMES = ("fwd_ms", "bwd_ms", "decode_ms")          # what a row measures, in milliseconds per call
# The small call of issue "host overhead": one sequence of 128 tokens, 8 heads, d = 64, where the kernels
# take microseconds and the host's work (checks, dispatch, launches) decides the latency.
SMALL_SHAPE = (1, 8, 128, 64)                      # (B, H, N, d)
SMALL_TIMES = ("call_ms", "train_ms")              # inference forward; forward + backward (grads of q, k, v)
DTYPES = {"float16": 2, "bfloat16": 2, "float32": 4}     # bench dtypes and their bytes per element
DEFAULT_TIMER = "triton.testing.do_bench(return_mode='median')"
# `python -m flashlib bench` exits with this when the run cannot be made here and nothing ran (this GPU's
# kernels do not take --dtype; --generate without transformers): make bench-gpu reports it as skipped
# and goes on; any other non-zero code stops the sweep.
EXIT_NOT_SUPPORTED = 4
# Speed goals: (what, the limit, whether the measured ratio must be at most or at least the limit). The
# bench reports each as met or MISSED; no test asserts them (a T4, whose Triton kernels run on CUDA
# cores, misses them, and a shared GPU makes timings flaky).
GOALS = {"generate": ("flashlib.auto's time per generated token / plain SDPA's (issue 10)", 1.1, "at most"),
         "small": ("the small call's speed against the fastest SDPA backend (SDPA time / flashlib time: "
                   "within 2x)", 0.5, "at least")}
_ENV_FIELDS = ("device", "compute_capability", "sm_count", "driver", "cuda", "torch", "triton", "flashlib",
               "commit", "dirty", "date")
_WHY_MAX = 600                                     # characters of a refusal's reason that are kept


def attention_flops(batch: int, heads: int, n_q: int, n_k: int, d: int, *, causal: bool = False,
                    backward: bool = False) -> float:
    """FA2's count: ``4 · Nq · Nk · d · H · B`` forward, x2.5 backward, halved when causal.

    Explained in: notebooks/07_triton.
    Tested in: tests/tools/test_bench.py.
    """
    _check_sizes("attention_flops", batch=batch, heads=heads, n_q=n_q, n_k=n_k, d=d)
    causal, backward = check_flag(causal, "causal"), check_flag(backward, "backward")
    flops = 4.0 * n_q * n_k * d * heads * batch
    if causal:
        flops /= 2
    return flops * 2.5 if backward else flops


def decode_bytes(batch: int, kv_heads: int, n: int, d: int, elem_bytes: int) -> float:
    """Bytes of K and V a decode step reads: ``2 · B · Hkv · N · d · elem``.

    Explained in: notebooks/07_triton.
    Tested in: tests/tools/test_bench.py.
    """
    _check_sizes("decode_bytes", batch=batch, kv_heads=kv_heads, n=n, d=d, elem_bytes=elem_bytes)
    return 2.0 * batch * kv_heads * n * d * elem_bytes


def _check_sizes(source, **sizes) -> None:
    """Each of ``sizes`` an int >= 0 (a Python or NumPy integer, not a bool), else an error naming it."""
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{source}: {name} must be an int >= 0, got {type(value).__name__} {value!r}")
        if value < 0:
            raise ValueError(f"{source}: {name} must be an int >= 0, got {value}")


def _naive(q, k, v, causal):
    """Attention with S and P materialized, in the inputs' dtype (chapter 1, in torch)."""
    import torch
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        nq, nk = q.shape[2], k.shape[2]
        mask = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(nk - nq)
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, -1) @ v


def _sdpa(q, k, v, causal, gqa=False):
    """torch's SDPA with flashlib's semantics (GQA, bottom-right causal), with the fewest masks: fused
    backends refuse an explicit mask, so one is passed only where no flag says the same. GQA: K and V
    are read as they are with ``gqa=True`` (SDPA's ``enable_gqa``, torch >= 2.5), else expanded to every
    query head here."""
    import functools

    import torch
    g = q.shape[1] // k.shape[1]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if g > 1 and gqa:
        sdpa = functools.partial(sdpa, enable_gqa=True)
    elif g > 1:
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    nq, nk = q.shape[2], k.shape[2]
    if not causal or nq == 1:   # bottom-right: a single query row (decoding) sees every key
        return sdpa(q, k, v)
    if nq == nk:                # SDPA's is_causal is top-left aligned: the same only when Nq == Nk
        return sdpa(q, k, v, is_causal=True)
    mask = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(nk - nq)
    return sdpa(q, k, v, attn_mask=mask)


def _sdpa_contexts():
    """``{row name: (context factory, None) or (None, why this torch cannot force it)}``."""
    import torch
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        why = f"torch {torch.__version__} has no torch.nn.attention.sdpa_kernel (torch >= 2.3 has)"
        return {name: (None, why) for name in SDPA_BACKENDS}
    out = {}
    for name, member in SDPA_BACKENDS.items():
        if hasattr(SDPBackend, member):
            out[name] = (lambda m=getattr(SDPBackend, member): sdpa_kernel(m), None)
        else:
            out[name] = (None, f"torch {torch.__version__} has no SDPBackend.{member}")
    return out


def _measure(call: Callable, refusals: tuple = ()) -> tuple[float | None, str | None]:
    """``(ms, None)`` from ``call() -> ms``, or ``(None, why)``: out of memory, or an exception in
    ``refusals`` (an SDPA backend refusing this shape or dtype), with the warnings torch gave why."""
    import torch
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return float(call()), None
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            return None, "out of memory"
        except refusals as e:
            said = dict.fromkeys(" ".join(str(w.message).split()) for w in caught)
            return None, " ".join([*said, f"{type(e).__name__}: {e}"])[:_WHY_MAX]


@contextlib.contextmanager
def triton_kernels(forward: str, backward: str):
    """Run the body with ``FLASHLIB_TRITON_FWD=forward`` and ``FLASHLIB_TRITON_BWD=backward`` (the Triton
    backend's kernels: flashlib.backends.triton.KNOBS), then restore both
    variables as they were (unset if they were unset), also when the body raises
    (``unittest.mock.patch.dict`` of ``os.environ``: it restores the whole environment as it was).

    Explained in: notebooks/07_triton.
    Tested in: tests/tools/test_bench.py.
    """
    from ..backends.triton import KNOBS
    wanted = {variable: (version, KNOBS[variable]) for variable, version in zip(KNOBS, (forward, backward))}
    for variable, (version, versions) in wanted.items():
        if version not in versions:
            raise ValueError(f"triton_kernels: {variable} must be one of {versions}, got {version!r}")
    with mock.patch.dict(os.environ, {variable: version for variable, (version, _) in wanted.items()}):
        yield


def _backward(fn, q, k, v, do):
    """A call that runs only the backward: the forward runs once here and its graph is kept."""
    import torch
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    o = fn(qg, kg, vg)
    return lambda: torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True)


def host_timer(fn: Callable, calls: int = 200, repeats: int = 7) -> float:
    """Milliseconds per call of ``fn()`` run ``calls`` times back to back, the GPU synchronised after the
    last (median of ``repeats``). For a call whose kernels take microseconds this is what the reader's loop
    sees: the host's work (checks, dispatch, launches) plus whatever GPU time it cannot hide. CUDA events
    (``do_bench``) would time only the GPU, and hide exactly the host overhead this measures.

    Explained in: notebooks/07_triton.
    Tested in: tests/tools/test_bench_small.py.
    """
    import statistics
    import time

    import torch
    if not callable(fn):
        raise TypeError(f"host_timer: fn must be a callable taking no arguments, got {type(fn).__name__}")
    for name, value in (("calls", calls), ("repeats", repeats)):
        if not _positive_int(value):
            raise ValueError(f"host_timer: {name} must be a positive int, got {value!r}")
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    sync()                                               # warm: compiled, cached, allocated
    per_call = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        per_call.append((time.perf_counter() - start) / calls * 1e3)
    return statistics.median(per_call)


def _time_calls(calls: dict, context, refusals, why: dict, inference=()) -> dict:
    """``{key: ms or None}`` of each ``calls[key]() -> ms`` run under ``context`` (grad enabled, or off
    for ``inference`` keys), skipping keys already in ``why``; a refusal's reason goes into ``why``."""
    import torch
    times = dict.fromkeys(calls)
    for key, call in calls.items():
        if key in why:
            continue
        with context(), (torch.no_grad() if key in inference else torch.enable_grad()):
            times[key], reason = _measure(call, refusals)
        if reason:
            why[key] = reason
    return times


def _refusals(name) -> tuple:
    """What counts as an implementation refusing a call rather than failing: SDPA refusing a shape, or
    the CUDA backend unable to run here (no CuPy)."""
    return (RuntimeError,) if name in SDPA_BACKENDS or name == "flashlib-cuda" else ()


def _tma_refusal(q, k, v, do) -> str | None:
    """Why the TMA kernels do not take these tensors (row "flashlib-tma" then times nothing: never
    versions 1 and 2 under its name), or None."""
    from ..kernels.triton import fa2_fwd_v4_tma
    why = fa2_fwd_v4_tma.supported(q, k, v, do)
    return None if why is None else f"{TMA_REFUSED}: {why}"[:_WHY_MAX]


def _time_impl(timer, fn, dec, qkv_do, context, refusals, untimed=None) -> tuple[dict, dict]:
    """Forward, backward and decode times of one implementation (``context`` forces its SDPA
    backend), and why any of them is missing (``untimed``: ``{time: why}`` not to time at all)."""
    q, k, v, do = qkv_do
    why = dict(untimed or {})
    times = _time_calls({"fwd_ms": lambda: timer(lambda: fn(q, k, v))}, context, refusals, why)
    if times["fwd_ms"] is None and why.get("fwd_ms") != NOT_ASKED and "bwd_ms" not in why:
        why["bwd_ms"] = "not timed: the forward has no time"       # refused or out of memory: so is this
    times |= _time_calls({"bwd_ms": lambda: timer(_backward(fn, q, k, v, do)), "decode_ms": lambda: timer(dec)},
                         context, refusals, why, inference=("decode_ms",))
    return times, why


def _git_commit() -> tuple[str, bool | None]:
    """flashlib's git commit and whether tracked files differ from it, when it runs from a checkout;
    ``("unknown", None)`` otherwise (an installed wheel, no git, a repository git will not read)."""
    root = pathlib.Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return "unknown", None

    def git(*args):
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30,
                              check=True).stdout.strip()
    try:
        return git("rev-parse", "HEAD"), bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return "unknown", None


def _nvidia_driver(index: int) -> str:
    """The NVIDIA driver's version (e.g. "550.54.15"): from nvidia-smi, else NVML, else "unknown"."""
    try:
        out = subprocess.run(["nvidia-smi", "-i", str(index), "--query-gpu=driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30, check=True)
        if out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        import pynvml
        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:                              # noqa: BLE001 - NVML absent or failing: say unknown
        return "unknown"


def environment(device="cuda") -> dict:
    """Where and when a run happens: device name, compute capability, SM count, NVIDIA driver, CUDA
    (torch's), torch, triton, flashlib's version and git commit ("unknown" outside a git checkout;
    ``dirty``: tracked files differ from it), and the UTC date. On a CPU the GPU fields are None.

    Explained in: notebooks/07_triton.
    Tested in: tests/tools/test_bench.py.
    """
    import torch

    from .. import __version__
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    dev = torch.device(device)
    gpu = dev.type == "cuda"
    props = torch.cuda.get_device_properties(dev) if gpu else None
    commit, dirty = _git_commit()
    return {
        "device": props.name if gpu else "cpu",
        "compute_capability": f"sm_{props.major}{props.minor}" if gpu else None,
        "sm_count": props.multi_processor_count if gpu else None,
        "driver": _nvidia_driver(dev.index or 0) if gpu else None,
        "cuda": torch.version.cuda if gpu else None,
        "torch": torch.__version__, "triton": triton_version, "flashlib": __version__,
        "commit": commit, "dirty": dirty,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def _with_throughput(row: dict, config: dict) -> dict:
    """``row`` plus what its times mean: forward/backward TFLOP/s and decode GB/s (None where no time)."""
    b, h, n, d = config["batch"], config["heads"], row["n"], config["head_dim"]
    work = {"fwd_tflops": ("fwd_ms", attention_flops(b, h, n, n, d, causal=config["causal"]) / 1e12),
            "bwd_tflops": ("bwd_ms", attention_flops(b, h, n, n, d, causal=config["causal"],
                                                     backward=True) / 1e12),
            "decode_gbs": ("decode_ms", decode_bytes(b, config["kv_heads"], n, d, DTYPES[config["dtype"]]) / 1e9)}
    return {**row, **{key: (amount / (row[t] * 1e-3) if row[t] else None) for key, (t, amount) in work.items()}}


def run(ns=DEFAULT_NS, *, batch=4, heads=16, kv_heads=None, head_dim=128, dtype="float16", causal=False,
        device="cuda", timer: Callable | None = None, progress=True, cuda=True, tma=True,
        small: tuple | None = None, small_timer: Callable | None = None, only=TIMES) -> dict:
    """Time forward, backward and decode of "flashlib" (the Triton kernels, versions 1 and 2),
    "flashlib-tma" (the TMA forward and the TMA dK/dV: tensor descriptors; no decode; unless
    ``tma=False``), "flashlib-cuda" (the CUDA C++ kernels; unless ``cuda=False``), torch SDPA forced to
    each of its backends ("sdpa-flash", "sdpa-cudnn", "sdpa-efficient") and "naive" at each N.

    Returns ``{"environment": environment(device), "config": {"ns", "batch", "heads", "kv_heads",
    "head_dim", "dtype", "causal", "timer"}, "rows": [{"n", "impl", "fwd_ms", "bwd_ms", "decode_ms",
    "why", "fwd_tflops", "bwd_tflops", "decode_gbs"}]}``. A time is None where the implementation ran
    out of memory, an SDPA backend refused the shape or dtype, or a flashlib backend cannot run here
    (for example CuPy missing for "flashlib-cuda"); ``why`` maps each such time to the reason (nothing
    is dropped silently; "flashlib-cuda" has no backward time where its backward is Triton's:
    :data:`CUDA_NO_BACKWARD`). "flashlib-tma" never has a decode time (:data:`TMA_NO_DECODE`: the
    kernel is row "flashlib"'s), and no time at all where the TMA kernels do not take the tensors
    (float32, a head dim that is not a multiple of 8: the reason of
    flashlib.kernels.triton.fa2_fwd_v4_tma.supported; versions 1 and 2 are never timed in their place). Each
    Triton row sets ``FLASHLIB_TRITON_FWD`` and ``FLASHLIB_TRITON_BWD`` around its own calls only
    (:data:`TRITON_KERNELS`, :func:`triton_kernels`). With GQA, each SDPA backend that takes SDPA's
    ``enable_gqa`` reads K and V as flashlib does; one that does not gets them expanded to H heads
    (outside the timing); ``config["sdpa_kv"]`` records which (:data:`SDPA_KV`). ``timer(fn) -> ms`` defaults to ``triton.testing.do_bench`` (median); tests pass another to
    run the plumbing on a CPU at tiny sizes.

    ``only``: the times to measure (a subset of :data:`TIMES`; the others are null with
    :data:`NOT_ASKED`), e.g. ``("decode_ms",)`` for a decode sweep to 128k cached tokens, where a forward
    and backward at that length would take most of the run.

    ``small=(B, H, N, d)`` (``python -m flashlib bench`` passes :data:`SMALL_SHAPE`) also times one small
    call of every implementation in the run's dtype with ``small_timer`` (default :func:`host_timer`:
    back to back, host time included): ``results["small"] = {"shape": [B, H, N, d], "rows": [{"impl",
    "call_ms", "train_ms", "why"}]}``; :func:`small_ratios` turns it into flashlib's latency against SDPA.

    Explained in: notebooks/07_triton.
    Tested in: tests/tools/test_bench.py, tests/tools/test_bench_small.py.
    """
    import torch

    import flashlib
    timer_name = DEFAULT_TIMER if timer is None else getattr(timer, "__qualname__", repr(timer))
    config = dict(ns=list(ns) if isinstance(ns, (list, tuple, range)) else ns, batch=batch, heads=heads,
                  kv_heads=heads if kv_heads is None else kv_heads, head_dim=head_dim, dtype=dtype,
                  causal=causal, timer=timer_name)
    _check_config(config, "run")
    if not isinstance(cuda, bool):
        raise TypeError(f"run: cuda must be a bool (time the 'flashlib-cuda' row or not), got {cuda!r}")
    if not isinstance(tma, bool):
        raise TypeError(f"run: tma must be a bool (time the 'flashlib-tma' row or not), got {tma!r}")
    only = (only,) if isinstance(only, str) else only
    if (not isinstance(only, (tuple, list)) or not only or not all(isinstance(t, str) for t in only)
            or not set(only) <= set(TIMES)):
        raise ValueError(f"run: only must be a non-empty subset of {TIMES}, got {only!r}")
    not_asked = {t: NOT_ASKED for t in TIMES if t not in only}
    if timer is None:
        from triton.testing import do_bench
        timer = lambda fn: do_bench(fn, return_mode="median")            # noqa: E731
    env = environment(device)
    kv_heads, dt, group = config["kv_heads"], getattr(torch, dtype), heads // config["kv_heads"]
    sdpa = _sdpa_contexts()
    skipped = {name for name, wanted in (("flashlib-cuda", cuda), ("flashlib-tma", tma)) if not wanted}
    mine = {name: backend for name, backend in FLASHLIB_IMPLS.items() if name not in skipped}
    untimed = {}                                   # per impl: {time: why} it is not timed (same at every N)
    if tma:
        untimed["flashlib-tma"] = {"decode_ms": TMA_NO_DECODE}
    if cuda:
        from ..kernels import cuda as cuda_kernels
        why_not = cuda_kernels.backward_supported(torch.empty(1, 1, 1, head_dim, dtype=dt, device=device))
        if why_not is not None:
            untimed["flashlib-cuda"] = {"bwd_ms": f"{CUDA_NO_BACKWARD} ({why_not})"}
    native = _sdpa_native_gqa(sdpa, heads, kv_heads, head_dim, dt, device, causal)
    if group > 1:
        config["sdpa_kv"] = {name: SDPA_KV[g] for name, g in native.items()}
    attend = {**{name: lambda a, b, c, be=be: flashlib.attention(a, b, c, causal=causal, backend=be)
                 for name, be in mine.items()},
              **{name: lambda a, b, c, g=native[name]: _sdpa(a, b, c, causal, gqa=g) for name in SDPA_BACKENDS},
              "naive": lambda a, b, c: _naive(a, b, c, causal)}
    rows = []
    if progress:                                     # tqdm only where a bar is drawn: a bare GPU Python
        from tqdm.auto import tqdm                   # (make test-gpu PY=python3) may not have it
        ns_iter = tqdm(config["ns"], desc="bench N")
    else:
        ns_iter = config["ns"]
    for n in ns_iter:
        gen = torch.Generator(device=device).manual_seed(n)
        q = torch.randn(batch, heads, n, head_dim, device=device, dtype=dt, generator=gen)   # (B, H, N, d)
        k = torch.randn(batch, kv_heads, n, head_dim, device=device, dtype=dt, generator=gen)  # (B, Hkv, N, d)
        v = torch.randn(batch, kv_heads, n, head_dim, device=device, dtype=dt, generator=gen)
        do = torch.randn_like(q)
        q1 = q[:, :, -1:].contiguous()                                                       # (B, H, 1, d)
        expanded = ((k, v) if group == 1 or all(native.values())      # (B, H, N, d) for SDPA rows without GQA
                    else (k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)))
        for name, fn in attend.items():
            kk, vv = expanded if name in SDPA_BACKENDS and not native[name] else (k, v)
            if name in mine:
                dec = lambda be=mine[name]: flashlib.decode(q1, k, v, backend=be)       # noqa: E731
            else:
                dec = lambda: fn(q1, kk, vv)                                               # noqa: E731
            context, why_not = _context(name, sdpa)
            skip = {**not_asked, **untimed.get(name, {})}
            if name == "flashlib-tma" and (tma_why := _tma_refusal(q, k, v, do)) is not None:
                skip["fwd_ms"] = tma_why
            if why_not:
                times, why = dict.fromkeys(TIMES), dict.fromkeys(TIMES, why_not)
            else:
                times, why = _time_impl(timer, fn, dec, (q, kk, vv, do), context, _refusals(name), skip)
            rows.append(_with_throughput({"n": n, "impl": name, **times, "why": why}, config))
    results = {"environment": env, "config": config, "rows": rows}
    if small is not None:
        results["small"] = _small_calls(small, small_timer or host_timer, attend, sdpa, dt, device,
                                        {name: untimed.get(name, {}) for name in attend}, tma)
    return results


def _sdpa_native_gqa(sdpa, heads, kv_heads, head_dim, dt, device, causal) -> dict:
    """``{SDPA row: whether it reads GQA's K and V as they are}``: where the forced backend takes SDPA's
    ``enable_gqa`` (asked once, on a tiny call), it gets K and V with ``kv_heads`` heads, as flashlib
    does, so a decode step of either reads the same bytes; elsewhere (an older torch, a backend that
    refuses it) K and V are expanded to every query head before timing. MHA: nothing to ask."""
    import torch
    native = dict.fromkeys(SDPA_BACKENDS, False)
    if kv_heads == heads:
        return native
    q = torch.zeros(1, heads, 1, head_dim, device=device, dtype=dt)        # (1, H, 1, d)
    kv = torch.zeros(1, kv_heads, 16, head_dim, device=device, dtype=dt)   # (1, Hkv, 16, d)
    for name in SDPA_BACKENDS:
        context, why_not = _context(name, sdpa)
        if why_not:
            continue
        try:
            with context(), warnings.catch_warnings():
                warnings.simplefilter("ignore")              # a refusal's warnings: kept where it is timed
                _sdpa(q, kv, kv, causal, gqa=True)
            native[name] = True
        except (RuntimeError, TypeError):                    # refused, or a torch without enable_gqa
            pass
    return native


def _context(name, sdpa):
    """``(context factory, why it cannot run or None)`` of one implementation: its SDPA backend forced,
    or its Triton kernels set (around its own calls only), or nothing."""
    context, why_not = sdpa.get(name, (contextlib.nullcontext, None))       # non-SDPA: forces nothing
    if name in TRITON_KERNELS:
        context = lambda versions=TRITON_KERNELS[name]: triton_kernels(*versions)        # noqa: E731
    return context, why_not


def _small_calls(shape, timer, attend, sdpa, dt, device, untimed, tma) -> dict:
    """One small call of each implementation in ``attend``: its inference forward ("call_ms") and its
    forward + backward ("train_ms"), each timed by ``timer``; None with the reason where it cannot run."""
    import torch
    if not (isinstance(shape, (tuple, list)) and len(shape) == 4 and all(_positive_int(x) for x in shape)):
        raise ValueError(f"run: small must be (B, H, N, d) of positive ints, e.g. {SMALL_SHAPE}, got {shape!r}")
    b, h, n, d = shape
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, do = (torch.randn(b, h, n, d, device=device, dtype=dt, generator=gen) for _ in range(4))
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))

    def train(fn):
        return lambda: torch.autograd.grad(fn(qg, kg, vg), (qg, kg, vg), do)
    rows = []
    for name, fn in attend.items():
        context, why_not = _context(name, sdpa)
        why = dict.fromkeys(SMALL_TIMES, why_not) if why_not else {}
        if name == "flashlib-tma" and tma and not why and (tma_why := _tma_refusal(q, k, v, do)) is not None:
            why = dict.fromkeys(SMALL_TIMES, tma_why)
        if "bwd_ms" in untimed[name]:               # e.g. the CUDA backward does not apply: Triton's runs
            why.setdefault("train_ms", untimed[name]["bwd_ms"])
        times = _time_calls({"call_ms": lambda f=fn: timer(lambda: f(q, k, v)), "train_ms": lambda f=fn: timer(train(f))},
                            context, _refusals(name), why, inference=("call_ms",))
        rows.append({"impl": name, **times, "why": why})
    return {"shape": list(shape), "rows": rows}


# ---- result files: one validator for run's arguments, save and load ----

def _fail(source, field, expected, got):
    raise ValueError(f"{source}: {field} must be {expected}, got {got!r}")


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _check_config(config, source) -> None:
    if not isinstance(config, dict):
        _fail(source, "config", "a dict", config)
    ns = config.get("ns")
    if not isinstance(ns, list) or not ns or not all(_positive_int(n) for n in ns):
        _fail(source, "config.ns", "a non-empty list of positive ints (sequence lengths)", ns)
    for key in ("batch", "heads", "kv_heads", "head_dim"):
        if not _positive_int(config.get(key)):
            _fail(source, f"config.{key}", "a positive int", config.get(key))
    if config["heads"] % config["kv_heads"]:
        _fail(source, "config.kv_heads", f"a divisor of heads={config['heads']} (GQA)", config["kv_heads"])
    if config.get("dtype") not in DTYPES:
        _fail(source, "config.dtype", f"one of {sorted(DTYPES)}", config.get("dtype"))
    if not isinstance(config.get("causal"), bool):
        _fail(source, "config.causal", "a bool", config.get("causal"))
    if not isinstance(config.get("timer"), str) or not config["timer"]:
        _fail(source, "config.timer", "the timer's name", config.get("timer"))
    kv = config.get("sdpa_kv")
    if kv is not None and (not isinstance(kv, dict) or not set(kv) <= set(SDPA_BACKENDS)
                           or not set(kv.values()) <= set(SDPA_KV.values())):
        _fail(source, "config.sdpa_kv", f"{{SDPA row: one of {sorted(SDPA_KV.values())}}}", kv)


def _check_environment(env, source) -> None:
    """A file's environment must name a CUDA GPU: nothing measured on a CPU is saved."""
    if not isinstance(env, dict):
        _fail(source, "environment", "a dict", env)
    if not isinstance(env.get("device"), str) or env["device"] in ("", "cpu"):
        _fail(source, "environment.device", "a CUDA GPU's name (nothing measured on a CPU is saved)",
              env.get("device"))
    for key in ("driver", "cuda", "torch", "triton", "flashlib", "commit"):
        if not isinstance(env.get(key), str) or not env[key]:
            _fail(source, f"environment.{key}", "a non-empty string", env.get(key))
    if not re.fullmatch(r"sm_\d+", str(env.get("compute_capability"))):
        _fail(source, "environment.compute_capability", "a CUDA GPU's 'sm_XY'", env.get("compute_capability"))
    if not _positive_int(env.get("sm_count")):
        _fail(source, "environment.sm_count", "a positive int (the GPU's SMs)", env.get("sm_count"))
    if env.get("dirty") not in (True, False, None):
        _fail(source, "environment.dirty", "true, false or null", env.get("dirty"))
    try:
        datetime.datetime.strptime(env.get("date"), "%Y-%m-%dT%H:%M:%SZ")
    except (TypeError, ValueError):
        _fail(source, "environment.date", "a UTC time like '2026-01-31T12:00:00Z'", env.get("date"))


def _check_rows(rows, config, source) -> None:
    """Every time positive or null with its reason, and flashlib and each SDPA backend at every N."""
    if not isinstance(rows, list) or not rows:
        _fail(source, "rows", "a non-empty list", rows)
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            _fail(source, f"rows[{i}]", "a dict", row)
        if row.get("n") not in config["ns"]:
            _fail(source, f"rows[{i}].n", f"one of config.ns {config['ns']}", row.get("n"))
        if not isinstance(row.get("impl"), str) or not row["impl"]:
            _fail(source, f"rows[{i}].impl", "an implementation's name", row.get("impl"))
        _check_times(row, TIMES, f"rows[{i}]", source)
    present = {(r["n"], r["impl"]) for r in rows}
    for n in config["ns"]:
        for impl in ("flashlib", *SDPA_BACKENDS):
            if (n, impl) not in present:
                _fail(source, "rows", f"a row for impl={impl!r} at n={n} (SDPA is measured in the same run)",
                      sorted(i for m, i in present if m == n))


def _check_times(row, keys, where, source) -> None:
    """Each of ``keys`` in ``row`` a positive number of milliseconds, or null with its reason in ``why``."""
    why = row.get("why")
    if not isinstance(why, dict):
        _fail(source, f"{where}.why", "a dict of reasons for the null times", why)
    for key in keys:
        t = row.get(key, "missing")
        if t is None:
            if not isinstance(why.get(key), str) or not why[key]:
                _fail(source, f"{where}.why.{key}", f"the reason {key} is null", why.get(key))
        elif isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            _fail(source, f"{where}.{key}", "a positive number of milliseconds or null", t)


def _check_small(small, source) -> None:
    """The optional small-call section: its shape, and flashlib and every SDPA backend timed or refused."""
    if not isinstance(small, dict):
        _fail(source, "small", "a dict with 'shape' and 'rows'", small)
    shape = small.get("shape")
    if not isinstance(shape, list) or len(shape) != 4 or not all(_positive_int(x) for x in shape):
        _fail(source, "small.shape", "[B, H, N, d] of positive ints", shape)
    rows = small.get("rows")
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows):
        _fail(source, "small.rows", "a non-empty list of dicts", rows)
    for i, row in enumerate(rows):
        if not isinstance(row.get("impl"), str) or not row["impl"]:
            _fail(source, f"small.rows[{i}].impl", "an implementation's name", row.get("impl"))
        _check_times(row, SMALL_TIMES, f"small.rows[{i}]", source)
    missing = [impl for impl in ("flashlib", *SDPA_BACKENDS) if impl not in {r["impl"] for r in rows}]
    if missing:
        _fail(source, "small.rows", f"a row for each of {missing} (SDPA is measured in the same run)",
              [r["impl"] for r in rows])


def _check(results, source) -> None:
    if not isinstance(results, dict):
        _fail(source, "the results", "a dict from run() or load()", type(results).__name__)
    _check_environment(results.get("environment"), source)
    _check_config(results.get("config"), source)
    _check_rows(results.get("rows"), results["config"], source)
    if "small" in results:
        _check_small(results["small"], source)


def result_name(results: dict) -> str:
    """The file name a run gets when ``--save`` names a folder: GPU, dtype, head dim, causal, date, e.g.
    "nvidia-h100-80gb-hbm3-fp16-d128-causal-20261123T2045Z.json" (benchmarks/README.md's convention,
    written once; the start time keeps two runs of one day apart).

    Explained in: notebooks/07_triton.
    Tested in: tests/tools/test_bench.py.
    """
    env, config = results["environment"], results["config"]
    gpu = re.sub(r"[^a-z0-9]+", "-", str(env["device"]).lower()).strip("-")
    dtype = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}[config["dtype"]]
    date = str(env["date"])[:16].replace("-", "").replace(":", "") + "Z"      # 2026-11-23T20:45 -> 20261123T2045Z
    return f"{gpu}-{dtype}-d{config['head_dim']}{'-causal' if config['causal'] else ''}-{date}.json"


def save(results: dict, path) -> pathlib.Path:
    """Write ``results`` (from :func:`run` on a CUDA GPU) to ``path`` as JSON, schema :data:`SCHEMA`:
    ``{"schema", "environment", "config", "rows": [{"n", "impl", "fwd_ms", "bwd_ms", "decode_ms",
    "why"}]}``, plus ``"small"`` where the run timed a small call; throughputs are not stored (:func:`load` derives them from the times). Results that are
    not a CUDA GPU's, or lack a field, are refused with a ValueError and nothing is written.

    Explained in: notebooks/07_triton.
    Tested in: tests/tools/test_bench.py.
    """
    _check(results, "results")
    data = {"schema": SCHEMA, "environment": {k: results["environment"][k] for k in _ENV_FIELDS},
            "config": results["config"],
            "rows": [{k: r[k] for k in ("n", "impl", *TIMES, "why")} for r in results["rows"]]}
    if "small" in results:
        data["small"] = results["small"]
    path = pathlib.Path(path)
    path.write_text(json.dumps(data, indent=1, allow_nan=False) + "\n")
    return path


def load(path) -> dict:
    """Read a result file written by :func:`save`, check it, and return it as :func:`run` returns
    results (with TFLOP/s and GB/s derived from the times). A file that is not JSON, has another
    schema, or lacks or mistypes a field is refused with a ValueError naming the file and the field.

    Explained in: notebooks/07_triton.
    Tested in: tests/tools/test_bench.py.
    """
    path = pathlib.Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not a JSON file ({e})") from None
    if not isinstance(data, dict) or data.get("schema") not in SCHEMAS:
        got = data.get("schema") if isinstance(data, dict) else type(data).__name__
        _fail(path, "schema", f"one of {SCHEMAS}", got)
    if data["schema"] != SCHEMA and "small" in data:
        _fail(path, "small", f"absent in a {data['schema']} file (schema {SCHEMA} added it)", "a section")
    _check(data, path)
    out = {"environment": data["environment"], "config": data["config"],
           "rows": [_with_throughput(r, data["config"]) for r in data["rows"]]}
    if "small" in data:
        out["small"] = data["small"]
    return out


def ratios(results: dict, impl: str = "flashlib") -> list[dict]:
    """Speed of ``impl`` against each SDPA backend measured in the same run, at each N:
    ``[{"n", "baseline", "fwd", "bwd", "decode"}]``, each the backend's time / ``impl``'s (> 1: ``impl``
    is faster; equal to the ratio of TFLOP/s), None where either has no time.

    Explained in: notebooks/07_triton.
    Tested in: tests/tools/test_bench.py.
    """
    mine = {r["n"]: r for r in results["rows"] if r["impl"] == impl}
    if not mine:
        raise ValueError(f"impl must be one of the results' implementations "
                         f"{sorted({r['impl'] for r in results['rows']})}, got {impl!r}")
    return [{"n": r["n"], "baseline": r["impl"],
             **{t[:-3]: (r[t] / mine[r["n"]][t] if r[t] and mine[r["n"]][t] else None) for t in TIMES}}
            for r in results["rows"] if r["impl"] in SDPA_BACKENDS and r["n"] in mine]


def small_ratios(results: dict) -> list[dict]:
    """The small call's latency against SDPA's (:data:`SMALL_SHAPE`, timed back to back by
    :func:`host_timer`): ``[{"impl", "baseline", "call", "train"}]`` for each of flashlib's rows and each
    SDPA backend, the backend's time / flashlib's (> 1: flashlib is faster; the goal "within 2x of SDPA's
    latency" is a ratio >= 0.5), None where either has no time. ``[]`` for results without a small call.

    Explained in: notebooks/07_triton.
    Tested in: tests/tools/test_bench_small.py.
    """
    rows = {r["impl"]: r for r in results.get("small", {}).get("rows", [])}
    return [{"impl": impl, "baseline": base,
             **{t[:-3]: (rows[base][t] / rows[impl][t] if rows[base][t] and rows[impl][t] else None)
                for t in SMALL_TIMES}}
            for impl in FLASHLIB_IMPLS if impl in rows for base in SDPA_BACKENDS if base in rows]


def _flashlib_impls(results: dict) -> list[str]:
    """flashlib's rows in ``results`` ("flashlib", and "flashlib-tma" and "flashlib-cuda" where they were
    timed), in :data:`FLASHLIB_IMPLS`'s order."""
    present = {r["impl"] for r in results["rows"]}
    return [impl for impl in FLASHLIB_IMPLS if impl in present]


def _title(results: dict) -> str:
    env, c = results["environment"], results["config"]
    where = env["device"]
    if env["compute_capability"] is not None:
        where += (f" ({env['compute_capability']}, {env['sm_count']} SMs, driver {env['driver']}, "
                  f"CUDA {env['cuda']})")
    commit = env["commit"][:10] + (" + uncommitted changes" if env["dirty"] else "")
    return (f"measured on {where}; torch {env['torch']}, triton {env['triton']}; flashlib {env['flashlib']} "
            f"commit {commit}; {env['date']}\nB={c['batch']} H={c['heads']} Hkv={c['kv_heads']} "
            f"d={c['head_dim']} {c['dtype']}{' causal' if c['causal'] else ''}; times: {c['timer']}")


def plot(results: dict, path=None):
    """Top: forward TFLOP/s, backward TFLOP/s and decode GB/s of each implementation against N; bottom:
    the speed of flashlib's rows relative to each SDPA backend (:func:`ratios`; line style per row,
    :data:`LINESTYLES`: solid "flashlib", dash-dot "flashlib-tma", dashed "flashlib-cuda"). Titled with
    where, with what and when it was measured; saved if ``path``.

    Explained in: notebooks/07_triton.
    Tested in: tests/tools/test_bench.py.
    """
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 3, figsize=(15, 8), sharex=True)
    panels = (("fwd_tflops", "forward TFLOP/s", "fwd"), ("bwd_tflops", "backward TFLOP/s", "bwd"),
              ("decode_gbs", "decode GB/s (K/V read)", "decode"))
    speeds = {impl: ratios(results, impl) for impl in _flashlib_impls(results)}
    for (top, bottom), (key, label, short) in zip(axes.T, panels):
        for impl in dict.fromkeys(r["impl"] for r in results["rows"]):
            pts = [(r["n"], r[key]) for r in results["rows"] if r["impl"] == impl and r[key] is not None]
            if pts:
                top.plot(*zip(*pts), marker="o", label=impl)
        top.set_ylabel(label)
        for impl, speed in speeds.items():
            for color, base in enumerate(SDPA_BACKENDS):
                pts = [(s["n"], s[short]) for s in speed if s["baseline"] == base and s[short] is not None]
                if pts:
                    bottom.plot(*zip(*pts), marker="o", color=f"C{color}", linestyle=LINESTYLES[impl],
                                label=f"{impl} vs {base}")
        bottom.axhline(1.0, color="gray", linewidth=1)
        bottom.set_ylabel(f"{short}: SDPA time / flashlib time")
        bottom.set_xlabel("sequence length N")
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.set_xticks(results["config"]["ns"], [str(n) for n in results["config"]["ns"]])
            ax.minorticks_off()
            ax.grid(True, alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
    fig.suptitle(_title(results), fontsize=9)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=120)
    return fig


def plot_file(path, out=None):
    """:func:`plot` of the result file ``path`` (checked by :func:`load`); saved to ``out`` if given.

    Explained in: notebooks/07_triton.
    Tested in: tests/tools/test_bench.py.
    """
    return plot(load(path), out)


def format_results(results: dict) -> str:
    """The measurements as a table, the speed of each of flashlib's rows against each SDPA backend, and
    why any time is missing (OOM: out of memory; refused: the SDPA backend, or the TMA kernels, do not
    take this shape or dtype; -: not timed, e.g. the backward of a forward that has no time, or the
    kernels another row times).

    Explained in: notebooks/07_triton.
    Tested in: tests/tools/test_bench.py.
    """
    def f(x, why=None):
        if x is not None:
            return f"{x:8.1f}"
        return ("OOM" if why == "out of memory" else "-" if why.startswith("not timed") else "refused").rjust(8)

    def x(r):
        return "       -" if r is None else f"{r:7.2f}x"
    lines = [f"{'N':>6} {'impl':<15} {'fwd TF/s':>8} {'bwd TF/s':>8} {'dec GB/s':>8}"]
    for r in results["rows"]:
        w = r["why"]
        lines.append(f"{r['n']:>6} {r['impl']:<15} {f(r['fwd_tflops'], w.get('fwd_ms'))} "
                     f"{f(r['bwd_tflops'], w.get('bwd_ms'))} {f(r['decode_gbs'], w.get('decode_ms'))}")
    for impl in _flashlib_impls(results):
        lines += ["", f"{impl}'s speed against SDPA in the same run (SDPA time / {impl} time; > 1: faster)",
                  f"{'N':>6} {'against':<15} {'fwd':>8} {'bwd':>8} {'decode':>8}"]
        lines += [f"{s['n']:>6} {s['baseline']:<15} {x(s['fwd'])} {x(s['bwd'])} {x(s['decode'])}"
                  for s in ratios(results, impl)]
    if "small" in results:
        b, h, n, d = results["small"]["shape"]
        lines += ["", f"a small call (B={b} H={h} N={n} d={d}), back to back: microseconds per call",
                  f"{'impl':<15} {'call us':>8} {'train us':>8}"]
        lines += [f"{r['impl']:<15} " + " ".join(f(None if r[t] is None else r[t] * 1e3, r['why'].get(t))
                                                 for t in SMALL_TIMES) for r in results["small"]["rows"]]
        lines += ["", "the small call's speed against SDPA (SDPA time / flashlib time; > 1: faster)",
                  f"{'impl':<15} {'against':<15} {'call':>8} {'train':>8}"]
        lines += [f"{s['impl']:<15} {s['baseline']:<15} {x(s['call'])} {x(s['train'])}"
                  for s in small_ratios(results)]
        calls = [s["call"] for s in small_ratios(results) if s["impl"] == "flashlib" and s["call"] is not None]
        if calls:
            lines.append(goal_line("small", min(calls)))
    notes: dict = {}                  # (impl, reason) -> the measurements it applies to
    for r in results["rows"] + [dict(r, impl=f"{r['impl']} (small call)")
                                for r in results.get("small", {}).get("rows", [])]:
        for key, why in r["why"].items():
            notes.setdefault((r["impl"], why), dict.fromkeys(()))[key[:-3]] = None
    if notes:
        lines += ["", "why some times are missing:"]
        lines += [f"  {impl} {', '.join(keys)}: {why}" for (impl, why), keys in notes.items()]
    return "\n".join(lines)


def goal_line(goal: str, value: float) -> str:
    """``"goal met: <what>: 1.04 (at most 1.1)"`` or ``"goal MISSED: ..."`` for goal ``goal`` of
    :data:`GOALS` at the measured ratio ``value``.

    Explained in: notebooks/07_triton.
    Tested in: tests/tools/test_bench.py.
    """
    if goal not in GOALS:
        raise ValueError(f"goal must be one of {sorted(GOALS)}, got {goal!r}")
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise TypeError(f"value must be a finite number (a measured ratio), got {value!r}")
    what, limit, sense = GOALS[goal]
    met = value <= limit if sense == "at most" else value >= limit
    return f"goal {'met' if met else 'MISSED'}: {what}: {value:.2f} ({sense} {limit})"


def dtype_refusal(dtype: str, device="cuda") -> str | None:
    """None where flashlib's kernels take ``dtype`` on ``device`` (:func:`flashlib.hardware.kernel_dtypes`),
    else why not, naming the GPU and the dtypes it does take.

    Explained in: notebooks/07_triton.
    Tested in: tests/tools/test_bench.py.
    """
    from ..hardware import device_facts, kernel_dtypes
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    takes = kernel_dtypes(device)
    if dtype in takes:
        return None
    facts = device_facts(device)
    arch = facts.arch if facts is not None else "this device"
    return (f"flashlib's kernels do not take {dtype} on this GPU ({arch}; bfloat16 needs sm_80 or newer); "
            f"they take {', '.join(takes)} here")


def _tiny_llama(dtype, device, layers=2):
    """A randomly initialised Llama (8 query heads on 2 kv heads), built from a config (nothing is
    downloaded) with attention through SDPA: the model tests/gpu/test_auto_gpu.py checks for tokens."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config).to(device, getattr(torch, dtype)).eval()


def _hf_generate(model, ids, new):
    """``new`` greedy tokens after ``ids`` (B, T), never stopped early by an end-of-sequence token."""
    import torch
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                              min_new_tokens=new, do_sample=False, pad_token_id=0)


def generate_per_token(*, batch=4, prompt=2048, new=32, repeats=3, dtype="float16", device="cuda",
                       model=None, generate=None, clock=None) -> dict:
    """Milliseconds per generated token of a model's greedy generation, with and without flashlib.auto:
    ``(t(new + 1) - t(1)) / new`` (the prefill subtracted), best of ``repeats``, GPU synchronised around
    each timing. Returns ``{"sdpa_ms", "auto_ms", "ratio": auto / sdpa, "decode_calls", "goal"}``;
    ``decode_calls`` counts the timed calls flashlib.auto sent to flashlib.decode, ``goal`` is
    :func:`goal_line` for :data:`GOALS` ``["generate"]`` ("goal not measured", saying why, where no timed
    call reached flashlib.decode).

    ``model``: default a tiny random Llama (``transformers`` needed) in ``dtype``; ``generate(model, ids,
    new)``: default Hugging Face's greedy ``model.generate``; ``clock``: default ``time.perf_counter``
    (tests pass fakes to run the plumbing on a CPU).

    Explained in: notebooks/11_models.
    Tested in: tests/tools/test_bench.py.
    """
    import time

    import torch

    import flashlib.auto as auto
    for name, value in (("batch", batch), ("prompt", prompt), ("new", new), ("repeats", repeats)):
        if not _positive_int(value):
            raise ValueError(f"generate_per_token: {name} must be a positive int, got {value!r}")
    if dtype not in DTYPES:
        raise ValueError(f"generate_per_token: dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    model = _tiny_llama(dtype, device) if model is None else model
    generate = _hf_generate if generate is None else generate
    clock = time.perf_counter if clock is None else clock
    ids = torch.randint(3, 512, (batch, prompt), generator=torch.Generator().manual_seed(1)).to(device)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)

    def best(n):
        times = []
        for _ in range(repeats):
            sync()
            t0 = clock()
            generate(model, ids, n)
            sync()
            times.append(clock() - t0)
        return min(times)

    def per_token():
        return (best(new + 1) - best(1)) / new * 1e3

    generate(model, ids, 4)                             # warm up SDPA and the allocator
    with auto.enabled():
        generate(model, ids, 4)                         # compile flashlib's kernels for these shapes
        before = auto.stats["decode"]
        auto_ms = per_token()
        decode_calls = auto.stats["decode"] - before
    sdpa_ms = per_token()
    ratio = auto_ms / sdpa_ms if sdpa_ms > 0 else math.inf
    if decode_calls == 0:                               # the timing never reached Flash-Decoding
        goal = f"goal not measured: {GOALS['generate'][0]}: no timed call went to flashlib.decode"
    elif not math.isfinite(ratio):
        goal = f"goal not measured: {GOALS['generate'][0]}: plain SDPA's time per token was not positive"
    else:
        goal = goal_line("generate", ratio)
    return {"sdpa_ms": sdpa_ms, "auto_ms": auto_ms, "ratio": ratio, "decode_calls": decode_calls,
            "goal": goal}


# ---- serving (issue 25): ragged batches, paged caches, cascade decoding ----

# The serving rows (:func:`serving`) and what each one times.
SERVING_ROWS = {
    "varlen": "flashlib.attention_varlen, causal, on the ragged batch packed end to end",
    "padded-flashlib": "flashlib.attention, causal, on the batch right-padded to its longest sequence",
    "padded-sdpa": "torch SDPA (is_causal, its own backend choice) on the same padded batch",
    "paged-decode": "flashlib.decode with a block table (pages in shuffled order)",
    "dense-decode": "flashlib.decode on a dense cache holding the same keys and values",
    "cascade": "the shared prefix attended once for every sequence, each suffix alone, merged (merge_states)",
    "plain-decode": "flashlib.decode with the prefix copied into every sequence's cache",
}
# row -> the rows it is compared with (their time / its time: > 1, it is faster)
SERVING_PAIRS = {"varlen": ("padded-sdpa", "padded-flashlib"), "paged-decode": ("dense-decode",),
                 "cascade": ("plain-decode",)}
SERVING_TIMES = ("ms", "train_ms")           # the inference call; forward + backward (grads of q, k, v)
SERVING_INFERENCE = "not timed: decoding is inference only (no gradient)"


def _ragged_lengths(batch: int, max_len: int) -> list[int]:
    """The serving rows' sequence lengths: a ramp ``max_len · (b + 1) / B`` (at least 1), so the longest is
    ``max_len`` and the padded batch wastes about half its tokens (and two thirds of causal attention's
    work: ``Σ len² ≈ B · max_len² / 3``)."""
    _check_sizes("serving", batch=batch, max_len=max_len)
    return [max(1, max_len * (b + 1) // batch) for b in range(batch)]


def _serving_config(batch, heads, kv_heads, head_dim, dtype, max_len, page_size, suffix, timer_name) -> dict:
    config = dict(batch=batch, heads=heads, kv_heads=heads if kv_heads is None else kv_heads,
                  head_dim=head_dim, dtype=dtype, max_len=max_len, page_size=page_size, suffix=suffix,
                  timer=timer_name)
    for key in ("batch", "heads", "kv_heads", "head_dim", "max_len", "page_size", "suffix"):
        if not _positive_int(config[key]):
            _fail("serving", key, "a positive int", config[key])
    if heads % config["kv_heads"]:
        _fail("serving", "kv_heads", f"a divisor of heads={heads} (GQA)", config["kv_heads"])
    if dtype not in DTYPES:
        _fail("serving", "dtype", f"one of {sorted(DTYPES)}", dtype)
    return config


def _ragged_batch(config, dt, device, gen):
    """The packed batch ``(total, H, d)`` / ``(total, Hkv, d)``, its cu_seqlens, and the same batch
    right-padded ``(B, H, max_len, d)`` (zeros past each length)."""
    import torch
    b, h, hkv, d, n = (config[k] for k in ("batch", "heads", "kv_heads", "head_dim", "max_len"))
    lens = _ragged_lengths(b, n)
    total = sum(lens)
    packed = [torch.randn(total, heads, d, device=device, dtype=dt, generator=gen) for heads in (h, hkv, hkv, h)]
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)
    padded = []
    for x in packed:                                  # (total, heads, d) -> (B, heads, max_len, d)
        p = x.new_zeros(b, n, x.shape[1], d)
        for i, (start, length) in enumerate(zip(cu.tolist(), lens)):
            p[i, :length] = x[start:start + length]
        padded.append(p.transpose(1, 2))
    return lens, packed, cu, padded


def _paged_copy(cache, page_size, gen):
    """A dense cache ``(B, Hkv, Nmax, d)`` (Nmax a multiple of page_size) as pages ``(B · Nmax /
    page_size, page_size, Hkv, d)`` in shuffled order, and the int32 block table that finds them."""
    import torch
    b, hkv, nmax, d = cache.shape
    per = nmax // page_size
    order = torch.randperm(b * per, generator=gen, device="cpu").to(cache.device)
    chunks = cache.transpose(1, 2).reshape(b * per, page_size, hkv, d)      # page i of the ordered layout
    pages = torch.empty_like(chunks)
    pages[order] = chunks                                                    # stored at page order[i]
    return pages, order.view(b, per).to(torch.int32)


def serving(*, batch=8, heads=16, kv_heads=None, head_dim=128, dtype="float16", max_len=4096, page_size=16,
            suffix=256, device="cuda", timer: Callable | None = None, backend="auto") -> dict:
    """Time the serving rows (:data:`SERVING_ROWS`) on one set of inputs each:

    * a ragged batch of ``batch`` sequences of ``max_len · (b + 1) / B`` tokens (a ramp up to ``max_len``:
      padding wastes about half the tokens and two thirds of causal attention's work), causal:
      "varlen" (packed, no padding) against "padded-sdpa" and "padded-flashlib" (right-padded to the
      longest), the inference call (``ms``) and forward + backward (``train_ms``);
    * a decode step (one query per sequence) against caches of those lengths: "paged-decode" (pages of
      ``page_size`` tokens, in shuffled order) against "dense-decode" on the same keys and values;
    * a decode step of ``batch`` sequences sharing a prompt of ``max_len`` tokens, each with its own
      ``suffix`` tokens: "cascade" (the prefix attended once for all the queries, the suffixes alone,
      merged with :func:`flashlib.merge_states`) against "plain-decode" (the prefix copied into every
      sequence's cache).

    Before timing, each row's output is compared with its baselines' (the real tokens of the padded
    rows): ``results["checks"]``, the largest absolute difference per pair (paged and dense decode run
    the same kernel on the same data: 0). A bench that times wrong code measures nothing.

    Returns ``{"environment", "config", "rows": [{"impl", "ms", "train_ms", "why", "work", "unit"}],
    "checks"}``: times in milliseconds (None with the reason in ``why``: out of memory, SDPA refusing,
    decoding has no backward), ``work`` what the row moves or computes (FLOPs of causal attention over
    the tokens it attends, or bytes of K and V a decode step reads). :func:`_serving_ratios` gives the
    speedups, :func:`_format_serving` the table. ``timer(fn) -> ms`` defaults to
    ``triton.testing.do_bench`` (median); tests pass another to run the plumbing on a CPU at tiny sizes.

    Explained in: notebooks/10_serving.
    Tested in: tests/tools/test_bench.py.
    """
    import torch

    import flashlib
    timer_name = DEFAULT_TIMER if timer is None else getattr(timer, "__qualname__", repr(timer))
    config = _serving_config(batch, heads, kv_heads, head_dim, dtype, max_len, page_size, suffix, timer_name)
    if timer is None:
        from triton.testing import do_bench
        timer = lambda fn: do_bench(fn, return_mode="median")            # noqa: E731
    env = environment(device)
    dt, hkv, elem = getattr(torch, dtype), config["kv_heads"], DTYPES[dtype]
    gen = torch.Generator(device=device).manual_seed(0)
    cpu_gen = torch.Generator().manual_seed(0)
    group = heads // hkv

    # ragged prefill: packed vs padded
    lens, (q, k, v, do), cu, (qp, kp, vp, dop) = _ragged_batch(config, dt, device, gen)

    def varlen(a, b, c):
        return flashlib.attention_varlen(a, b, c, cu, cu, max_len, max_len, causal=True, backend=backend)

    def padded_flashlib(a, b, c):
        return flashlib.attention(a, b, c, causal=True, backend=backend)

    def padded_sdpa(a, b, c):
        return _sdpa(a, b, c, True, gqa=group > 1)

    useful = sum(attention_flops(1, heads, n, n, head_dim, causal=True) for n in lens)
    padded_work = attention_flops(batch, heads, max_len, max_len, head_dim, causal=True)
    prefill = {"varlen": (varlen, (q, k, v, do), useful),
               "padded-flashlib": (padded_flashlib, (qp, kp, vp, dop), padded_work),
               "padded-sdpa": (padded_sdpa, (qp, kp, vp, dop), padded_work)}

    # decode: paged vs dense, the same keys and values
    nmax = -(-max_len // page_size) * page_size
    q1 = torch.randn(batch, heads, 1, head_dim, device=device, dtype=dt, generator=gen)       # (B, H, 1, d)
    kc, vc = (torch.randn(batch, hkv, nmax, head_dim, device=device, dtype=dt, generator=gen) for _ in "kv")
    (kpages, table), (vpages, _) = (_paged_copy(x, page_size, cpu_gen.manual_seed(1)) for x in (kc, vc))
    seqlens = torch.tensor(lens, dtype=torch.int32, device=device)
    read = 2.0 * hkv * sum(lens) * head_dim * elem
    decode = {"paged-decode": (lambda: flashlib.decode(q1, kpages, vpages, cache_seqlens=seqlens,
                                                       block_table=table, backend=backend), read),
              "dense-decode": (lambda: flashlib.decode(q1, kc, vc, cache_seqlens=seqlens, backend=backend), read)}

    # cascade: a shared prefix of max_len tokens, suffix tokens of each sequence's own
    k_pre, v_pre = (torch.randn(1, hkv, max_len, head_dim, device=device, dtype=dt, generator=gen) for _ in "kv")
    k_suf, v_suf = (torch.randn(batch, hkv, suffix, head_dim, device=device, dtype=dt, generator=gen)
                    for _ in "kv")
    k_all, v_all = (torch.cat([pre.expand(batch, -1, -1, -1), suf], dim=2)
                    for pre, suf in ((k_pre, k_suf), (v_pre, v_suf)))

    def cascade():
        # every sequence's query as one batch of `batch` queries against the prefix, read once
        o_pre, lse_pre = flashlib.decode(q1.permute(2, 1, 0, 3), k_pre, v_pre, return_lse=True, backend=backend)
        o_suf, lse_suf = flashlib.decode(q1, k_suf, v_suf, return_lse=True, backend=backend)
        # (1, H, B, d) -> (B, H, 1, d), (1, H, B) -> (B, H, 1)
        return flashlib.merge_states(o_pre.permute(2, 1, 0, 3), lse_pre.permute(2, 1, 0), o_suf, lse_suf)[0]

    decode |= {"cascade": (cascade, 2.0 * hkv * (max_len + batch * suffix) * head_dim * elem),
               "plain-decode": (lambda: flashlib.decode(q1, k_all, v_all, backend=backend),
                                2.0 * batch * hkv * (max_len + suffix) * head_dim * elem)}

    checks = _serving_checks(prefill, decode, lens, cu)
    rows = []
    for name, (fn, (a, b, c, g), work) in prefill.items():
        why: dict = {}
        # SDPA refusing (RuntimeError), or a torch before enable_gqa (TypeError): recorded, not raised
        refusals = (RuntimeError, TypeError) if name == "padded-sdpa" else ()
        times = _time_calls({"ms": lambda: timer(lambda: fn(a, b, c)),
                             "train_ms": lambda: timer(_backward(fn, a, b, c, g))},
                            contextlib.nullcontext, refusals, why, inference=("ms",))
        rows.append({"impl": name, **times, "why": why, "work": work, "unit": "FLOP"})
    for name, (fn, work) in decode.items():
        why = {"train_ms": SERVING_INFERENCE}
        times = _time_calls({"ms": lambda: timer(fn), "train_ms": None}, contextlib.nullcontext, (), why,
                            inference=("ms",))
        rows.append({"impl": name, **times, "why": why, "work": work, "unit": "byte"})
    return {"environment": env, "config": config, "rows": rows, "checks": checks}


def _serving_checks(prefill, decode, lens, cu) -> dict:
    """``{"row vs baseline": max |difference|}`` of each pair in :data:`SERVING_PAIRS`, on the real tokens
    (the padded rows' outputs unpadded to the packed order), computed once without gradients."""
    import torch
    with torch.no_grad():
        out = {}
        for name, (fn, (a, b, c, _), _) in prefill.items():
            try:
                o = fn(a, b, c)
            except (RuntimeError, TypeError):
                if name != "padded-sdpa":
                    raise
                continue                                    # SDPA refusing: its time says why
            if name != "varlen":                            # (B, H, max_len, d) -> packed (total, H, d)
                o = torch.cat([o[i, :, :n].transpose(0, 1) for i, n in enumerate(lens)])
            out[name] = o.float()
        out |= {name: fn().float() for name, (fn, _) in decode.items()}
    return {f"{row} vs {base}": (out[row] - out[base]).abs().max().item()
            for row, bases in SERVING_PAIRS.items() for base in bases if row in out and base in out}


def _serving_ratios(results: dict) -> list[dict]:
    """The speedups of :func:`serving`'s rows: ``[{"impl", "baseline", "ms", "train_ms"}]`` for each pair of
    :data:`SERVING_PAIRS`, the baseline's time / the row's (> 1: the row is faster), None where either has
    no time."""
    rows = {r["impl"]: r for r in results["rows"]}
    return [{"impl": impl, "baseline": base,
             **{t: (rows[base][t] / rows[impl][t] if rows[base][t] and rows[impl][t] else None)
                for t in SERVING_TIMES}}
            for impl, bases in SERVING_PAIRS.items() if impl in rows for base in bases if base in rows]


def _format_serving(results: dict) -> str:
    """:func:`serving`'s measurements as text: each row's times and work, the speedups
    (:func:`_serving_ratios`), the output checks, and why any time is missing."""
    c = results["config"]
    lines = [f"serving rows: B={c['batch']} H={c['heads']} Hkv={c['kv_heads']} d={c['head_dim']} {c['dtype']}, "
             f"lengths {_ragged_lengths(c['batch'], c['max_len'])[0]}..{c['max_len']}, page size {c['page_size']}, "
             f"cascade prefix {c['max_len']} + suffix {c['suffix']}; times: {c['timer']}",
             f"{'impl':<16} {'ms':>9} {'train ms':>9} {'work':>14}"]

    def ms(r, t):
        return "-".rjust(9) if r[t] is None else f"{r[t]:9.3f}"
    for r in results["rows"]:
        work = f"{r['work'] / 1e9:8.2f} GFLOP" if r["unit"] == "FLOP" else f"{r['work'] / 1e6:8.2f} MB"
        lines.append(f"{r['impl']:<16} {ms(r, 'ms')} {ms(r, 'train_ms')} {work:>14}")
    lines += ["", "speedup (baseline time / row time; > 1: faster)",
              f"{'impl':<16} {'against':<16} {'ms':>8} {'train':>8}"]
    for s in _serving_ratios(results):
        lines.append(f"{s['impl']:<16} {s['baseline']:<16} " + " ".join(
            "       -" if s[t] is None else f"{s[t]:7.2f}x" for t in SERVING_TIMES))
    lines += ["", "outputs checked before timing (max |difference|):"]
    lines += [f"  {pair}: {err:.2e}" for pair, err in results["checks"].items()]
    missing = [(r["impl"], t, r["why"][t]) for r in results["rows"] for t in SERVING_TIMES if r[t] is None]
    if missing:
        lines += ["", "why some times are missing:"]
        lines += [f"  {impl} {t}: {why}" for impl, t, why in missing]
    lines += ["", *(f"  {name}: {what}" for name, what in SERVING_ROWS.items())]
    return "\n".join(lines)


def main(args) -> int:
    """``python -m flashlib bench``: measure on the GPU (``--save FILE.json`` keeps the results), or
    say there is none, save nothing, and show the compile report. The options are checked first, on
    every device: a ValueError naming the option (the command line makes it argparse's usage error).

    Explained in: notebooks/07_triton.
    Tested in: tests/tools/test_bench.py.
    """
    import torch
    _check_arguments(args)                  # on every device: a CPU run checks the options too
    if not torch.cuda.is_available():
        if args.save:
            print(f"--save {args.save}: no CUDA GPU on this machine, so nothing was measured and nothing "
                  "was written (flashlib never records a GPU number it did not measure). Run it on a GPU.",
                  file=sys.stderr)
            return 1
        print("No CUDA GPU on this machine: nothing to time (flashlib never prints a GPU number it did "
              "not measure). Run this in Colab or on a GPU machine.\n"
              "What the kernels compile to on each GPU instead (flashlib.tools.compile_report.compile_report):")
        from .compile_report import compile_report, summary
        print(summary(compile_report()))
        return 0
    refusal = dtype_refusal(args.dtype)
    if refusal is not None:
        print(f"--dtype {args.dtype}: {refusal}. Nothing was run (exit code {EXIT_NOT_SUPPORTED}: not "
              "supported here).", file=sys.stderr)
        return EXIT_NOT_SUPPORTED
    if args.generate:
        if importlib.util.find_spec("transformers") is None:
            print("--generate times a Hugging Face model's generation: the Python package 'transformers' "
                  "is not installed (pip install transformers). Nothing was run (exit code "
                  f"{EXIT_NOT_SUPPORTED}: not supported here).", file=sys.stderr)
            return EXIT_NOT_SUPPORTED
        g = generate_per_token(dtype=args.dtype)
        print(f"ms per generated token (tiny Llama, B=4, 2048-token prompt, {args.dtype}): plain SDPA "
              f"{g['sdpa_ms']:.3f}, flashlib.auto {g['auto_ms']:.3f} ({g['decode_calls']} calls to "
              f"flashlib.decode timed)\n{g['goal']}")
        return 0
    if getattr(args, "serving", False):
        results = serving(batch=args.batch, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                          dtype=args.dtype, max_len=args.max_len, page_size=args.page_size, suffix=args.suffix)
        print(_format_serving(results))
        return 0
    folder = bool(args.save) and pathlib.Path(args.save).is_dir()     # a folder: result_name() inside
    if args.save:                     # refuse before a long run, not after it
        try:
            _check_environment(environment(), "this machine")
        except ValueError as e:
            print(f"--save {args.save}: {e}; nothing was run", file=sys.stderr)
            return 2
    results = run(args.n, batch=args.batch, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                  dtype=args.dtype, causal=args.causal, cuda=not args.no_cuda, tma=not args.no_tma,
                  small=None if args.no_small else SMALL_SHAPE, only=tuple(f"{t}_ms" for t in args.only),
                  progress=importlib.util.find_spec("tqdm") is not None)   # a bare GPU Python may lack it
    print(format_results(results))
    if args.save:
        path = save(results, pathlib.Path(args.save) / result_name(results) if folder else args.save)
        print(f"results saved to {path}")
    if args.out and importlib.util.find_spec("matplotlib") is None:
        print(f"--out {args.out}: matplotlib is not installed, so no plot was drawn (the table above and "
              "--save keep every measurement)", file=sys.stderr)
    elif args.out:
        plot(results, args.out)
        print(f"plot saved to {args.out}")
    return 0


def _int_option(low: int, high: int | None = None, what: str = "") -> Callable[[str], int]:
    """An argparse ``type``: an int in ``[low, high]``, else argparse's usage error naming the option."""
    import argparse
    expected = f"an int >= {low}" if high is None else f"an int from {low} to {high}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {expected}{what}, got {text!r}")
        return value
    parse.__name__ = expected                  # argparse names the type in some messages
    return parse


# matplotlib's Agg canvas formats (FigureCanvasBase.get_supported_filetypes()), should it be missing here
_PLOT_SUFFIXES = ("eps", "jpeg", "jpg", "pdf", "pgf", "png", "ps", "raw", "rgba", "svg", "svgz", "tif",
                  "tiff", "webp")


def _check_arguments(args) -> None:
    """The ``bench`` options that only make sense together, and the files it will write, checked before
    anything runs (on every device: a CPU, which times nothing, checks them too). A ValueError naming
    the option otherwise (``python -m flashlib bench`` turns it into argparse's usage error, exit 2)."""
    heads = args.heads
    kv_heads = heads if args.kv_heads is None else args.kv_heads
    if heads % kv_heads:
        raise ValueError(f"argument --kv-heads: must divide --heads={heads} (GQA: each kv head serves "
                         f"H / Hkv query heads), got {kv_heads}")
    if args.generate and args.save:
        raise ValueError("argument --save: --generate prints its measurement only (the result files hold "
                         "the sweep); drop --save or --generate")
    if getattr(args, "serving", False) and args.generate:
        raise ValueError("argument --serving: --generate and --serving are two separate runs; pick one")
    if getattr(args, "serving", False) and args.save:
        raise ValueError("argument --save: --serving prints its measurement only (the result files hold "
                         "the sweep); drop --save or --serving")
    if args.save:
        save_to = pathlib.Path(args.save)
        if not save_to.is_dir():
            if not str(args.save).endswith(".json"):
                raise ValueError(f"argument --save: expected FILE.json or an existing folder (chapter 7 draws "
                                 f"*.json only), got {args.save!r}")
            if not save_to.resolve().parent.is_dir():
                raise ValueError(f"argument --save: its folder does not exist, got {args.save!r}")
    if args.out:
        out = pathlib.Path(args.out)
        if out.is_dir() or not out.resolve().parent.is_dir():
            raise ValueError(f"argument --out: expected a file in an existing folder (or '' for no plot), "
                             f"got {args.out!r}")
        suffix = out.suffix[1:].lower()
        if suffix and suffix not in _PLOT_SUFFIXES:
            raise ValueError(f"argument --out: the plot's format must be one of {', '.join(_PLOT_SUFFIXES)}, "
                             f"got {args.out!r}")


def add_arguments(parser) -> None:
    """The ``bench`` subcommand's options."""
    from ..validation import MAX_HEAD_DIM
    parser.add_argument("--n", type=_int_option(1), nargs="+", default=list(DEFAULT_NS), metavar="N",
                        help="sequence lengths to time (decode: the KV cache's length)")
    parser.add_argument("--batch", type=_int_option(1), default=4, help="batch size B")
    parser.add_argument("--heads", type=_int_option(1), default=16, help="query heads H")
    parser.add_argument("--kv-heads", type=_int_option(1), default=None,
                        help="key/value heads Hkv, fewer for GQA (must divide --heads; default: --heads)")
    parser.add_argument("--head-dim", type=_int_option(1, MAX_HEAD_DIM, " (flashlib's largest head dim)"),
                        default=128, help="head dimension d")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float16", help="element type of q, k, v")
    parser.add_argument("--causal", action="store_true", help="time causal attention (bottom-right aligned)")
    parser.add_argument("--no-cuda", action="store_true",
                        help="skip the 'flashlib-cuda' row (the CUDA C++ kernels)")
    parser.add_argument("--no-tma", action="store_true",
                        help="skip the 'flashlib-tma' row (the Triton TMA kernels: tensor descriptors)")
    parser.add_argument("--only", nargs="+", choices=("fwd", "bwd", "decode"), default=["fwd", "bwd", "decode"],
                        help="time only these (e.g. --only decode for long KV caches); the others are null, "
                             "with the reason")
    parser.add_argument("--generate", action="store_true",
                        help="instead of the sweep: a tiny Llama's time per generated token through "
                             "flashlib.auto against plain SDPA (needs transformers), and its goal")
    parser.add_argument("--serving", action="store_true",
                        help="instead of the sweep: the serving rows (flashlib.attention_varlen against padded "
                             "SDPA, paged against dense decode, cascade against plain decode) at --batch, "
                             "--heads, --kv-heads, --head-dim, --dtype")
    parser.add_argument("--max-len", type=_int_option(1), default=4096,
                        help="--serving: the longest sequence of the ragged batch, and the shared prefix")
    parser.add_argument("--page-size", type=_int_option(1), default=16,
                        help="--serving: tokens per page of the paged cache (any size >= 1)")
    parser.add_argument("--suffix", type=_int_option(1), default=256,
                        help="--serving: each sequence's own tokens after the shared prefix (cascade)")
    parser.add_argument("--no-small", action="store_true",
                        help=f"skip the small call (B, H, N, d = {SMALL_SHAPE}: host overhead against SDPA)")
    parser.add_argument("--out", default="flashlib-bench.png", help="plot file ('' for none)")
    parser.add_argument("--save", default=None, metavar="FILE.json",
                        help=f"write every measurement and the environment to FILE.json (schema {SCHEMA}; "
                             "GPU only; default: nothing is saved); an existing folder (e.g. benchmarks/) "
                             "gets a file named after the GPU, dtype, head dim, causal and date")
