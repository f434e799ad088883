"""The "triton" backend: :mod:`flashlib.kernels.triton`, compiled on a GPU, Triton's interpreter on a CPU.

The kernels are imported on first use (importing flashlib imports no triton). The caller's
``(block_q, block_k)`` become a :class:`~flashlib.kernels.triton.configs.Config`; None lets the
device's table choose.

The forward comes in two kernels: version 1 (:mod:`~flashlib.kernels.triton.fa2_fwd`, pointer loads, the
default) and the TMA forward (:mod:`~flashlib.kernels.triton.fa2_fwd_tma`, version 4 of the Triton kernels:
tensor descriptors, TMA on sm_90). The environment variable ``FLASHLIB_TRITON_FWD`` chooses: ``v1``
(default) or ``tma``, which runs the TMA forward wherever its memory rules hold
(:func:`~flashlib.kernels.triton.fa2_fwd_tma.supported`) and version 1 elsewhere.
The backward likewise: ``FLASHLIB_TRITON_BWD`` is ``v2`` (default, :mod:`~flashlib.kernels.triton.fa2_bwd`)
or ``tma``, which swaps in the TMA dK/dV kernel (:mod:`~flashlib.kernels.triton.fa2_bwd_tma`, version 5)
where the memory rules hold for q, k, v and dO. Both are opt-in until a GPU has measured them faster.
Both need tensor descriptors (triton >= 3.4): with an older Triton ``tma`` runs versions 1 and 2
(:func:`~flashlib.kernels.triton.fa2_fwd_tma.supported` says why).

Triton versions: ``check`` raises RuntimeError where ``triton`` is missing or older than flashlib
supports (:mod:`flashlib.kernels.triton.versions`, naming the version and the fix), which
``backend="auto"`` takes as "use the next backend" (:func:`flashlib.backends.auto_choice`).

Explained in: notebooks/07_triton.
"""
from __future__ import annotations

import functools
import os
import types

from ..validation import lengths_as_int32

DESCRIPTION = "flashlib.kernels.triton kernels (compiled on CUDA, Triton's interpreter on CPU)"
FORWARD_VERSIONS = ("v1", "tma")      # FLASHLIB_TRITON_FWD's values; the first is the default
BACKWARD_VERSIONS = ("v2", "tma")     # FLASHLIB_TRITON_BWD's values; the first is the default
KNOBS = {"FLASHLIB_TRITON_FWD": FORWARD_VERSIONS, "FLASHLIB_TRITON_BWD": BACKWARD_VERSIONS}   # read by info, bench

# The host path runs on every call (a small call's whole cost on a GPU): the kernel modules are imported
# once (_kernels), a caller's blocks become a Config once (_config), and the knobs are read from
# os.environ on each call (tests and the bench change them between calls), one lookup each.


@functools.cache
def _kernels() -> types.SimpleNamespace:
    """The kernel modules (and torch), imported on first use: importing flashlib imports no triton."""
    import torch

    from ..kernels import triton as ft
    from ..kernels.triton import configs, fa2_bwd, fa2_bwd_tma, fa2_fwd, fa2_fwd_tma
    return types.SimpleNamespace(ft=ft, configs=configs, fa2_fwd=fa2_fwd, fa2_fwd_tma=fa2_fwd_tma,
                                 fa2_bwd=fa2_bwd, fa2_bwd_tma=fa2_bwd_tma, torch=torch)


def _wanted(variable: str) -> str:
    versions = KNOBS[variable]
    wanted = os.environ.get(variable)
    if wanted is None:
        return versions[0]
    if wanted not in versions:
        raise ValueError(f"{variable} must be one of {versions}, got {wanted!r}")
    return wanted


def forward_version(q, k, v) -> str:
    """The forward version that runs for these tensors: "v1", or "tma" where ``FLASHLIB_TRITON_FWD=tma``
    asks for it and :func:`flashlib.kernels.triton.fa2_fwd_tma.supported` accepts them.

    Explained in: notebooks/07_triton.
    Tested in: tests/kernels/triton/test_triton_fa2_fwd_tma.py.
    """
    if _wanted("FLASHLIB_TRITON_FWD") == "tma" and _kernels().fa2_fwd_tma.supported(q, k, v) is None:
        return "tma"
    return "v1"


def backward_version(q, k, v, do) -> str:
    """The backward that runs: "v2" (fa2_bwd), or "tma" (its dK/dV kernel through tensor descriptors,
    :mod:`flashlib.kernels.triton.fa2_bwd_tma`) where ``FLASHLIB_TRITON_BWD=tma`` asks for it and
    :func:`flashlib.kernels.triton.fa2_fwd_tma.supported` accepts q, k, v and do.

    Explained in: notebooks/07_triton.
    Tested in: tests/kernels/triton/test_triton_fa2_bwd_tma.py.
    """
    if _wanted("FLASHLIB_TRITON_BWD") == "tma" and _kernels().fa2_fwd_tma.supported(q, k, v, do) is None:
        return "tma"
    return "v2"


def _last_dim_contiguous(*xs):
    for x in xs:
        if x.stride(-1) != 1:                         # rare: copy those that need it
            return tuple(x if x.stride(-1) == 1 else x.contiguous() for x in xs)
    return xs


@functools.lru_cache(maxsize=64)
def _table_config(blocks):
    """A Config from the caller's (block_q, block_k), both given or None (see _config)."""
    for name, b in zip(("block_q", "block_k"), blocks):
        if b is not None and (b < 16 or b & (b - 1)):
            raise ValueError(f"backend='triton' needs {name} to be a power of two >= 16 (tl.arange "
                             f"and tl.dot), got {b}")
    bq, bk = (b if b is not None else 32 for b in blocks)
    return _kernels().configs.Config(bq, bk, 4, 1)


def _config(blocks):
    """A Config from the caller's (block_q, block_k), or None to let the device's table choose."""
    blocks = tuple(blocks)                       # hashable for the cache (a list works too)
    return None if blocks == (None, None) else _table_config(blocks)


def _on_q_device(entry):
    """Run a backend entry point with q's CUDA device current. Triton launches on the *current* device,
    whatever device the tensors are on, so tensors on cuda:1 while cuda:0 is current would be launched
    on the wrong GPU (flash-attn guards its kernels the same way). On a CPU, or where q's device is
    already current (the usual case: one comparison), nothing is changed.

    Explained in: notebooks/07_triton.
    Tested in: tests/kernels/triton/test_triton_host.py.
    """
    @functools.wraps(entry)
    def run(q, *args, **kwargs):
        d = q.device
        if d.type == "cuda" and d.index is not None:
            torch = _kernels().torch
            if d.index != torch.cuda.current_device():
                with torch.cuda.device(d):
                    return entry(q, *args, **kwargs)
        return entry(q, *args, **kwargs)
    return run


@_on_q_device
def forward(q, k, v, *, causal, scale, allow_tf32=False, blocks=(None, None)):
    """Backend.forward: :func:`flashlib.kernels.triton.fa2_fwd.forward`, or the TMA forward
    (:func:`flashlib.kernels.triton.fa2_fwd_tma.forward`) where :func:`forward_version` says so.
    Explained in: notebooks/07_triton."""
    kernels = _kernels()
    q, k, v = _last_dim_contiguous(q, k, v)
    _wanted("FLASHLIB_TRITON_BWD")      # a bad backward knob fails before the forward runs
    if forward_version(q, k, v) == "tma":
        return kernels.fa2_fwd_tma.forward(q, k, v, causal=causal, scale=scale, config=_config(blocks))
    return kernels.fa2_fwd.forward(q, k, v, causal=causal, scale=scale, allow_tf32=allow_tf32,
                                   config=_config(blocks))


@_on_q_device
def backward(q, k, v, o, lse, do, *, causal, scale, allow_tf32=False, blocks=(None, None)):
    """Backend.backward: :func:`flashlib.kernels.triton.fa2_bwd.backward`, or with the TMA dK/dV
    (:func:`flashlib.kernels.triton.fa2_bwd_tma.backward`) where :func:`backward_version` says so.
    Explained in: notebooks/07_triton."""
    kernels = _kernels()
    q, k, v, o, do = _last_dim_contiguous(q, k, v, o, do)
    cfg = _config(blocks)                         # dK/dV: key block = block_k, query step = block_q
    if backward_version(q, k, v, do) == "tma":
        return kernels.fa2_bwd_tma.backward(q, k, v, o, lse, do, causal=causal, scale=scale,
                                            config_dkdv=cfg, config_dq=cfg)
    return kernels.fa2_bwd.backward(q, k, v, o, lse, do, causal=causal, scale=scale, allow_tf32=allow_tf32,
                                    config_dkdv=cfg, config_dq=cfg)


MIN_DECODE_BLOCK_N = 16      # the smallest key block of a decode config (tl.dot needs >= 16)


@_on_q_device
def decode(q, k_cache, v_cache, cache_seqlens, *, num_splits, scale):
    """Backend.decode: :func:`flashlib.kernels.triton.decode.decode` (split-KV, then combine);
    ``cache_seqlens`` None reaches the kernel as None (no lengths tensor is made). int64 lengths are
    clamped into ``[0, Nmax]`` in 64 bits on their device (no read-back) before they become the
    kernel's int32: 2**32 + 3 means Nmax, not 3. The kernel's splits are whole key blocks
    (``MIN_DECODE_BLOCK_N`` keys or more), so at most ``ceil(Nmax / MIN_DECODE_BLOCK_N)`` of them can
    hold a key: ``num_splits`` is clamped to that (the splits dropped were empty: the same answer).
    Explained in: notebooks/07_triton."""
    import torch

    from ..kernels.triton import decode as triton_decode
    q, k_cache, v_cache = _last_dim_contiguous(q, k_cache, v_cache)
    nmax = k_cache.shape[2]
    if cache_seqlens is not None:
        cache_seqlens = lengths_as_int32(cache_seqlens, nmax)
    num_splits = max(1, min(num_splits, -(-nmax // MIN_DECODE_BLOCK_N)))
    return triton_decode.decode(q, k_cache, v_cache, cache_seqlens, num_splits=num_splits, scale=scale)


def check(q, op):
    """Backend.check: triton importable and supported (>= 3.2: RuntimeError naming the version and the
    fix otherwise), in the mode q's device needs (meta tensors: any mode, nothing runs); no float64;
    bf16 needs sm_80+.
    Explained in: notebooks/07_triton."""
    # Plain imports, not _kernels(): check runs while torch.compile traces flashlib.attention, and dynamo
    # traces an import but breaks the graph at a functools.cache wrapper.
    import torch
    try:
        from ..kernels import triton as ft
    except ImportError as exc:
        raise RuntimeError(f"backend='triton' cannot run here: {exc}") from None
    if not q.is_meta:                              # meta: shapes only (flashlib._ops), no kernel
        ft.check_tensors(q)
    if q.dtype == torch.float64:
        raise TypeError("backend='triton' supports float16, bfloat16 and float32, got torch.float64; "
                        "use backend='reference' for float64")
    from ..hardware import device_facts            # a GPU's (asked once per index), or a rehearsed one's
    facts = device_facts(q.device)
    if facts is not None:
        from ..kernels.triton.configs import check_dtype_arch
        check_dtype_arch(str(q.dtype).removeprefix("torch."), facts.arch)
